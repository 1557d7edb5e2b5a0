"""A launcher for tests whose subject is not the launcher: ranks forked from a process that imported the training
stack once (testing/zygote.py), in place of `deepspeed --module disco_clip_ds.train`.

A tiny CPU run spends most of its CPU time importing torch, transformers and DeepSpeed, once in each of the
`deepspeed` runner, its per-node launcher and every rank. Forked ranks skip all of it. What a rank sees is what
DeepSpeed's launcher gives it (the environment, `--local_rank`, unbuffered output into the log, the exit code of
the first rank to fail); the launchers themselves (deepspeed, torchrun, accelerate) are what the tests that name
them run.

`start(...)` returns a `ForkedLaunch`, which `testing.launch.finish` waits for and kills like a Popen: its pid
leads the process group holding the ranks.
"""

from __future__ import annotations

import atexit
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

_LOCK = threading.Lock()
_SERVER: _Zygote | None = None


class _Zygote:
    """The server process and a thread that reads its replies (a pid per request, a status per ended launcher)."""

    def __init__(self, env: dict):
        reply_r, reply_w = os.pipe()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "disco_clip_ds.testing.zygote", str(reply_w)],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            pass_fds=(reply_w,),
            env=env,
            start_new_session=True,
        )
        os.close(reply_w)
        self.replies = os.fdopen(reply_r)
        self.started: list[int] = []
        self.statuses: dict[int, int] = {}
        self.changed = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.replies:
            reply = json.loads(line)
            with self.changed:
                if "pid" in reply:
                    self.started.append(reply["pid"])
                else:
                    self.statuses[reply["exit"]] = reply["status"]
                self.changed.notify_all()
        with self.changed:  # the server is gone: every launcher it had is reported as killed
            self.gone = True
            self.changed.notify_all()

    gone = False

    def request(self, request: dict) -> int:
        with self.changed:
            count = len(self.started)
            self.proc.stdin.write((json.dumps(request) + "\n").encode())
            self.proc.stdin.flush()
            if not self.changed.wait_for(lambda: len(self.started) > count or self.gone, timeout=600):
                raise RuntimeError("the forked launcher's server did not answer in 600 s")
            if self.gone:
                raise RuntimeError("the forked launcher's server ended (its imports failed?)")
            return self.started[count]

    def close(self) -> None:
        try:
            self.proc.stdin.close()
            self.proc.wait(timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()


def _server(env: dict) -> _Zygote:
    global _SERVER
    with _LOCK:
        if _SERVER is None or _SERVER.proc.poll() is not None or _SERVER.gone:
            _SERVER = _Zygote(env)
            atexit.register(_SERVER.close)
        return _SERVER


class ForkedLaunch:
    """A forked launcher, as much of subprocess.Popen as the tests use: pid, returncode, poll, wait, send_signal."""

    def __init__(self, server: _Zygote, pid: int, args: list):
        self.server, self.pid, self.args, self.returncode = server, pid, args, None

    def poll(self) -> int | None:
        with self.server.changed:
            status = self.server.statuses.get(self.pid)
        if status is not None and self.returncode is None:
            self.returncode = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        with self.server.changed:
            ended = self.server.changed.wait_for(lambda: self.pid in self.server.statuses or self.server.gone, timeout)
        if not ended:
            raise subprocess.TimeoutExpired(self.args, timeout)
        if self.poll() is None:  # the server died: its launchers are orphans, killed by the caller's finish()
            self.returncode = -9
        return self.returncode

    def send_signal(self, signum: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, signum)

    def terminate(self) -> None:
        self.send_signal(15)

    def kill(self) -> None:
        self.send_signal(9)


def start(nproc: int, module: str, args: list, log: Path, env: dict, cwd: Path, master_port: int, fallback: list):
    """Start MODULE ARGS on NPROC forked ranks (output appended to LOG, environment ENV, in CWD); FALLBACK (the
    real launcher's command) runs instead when ENV changes what the server imported under. A ForkedLaunch."""
    server = _server(env)
    request = {
        "nproc": nproc, "module": module, "args": [str(a) for a in args], "env": env, "cwd": str(cwd),
        "log": str(log), "master_port": master_port, "fallback": [str(c) for c in fallback],
    }  # fmt: skip
    return ForkedLaunch(server, server.request(request), fallback)
