"""Teacher fingerprints (data/teacher_id.py): a folder's is the sha256 of its config.json and weight files, computed by
hand here; it is read once and then taken from the cache with no weight file opened, until a file changes (even one
rewritten in place with its size and mtime put back) or `verify` is asked; a cache that is garbage or cannot be
written costs a read, never a wrong fingerprint. A hub id's is its resolved commit's, with no weight fetched: offline
from a hub cache holding config.json alone, online from a loopback hub that records every request."""

import hashlib
import json
import os
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from disco_clip_ds.data.teacher_id import cache_entry, teacher_fingerprint
from disco_clip_ds.errors import UsageError
from disco_clip_ds.testing.file_opens import recorded_opens

COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture
def opened():
    """The paths opened (by any Python code in this process) during the test."""
    with recorded_opens() as seen:
        yield seen


@pytest.fixture
def teacher(tmp_path, monkeypatch):
    """A teacher folder: config.json, two weight files, and files the fingerprint leaves out; the cache in TMP."""
    monkeypatch.setenv("DISCO_CLIP_CACHE", str(tmp_path / "cache"))
    folder = tmp_path / "teacher"
    folder.mkdir()
    (folder / "config.json").write_text('{"model_type": "clip"}')
    (folder / "model.safetensors").write_bytes(bytes(range(256)) * 4096)
    (folder / "extra.bin").write_bytes(b"\x07" * 1000)
    (folder / "tokenizer.json").write_text("{}")  # not weights
    (folder / "sub.safetensors").mkdir()  # a folder, not a file
    return folder


def by_hand(folder) -> str:
    """The fingerprint as the sidecars of every version record it: each file's name then its bytes, in name order."""
    digest = hashlib.sha256()
    for name in ("config.json", "extra.bin", "model.safetensors"):
        digest.update(name.encode() + (folder / name).read_bytes())
    return digest.hexdigest()[:16]


def weight_opens(opened, folder) -> list[str]:
    return [p for p in opened if p.endswith((".safetensors", ".bin")) and str(folder) in p]


def test_a_folder_is_read_once_then_fingerprinted_from_the_cache(teacher, opened, caplog):
    caplog.set_level("INFO", logger="disco_clip_ds.data.teacher_id")
    expected = by_hand(teacher)
    opened.clear()
    assert teacher_fingerprint(str(teacher)) == expected
    assert sorted(weight_opens(opened, teacher)) == [str(teacher / "extra.bin"), str(teacher / "model.safetensors")]
    assert f"{1000 + 256 * 4096} bytes of weights read" in caplog.text
    assert cache_entry(teacher).is_file() and not (teacher / ".cache").exists()  # never written into the teacher

    opened.clear()
    caplog.clear()
    assert teacher_fingerprint(str(teacher)) == expected
    assert weight_opens(opened, teacher) == []  # not one weight file opened
    assert "no weights read" in caplog.text

    assert teacher_fingerprint(str(teacher), verify=True) == expected  # asked: read all the same
    assert len(weight_opens(opened, teacher)) == 2


def test_a_file_changed_in_place_is_read_again(teacher, opened):
    """Rewritten with other bytes of the same size, its mtime put back: its ctime changed, so the cache misses."""
    first = teacher_fingerprint(str(teacher))
    weights = teacher / "model.safetensors"
    before = weights.stat()
    with open(weights, "r+b") as f:
        f.write(b"\xff")
    os.utime(weights, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert weights.stat().st_size == before.st_size and weights.stat().st_mtime_ns == before.st_mtime_ns
    opened.clear()
    assert teacher_fingerprint(str(teacher)) == by_hand(teacher) != first
    assert str(weights) in weight_opens(opened, teacher)
    (teacher / "more.safetensors").write_bytes(b"\1")  # a weight file added
    assert teacher_fingerprint(str(teacher)) not in (first, by_hand(teacher))


def test_a_garbage_or_unwritable_cache_costs_a_read_not_a_wrong_fingerprint(teacher, tmp_path, monkeypatch, opened):
    expected = by_hand(teacher)
    assert teacher_fingerprint(str(teacher)) == expected
    entry = cache_entry(teacher)
    held = json.loads(entry.read_text())
    for garbage in ("{not json", json.dumps({**held, "folder": str(tmp_path)}), json.dumps({**held, "fingerprint": 5})):
        entry.write_text(garbage)
        opened.clear()
        assert teacher_fingerprint(str(teacher)) == expected
        assert len(weight_opens(opened, teacher)) == 2
    (tmp_path / "a_file").write_text("")
    monkeypatch.setenv("DISCO_CLIP_CACHE", str(tmp_path / "a_file"))  # no folder can be made there
    assert teacher_fingerprint(str(teacher)) == expected


def test_a_folder_without_config_is_refused(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"\0")
    with pytest.raises(UsageError, match="no config.json: not a model folder"):
        teacher_fingerprint(str(tmp_path))


def hub_cache(root, repo, commit):
    """A hub cache as huggingface_hub lays it out, holding the repo's config.json alone (no weights)."""
    storage = root / f"models--{repo.replace('/', '--')}"
    (storage / "snapshots" / commit).mkdir(parents=True)
    (storage / "snapshots" / commit / "config.json").write_text('{"model_type": "clip"}')
    (storage / "refs").mkdir(exist_ok=True)
    (storage / "refs" / "main").write_text(commit)


def test_a_hub_id_offline_is_fingerprinted_from_the_cached_commit(tmp_path, monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    hub_cache(tmp_path / "hub", "org/tiny", COMMIT)
    expected = hashlib.sha256(f"hub:org/tiny@{COMMIT}".encode()).hexdigest()[:16]
    assert teacher_fingerprint("org/tiny") == expected
    other = "f" * 40
    hub_cache(tmp_path / "hub", "org/tiny", other)  # main moved to another commit
    assert teacher_fingerprint("org/tiny") == hashlib.sha256(f"hub:org/tiny@{other}".encode()).hexdigest()[:16]
    with pytest.raises(UsageError) as refused:
        teacher_fingerprint("org/absent")
    assert str(refused.value).startswith("--teacher org/absent: no such folder, nor a model on the hub")
    assert "\n" not in str(refused.value)


class _Hub(BaseHTTPRequestHandler):
    """A hub on 127.0.0.1 that knows one repo's config.json at COMMIT and records every request."""

    protocol_version = "HTTP/1.0"
    body = b'{"model_type": "clip"}'

    def _answer(self, with_body: bool):
        self.server.requests.append((self.command, self.path))
        if self.path.split("?")[0] not in (
            "/org/tiny/resolve/main/config.json",
            f"/org/tiny/resolve/{COMMIT}/config.json",
        ):
            self.send_error(404)
            return
        self.send_response(200)
        for name, value in (("X-Repo-Commit", COMMIT), ("ETag", '"abc123"'), ("Content-Length", len(self.body))):
            self.send_header(name, str(value))
        self.end_headers()
        if with_body:
            self.wfile.write(self.body)

    def do_HEAD(self):
        self._answer(False)

    def do_GET(self):
        self._answer(True)

    def log_message(self, *args):
        pass


@pytest.mark.slow  # beyond the fast tier's time budget
def test_a_hub_id_online_is_fingerprinted_without_fetching_weights(tmp_path, monkeypatch):
    import huggingface_hub.constants as constants

    server = ThreadingHTTPServer(("127.0.0.1", 0), _Hub)
    server.requests = []
    threading.Thread(target=server.serve_forever, daemon=True).start()
    endpoint = f"http://127.0.0.1:{server.server_address[1]}"
    monkeypatch.setenv("NO_PROXY", "127.0.0.1")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "ENDPOINT", endpoint)
    monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", endpoint + "/{repo_id}/resolve/{revision}/{filename}")
    try:
        fingerprint = teacher_fingerprint("org/tiny")
    finally:
        server.shutdown()
        server.server_close()
    assert fingerprint == hashlib.sha256(f"hub:org/tiny@{COMMIT}".encode()).hexdigest()[:16]
    paths = [path for _, path in server.requests]
    assert paths and all(path.endswith("/config.json") for path in paths), server.requests
