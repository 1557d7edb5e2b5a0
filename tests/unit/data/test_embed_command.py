"""`disco-clip data embed` (commands/data.py, data/prep/embed.py): two sources whose shards share file names and
sample keys get their own embeddings (D3), and a teacher that cannot be read or stored is one line, exit 2, before
any model is built (D5, D6)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from disco_clip_ds.commands.data import embed_main
from disco_clip_ds.data.embeddings import EmbeddingStore
from disco_clip_ds.data.streams.tar_samples import raw_samples
from disco_clip_ds.data.teacher_id import teacher_fingerprint
from disco_clip_ds.errors import run_main
from disco_clip_ds.testing.images import noise_image_bytes, write_samples, write_shards
from disco_clip_ds.testing.launch import TINY_CONFIG, TOKENIZER_DIR


def _embed(argv: list[str]) -> int:
    return run_main(embed_main, argv, "disco-clip data embed")


@pytest.mark.slow  # builds a tiny teacher and embeds 12 samples
def test_two_sources_with_the_same_shard_names_get_their_own_embeddings(tmp_path, capsys, monkeypatch):
    """D3: b's shards were "already done" with a's sidecars, and training read a's embeddings for b's samples."""
    from disco_clip_ds.models.build import build_model

    monkeypatch.chdir(tmp_path)
    rng = np.random.default_rng(0)
    for src in "ab":  # the same shard names and keys (s00000 ...), other images and captions
        samples = [{"jpg": noise_image_bytes(rng, "JPEG"), "txt": f"{src}: caption {i}"} for i in range(6)]
        write_samples(tmp_path / src, samples, per_shard=3)
    torch.manual_seed(0)
    build_model(model_config=str(TINY_CONFIG)).save_pretrained(tmp_path / "teacher")
    argv = ["--teacher", "teacher", "--tokenizer_name", str(TOKENIZER_DIR), "--output", "emb"]
    argv += ["--shards", "a/{00000..00001}.tar::b/{00000..00001}.tar"]
    assert _embed(argv) == 0
    assert "4 shard(s) embedded, 0 already done" in capsys.readouterr().out
    assert len(list((tmp_path / "emb").glob("*.teacher.safetensors"))) == 4
    store = EmbeddingStore("emb", teacher_fingerprint("teacher"))
    for name in ("00000.tar", "00001.tar"):
        keys = [sample["__key__"] for sample in raw_samples(f"a/{name}")]
        assert keys == [sample["__key__"] for sample in raw_samples(f"b/{name}")]
        for key in keys:
            a_image, a_text = store.pair(f"a/{name}", key)
            b_image, b_text = store.pair(str(tmp_path / "b" / name), key)  # the same shard spelled absolutely
            assert not torch.allclose(a_image, b_image) and not torch.allclose(a_text, b_text)
    assert _embed(argv) == 0 and "0 shard(s) embedded, 4 already done" in capsys.readouterr().out
    # one shard named twice would be embedded into one sidecar twice
    assert _embed([*argv[:-1], "a/00000.tar::a/../a/00000.tar"]) == 2
    err = capsys.readouterr().err
    assert "names the shard a/00000.tar twice" in err and len(err.splitlines()) == 1


def test_a_missing_relative_teacher_folder_is_one_line(tmp_path, capsys, monkeypatch, no_model):
    """D6: two tracebacks ending in LocalEntryNotFoundError."""
    monkeypatch.chdir(tmp_path)
    write_shards(tmp_path / "data", num_shards=1, per_shard=2)
    for teacher, said in (("teacher", "no such folder, nor a model on the hub"), ("./teacher", "no such folder")):
        assert _embed(["--teacher", teacher, "--shards", "data"]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"disco-clip data embed: --teacher {teacher}: {said}") and len(err.splitlines()) == 1


def test_a_teacher_whose_weights_fail_their_manifest_is_refused_in_one_line(tmp_path, capsys, no_model):
    """A teacher folder (an exported model) whose model.safetensors no longer matches its manifest is refused as
    `disco-clip export` refuses it, before any shard is read or model built."""
    from disco_clip_ds.checkpoint.manifest import write_manifest
    from disco_clip_ds.models.build import load_config

    teacher = tmp_path / "teacher"
    load_config(model_config=str(TINY_CONFIG)).save_pretrained(teacher)
    (teacher / "model.safetensors").write_bytes(b"weights")
    write_manifest(teacher)
    (teacher / "model.safetensors").write_bytes(b"weigh")
    assert _embed(["--teacher", str(teacher), "--shards", str(tmp_path / "nowhere")]) == 1
    (line,) = capsys.readouterr().err.splitlines()
    assert line == (
        f"disco-clip data embed: --teacher {teacher} does not verify: model.safetensors is 5 bytes, the manifest says "
        "7; no checkpoint beside it verifies"
    )


def test_a_siglip2_teacher_is_refused_in_one_line(tmp_path, capsys, no_model):
    """D5: AttributeError: 'Siglip2VisionConfig' object has no attribute 'image_size'."""
    from disco_clip_ds.models.build import load_config

    load_config(model_config="recipes/models/siglip2_tiny.json").save_pretrained(tmp_path / "siglip2")
    write_shards(tmp_path / "data", num_shards=1, per_shard=2)
    assert _embed(["--teacher", str(tmp_path / "siglip2"), "--shards", str(tmp_path / "data")]) == 2
    err = capsys.readouterr().err
    assert "a SigLIP 2 model, whose NaFlex image input has no one image size" in err and len(err.splitlines()) == 1


@pytest.fixture(scope="module")
def tiny_teacher(tmp_path_factory):
    from disco_clip_ds.models.build import build_model

    folder = tmp_path_factory.mktemp("teacher") / "teacher"
    build_model(model_config=str(TINY_CONFIG), seed=0).save_pretrained(folder)
    return folder


def _odd_shards(folder) -> str:
    """3 shards of 5, 4 and 5 samples (batches of 2 fall across workers unevenly), one without a caption and one
    whose image does not decode."""
    rng = np.random.default_rng(1)
    samples = [{"jpg": noise_image_bytes(rng, "JPEG", 48), "txt": f"caption {i}"} for i in range(14)]
    samples[3] = {"jpg": samples[3]["jpg"]}
    samples[7] = {"jpg": b"not a jpeg", "txt": "broken"}
    write_samples(folder, samples[:5], per_shard=5)
    write_samples(folder / "b", samples[5:9], per_shard=4)
    write_samples(folder / "c", samples[9:], per_shard=5)
    _as_gnu_tar(folder / "c" / "00000.tar")  # a tar the header walk leaves to tarfile: read whole by every worker
    return f"{folder}/00000.tar::{folder}/b/00000.tar::{folder}/c/00000.tar"


def _as_gnu_tar(path) -> None:
    """The same samples in a GNU tar with a long-named member without extension (passed over by every reader)."""
    import io
    import tarfile

    from disco_clip_ds.data.tarcopy import sample_members

    with tarfile.open(path) as tar:
        members = [(info, tar.extractfile(info).read()) for info in tar.getmembers()]
    members.insert(1, (tarfile.TarInfo("z" * 120), b"passed over"))
    with tarfile.open(path, "w", format=tarfile.GNU_FORMAT) as tar:
        for info, data in members:
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    assert sample_members(str(path)) is None


@pytest.mark.slow  # beyond the fast tier's time budget
def test_the_sidecars_do_not_depend_on_the_number_of_decoding_workers(tmp_path, tiny_teacher, capsys):
    """Batch i of the sequence is decoded by worker i % W and the DataLoader returns them in turn: a worker that
    took another's batch, or a shard's batches out of order, would change the rows or the batches' forwards."""
    shards = _odd_shards(tmp_path / "data")
    base = ["--teacher", str(tiny_teacher), "--tokenizer_name", str(TOKENIZER_DIR), "--shards", shards]
    base += ["--batch_size", "2", "--augmentations", "2"]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the same kernels in every run
    try:
        for workers in (0, 2, 3):
            argv = [*base, "--num_workers", str(workers), "--output", str(tmp_path / f"w{workers}")]
            assert _embed(argv) == 0
            assert "3 shard(s) embedded, 0 already done, 2 sample(s) without image or caption skipped" in (
                capsys.readouterr().out
            )
    finally:
        torch.set_num_threads(threads)
    files = sorted(p.name for p in (tmp_path / "w0").iterdir())
    assert len(files) == 3
    for workers in (2, 3):
        assert sorted(p.name for p in (tmp_path / f"w{workers}").iterdir()) == files
        for name in files:
            assert (tmp_path / f"w{workers}" / name).read_bytes() == (tmp_path / "w0" / name).read_bytes(), name


@pytest.mark.slow  # beyond the fast tier's time budget
def test_a_damaged_shard_read_by_a_worker_is_one_line_naming_it_and_the_shards_before_it_are_kept(
    tmp_path, tiny_teacher, capsys
):
    shards = _odd_shards(tmp_path / "data")
    torn = tmp_path / "data" / "b" / "00000.tar"
    torn.write_bytes(torn.read_bytes()[:3000])  # cut inside its second sample
    argv = ["--teacher", str(tiny_teacher), "--tokenizer_name", str(TOKENIZER_DIR), "--shards", shards]
    argv += ["--batch_size", "2", "--num_workers", "2", "--output", str(tmp_path / "emb")]
    assert _embed(argv) == 1
    said = [line for line in capsys.readouterr().err.splitlines() if line.startswith("disco-clip data embed:")]
    assert len(said) == 1 and "b/00000.tar is damaged (unexpected end of data)" in said[0], said
    assert "`disco-clip data verify`" in said[0]
    assert [p.name.split(".")[0] for p in (tmp_path / "emb").iterdir()] == ["00000"]  # the first shard's, written


def test_a_negative_worker_count_or_an_autocast_on_the_cpu_is_refused_in_one_line(tmp_path, capsys, no_model):
    write_shards(tmp_path / "data", num_shards=1, per_shard=2)
    assert _embed(["--teacher", "t", "--shards", str(tmp_path / "data"), "--num_workers", "-1"]) == 2
    err = capsys.readouterr().err
    assert "--num_workers -1: give 0" in err and len(err.splitlines()) == 1
    if not torch.cuda.is_available():
        assert _embed(["--teacher", "t", "--shards", str(tmp_path / "data"), "--precision", "bfloat16"]) == 2
        err = capsys.readouterr().err
        assert "--precision bfloat16: autocast runs on a GPU only" in err and len(err.splitlines()) == 1


def test_the_forward_precision_autocasts_on_a_gpu_only():
    from disco_clip_ds.data.prep.embed import autocast_dtype
    from disco_clip_ds.errors import UsageError

    cpu, gpu = torch.device("cpu"), torch.device("cuda", 0)  # a device object needs no GPU
    assert autocast_dtype("auto", cpu) is None and autocast_dtype("float32", cpu) is None
    assert autocast_dtype("auto", gpu) == torch.bfloat16 and autocast_dtype("bfloat16", gpu) == torch.bfloat16
    assert autocast_dtype("float16", gpu) == torch.float16 and autocast_dtype("float32", gpu) is None
    for precision in ("bfloat16", "float16"):
        with pytest.raises(UsageError, match=f"--precision {precision}: autocast runs on a GPU only"):
            autocast_dtype(precision, cpu)
    with pytest.raises(UsageError, match="--precision half: give one of auto, float32, bfloat16, float16"):
        autocast_dtype("half", gpu)


@pytest.mark.slow  # beyond the fast tier's time budget
def test_the_autocast_forward_runs_in_the_lower_precision_and_returns_float32(tiny_teacher):
    """`_forward` under autocast, run on the CPU's bfloat16 autocast (the GPU's is the same context on another
    device): float32 embeddings near the float32 forward's, not equal to them (the cast was applied)."""
    from disco_clip_ds.data.prep.embed import _forward, load_teacher

    teacher = load_teacher(str(tiny_teacher), str(TOKENIZER_DIR))
    rng = np.random.default_rng(0)
    crops = torch.from_numpy(rng.integers(0, 256, (3, 3, 64, 64), dtype=np.uint8))
    captions = [{"txt": f"a photo of {i}"} for i in range(3)]
    full = _forward(teacher, crops, captions, ["txt"], None)
    low = _forward(teacher, crops, captions, ["txt"], torch.bfloat16)
    for a, b in ((full[0], low[0]), (full[1]["txt"], low[1]["txt"])):
        assert b.dtype == torch.float32 and a.shape == b.shape
        assert not torch.equal(a, b)
        assert torch.allclose(a, b, atol=0.05)


def test_a_second_embed_into_a_folder_being_written_is_refused_naming_the_writer(tmp_path, capsys):
    """Into --output, or beside the shards without it: refused in one line naming the holder's host and pid, before
    any teacher is read (`t` does not exist); the holder here is a forked process holding the folder's lock, as a
    running `data embed` does. (Every rank of a launched embed gets the line: test_runlock.py.)"""
    import socket

    from disco_clip_ds.distributed.runlock import writer_lock
    from disco_clip_ds.testing.writers import held_elsewhere

    write_shards(tmp_path / "data", num_shards=1, per_shard=2)
    for output, flag, instead in ((tmp_path / "emb", "--output", "give another --output"), (None, "", "give --output")):
        folder, flag = (output, flag) if output else (tmp_path / "data", "the shards' folder")
        argv = ["--teacher", "t", "--shards", str(tmp_path / "data")] + (["--output", str(output)] if output else [])
        with held_elsewhere(writer_lock(folder, flag, "disco-clip data embed")) as pid:
            assert _embed(argv) == 2
        holder = f"disco-clip data embed: host {socket.gethostname()}, pid {pid}, since "
        err = capsys.readouterr().err
        assert err.startswith(f"disco-clip data embed: {flag} {folder}: being written by another process ({holder}")
        assert err.endswith(f"): wait for it to end, or {instead}\n") and err.count("\n") == 1
    assert sorted(p.name for p in (tmp_path / "data").iterdir()) == ["00000.tar", "sizes.json"]


def _tar_of(path, members: list[tuple[str, bytes]]) -> str:
    """A tar at PATH holding `members` (name, bytes) in that order; no member: an empty but valid tar."""
    import io
    import tarfile

    path.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(path, "w") as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return str(path)


@pytest.mark.slow  # embeds and filters with the tiny teacher
def test_an_empty_shard_gets_a_sidecar_of_no_rows_counted_and_the_filter_takes_it(tmp_path, tiny_teacher, capsys):
    """A valid tar with no member (img2dataset's shard whose every download failed): `data embed` writes it a sidecar
    of no rows and says it was empty, instead of stopping; `data filter` reads it as a shard of nothing."""
    from disco_clip_ds.commands.data import filter_main
    from disco_clip_ds.data.embeddings import read_reinforced, sidecar_path

    urls = write_shards(tmp_path / "data", num_shards=1, per_shard=3)
    empty = _tar_of(tmp_path / "data" / "00001.tar", [])
    base = ["--teacher", str(tiny_teacher), "--tokenizer_name", str(TOKENIZER_DIR), "--num_workers", "0"]
    assert _embed([*base, "--shards", f"{urls[0]}::{empty}", "--augmentations", "2"]) == 0
    out = capsys.readouterr().out
    assert "2 shard(s) embedded (1 empty: no sample), 0 already done" in out and "sidecars beside their shards" in out
    full, none = (read_reinforced(sidecar_path(tmp_path / "data", u)) for u in (urls[0], empty))
    assert none.keys == [] and [i.shape[1:] for i in none.images] == [i.shape[1:] for i in full.images]
    assert none.boxes.shape == (0, 2, 4) and len(full.keys) == 3
    kept = tmp_path / "kept"
    argv = ["--shards", str(tmp_path / "data"), "--output", str(kept), "--clip_score_min", "-1"]
    assert run_main(filter_main, argv, "f") == 0
    assert sum(json.loads((kept / "sizes.json").read_text()).values()) == 3


@pytest.mark.slow  # embeds with the tiny teacher
def test_two_samples_of_one_key_in_a_shard_are_refused_naming_the_shard_and_the_key(tmp_path, tiny_teacher, capsys):
    """The sidecar maps a key to one row: two samples of one key (not adjacent: adjacent members are one sample)
    would share it. Refused in one line, the shards before it kept."""
    rng = np.random.default_rng(0)
    good = write_shards(tmp_path / "data", num_shards=1, per_shard=2)[0]
    image = noise_image_bytes(rng, "JPEG", 32)
    members = [("a.jpg", image), ("a.txt", b"one"), ("b.jpg", image), ("b.txt", b"two")]
    twice = _tar_of(tmp_path / "data" / "00001.tar", [*members, ("a.jpg", image), ("a.txt", b"three")])
    argv = ["--teacher", str(tiny_teacher), "--tokenizer_name", str(TOKENIZER_DIR), "--num_workers", "1"]
    assert _embed([*argv, "--shards", f"{good}::{twice}", "--batch_size", "2", "--output", str(tmp_path / "e")]) == 1
    said = [line for line in capsys.readouterr().err.splitlines() if line.startswith("disco-clip data embed:")]
    assert len(said) == 1 and "00001.tar holds two samples of key a" in said[0], said
    assert len(list((tmp_path / "e").glob("00000.*.teacher.safetensors"))) == 1
    assert not list((tmp_path / "e").glob("00001.*"))


@pytest.mark.parametrize("cut", [0, 700, 3000])
def test_a_zero_byte_or_cut_short_shard_is_a_data_error_naming_it(tmp_path, cut):
    """0 bytes, cut inside the first member's header, cut inside a later member: each shard's batches end with a
    DataError naming it (raised as one line when its batch comes back), never tarfile's traceback."""
    from disco_clip_ds.data.prep.embed_loader import _raw_batches

    url = write_shards(tmp_path / "data", num_shards=1, per_shard=4)[0]
    with open(url, "r+b") as f:
        f.truncate(cut)
    *_, (read, last, error) = list(_raw_batches(url, 2))
    assert last and read() == [] and "00000.tar is damaged" in str(error)
    assert "`disco-clip data verify`" in str(error)
