"""A loopback HTTP server for download tests and benchmarks: good images, error codes, hangs, trickles, corrupt
files.

    with ImageServer() as server:
        url = server.add("/a.jpg", body=jpeg_bytes)                # 200 with the bytes
        server.add("/missing.jpg", status=404)                      # an error status
        server.add("/hang.jpg", hang=True)                          # accepts, never answers
        server.add("/slow.jpg", body=data, trickle=0.2)             # one body byte every 0.2 s
        server.add("/slower.jpg", body=data, trickle_headers=0.2)   # even the status line, byte by byte
        server.add("/late.jpg", body=data, delay=0.1)               # answers after 0.1 s
        server.add("/huge.jpg", body=data, content_length=2**31)    # declares 2 GiB, sends DATA, closes
        server.add("/endless.jpg", body=data, endless=True)         # DATA over and over, no Content-Length
        server.add("/local.jpg", redirect="file:///etc/passwd")     # 302 to another URL

Unknown paths get 404. `server.hits` counts requests per path.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


@dataclass
class Route:
    """What the server answers on one path: BODY with STATUS and CONTENT_TYPE, or it hangs, trickles the body (or
    the headers) a byte at a time every so many seconds, or answers after DELAY seconds; a CONTENT_LENGTH other than
    the body's (a hostile server's), a body sent ENDLESSly (until the client hangs up), or a 302 REDIRECT."""

    body: bytes = b""
    status: int = 200
    content_type: str = "image/jpeg"
    hang: bool = False
    trickle: float = 0.0
    trickle_headers: float = 0.0
    delay: float = 0.0
    content_length: int | None = None
    endless: bool = False
    redirect: str | None = None


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.0"

    def do_GET(self):
        server: ImageServer = self.server.owner
        route = server.routes.get(self.path)
        with server.lock:
            server.hits[self.path] += 1
        if route is None or route.status >= 400:
            self.send_error(404 if route is None else route.status)
            return
        if route.hang:
            server.stopping.wait()
            return
        if route.delay:
            time.sleep(route.delay)
        if route.trickle_headers:
            head = f"HTTP/1.0 200 OK\r\nContent-Length: {len(route.body)}\r\n\r\n".encode() + route.body
            try:
                for i in range(len(head)):
                    if server.stopping.wait(route.trickle_headers):
                        return
                    self.wfile.write(head[i : i + 1])
                    self.wfile.flush()
            except ConnectionError:
                pass
            return
        if route.redirect:
            self.send_response(302)
            self.send_header("Location", route.redirect)
            self.end_headers()
            return
        self.send_response(route.status)
        self.send_header("Content-Type", route.content_type)
        if not route.endless:
            length = len(route.body) if route.content_length is None else route.content_length
            self.send_header("Content-Length", str(length))
        self.end_headers()
        try:
            if route.endless:
                while not server.stopping.is_set():
                    self.wfile.write(route.body)
            elif route.trickle:
                for i in range(len(route.body)):
                    if server.stopping.wait(route.trickle):
                        return
                    self.wfile.write(route.body[i : i + 1])
                    self.wfile.flush()
            else:
                self.wfile.write(route.body)
        except ConnectionError:  # the client gave up (a deadline): expected here
            pass

    def log_message(self, *args):
        pass


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    block_on_close = False
    request_queue_size = 256  # the default backlog of 5 drops connections under many download threads


class ImageServer:
    """Context manager running the server on 127.0.0.1 in a background thread."""

    def __init__(self):
        self.routes: dict[str, Route] = {}
        self.hits: Counter = Counter()
        self.lock = threading.Lock()
        self.stopping = threading.Event()
        self._server = _Server(("127.0.0.1", 0), _Handler)
        self._server.owner = self
        self.base_url = f"http://127.0.0.1:{self._server.server_address[1]}"

    def add(self, path: str, **route) -> str:
        """Serve a `Route(**route)` on PATH; its URL."""
        self.routes[path] = Route(**route)
        return self.base_url + path

    def url(self, path: str) -> str:
        """The URL of PATH on this server."""
        return self.base_url + path

    def __enter__(self) -> ImageServer:
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc):
        self.stopping.set()  # releases hanging and trickling handlers
        self._server.shutdown()
        self._server.server_close()
