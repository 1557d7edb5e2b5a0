"""Resume under changed settings (checkpoint.resume): the comparison of a run's recorded facts with the resuming
command's (fast, on dicts), the one-line refusals before the model is built (in process, against a real
checkpoint), and the exact resume of a 2-rank x K=1 run on 1 rank x K=2 through a DeepSpeed universal checkpoint
(launched), with AdamW so that the re-partitioned moments matter.

Which samples each step consumed is shown on sample keys, in process (`test_one_rank_with_two_workers_reads_the_two_
ranks_samples_step_by_step`): the training stream with its decoding replaced by the key, read by real DataLoaders as
the Trainer reads them (each rank's loader in turn; the 1-rank loader's K=2 batches per step, after skipping the
steps done). The launched resume then ends at the uninterrupted run's weights, which a repeated or skipped sample
would change.
"""

import hashlib
import json
import shutil
from pathlib import Path

import pytest

from disco_clip_ds.checkpoint.resume import (
    describe_resumes,
    facts_at,
    resume_problems,
    with_resume,
)
from disco_clip_ds.testing.images import write_shards
from disco_clip_ds.testing.launch import LAUNCH_COMMON, REPO, TINY_CONFIG

from helpers import assert_same_training, run_to_end, save_initial_model, weights

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


# --- the comparison, on facts ---


def _facts(**changes) -> dict:
    """The facts of a 2-rank x K=1 ZeRO-2 run of 4 per rank, 1 DataLoader worker each, and `changes`."""
    facts = {
        "data": "d/{0..3}.tar",
        "num_shards": 4,
        "shards_sha256": "aaaa",
        "train_num_samples": 96,
        "world_size": 2,
        "micro_batch_per_rank": 4,
        "gradient_accumulation_steps": 1,
        "contrastive_accumulation": False,
        "zero_stage": 2,
        "dataloader_num_workers": 1,
        "max_steps": 6,
        "model": {"text_config.hidden_size": 64, "vision_config.hidden_size": 64},
    }
    facts.update(changes)
    world, k, micro = facts["world_size"], facts["gradient_accumulation_steps"], facts["micro_batch_per_rank"]
    facts.setdefault("data_readers", world * max(1, facts["dataloader_num_workers"]))
    facts.setdefault("global_batch", micro * k * world)
    facts.setdefault("global_contrastive_batch", micro * world * (k if facts["contrastive_accumulation"] else 1))
    return facts


def test_the_same_settings_and_a_world_size_traded_for_contrastive_accumulation_resume():
    old = _facts()
    assert resume_problems(old, _facts()) == []
    assert resume_problems(old, _facts(max_steps=10)) == []  # max_steps is the user's to raise
    one_rank = _facts(
        world_size=1, gradient_accumulation_steps=2, contrastive_accumulation=True, dataloader_num_workers=2
    )
    assert one_rank["global_contrastive_batch"] == 8 and resume_problems(old, one_rank) == []
    four = _facts(world_size=4, micro_batch_per_rank=2, dataloader_num_workers=0, data_readers=4)
    assert resume_problems(_facts(dataloader_num_workers=2), four) == []  # 2 x 2 readers -> 4 x 1


@pytest.mark.parametrize(
    "new,expected",
    [
        (
            _facts(world_size=1, dataloader_num_workers=2),
            "contrastive batch 8 (4 per rank x 2 ranks x K 1) -> 4 (4 per rank x 1 rank x K 1): pass "
            "--gradient_accumulation_steps 2 --contrastive_accumulation true",
        ),
        (
            _facts(gradient_accumulation_steps=2),  # K=2 without contrastive accumulation: twice the samples per step
            "contrastive batch 8 (4 per rank x 2 ranks x K 1) -> 8 (4 per rank x 2 ranks x K 2): pass "
            "--gradient_accumulation_steps 1",
        ),
        (
            _facts(world_size=1, gradient_accumulation_steps=2, contrastive_accumulation=True),
            "data readers (ranks x DataLoader workers) 2 -> 1: pass --dataloader_num_workers 2 to continue each "
            "reader's stream exactly, or --ignore_data_skip to restart the data stream (samples seen before are seen "
            "again)",
        ),
        (
            _facts(zero_stage=3),
            "ZeRO stage 2 -> 3: pass a --deepspeed config with stage 2 (optimizer state does not move between "
            "stages), or export the checkpoint and start a new --output_dir",
        ),
        (_facts(zero_stage=None), "ZeRO stage 2 -> none (no DeepSpeed): pass a --deepspeed config with stage 2"),
        (
            _facts(model={"text_config.hidden_size": 64, "vision_config.hidden_size": 128}),
            "model vision_config.hidden_size 64 -> 128: resume with the run's own model",
        ),
        (
            _facts(data="e/{0..4}.tar", num_shards=5, shards_sha256="bbbb"),
            "training data d/{0..3}.tar (4 shards) -> e/{0..4}.tar (5 shards): pass the run's --train_shards, or "
            "--ignore_data_skip",
        ),
        (_facts(train_num_samples=200), "--train_num_samples 96 -> 200: pass --train_num_samples 96"),
    ],
)
def test_each_change_is_one_clause_naming_old_new_and_what_to_pass(new, expected):
    problems = resume_problems(_facts(), new)
    assert len(problems) == 1 and problems[0].startswith(expected), problems


def test_a_contrastive_batch_that_no_flags_give_on_the_new_ranks_asks_for_another_world_size():
    old = _facts(micro_batch_per_rank=3, dataloader_num_workers=2)  # 6 pairs, 4 readers
    assert resume_problems(old, _facts(micro_batch_per_rank=3, world_size=4)) == [
        "contrastive batch 6 (3 per rank x 2 ranks x K 1) -> 12 (3 per rank x 4 ranks x K 1): resume on a number of "
        "ranks that divides 6"
    ]


def test_the_world_size_moves_only_under_zero_1_and_2():
    for stage in (None, 3):
        old = _facts(zero_stage=stage)
        new = _facts(
            zero_stage=stage,
            world_size=1,
            gradient_accumulation_steps=2,
            contrastive_accumulation=True,
            dataloader_num_workers=2,
        )
        assert resume_problems(old, new) == [
            "world size 2 -> 1: only DeepSpeed ZeRO-1/2 checkpoints move to another number of ranks; resume on 2 ranks"
        ]


def test_ignore_data_skip_allows_a_changed_reader_count_or_data():
    new = _facts(dataloader_num_workers=2, train_num_samples=50, shards_sha256="bbbb")
    assert len(resume_problems(_facts(), new)) == 3
    assert resume_problems(_facts(), new, ignore_data_skip=True) == []


def test_facts_missing_from_an_older_run_file_are_not_compared():
    old = {"world_size": 2, "micro_batch_per_rank": 4, "gradient_accumulation_steps": 1, "zero_stage": 2}
    assert resume_problems(old, _facts()) == []


def test_resumes_are_segments_and_the_first_launchs_facts_stay():
    first = _facts()
    del first["model"]
    moved = _facts(world_size=1, gradient_accumulation_steps=2, contrastive_accumulation=True, dataloader_num_workers=2)
    run = with_resume(first, 3, moved, universal=True, ignore_data_skip=False)
    assert {k: v for k, v in run.items() if k != "resumes"} == first
    assert [s["from_step"] for s in run["resumes"]] == [3] and run["resumes"][0]["universal_checkpoint"]
    # checkpoint-3 was saved by the first launch, checkpoint-6 by the resume from step 3
    assert facts_at(run, 3)["world_size"] == 2 and facts_at(run, 6)["world_size"] == 1
    # resuming checkpoint-3 again (the resume from 3 saved nothing) replaces that segment; a later one adds its own
    again = with_resume(run, 3, _facts(), universal=False, ignore_data_skip=True)
    assert [s["world_size"] for s in again["resumes"]] == [2] and again["resumes"][0]["data_restarted"]
    later = with_resume(run, 6, _facts(), universal=True, ignore_data_skip=False)
    assert [s["from_step"] for s in later["resumes"]] == [3, 6]
    assert describe_resumes(later) == "step 3 (1 rank x K 2); step 6 (2 ranks x K 1)"


# --- which samples each step reads, by key ---


class _Keys:
    """The training stream with decoding replaced by the sample's key: which samples it yields, in its order."""

    @staticmethod
    def stream(urls, rank, world, workers):
        from disco_clip_ds.data.streams.shards import ShardStream

        class KeyStream(ShardStream):
            def _decode(self, sample, epoch):
                return f"{epoch}/{sample['__key__']}", None  # in place of (pixels, caption)

        return KeyStream(urls, 64, rank=rank, world_size=world, seed=7, shuffle_buffer=8, num_workers=workers)

    @staticmethod
    def batches(stream, workers, count):
        import itertools

        from torch.utils.data import DataLoader

        loader = DataLoader(stream, batch_size=PER_RANK, num_workers=workers, collate_fn=_keys_of)
        return list(itertools.islice(loader, count))


def _keys_of(batch: list) -> list[str]:
    return [key for key, *_ in batch]  # each item: (key, None, its stream position)


def test_one_rank_with_two_workers_reads_the_two_ranks_samples_step_by_step(tmp_path):
    urls = write_shards(tmp_path / "shards", num_shards=4, per_shard=24, seed=1)
    # 2 ranks x 1 worker x K=1: step s contrasts rank 0's batch s with rank 1's
    ranks = [_Keys.batches(_Keys.stream(urls, r, 2, 1), 1, STEPS) for r in range(2)]
    reference = [sorted(ranks[0][s] + ranks[1][s]) for s in range(STEPS)]
    # 1 rank x 2 workers x K=2, resumed at step SAVE: the Trainer skips SAVE x 2 batches, then takes 2 per step
    loader = _Keys.batches(_Keys.stream(urls, 0, 1, 2), 2, 2 * STEPS)
    resumed = [sorted(loader[2 * s] + loader[2 * s + 1]) for s in range(SAVE, STEPS)]
    assert resumed == reference[SAVE:]
    keys = [k for step in reference for k in step]
    assert len(keys) == len(set(keys)) == STEPS * 2 * PER_RANK  # no sample twice in the run


# --- launched: a real checkpoint, refused in process, resumed exactly on another world size ---


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("resumedata")
    write_shards(root / "shards", num_shards=4, per_shard=24, seed=1)
    return {"shards": f"{root}/shards/{{00000..00003}}.tar", "model": save_initial_model(root / "tiny", 7)}


def _args(output: Path, data: dict, *extra: str, model: list[str] | None = None) -> list[str]:
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
        str(PER_RANK),
        "--save_steps",
        str(SAVE),
        "--max_steps",
        str(STEPS),
        *ADAMW,
        *extra,
    ]


@pytest.fixture(scope="module")
def full(tmp_path_factory, data):
    """The uninterrupted reference: 2 ranks x K=1, 1 DataLoader worker each, ZeRO-2, AdamW; checkpoint-3 is what a
    run stopped at step 3 leaves (checkpoints are complete or absent, and training is deterministic)."""
    out = tmp_path_factory.mktemp("full") / "run"
    rc, log = run_to_end(out, _args(out, data, "--deepspeed", ZERO2), launcher="torchrun", nproc=2)
    assert rc == 0, log[-3000:]
    return out


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
def test_two_ranks_resumed_on_one_rank_with_k2_end_at_the_uninterrupted_weights(full, data, tmp_path):
    out = _stopped_at_save(full, tmp_path / "run")
    checkpoint = out / f"checkpoint-{SAVE}"
    before, run_before = _digest(checkpoint), json.loads((out / "run.json").read_text())
    (out / "universal" / f"tmp-checkpoint-{SAVE}" / "zero").mkdir(parents=True)  # what a kill mid-conversion leaves
    resumed = [
        "--deepspeed",
        ZERO2,
        "--resume_from_checkpoint",
        "latest",
        "--gradient_accumulation_steps",
        "2",
        "--contrastive_accumulation",
        "true",
        "--dataloader_num_workers",  # 2 readers, as 2 ranks x 1 worker
        "2",
    ]
    rc, log = run_to_end(out, _args(out, data, *resumed), launcher="torchrun", nproc=1)
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
    from disco_clip_ds.export.weights import describe_run

    assert describe_run(out / f"checkpoint-{STEPS}")["resumes"] == f"step {SAVE} (1 rank x K 2)"


def _refusal(out: Path, data: dict, capsys, monkeypatch, *extra: str, model=None, prefix="") -> str:
    """`disco-clip train ... --resume_from_checkpoint latest EXTRA` in this process (1 rank): its one line."""
    from disco_clip_ds.errors import run_main
    from disco_clip_ds.train import run as train

    def tripwire(*args, **kwargs):
        raise AssertionError("the model was built")

    monkeypatch.setattr(train, "build_model", tripwire)
    argv = _args(out, data, "--resume_from_checkpoint", "latest", *extra, model=model)
    assert run_main(train.main, argv, "disco-clip train") == 2
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
