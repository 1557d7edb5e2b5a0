"""Resume on another world size, launched (checkpoint.resume against a real checkpoint): the one-line refusals before
the model is built (in process), and the exact resume of a 2-rank x K=1 run on 1 rank x K=2 through a DeepSpeed
universal checkpoint, with AdamW so that the re-partitioned moments matter, under ZeRO-2 and ZeRO-3, and on 4 ranks x
half the micro-batch (each pair of ranks sharing one of the run's readers); every run at progressive resolution whose
stages change after the resume, with patch dropout (SCHEDULE), the one-rank resume running step 4's two micro-batches
as one forward (--stage_micro_batch_sizes). One reference run per stage: 2 ranks x K=1, AdamW; the
ZeRO-3 one trains the ZeRO-2 one's weights (ZeRO-3 gathers the interpolated position embeddings' weight). Under
ZeRO-3 deepspeed's own universal load loses the Adam step count and the per-group weight decay: a minimal
reproduction on deepspeed alone shows what it loses and what `universal.repair_zero3_universal_load` restores. (The
comparison of facts, and which samples each step reads: unit/checkpoint/test_resume.py.)
"""

import argparse
import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest

from disco_clip_ds.testing.images import write_shards
from disco_clip_ds.testing.launch import LAUNCH_COMMON, QUICK, REPO, TINY_CONFIG, run_to_end
from disco_clip_ds.testing.ranks import run_ranks
from disco_clip_ds.testing.runs import assert_same_training, save_initial_model, weights

STEPS, SAVE, PER_RANK = 6, 3, 4
# AdamW: universal checkpoints re-partition its moments. eps 1e-6 rather than 1e-8: with 1e-8 Adam divides the
# gradient's fp32 reduction-order noise (2 ranks' sum vs 2 micro-steps' sum) by the root of near-zero second moments,
# and two uninterrupted runs, 2 ranks x K=1 and 1 rank x K=2, already differ by ~7e-4 relative after 6 steps.
ADAMW = [
    "--adam_epsilon",
    "1e-6",
    "--optim",
    "adamw_torch",
    "--learning_rate",
    "1e-3",
    "--lr_scheduler_type",
    "linear",
    "--warmup_steps",
    "2",
    "--weight_decay",
    "0.1",
]
ZERO2, ZERO3 = str(REPO / "ds_configs/cpu_zero2.json"), str(REPO / "ds_configs/cpu_zero3.json")
# Every run trains at progressive resolution (models/resolution.py): 32 px for steps 1-2, 48 for 3-4, 64 for 5-6.
# The resumed run starts at step 4, mid-stage, and crosses the boundary to 64 after the resume: the side is the
# step's, whatever the world size, K, ZeRO stage or DataLoader workers that made the batch. With FLIP's patch dropout
# at 0.5 in every stage: each sample keeps patches of the step's grid (2 of 4 at 32 px, 4 of 9 at 48, 8 of 16 at 64),
# its own whatever the rank, micro-batch or resume that trains it (models/patch_dropout.py).
SCHEDULE = ["--resolution_schedule", "0:32,0.34:48,0.67:64", "--patch_dropout", "0.5"]


# --- launched: a real checkpoint, refused in process, resumed exactly on another world size ---


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("resumedata")
    write_shards(root / "shards", num_shards=4, per_shard=24, seed=1)
    return {"shards": f"{root}/shards/{{00000..00003}}.tar", "model": save_initial_model(root / "tiny", 7)}


def _args(output: Path, data: dict, *extra: str, model: list[str] | None = None, per_rank=PER_RANK) -> list[str]:
    return [
        "--output_dir",
        str(output),
        *(model or ["--model_name_or_path", str(data["model"])]),
        "--train_shards",
        data["shards"],
        *LAUNCH_COMMON,
        "--train_num_samples",
        "96",
        "--per_device_train_batch_size",
        str(per_rank),
        "--save_steps",
        str(SAVE),
        "--max_steps",
        str(STEPS),
        *ADAMW,
        *extra,
    ]


def _reference(tmp_path_factory, data, config: str) -> Path:
    out = tmp_path_factory.mktemp("full") / "run"
    rc, log = run_to_end(out, _args(out, data, "--deepspeed", config, *SCHEDULE), launcher=QUICK, nproc=2)
    assert rc == 0, log[-3000:]
    return out


@pytest.fixture(scope="module")
def full(tmp_path_factory, data):
    """The uninterrupted reference: 2 ranks x K=1, 1 DataLoader worker each, ZeRO-2, AdamW; checkpoint-3 is what a
    run stopped at step 3 leaves (checkpoints are complete or absent, and training is deterministic)."""
    return _reference(tmp_path_factory, data, ZERO2)


@pytest.fixture(scope="module")
def full_zero3(tmp_path_factory, data):
    """The same reference under ZeRO-3."""
    return _reference(tmp_path_factory, data, ZERO3)


def _stopped_at_save(full: Path, folder: Path) -> Path:
    """A run folder as the reference was at step SAVE: its checkpoint and run.json."""
    folder.mkdir()
    shutil.copytree(full / f"checkpoint-{SAVE}", folder / f"checkpoint-{SAVE}")
    shutil.copy(full / "run.json", folder / "run.json")
    return folder


def _digest(folder: Path) -> dict:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest() for p in folder.rglob("*") if p.is_file()
    }


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_zero3_at_progressive_resolution_trains_the_zero2_weights(full, full_zero3, data):
    """The two references: each step at its stage's side (the earlier ones with the position embeddings
    interpolated, which under ZeRO-3 read a partitioned weight: models/resolution.py `gather_position_embedding`), and
    the same losses and weights under both stages."""
    for run in (full, full_zero3):
        history = json.loads((run / "trainer_state.json").read_text())["log_history"]
        assert [h["image_size"] for h in history if "loss" in h] == [32, 32, 48, 48, 64, 64]
    assert_same_training(full_zero3, full, weights(data["model"]), STEPS)


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("stage", [2, 3])
def test_two_ranks_resumed_on_one_rank_with_k2_end_at_the_uninterrupted_weights(stage, data, tmp_path, request):
    full = request.getfixturevalue({2: "full", 3: "full_zero3"}[stage])
    out = _stopped_at_save(full, tmp_path / "run")
    checkpoint = out / f"checkpoint-{SAVE}"
    before, run_before = _digest(checkpoint), json.loads((out / "run.json").read_text())
    (out / "universal" / f"tmp-checkpoint-{SAVE}" / "zero").mkdir(parents=True)  # what a kill mid-conversion leaves
    resumed = [
        "--deepspeed",
        {2: ZERO2, 3: ZERO3}[stage],
        "--resume_from_checkpoint",
        "latest",
        "--gradient_accumulation_steps",
        "2",
        "--contrastive_accumulation",
        "true",
        "--dataloader_num_workers",  # 2 readers, as 2 ranks x 1 worker
        "2",
        *SCHEDULE,
        "--stage_micro_batch_sizes",  # the K=2 micro-batches of step 4 (48 px) in one forward, of steps 5-6 apart
        "8,8,4",
    ]
    rc, log = run_to_end(out, _args(out, data, *resumed), launcher=QUICK, nproc=1)
    assert rc == 0, log[-3000:]
    assert f"checkpoint-{SAVE}, world size 2 -> 1: through a universal checkpoint" in log
    # the steps after SAVE, the moments, the schedule and the step count carried over: the same losses and weights
    assert_same_training(out, full, weights(data["model"]), STEPS)
    assert _digest(checkpoint) == before  # the original checkpoint is untouched
    assert sorted(p.name for p in (out / "universal").iterdir()) == [f"checkpoint-{SAVE}"]  # the partial one replaced
    run = json.loads((out / "run.json").read_text())
    assert {k: v for k, v in run.items() if k != "resumes"} == run_before  # the first launch's facts stay
    [segment] = run["resumes"]
    assert segment["from_step"] == SAVE and segment["world_size"] == 1 and segment["gradient_accumulation_steps"] == 2
    assert segment["global_contrastive_batch"] == run_before["global_contrastive_batch"] == 2 * PER_RANK
    assert segment["resolution_schedule"] == (
        "32 from step 1 (micro-batch 8), 48 from step 3 (micro-batch 8), 64 from step 5 (micro-batch 4)"
    )
    logged = json.loads((out / "trainer_state.json").read_text())["log_history"]
    assert [h["micro_batch_per_rank"] for h in logged if "loss" in h][SAVE:] == [8, 4, 4]
    from disco_clip_ds.export.card import describe_run

    assert describe_run(out / f"checkpoint-{STEPS}")["resumes"] == f"step {SAVE} (1 rank x K 2)"


@pytest.mark.slow
@pytest.mark.timeout(600)
# ZeRO-3 only: the readers' split is the same under every stage, and ZeRO-2's 4-rank resume is measured by
# bench/train/resume_world_size.py; ZeRO-2's re-partitioning onto another world size is the one-rank test's [2]
@pytest.mark.parametrize("stage", [3])
def test_two_ranks_resumed_on_four_with_half_the_micro_batch_end_at_the_uninterrupted_weights(
    stage, data, tmp_path, request
):
    """4 ranks x 2 pairs: ranks 2k and 2k+1 share the 2-rank run's reader k (resume.ranks_per_reader), so each step
    contrasts the same 8 pairs; the readers end where the uninterrupted run's did."""
    full = request.getfixturevalue({2: "full", 3: "full_zero3"}[stage])
    out = _stopped_at_save(full, tmp_path / "run")
    resumed = ["--deepspeed", {2: ZERO2, 3: ZERO3}[stage], "--resume_from_checkpoint", "latest", *SCHEDULE]
    rc, log = run_to_end(out, _args(out, data, *resumed, per_rank=PER_RANK // 2), launcher=QUICK, nproc=4)
    assert rc == 0, log[-3000:]
    assert f"checkpoint-{SAVE}, world size 2 -> 4: through a universal checkpoint" in log
    assert_same_training(out, full, weights(data["model"]), STEPS)
    state = f"checkpoint-{STEPS}/stream_state.json"
    assert json.loads((out / state).read_text()) == json.loads((full / state).read_text())
    [segment] = json.loads((out / "run.json").read_text())["resumes"]
    shared = (
        segment["world_size"],
        segment["micro_batch_per_rank"],
        segment["data_readers"],
        segment["ranks_per_reader"],
    )
    assert shared == (4, PER_RANK // 2, 2, 2)


def _refusal(out: Path, data: dict, capsys, monkeypatch, *extra: str, model=None, prefix="") -> str:
    """`disco-clip train ... --resume_from_checkpoint latest EXTRA` in this process (1 rank): its one line."""
    from disco_clip_ds.commands.train import main
    from disco_clip_ds.errors import run_main
    from disco_clip_ds.train import run as train

    def tripwire(*args, **kwargs):
        raise AssertionError("the model was built")

    monkeypatch.setattr(train, "build_model", tripwire)
    argv = _args(out, data, "--resume_from_checkpoint", "latest", *extra, model=model)
    assert run_main(main, argv, "disco-clip train") == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(
        f"disco-clip train: {prefix or f'cannot resume checkpoint-{SAVE} under changed settings: '}"
    ), lines
    return lines[0]


@pytest.mark.slow
def test_changed_settings_are_refused_in_one_line_before_the_model_is_built(full, data, tmp_path, capsys, monkeypatch):
    out = _stopped_at_save(full, tmp_path / "run")
    before = _digest(out)
    one_rank = ["--gradient_accumulation_steps", "2", "--dataloader_num_workers", "2"]
    bigger = tmp_path / "bigger.json"
    config = json.loads(TINY_CONFIG.read_text())
    config["vision_config"]["hidden_size"] = 128
    bigger.write_text(json.dumps(config))
    cases = [
        (["--deepspeed", ZERO2, "--dataloader_num_workers", "2"], "contrastive batch 8 (4 per rank x 2 ranks x K 1)"),
        (["--deepspeed", ZERO3, *one_rank], "ZeRO stage 2 -> 3: pass a --deepspeed config with stage 2"),
        (["--deepspeed", ZERO2, *one_rank[:2], "--dataloader_num_workers", "1"], "data readers (ranks x DataLoader"),
        (["--deepspeed", ZERO2, *one_rank, "--train_num_samples", "48"], "--train_num_samples 96 -> 48"),
        (
            ["--deepspeed", ZERO2, *one_rank, "--train_shards", data["shards"].replace("00003", "00002")],
            "training data",
        ),
    ]
    for extra, expected in cases:
        assert expected in _refusal(out, data, capsys, monkeypatch, *extra), extra
    # a different architecture: the checkpoint's config.json against --model_config
    line = _refusal(
        out, data, capsys, monkeypatch, "--deepspeed", ZERO2, *one_rank, model=["--model_config", str(bigger)]
    )
    assert "model vision_config.hidden_size 64 -> 128" in line
    line = _refusal(
        out, data, capsys, monkeypatch, "--resume_from_checkpoint", str(out / "checkpoint-9"), prefix="--resume"
    )
    assert line == f"disco-clip train: --resume_from_checkpoint {out / 'checkpoint-9'}: no such folder"
    after = _digest(out)
    assert after.pop("run.lock") == hashlib.sha256(b"").hexdigest()  # the run lock, released
    assert after == before  # nothing else written: no run.json rewrite, no conversion


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_three_ranks_on_a_two_rank_checkpoint_get_one_line_each_and_exit_2(full, data, tmp_path):
    """Launched, so that every rank is seen to refuse on its own (before: DeepSpeed's "DP world size of 2 but the
    current world size is 3" at the end of a long traceback, after the model was built)."""
    out = _stopped_at_save(full, tmp_path / "run")
    rc, log = run_to_end(
        out,
        _args(out, data, "--deepspeed", ZERO2, "--resume_from_checkpoint", "latest"),
        launcher="deepspeed",
        nproc=3,
    )
    assert rc == 2, log[-3000:]
    lines = [line for line in log.splitlines() if line.startswith("disco-clip train: ")]
    expected = (
        f"disco-clip train: cannot resume checkpoint-{SAVE} under changed settings: contrastive batch 8 (4 per "
        "rank x 2 ranks x K 1) -> 12 (4 per rank x 3 ranks x K 1): resume on a number of ranks that divides 8; data "
        "readers (ranks x DataLoader workers) 2 -> 3: pass --ignore_data_skip to restart the data stream (samples "
        "seen before are seen again)"
    )
    assert lines == [expected] * 3, log[-3000:]
    assert "Traceback" not in log and not (out / "universal").exists()


@pytest.mark.slow
def test_the_trainers_checkpoints_need_deepspeeds_inject_missing_state_to_convert(full, tmp_path):
    """The Trainer's engine saves no universal_checkpoint_info (Megatron-DeepSpeed's models carry it), which
    ds_to_universal requires; its --inject_missing_state adds the default one (resume._convert passes it)."""
    import argparse

    from deepspeed.checkpoint import ds_to_universal

    options = argparse.Namespace(
        input_folder=str(full / f"checkpoint-{SAVE}" / f"global_step{SAVE}"),
        output_folder=str(tmp_path / "universal" / f"global_step{SAVE}_universal"),
        num_extract_workers=1,
        num_merge_workers=1,
        keep_temp_folder=False,
        strict=True,
        inject_missing_state=False,
    )
    with pytest.raises(AssertionError, match="universal_checkpoint_info state is missing"):
        ds_to_universal.main(options)


# --- deepspeed alone: what its ZeRO-3 universal load loses, and what universal.repair_zero3_universal_load restores ---


def _zero3_universal_round_trip(rank, world_size, folder):
    """One rank: a ZeRO-3 engine over two AdamW parameter groups (weight decay 0.1 and 0) steps once and saves;
    deepspeed's ds_to_universal converts the save; fresh engines load the conversion (`load_universal`) and step once
    more, without and with the repair. Each engine's (Adam step count per sub-group, weight decay per group) after
    the load and after its step, and ("kept") how far the loaded fp32 weights and moments are from the saved ones."""
    os.environ.update(DS_ACCELERATOR="cpu", LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size))
    import deepspeed
    import torch
    from deepspeed.checkpoint import ds_to_universal

    from disco_clip_ds.checkpoint.universal import repair_zero3_universal_load

    def engine(universal: bool):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
        decay = [p for name, p in model.named_parameters() if name == "0.weight"]
        rest = [p for name, p in model.named_parameters() if name != "0.weight"]
        optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0}])
        config = {
            "train_micro_batch_size_per_gpu": 1,
            "zero_optimization": {"stage": 3},
            "checkpoint": {"load_universal": universal},
        }
        return deepspeed.initialize(model=model, optimizer=optimizer, config=config)[0]

    def step(e):
        e.backward(e(torch.ones(1, 4)).square().sum())
        e.step()

    def facts(e):
        inner = e.optimizer.optimizer
        steps = [inner.state[flat]["step"].item() for flat in e.optimizer.fp32_partitioned_groups_flat]
        return steps, [group["weight_decay"] for group in inner.param_groups]

    def tensors(e):  # the fp32 master weights and both moments of every sub-group
        flats, state = e.optimizer.fp32_partitioned_groups_flat, e.optimizer.optimizer.state
        return [t.clone() for f in flats for t in (f, state[f]["exp_avg"], state[f]["exp_avg_sq"])]

    saved = engine(False)
    step(saved)
    saved.save_checkpoint(str(folder), tag="global_step1")
    before = tensors(saved)
    ds_to_universal.main(
        argparse.Namespace(
            input_folder=str(folder / "global_step1"),
            output_folder=str(folder / "global_step1_universal"),
            num_extract_workers=1,
            num_merge_workers=1,
            keep_temp_folder=False,
            strict=True,
            inject_missing_state=True,
        )
    )  # and folder/latest_universal
    seen = {}
    for repaired in (False, True):
        loaded = engine(True)
        loaded.load_checkpoint(str(folder))
        if repaired:
            repair_zero3_universal_load(loaded.optimizer, folder)
        after_load = facts(loaded)
        seen["kept"] = max((a - b).abs().max().item() for a, b in zip(tensors(loaded), before, strict=True))
        step(loaded)
        seen[repaired] = after_load, facts(loaded)
    return seen


@pytest.mark.slow
@pytest.mark.timeout(600)  # a deepspeed import and three engines in a spawned rank
def test_deepspeeds_zero3_universal_load_shares_one_step_count_and_gives_every_group_group_0s_weight_decay(tmp_path):
    """deepspeed 0.19.8's `load_hp_checkpoint_state_from_checkpoint_dir_stage3` gives every sub-group one and the
    same `step` tensor (torch's Adam then adds 1 per sub-group: 3 after one step from 1, not 2) and copies group 0's
    hyperparameters into every group (the no-decay group decays); the repair gives each its own again. This test
    fails, and the repair can go, once deepspeed loads both right."""
    (seen,) = run_ranks(_zero3_universal_round_trip, 1, tmp_path, timeout=500)
    assert seen["kept"] == 0  # what it keeps: the fp32 master weights and both Adam moments, exactly
    # (steps per sub-group, weight decay per group) after the load, then after one step
    assert seen[False] == (([1, 1], [0.1, 0.1]), ([3, 3], [0.1, 0.1]))  # deepspeed alone
    assert seen[True] == (([1, 1], [0.1, 0]), ([2, 2], [0.1, 0]))  # repaired: as the saving engine would go on
