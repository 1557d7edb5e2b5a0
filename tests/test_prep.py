"""`disco-clip data download/verify/metadata` against a loopback server whose truth the test knows.

Shards are read back with tarfile, webdataset and HF datasets (not with prep's own readers), and images
are checked pixel by pixel against what the server sent.
"""

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

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from disco_clip_ds.data.prep import download as prep
from disco_clip_ds.data.prep.fetch import fetch_with_deadline
from disco_clip_ds.data.prep.inputs import expected_shards, input_columns
from disco_clip_ds.data.prep.metadata import _metadata_parser, metadata_main
from disco_clip_ds.data.prep.outputs import prepare_output_for_resume, summarize
from disco_clip_ds.data.prep.verify import _verify_parser, verify_main
from disco_clip_ds.errors import DataError, UsageError, run_main
from disco_clip_ds.testing.download import download_args, write_url_list
from disco_clip_ds.testing.images import image_bytes
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
]


def serve_all(server: ImageServer) -> list[tuple[str, str | None]]:
    """Register every route; return the (url, caption) rows, good and bad interleaved."""
    rows = []
    for i in range(max(len(GOOD), len(BAD))):
        if i < len(GOOD):
            path, (fmt, mode, size, color), caption = GOOD[i]
            ctype = "image/png" if fmt == "PNG" else "image/jpeg"
            rows.append((server.add(path, body=image_bytes(fmt, mode, size, color), content_type=ctype), caption))
        if i < len(BAD):
            path, behaviour, caption, _, _ = BAD[i]
            rows.append((server.add(path, **behaviour), caption))
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
        rows = serve_all(server)
        url_list = write_url_list(tmp / "urls.parquet", rows)
        options = dict(image_size=SIZE, processes=2, threads=8, samples_per_shard=6, timeout=2)
        argv = download_args(url_list, tmp / "out", **options, max_download_seconds=DEADLINE, encode_quality=90)
        started = time.monotonic()
        rc = prep.download_main(argv)
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


def test_verify_reports_an_undecodable_image(tmp_path, capsys):
    import webdataset as wds

    with wds.TarWriter(str(tmp_path / "00000.tar")) as sink:
        sink.write({"__key__": "a", "jpg": image_bytes("JPEG", "RGB", (8, 8), (1, 2, 3)), "txt": "one two"})
        sink.write({"__key__": "b", "jpg": b"not a jpeg", "txt": "three"})
    assert run_main(verify_main, [str(tmp_path)], "disco-clip data verify") == 1
    err = capsys.readouterr().err
    assert "b.jpg: cannot decode" in err


@pytest.mark.slow
def test_download_fails_loudly_when_nothing_arrives(image_server, tmp_path, capsys):
    rows = [(image_server.add(f"/gone{i}.jpg", status=404), "x") for i in range(3)]
    url_list = write_url_list(tmp_path / "urls.parquet", rows)
    rc = run_main(
        prep.download_main,
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
    assert prep.download_main(_download_argv(url_list, reference)) == 0

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

    assert prep.download_main(_download_argv(url_list, resumed)) == 0
    for name, text in finished_before.items():  # stats carry start/end times: unchanged means not redone
        assert (resumed / name).read_text() == text
    for name in ["sizes.json", "summary.json", *shards]:
        assert (resumed / name).read_bytes() == (reference / name).read_bytes(), name

    # a tar deleted behind img2dataset's back (its stats file stays) is detected and downloaded again
    stats_before = {p.name: p.read_text() for p in resumed.glob("*_stats.json")}
    (resumed / "00002.tar").unlink()
    capsys.readouterr()
    assert prep.download_main(_download_argv(url_list, resumed)) == 0
    assert "tar missing for shard(s) 00002" in capsys.readouterr().out
    assert (resumed / "00002.tar").read_bytes() == (reference / "00002.tar").read_bytes()
    stats_after = {p.name: p.read_text() for p in resumed.glob("*_stats.json")}
    assert {n for n in stats_after if stats_after[n] != stats_before[n]} == {"00002_stats.json"}


# --- fast checks, no img2dataset run ---------------------------------------------------------------


def test_fetch_with_deadline_cuts_a_trickle(image_server):
    url = image_server.add("/slow", body=b"x" * 1000, trickle=0.05)
    fast = image_server.add("/fast", body=b"y" * 1000)
    assert fetch_with_deadline(fast, timeout=2, deadline_s=5)[1] == b"y" * 1000
    started = time.monotonic()
    with pytest.raises(TimeoutError, match="deadline"):
        fetch_with_deadline(url, timeout=2, deadline_s=1)
    assert time.monotonic() - started < 25  # generous on a loaded machine; the whole body would take 50 s
    slow_head = image_server.add("/slow-head", body=b"z" * 10, trickle_headers=0.05)
    with pytest.raises(TimeoutError, match="deadline"):  # the status line and headers alone take ~2 s
        fetch_with_deadline(slow_head, timeout=2, deadline_s=1)


def _write_tar(path: Path, names: list[str]) -> None:
    with tarfile.open(path, "w") as tar:
        for name in names:
            info = tarfile.TarInfo(name)
            info.size, info.mtime = len(name), 1_700_000_000
            tar.addfile(info, io.BytesIO(name.encode()))


def test_summarize_aggregates_stats_and_names_failed_shards(tmp_path):
    stats = {
        0: dict(
            count=4,
            successes=2,
            failed_to_download=1,
            failed_to_resize=1,
            status_dict={"success": 2, "HTTP Error 404: Not Found": 1, "Image decoding error\n": 1},
        ),
        2: dict(count=3, successes=3, failed_to_download=0, failed_to_resize=0, status_dict={"success": 3}),
    }
    for i, s in stats.items():
        (tmp_path / f"0000{i}_stats.json").write_text(json.dumps(s))
    _write_tar(tmp_path / "00000.tar", ["k1.txt", "k1.jpg", "k0.jpg", "k0.txt"])  # completion order
    _write_tar(tmp_path / "00002.tar", ["a.jpg", "b.jpg", "c.png"])
    # shard 3 finished by its stats, but its tar lost a sample (cut at a member boundary): redo it
    (tmp_path / "00003_stats.json").write_text(json.dumps({**stats[2], "successes": 4}))
    _write_tar(tmp_path / "00003.tar", ["a.jpg", "b.jpg", "c.jpg"])
    summary, sizes = summarize(tmp_path, n_expected=4)
    assert not (tmp_path / "00003_stats.json").exists()
    assert summary == {
        "shards": 4,
        "shards_done": 2,
        "shards_failed": ["00001", "00003"],
        "count": 7,
        "successes": 5,
        "failed_to_download": 1,
        "failed_to_resize": 1,
        "failures_by_reason": {"HTTP Error 404: Not Found": 1, "Image decoding error": 1},
    }
    assert sizes == {"00000.tar": 2, "00002.tar": 3}
    with tarfile.open(tmp_path / "00000.tar") as tar:
        assert tar.getnames() == ["k0.jpg", "k0.txt", "k1.jpg", "k1.txt"]
        assert {m.mtime for m in tar.getmembers()} == {0}
        assert tar.extractfile("k1.jpg").read() == b"k1.jpg"


def test_resume_preparation_redoes_a_missing_tar_and_refuses_stray_json(tmp_path):
    for name in ("00000_stats.json", "00001_stats.json", "sizes.json", "summary.json"):
        (tmp_path / name).write_text("{}")
    _write_tar(tmp_path / "00000.tar", ["a.jpg"])
    (tmp_path / "00001.parquet").write_text("")
    assert prepare_output_for_resume(tmp_path) == [1]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["00000.tar", "00000_stats.json"]
    (tmp_path / "notes.json").write_text("{}")
    with pytest.raises(UsageError, match="notes.json"):
        prepare_output_for_resume(tmp_path)


def test_download_arguments_are_checked_before_any_work(tmp_path):
    url_list = write_url_list(tmp_path / "urls.parquet", [("http://127.0.0.1:9/x.jpg", "x")])
    base = download_args(url_list, tmp_path / "out")
    with pytest.raises(UsageError, match="did you mean --encode_quality"):
        prep.download_main(base + ["--encode_qualty", "90"])
    with pytest.raises(UsageError, match="use --output"):
        prep.download_main(base + ["--output_folder", "elsewhere"])
    with pytest.raises(UsageError, match=r"column 'url' .*\['URL', 'TEXT'\].*--url_col"):
        prep.download_main(base[:1] + ["datacomp"] + base[2:])
    (tmp_path / "broken.parquet").write_bytes(b"PAR1 not really")
    with pytest.raises(DataError, match="cannot read .*broken.parquet as parquet"):
        prep.download_main(base[:2] + ["--url_list", str(tmp_path / "broken.parquet")] + base[4:])
    with pytest.raises(UsageError, match="does not exist"):
        prep.download_main(["--preset", "cc", "--url_list", str(tmp_path / "nope.tsv"), "--output", str(tmp_path)])
    assert not (tmp_path / "out").exists()


def test_cc_preset_reads_a_tsv_header(tmp_path):
    tsv = tmp_path / "cc3m.tsv"
    tsv.write_text("caption\turl\na dog\thttp://127.0.0.1:9/a.jpg\na cat\thttp://127.0.0.1:9/b.jpg\n")
    preset = prep.PRESETS["cc"]
    assert input_columns(tsv, preset.input_format) == ["caption", "url"]
    assert expected_shards([tsv], preset.input_format, samples_per_shard=1) == 2


def test_metadata_offline_on_a_local_folder(tmp_path, capsys):
    assert os.environ.get("HF_HUB_OFFLINE") == "1"
    folder = tmp_path / "relaion"
    (folder / "part").mkdir(parents=True)
    for i, n in enumerate((3, 4)):
        pq.write_table(pa.table({"url": ["u"] * n, "caption": ["c"] * n}), folder / "part" / f"part-{i:05d}.parquet")
    (folder / "README.md").write_text("card")
    argv = ["--dataset", "laion/relaion2B-en-research-safe", "--output", str(folder)]
    assert metadata_main(argv + ["--pattern", "part/*.parquet"]) == 0
    assert "2 parquet files, 7 rows" in capsys.readouterr().out
    with pytest.raises(UsageError, match="no parquet file"):
        metadata_main(argv + ["--pattern", "other/*.parquet"])
    with pytest.raises(DataError, match="cannot fetch"):
        metadata_main(["--dataset", "laion/relaion2B-en-research-safe", "--output", str(tmp_path / "empty")])


@pytest.mark.parametrize(
    "script, args",
    [("relaion400m.sh", []), ("datacomp.sh", ["small"]), ("datacomp.sh", ["medium"]), ("cc3m.sh", ["GCC.tsv"])],
)
@pytest.mark.slow
def test_data_prep_scripts_run_through_with_valid_arguments(script, args, tmp_path):
    """Each data_prep script, with `disco-clip` replaced by a recorder: every call parses as our CLI does."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    shim = bin_dir / "disco-clip"
    shim.write_text('#!/usr/bin/env bash\nprintf "%s\\0" "$@" >> "$CALLS"; printf "\\n" >> "$CALLS"\n')
    shim.chmod(0o755)
    (tmp_path / "GCC.tsv").write_text("a dog\thttp://example.invalid/a.jpg\n")
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "CALLS": str(tmp_path / "calls")}
    script_path = Path(__file__).resolve().parents[1] / "data_prep" / script
    subprocess.run(["bash", str(script_path), *args], cwd=tmp_path, env=env, check=True, timeout=30)
    calls = [line.split("\0")[:-1] for line in (tmp_path / "calls").read_text().splitlines() if line]
    assert [c[:2] for c in calls][-2:] == [["data", "download"], ["data", "verify"]]
    for call in calls:
        rest = call[2:]
        if call[1] == "download":
            known, unknown = prep._download_parser().parse_known_args(rest)
            prep._parse_passthrough(unknown)
            assert known.preset in prep.PRESETS
        elif call[1] == "metadata":
            assert _metadata_parser().parse_args(rest).pattern
        else:
            _verify_parser().parse_args(rest)
    if script == "cc3m.sh":
        assert (tmp_path / "data/cc3m/metadata/cc3m.tsv").read_text().startswith("caption\turl\na dog")
