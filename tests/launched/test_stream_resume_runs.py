"""Resume seeks to the stream position, in launched runs sharing one uninterrupted reference run: 2-rank runs
stopped early and late decode no more than they train on and end with the uninterrupted run's weights; normalising
on the device trains bit-identically; dispatch_batches; the pixel cap; a rank whose shards hold no sample."""

import json
import shutil
from pathlib import Path

import pytest
import torch

from disco_clip_ds.testing.images import empty_second_shard, write_shards
from disco_clip_ds.testing.launch import QUICK

STEPS, PER_RANK, ACCUM, WORKERS = 6, 4, 3, 2

PER_STEP = 2 * PER_RANK * ACCUM  # samples trained on per step, both ranks

# What a rank's readers decode beyond what it trains on: each worker's prefetched batches (2) and the one in the
# making, per reader. It does not depend on the step a run resumes at.
AHEAD = 2 * WORKERS * (2 + 1) * PER_RANK

PIXEL_CAP = 300 * 300  # the data holds one 400 x 400 image: skipped under this cap


def _launch_args(output: Path, data: dict, *args: str) -> list[str]:
    from disco_clip_ds.testing.launch import LAUNCH_COMMON, REPO, SGD
    from disco_clip_ds.testing.runs import run_and_data

    return [
        *run_and_data(output, data),
        *LAUNCH_COMMON,
        "--dataloader_num_workers",
        str(WORKERS),
        "--per_device_train_batch_size",
        str(PER_RANK),
        "--gradient_accumulation_steps",
        str(ACCUM),
        "--max_steps",
        str(STEPS),
        "--save_steps",
        "1",
        "--save_total_limit",
        str(STEPS),
        "--max_image_pixels",
        str(PIXEL_CAP),
        *SGD,
        "--deepspeed",
        str(REPO / "ds_configs/cpu_zero2.json"),
        *args,
    ]


def _decoded(output: Path) -> int:
    return json.loads((output / "train_results.json").read_text())["decoded_samples"]


def _skipped(output: Path) -> int:
    return json.loads((output / "train_results.json").read_text())["skipped_samples"]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """8 shards x 10 samples (10 per reader and pass: every reader wraps into new passes), a few bad samples and one
    image above PIXEL_CAP."""
    from disco_clip_ds.testing.runs import save_initial_model

    root = tmp_path_factory.mktemp("seekdata")
    write_shards(root / "shards", 8, 10, seed=4, bad={3: "corrupt", 25: "no_text", 41: "large", 62: "empty_text"})
    return {"shards": str(root / "shards"), "model": save_initial_model(root / "tiny", 11)}


@pytest.fixture(scope="module")
def full(tmp_path_factory, data):
    """The uninterrupted run, a checkpoint at every step."""
    from disco_clip_ds.testing.launch import run_to_end

    out = tmp_path_factory.mktemp("full") / "run"
    rc, log = run_to_end(out, _launch_args(out, data), launcher=QUICK)
    assert rc == 0, log[-3000:]
    return out


def _resume_from_copy(full: Path, step: int, out: Path, data: dict, drop_state: bool = False) -> tuple[int, str]:
    """Resume in OUT from a copy of the full run's checkpoint-STEP (and its run.json)."""
    from disco_clip_ds.testing.launch import run_to_end

    out.mkdir(parents=True)
    shutil.copy(full / "run.json", out / "run.json")
    shutil.copytree(full / f"checkpoint-{step}", out / f"checkpoint-{step}")
    if drop_state:  # a checkpoint as older versions saved it: no stream state, no manifest
        (out / f"checkpoint-{step}" / "stream_state.json").unlink()
        (out / f"checkpoint-{step}" / "manifest.json").unlink()
    return run_to_end(out, _launch_args(out, data, "--resume_from_checkpoint", "latest"), launcher=QUICK)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_resume_seeks_decodes_what_it_trains_on_and_ends_with_the_uninterrupted_weights(full, data, tmp_path):
    from disco_clip_ds.testing.runs import same_weights

    state = json.loads((full / "checkpoint-5" / "stream_state.json").read_text())
    assert state["num_readers"] == 2 * WORKERS and sorted(state["readers"]) == ["0", "1", "2", "3"]
    assert _decoded(full) >= STEPS * PER_STEP
    decoded = {}
    for step in (1, 5):  # early and late; 1 x 3 and 5 x 3 micro-batches: the next batch is from worker 1 of 2
        out = tmp_path / f"from{step}"
        rc, log = _resume_from_copy(full, step, out, data)
        assert rc == 0, log[-3000:]
        assert "resume: the data stream seeks to where 4 readers stood" in log
        assert same_weights(out, full) <= 1e-6, step
        # the skips in the data trained on, carried in the stream state: not restarted from 0, the re-read block not
        # counted twice (before: 16 against the uninterrupted run's 26)
        assert _skipped(out) == _skipped(full) > 0, step
        decoded[step] = _decoded(out)
        trained = (STEPS - step) * PER_STEP
        assert trained <= decoded[step] <= trained + AHEAD, (step, decoded[step])
    assert decoded[5] < decoded[1]  # decoding on resume falls with the steps done, where skipping decoded them all


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_normalising_on_the_device_trains_bit_identically(full, data, tmp_path):
    """--normalize_on_device true on CPU ranks: the workers hand over uint8 batches and the trainer normalises
    them (here on the CPU, as it would on a GPU) for both passes of contrastive accumulation: the same losses and
    exactly the weights of the default run, whose workers normalise."""
    from disco_clip_ds.testing.launch import run_to_end
    from disco_clip_ds.testing.runs import step_losses, weights

    out = tmp_path / "on_device"
    rc, log = run_to_end(out, _launch_args(out, data, "--normalize_on_device", "true"), launcher=QUICK)
    assert rc == 0, log[-3000:]
    assert "the DataLoader hands over uint8 batches, normalised on cpu" in log
    assert "hands over uint8" not in (full.parent / "run.log").read_text()
    assert step_losses(out) == step_losses(full)
    on_device, default = weights(out), weights(full)
    assert on_device.keys() == default.keys() and all(torch.equal(on_device[k], default[k]) for k in default)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_resume_under_dispatch_batches_seeks_rank_0s_readers(data, tmp_path):
    """accelerate's dispatch_batches: rank 0 reads for both ranks with 3 workers, handing out 2 batches per step;
    after 2 steps its next batch comes from worker 4 mod 3 = 1. The resumed run's checkpoint-3 follows one step
    (2 batches) in which reader 0 handed out nothing: its restored position must be saved again, which a second
    resume from it shows; that one hands over uint8 batches (--normalize_on_device true), which accelerate
    broadcasts as they are."""
    from disco_clip_ds.testing.launch import run_to_end
    from disco_clip_ds.testing.runs import same_weights

    dispatch = ["--accelerator_config", '{"dispatch_batches": true}', "--dataloader_num_workers", "3"]
    dispatch += ["--gradient_accumulation_steps", "1", "--max_steps", "4"]
    full = tmp_path / "full"
    rc, log = run_to_end(full, _launch_args(full, data, *dispatch), launcher=QUICK)
    assert rc == 0, log[-3000:]
    on_device = ["--normalize_on_device", "true"]
    for source, step, out, extra in (
        (full, 2, tmp_path / "resumed", []),
        (tmp_path / "resumed", 3, tmp_path / "again", on_device),
    ):
        out.mkdir()
        shutil.copy(full / "run.json", out / "run.json")
        shutil.copytree(source / f"checkpoint-{step}", out / f"checkpoint-{step}")
        rc, log = run_to_end(
            out, _launch_args(out, data, *dispatch, *extra, "--resume_from_checkpoint", "latest"), launcher=QUICK
        )
        assert rc == 0, log[-3000:]
        assert "resume: the data stream seeks to where 3 readers stood" in log
        assert same_weights(out, full) <= 1e-6, out.name
        assert _skipped(out) == _skipped(full), out.name
        trained = (4 - step) * 2 * PER_RANK
        assert _decoded(out) <= trained + 3 * (2 + 1) * 2 * PER_RANK  # what it trained on, and what is ahead


@pytest.mark.slow
def test_max_image_pixels_skips_and_counts_a_larger_image(full):
    log = (full.parent / "run.log").read_text()
    assert "400 x 400 pixels, above the cap of 90000 (a decompression bomb?)" in log
    skipped = json.loads((full / "train_results.json").read_text())["skipped_samples"]
    assert skipped >= 4  # the large image, the corrupt one, the ones without or with an empty caption


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_rank_whose_shards_hold_no_sample_stops_every_rank_with_one_line(data, tmp_path):
    """Counts unknown (no sizes.json): rank 1's reader finds nothing once training runs; both ranks end, each with
    the same one line, exit 1, no traceback (deepspeed launcher: it passes the ranks' exit code on)."""
    from disco_clip_ds.testing.launch import LAUNCH_COMMON, run_to_end

    shards = empty_second_shard(tmp_path / "shards", sizes=False)
    out = tmp_path / "run"
    args = ["--output_dir", str(out), "--model_name_or_path", str(data["model"]), "--train_shards", shards]
    args += [*LAUNCH_COMMON, "--max_steps", "2", "--train_num_samples", "5"]
    rc, log = run_to_end(out, args, launcher="deepspeed", timeout=300)
    lines = [line for line in log.splitlines() if line.startswith("disco-clip train: ")]
    assert rc == 1 and len(lines) == 2, log[-3000:]
    assert lines[0] == lines[1] and lines[0].startswith(
        "disco-clip train: reader 1 of 2 (rank 1, DataLoader worker 0) found no readable sample in its shard(s) "
        "shards/00001.tar: check that they exist and hold samples"  # a shard by its public description (redact.py)
    ), lines
    assert "Traceback" not in log
