"""Launched: `disco-clip data download` (img2dataset) against a loopback server whose truth the test knows, then
`disco-clip data verify` of its shards.

Shards are read back with tarfile, webdataset and HF datasets (not with prep's own readers), and images
are checked pixel by pixel against what the server sent."""

from __future__ import annotations

import io
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest
from PIL import Image

from disco_clip_ds.commands.data import (
    download_main,
    verify_main,
)
from disco_clip_ds.data.prep.fetch import MAX_IMAGE_BYTES, MAX_IMAGE_PIXELS
from disco_clip_ds.errors import run_main
from disco_clip_ds.testing.download import download_args, write_url_list
from disco_clip_ds.testing.images import declaring_size, image_bytes
from disco_clip_ds.testing.imageserver import ImageServer

SIZE = 32


DEADLINE = 4


TRICKLE = 0.2  # seconds per byte


# path, (format, mode, size, colour), caption: each image one flat colour, so its pixels identify it
GOOD = [
    ("/red.jpg", ("JPEG", "RGB", (100, 60), (200, 30, 30)), "a red jpeg"),
    ("/wide.png", ("PNG", "RGB", (120, 40), (20, 40, 220)), "a wide blue png"),
    ("/tall.jpg", ("JPEG", "RGB", (30, 90), (30, 160, 60)), None),
    ("/grey.jpg", ("JPEG", "L", (50, 50), 90), ""),
    ("/rgba.png", ("PNG", "RGBA", (40, 40), (240, 200, 10, 255)), "naïve café — 数字 ✓ 🙂"),
    ("/big.jpg", ("JPEG", "RGB", (400, 300), (120, 0, 160)), "a big purple photo"),
    ("/tiny.png", ("PNG", "L", (6, 6), 200), "a tiny grey png"),
]


TRICKLE_BODY = image_bytes("JPEG", "RGB", (300, 300), (1, 2, 3))


LOCAL_REASON = "(scheme 'file'): only http and https are fetched"
TOO_MANY_BYTES = f"image above --max_image_bytes {MAX_IMAGE_BYTES}"

# path, server behaviour, caption, status, reason (img2dataset's error text; None: checked apart)
BAD = [
    ("/missing1.jpg", dict(status=404), "gone", "failed_to_download", "HTTP Error 404: Not Found"),
    ("/missing2.jpg", dict(status=404), "gone too", "failed_to_download", "HTTP Error 404: Not Found"),
    ("/error.jpg", dict(status=500), "server error", "failed_to_download", "HTTP Error 500: Internal Server Error"),
    ("/hang.jpg", dict(hang=True), "never answers", "failed_to_download", "timed out"),
    (
        "/trickle.jpg",
        dict(body=TRICKLE_BODY, trickle=TRICKLE),
        "trickles",
        "failed_to_download",
        f"download exceeded the {DEADLINE}s deadline",
    ),
    (
        "/corrupt.jpg",
        dict(body=b"\xff\xd8\xff\xe0" + bytes(range(256)) * 4),
        "corrupt",
        "failed_to_resize",
        "Image decoding error",
    ),
    ("/empty.jpg", dict(body=b""), "empty file", "failed_to_resize", None),
    # hostile metadata: a local file, a 2 GiB Content-Length, an endless body, a decompression bomb's header
    ("/local.jpg", dict(local=True), "a local file", "failed_to_download", f"not an http(s) URL {LOCAL_REASON}"),
    ("/2gib.jpg", dict(body=b"x" * 100, content_length=2**31), "huge", "failed_to_download", TOO_MANY_BYTES),
    ("/endless.jpg", dict(body=b"x" * 65536, endless=True), "endless", "failed_to_download", TOO_MANY_BYTES),
    (
        "/bomb.png",
        dict(body=declaring_size("PNG", (30000, 30000)), content_type="image/png"),
        "30000 x 30000 in 70 bytes",
        "failed_to_download",
        f"image above --max_image_pixels {MAX_IMAGE_PIXELS}",
    ),
]


def serve_all(server: ImageServer, local: Path) -> list[tuple[str, str | None]]:
    """Register every route; return the (url, caption) rows, good and bad interleaved (a `local=True` row: the URL
    file:// of the image LOCAL, which a download must not read)."""
    local.write_bytes(image_bytes("JPEG", "RGB", (40, 40), (1, 2, 3)))
    rows = []
    for i in range(max(len(GOOD), len(BAD))):
        if i < len(GOOD):
            path, (fmt, mode, size, color), caption = GOOD[i]
            ctype = "image/png" if fmt == "PNG" else "image/jpeg"
            rows.append((server.add(path, body=image_bytes(fmt, mode, size, color), content_type=ctype), caption))
        if i < len(BAD):
            path, behaviour, caption, _, _ = BAD[i]
            url = local.as_uri() if behaviour.get("local") else server.add(path, **behaviour)
            rows.append((url, caption))
    return rows


def read_tars(folder: Path) -> dict[str, dict[str, bytes]]:
    """All samples of all NNNNN.tar in `folder`, by key, read with tarfile."""
    samples: dict[str, dict[str, bytes]] = {}
    for tar_path in sorted(folder.glob("*.tar")):
        with tarfile.open(tar_path) as tar:
            for m in tar:
                key, _, ext = m.name.rpartition(".")
                samples.setdefault(key, {})[ext] = tar.extractfile(m).read()
    return samples


@pytest.fixture(scope="module")
def adversarial(tmp_path_factory):
    """One CLI download of the good-and-bad URL list; returns (output dir, rc, seconds, rows)."""
    tmp = tmp_path_factory.mktemp("adversarial")
    with ImageServer() as server:
        rows = serve_all(server, tmp / "local.jpg")
        url_list = write_url_list(tmp / "urls.parquet", rows)
        options = dict(image_size=SIZE, processes=2, threads=8, samples_per_shard=6, timeout=2)
        argv = download_args(url_list, tmp / "out", **options, max_download_seconds=DEADLINE, encode_quality=90)
        started = time.monotonic()
        rc = download_main(argv)
        seconds = time.monotonic() - started
        hits = dict(server.hits)
    return tmp / "out", rc, seconds, rows, hits


@pytest.mark.slow
def test_summary_counts_match_the_truth(adversarial):
    out, rc, _, rows, _ = adversarial
    assert rc == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["shards"] == summary["shards_done"] == 3 and summary["shards_failed"] == []
    assert summary["count"] == len(rows) == len(GOOD) + len(BAD)
    assert summary["successes"] == len(GOOD)
    assert summary["failed_to_download"] == sum(status == "failed_to_download" for *_, status, _ in BAD)
    assert summary["failed_to_resize"] == sum(status == "failed_to_resize" for *_, status, _ in BAD)
    expected = {}
    for *_, reason in BAD:
        if reason is not None:
            expected[reason] = expected.get(reason, 0) + 1
    reasons = dict(summary["failures_by_reason"])
    empty = [r for r in reasons if "buf.empty()" in r]  # OpenCV's message for a zero-byte image
    assert len(empty) == 1 and reasons.pop(empty[0]) == 1
    assert reasons == expected


@pytest.mark.slow
def test_each_good_image_arrives_resized_with_its_own_caption(adversarial):
    out, *_ = adversarial
    samples = read_tars(out)
    by_path = {json.loads(s["json"])["url"].rsplit("/", 1)[-1]: s for s in samples.values()}
    assert sorted(by_path) == sorted(p.lstrip("/") for p, _, _ in GOOD)
    for path, (_, mode, _, color), caption in GOOD:
        sample = by_path[path.lstrip("/")]
        assert sample["txt"].decode("utf-8") == (caption or "")
        with Image.open(io.BytesIO(sample["jpg"])) as img:
            assert img.size == (SIZE, SIZE)
            centre = img.convert("RGB").getpixel((SIZE // 2, SIZE // 2))
        want = (color,) * 3 if mode == "L" else color[:3]
        assert max(abs(a - b) for a, b in zip(centre, want)) <= 12, (path, centre, want)
    assert json.loads((out / "sizes.json").read_text()) == {
        p.name: len({m.rsplit(".", 1)[0] for m in tarfile.open(p).getnames()}) for p in sorted(out.glob("*.tar"))
    }


@pytest.mark.slow
def test_trickle_and_hang_do_not_hold_the_run(adversarial):
    _, _, seconds, _, hits = adversarial
    # without the deadline the trickle alone would hold a worker for len(body) * TRICKLE seconds
    assert seconds < len(TRICKLE_BODY) * TRICKLE  # > 300 s: generous under load, and still fails without the deadline
    assert hits["/trickle.jpg"] == 1 and hits["/hang.jpg"] == 1


@pytest.mark.slow
def test_shards_read_back_with_webdataset_and_hf_datasets(adversarial):
    import webdataset as wds
    from datasets import load_dataset

    out, *_ = adversarial
    want = sorted(c or "" for _, _, c in GOOD)
    tars = [str(p) for p in sorted(out.glob("*.tar"))]
    wds_samples = list(wds.WebDataset(tars, shardshuffle=False).decode("pil"))
    assert sorted(s["txt"] for s in wds_samples) == want
    assert all(s["jpg"].size == (SIZE, SIZE) for s in wds_samples)
    hf = load_dataset("webdataset", data_files={"train": tars}, split="train", streaming=True)
    hf_samples = list(hf)
    assert sorted(s["txt"] for s in hf_samples) == want
    assert all(s["jpg"].size == (SIZE, SIZE) for s in hf_samples)


@pytest.mark.slow
def test_verify_passes_good_shards_and_catches_a_truncated_tar(adversarial, tmp_path, capsys):
    out, *_ = adversarial
    copy = tmp_path / "shards"
    copy.mkdir()
    for p in out.glob("*.tar"):
        shutil.copy(p, copy / p.name)
    assert verify_main([str(copy)]) == 0
    assert json.loads((copy / "sizes.json").read_text()) == json.loads((out / "sizes.json").read_text())
    data = (copy / "00000.tar").read_bytes()
    with tarfile.open(copy / "00000.tar") as tar:
        third = tar.getmembers()[2]
    # cut at a member boundary (tarfile alone reads this as a shorter, valid tar) and inside member data
    for cut in (third.offset, third.offset_data + third.size // 2):
        (copy / "00000.tar").write_bytes(data[:cut])
        capsys.readouterr()
        assert run_main(verify_main, [str(copy)], "disco-clip data verify") == 1, cut
        assert "BROKEN 00000.tar" in capsys.readouterr().err
        assert "00000.tar" not in json.loads((copy / "sizes.json").read_text())


@pytest.mark.slow
def test_download_fails_loudly_when_nothing_arrives(image_server, tmp_path, capsys):
    rows = [(image_server.add(f"/gone{i}.jpg", status=404), "x") for i in range(3)]
    url_list = write_url_list(tmp_path / "urls.parquet", rows)
    rc = run_main(
        download_main,
        download_args(url_list, tmp_path / "out", threads=4, timeout=2),
        "disco-clip data download",
    )
    assert rc == 1
    assert "no sample was downloaded" in capsys.readouterr().err
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["failures_by_reason"] == {"HTTP Error 404: Not Found": 3}


def _download_argv(url_list: Path, output: Path) -> list[str]:
    return download_args(url_list, output, image_size=SIZE, processes=1, threads=2, samples_per_shard=6, timeout=5)


@pytest.mark.slow
def test_interrupted_download_resumes_to_the_same_shards(image_server, tmp_path, capsys):
    rows = [
        (
            image_server.add(
                f"/img{i}.png",
                body=image_bytes("PNG", "RGB", (20 + i, 30), (9 * i, 100, 250 - 9 * i)),
                content_type="image/png",
                delay=0.1,
            ),
            f"picture number {i}",
        )
        for i in range(24)
    ]
    url_list = write_url_list(tmp_path / "urls.parquet", rows)
    shards = [f"{i:05d}.tar" for i in range(4)]

    reference = tmp_path / "reference"
    assert download_main(_download_argv(url_list, reference)) == 0

    resumed = tmp_path / "resumed"
    cli = [sys.executable, "-m", "disco_clip_ds.cli", "data", "download", *_download_argv(url_list, resumed)]
    # The worker stops itself once shard 0 is written (a named fault point), so the kill lands in a known state.
    hold = tmp_path / "held.pid"
    env = {
        **os.environ,
        "NO_ALBUMENTATIONS_UPDATE": "1",
        "DISCO_FAULT": f"hold_after={hold}:shard=0",
    }
    proc = subprocess.Popen(cli, env=env, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    while not hold.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)  # the run and its download workers, mid-flight
    proc.wait()
    finished_before = {p.name: p.read_text() for p in resumed.glob("*_stats.json")}
    assert hold.exists(), "the download never reached the end of shard 0"
    assert sorted(finished_before) == ["00000_stats.json"]

    assert download_main(_download_argv(url_list, resumed)) == 0
    for name, text in finished_before.items():  # stats carry start/end times: unchanged means not redone
        assert (resumed / name).read_text() == text
    for name in ["sizes.json", "summary.json", *shards]:
        assert (resumed / name).read_bytes() == (reference / name).read_bytes(), name

    # a tar deleted behind img2dataset's back (its stats file stays) is detected and downloaded again
    stats_before = {p.name: p.read_text() for p in resumed.glob("*_stats.json")}
    (resumed / "00002.tar").unlink()
    capsys.readouterr()
    assert download_main(_download_argv(url_list, resumed)) == 0
    assert "tar missing for shard(s) 00002" in capsys.readouterr().out
    assert (resumed / "00002.tar").read_bytes() == (reference / "00002.tar").read_bytes()
    stats_after = {p.name: p.read_text() for p in resumed.glob("*_stats.json")}
    assert {n for n in stats_after if stats_after[n] != stats_before[n]} == {"00002_stats.json"}
