"""A 3-source weighted mixture in launched runs sharing one uninterrupted reference (2 ranks x K=1, ZeRO-2, AdamW):
stopped at step 3 and resumed on 2 ranks it ends with exactly the reference's weights (max abs difference 0.0) and
per-source counts; resumed on 1 rank x K=2 (2 DataLoader workers: the run's 2 readers) it trains the same steps; a
resume with other weights is refused in one line; run.json and the model card record the sources and weights.
(In process: tests/unit/data/test_mix.py.)"""

import json
import shutil
from pathlib import Path

import pytest

from disco_clip_ds.testing.images import write_shards
from disco_clip_ds.testing.launch import QUICK

STEPS, SAVE, PER_RANK = 6, 3, 4
WEIGHTS = ["0.6", "0.3", "0.1"]
# AdamW, as tests/launched/test_resume_on_another_world_size.py has it: a universal checkpoint (the 1-rank resume)
# converts Adam's moments, and eps 1e-6 keeps the 2-rank and 2-micro-step reduction orders' noise small
ADAMW = ["--optim", "adamw_torch", "--adam_epsilon", "1e-6", "--learning_rate", "1e-3", "--weight_decay", "0.1"]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """Sources a, b, c of 4, 2 and 2 shards x 12 samples (each of the 2 readers gets a shard of each)."""
    from disco_clip_ds.testing.runs import save_initial_model

    root = tmp_path_factory.mktemp("mixdata")
    for name, shards, seed in (("a", 4, 1), ("b", 2, 2), ("c", 2, 3)):
        write_shards(root / name, shards, 12, seed=seed)
    return {"shards": "::".join(str(root / n) for n in "abc"), "model": save_initial_model(root / "tiny", 9)}


def _args(output: Path, data: dict, *extra: str, weights=WEIGHTS) -> list[str]:
    from disco_clip_ds.testing.launch import LAUNCH_COMMON, REPO
    from disco_clip_ds.testing.runs import run_and_data

    return [
        *run_and_data(output, data),
        *LAUNCH_COMMON,
        "--train_data_weights",
        *weights,
        "--per_device_train_batch_size",
        str(PER_RANK),
        "--max_steps",
        str(STEPS),
        "--save_steps",
        str(SAVE),
        *ADAMW,
        "--deepspeed",
        str(REPO / "ds_configs/cpu_zero2.json"),
        *extra,
    ]


@pytest.fixture(scope="module")
def full(tmp_path_factory, data):
    from disco_clip_ds.testing.launch import run_to_end

    out = tmp_path_factory.mktemp("full") / "run"
    rc, log = run_to_end(out, _args(out, data), launcher=QUICK)
    assert rc == 0, log[-3000:]
    return out


def _stopped_at_save(full: Path, folder: Path) -> Path:
    folder.mkdir()
    shutil.copytree(full / f"checkpoint-{SAVE}", folder / f"checkpoint-{SAVE}")
    shutil.copy(full / "run.json", folder / "run.json")
    return folder


def _per_source(output: Path) -> list[list[int]]:
    """The samples seen per source at each logged step (a resumed run's history holds its checkpoint's steps)."""
    history = json.loads((output / "trainer_state.json").read_text())["log_history"]
    return [[h[f"samples_seen_source{s}"] for s in range(3)] for h in history if "loss" in h]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_stopped_mixture_resumes_exactly_and_a_resume_with_other_weights_is_refused(full, data, tmp_path):
    from disco_clip_ds.export.card import describe_run
    from disco_clip_ds.testing.launch import run_to_end
    from disco_clip_ds.testing.runs import same_weights

    seen = _per_source(full)
    assert [sum(step) for step in seen] == [2 * PER_RANK * k for k in range(1, STEPS + 1)]  # trained on, no more
    assert all(0 < n for n in seen[-1]) and seen[-1][0] > seen[-1][2]
    state = json.loads((full / f"checkpoint-{STEPS}" / "stream_state.json").read_text())
    assert state["sources"] == ["a", "b", "c"] and state["weights"] == pytest.approx([0.6, 0.3, 0.1])
    run = json.loads((full / "run.json").read_text())
    assert run["data"] == "a::b::c" and run["data_weights"] == "0.6 a, 0.3 b, 0.1 c"
    assert describe_run(full / f"checkpoint-{STEPS}")["data_weights"] == "0.6 a, 0.3 b, 0.1 c"

    out = _stopped_at_save(full, tmp_path / "resumed")
    rc, log = run_to_end(out, _args(out, data, "--resume_from_checkpoint", "latest"), launcher=QUICK)
    assert rc == 0, log[-3000:]
    assert "resume: the data stream seeks to where 2 readers stood" in log
    assert same_weights(out, full) == 0.0
    assert _per_source(out) == seen  # the log history carried over, and the counts go on from the checkpoint's

    other = _stopped_at_save(full, tmp_path / "other")
    resume = _args(other, data, "--resume_from_checkpoint", "latest", weights=["0.5", "0.3", "0.2"])
    rc, log = run_to_end(other, resume, launcher="deepspeed")  # it passes the ranks' exit code on
    lines = [line for line in log.splitlines() if line.startswith("disco-clip train: ")]
    assert rc == 2 and len(lines) == 2 and lines[0] == lines[1], log[-3000:]  # the same line on every rank
    assert "weights [0.6, 0.3, 0.1] -> [0.5, 0.3, 0.2]" in lines[0], lines
    assert "Traceback" not in log


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_two_ranks_resumed_on_one_rank_with_k2_train_the_same_mixture(full, data, tmp_path):
    from disco_clip_ds.testing.launch import run_to_end
    from disco_clip_ds.testing.runs import assert_same_training, weights

    out = _stopped_at_save(full, tmp_path / "run")
    resumed = ["--resume_from_checkpoint", "latest", "--gradient_accumulation_steps", "2"]
    resumed += ["--contrastive_accumulation", "true", "--dataloader_num_workers", "2"]  # 2 readers, as 2 ranks x 1
    rc, log = run_to_end(out, _args(out, data, *resumed), launcher=QUICK, nproc=1)
    assert rc == 0, log[-3000:]
    assert f"checkpoint-{SAVE}, world size 2 -> 1: through a universal checkpoint" in log
    assert_same_training(out, full, weights(data["model"]), STEPS)
    assert _per_source(out) == _per_source(full)
    state = f"checkpoint-{STEPS}/stream_state.json"
    assert json.loads((out / state).read_text()) == json.loads((full / state).read_text())
