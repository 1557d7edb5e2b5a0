"""The training step's host syncs, counted in a real run: 2 ranks under torchrun + DeepSpeed ZeRO-2, contrastive
accumulation of K = 2 micro-batches, with counting wrappers on every tensor method that reads a value on the host
(disco_clip_ds.testing.syncs). Outside logging and saving steps, our code (train/, distributed/, data/, models/)
makes at most one per optimizer step: the step's flags (train/step_flags.py); the loss (losses/) makes none. The same
run's log carries the throughput figures: TFLOPs per device at every logging step on CPU, no MFU there and one line
that says why."""

from __future__ import annotations

import json

import pytest

from disco_clip_ds.testing.images import write_shards
from disco_clip_ds.testing.launch import LAUNCH_COMMON, REPO, finish, start, train_command
from disco_clip_ds.testing.runs import save_initial_model

STEPS = 4  # logs and saves at step 4 only: steps 2 and 3 are the measured ones (step 1 fetches its batches first)


@pytest.fixture(scope="module")
def counted(tmp_path_factory):
    root = tmp_path_factory.mktemp("syncs")
    write_shards(root / "shards", num_shards=2, per_shard=32, seed=1)
    model = save_initial_model(root / "tiny", 7)
    out = root / "run"
    command = [c if c != "disco_clip_ds.train" else "disco_clip_ds.testing.syncs" for c in train_command("torchrun", 2)]
    command.insert(command.index("disco_clip_ds.testing.syncs") + 1, str(root / "syncs.json"))
    args = [*LAUNCH_COMMON, "--output_dir", str(out), "--model_name_or_path", str(model), "--train_num_samples", "64",
            "--train_shards", f"{root}/shards/{{00000..00001}}.tar", "--per_device_train_batch_size", "4",
            "--gradient_accumulation_steps", "2", "--max_steps", str(STEPS), "--logging_steps", str(STEPS),
            "--save_steps", str(STEPS), "--deepspeed", str(REPO / "ds_configs/cpu_zero2.json")]  # fmt: skip
    log = root / "run.log"
    code = finish(start([*command, *args], log), timeout=400)
    assert code == 0, log.read_text()[-4000:]
    ranks = [json.loads((root / f"syncs.rank{r}.json").read_text()) for r in range(2)]
    return ranks, out, log.read_text()


@pytest.mark.slow
def test_our_code_makes_at_most_one_host_sync_per_optimizer_step(counted):
    ranks, _, _ = counted
    for steps in ranks:
        assert len(steps) == STEPS, steps
        measured = steps[1:-1]  # the first fetch's own collective, and the logging / saving last step, left out
        ours = [step["ours"] for step in measured]
        sites = [{site: n for site, n in step["sites"].items() if site.startswith("ours")} for step in measured]
        assert all(n <= 1 for n in ours), sites
        # the one sync is there (the test would pass vacuously if the wrappers saw nothing of ours)
        assert all(n == 1 for n in ours) and all("step_flags.py" in " ".join(s["sites"]) for s in measured)
        # the loss (losses/) makes none once its shapes are agreed (the first step's micro-batches agree them)
        assert all(step["losses"] == 0 for step in measured), [s["sites"] for s in measured]
        # The Trainer's (and DeepSpeed's) own, counted and left to them: its NaN check of each micro-step's loss at
        # least.
        assert all(step["library"] >= 2 for step in measured)


@pytest.mark.slow
def test_the_log_holds_tflops_per_device_and_says_once_why_there_is_no_mfu_on_cpu(counted):
    _, out, log = counted
    history = json.loads((out / "trainer_state.json").read_text())["log_history"]
    logged = [entry for entry in history if "loss" in entry]
    assert logged and all(entry["tflops_per_device"] > 0 and "mfu" not in entry for entry in logged), logged
    assert logged[0]["samples_per_s_per_rank"] > 0
    results = json.loads((out / "train_results.json").read_text())
    assert results["train_tflops_per_device"] > 0 and "train_mfu" not in results
    assert log.count("MFU is not logged: no dense peak is known for a cpu device") == 1  # once, by rank 0
