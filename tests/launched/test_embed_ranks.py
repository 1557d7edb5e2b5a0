"""`disco-clip data embed` under torchrun: 2 gloo ranks write the same sidecars as one process, and an error on one
rank ends both, in one line each, without a hang.

The sidecars are compared tensor for tensor, bit for bit, and their metadata entry for entry: each shard is embedded
whole by one process, in the same batches, by the same CPU kernels with one thread, and its metadata names the shard
by its absolute path, which does not depend on the output folder. Not byte for byte: safetensors writes the metadata
in its (Rust) hash map's order, which differs from process to process, so two single-process runs differ in their
header bytes too. (On GPUs the kernels may differ by rank and batch, and only the tensors' closeness would hold.)"""

from __future__ import annotations

import subprocess

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from disco_clip_ds.commands.data import embed_main
from disco_clip_ds.data.embeddings import read_metadata
from disco_clip_ds.errors import run_main
from disco_clip_ds.testing.images import noise_image_bytes, write_samples
from disco_clip_ds.testing.launch import TINY_CONFIG, TOKENIZER_DIR, VENV_BIN, train_env
from disco_clip_ds.testing.ranks import free_port

SUMMARY = "5 shard(s) embedded, 0 already done, 1 sample(s) without image or caption skipped"


def _args(output, shards: str, teacher) -> list[str]:
    args = ["--teacher", str(teacher), "--tokenizer_name", str(TOKENIZER_DIR)]
    return [*args, "--shards", shards, "--output", str(output), "--batch_size", "3"]


def _embed_on_two_ranks(output, shards: str, teacher) -> subprocess.CompletedProcess:
    launcher = [str(VENV_BIN / "torchrun"), "--nproc_per_node", "2", "--master_port", str(free_port())]
    cmd = [*launcher, "-m", "disco_clip_ds.cli", "data", "embed", *_args(output, shards, teacher)]
    return subprocess.run(cmd, env=train_env(), capture_output=True, text=True, timeout=120)


@pytest.mark.timeout(300)
@pytest.mark.slow
def test_two_ranks_write_the_sidecars_of_one_process_and_fail_together(tmp_path, capsys):
    from disco_clip_ds.models.build import build_model

    rng = np.random.default_rng(0)
    samples = [{"jpg": noise_image_bytes(rng, "JPEG", 48), "txt": f"caption {i}"} for i in range(20)]
    samples[6] = {"jpg": samples[6]["jpg"]}  # no caption: skipped, counted on rank 1 (shard 1 is rank 1's)
    samples += [{"jpg": b"not a jpeg", "txt": "broken"}] * 2  # shard 5: no sample that can be embedded
    write_samples(tmp_path / "data", samples, per_shard=4)
    build_model(model_config=str(TINY_CONFIG), seed=0).save_pretrained(tmp_path / "teacher")
    good = str(tmp_path / "data" / "{00000..00004}.tar")  # 5 shards: rank 0 takes 0, 2, 4; rank 1 takes 1, 3

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each rank runs (OMP_NUM_THREADS=1): the same kernels
    try:  # one process: this one (a third launch would pay the imports again)
        assert run_main(embed_main, _args(tmp_path / "one", good, tmp_path / "teacher"), "disco-clip data embed") == 0
    finally:
        torch.set_num_threads(threads)
    assert capsys.readouterr().out.count(SUMMARY) == 1
    two = _embed_on_two_ranks(tmp_path / "two", good, tmp_path / "teacher")
    assert two.returncode == 0, two.stderr[-3000:]
    assert two.stdout.count(SUMMARY) == 1  # rank 0 alone prints it
    assert "embedding (rank 0 of 2)" in two.stderr and "samples/s" in two.stderr  # rank 0's bar, with its rate
    files = sorted(p.name for p in (tmp_path / "one").iterdir())
    assert len(files) == 5 and files == sorted(p.name for p in (tmp_path / "two").iterdir())
    for name in files:
        one_file, two_file = load_file(tmp_path / "one" / name), load_file(tmp_path / "two" / name)
        assert one_file.keys() == two_file.keys() and len(one_file) == 2, name  # one teacher's image and text
        assert all(torch.equal(one_file[k], two_file[k]) for k in one_file), name
        assert read_metadata(tmp_path / "one" / name) == read_metadata(tmp_path / "two" / name), name

    # again with shard 5, rank 1's, which fails: both ranks end with its one line (exit 2); the done ones are kept
    failed = _embed_on_two_ranks(tmp_path / "two", str(tmp_path / "data" / "{00000..00005}.tar"), tmp_path / "teacher")
    assert failed.returncode != 0
    said = [line for line in failed.stderr.splitlines() if line.startswith("disco-clip data embed:")]
    assert len(said) == 2 and all("00005.tar: no sample with an image and a caption" in line for line in said), said
    assert sorted(p.name for p in (tmp_path / "two").iterdir()) == files
