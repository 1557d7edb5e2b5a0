"""Resume under changed settings (checkpoint.resume), fast: the comparison of a run's recorded facts with the
resuming command's (on dicts), run.json's resume segments, and which samples each step consumed, shown on sample
keys in process (`test_one_rank_with_two_workers_reads_the_two_ranks_samples_step_by_step`): the training stream
with its decoding replaced by the key, read by real DataLoaders as the Trainer reads them (each rank's loader in
turn; the 1-rank loader's K=2 batches per step, after skipping the steps done). The launched resume on another
world size (tests/launched/test_resume_on_another_world_size.py) then ends at the uninterrupted run's weights, which
a repeated or skipped sample would change.
"""

import pytest
import torch

from disco_clip_ds.checkpoint.resume import (
    facts_at,
    resume_problems,
    with_resume,
)
from disco_clip_ds.export.card import describe_resumes
from disco_clip_ds.testing.images import write_shards

STEPS, SAVE, PER_RANK = 6, 3, 4  # as the launched resume


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


def test_a_changed_naflex_budget_is_refused_and_an_unchanged_one_resumes():
    assert resume_problems(_facts(max_num_patches=144), _facts(max_num_patches=144)) == []
    problems = resume_problems(_facts(max_num_patches=144), _facts(max_num_patches=256))
    expected = "--max_num_patches 144 -> 256: pass --max_num_patches 144"
    assert len(problems) == 1 and problems[0].startswith(expected), problems


def test_a_contrastive_batch_that_no_flags_give_on_the_new_ranks_asks_for_another_world_size():
    old = _facts(micro_batch_per_rank=3, dataloader_num_workers=2)  # 6 pairs, 4 readers
    assert resume_problems(old, _facts(micro_batch_per_rank=3, world_size=4)) == [
        "contrastive batch 6 (3 per rank x 2 ranks x K 1) -> 12 (3 per rank x 4 ranks x K 1): resume on a number of "
        "ranks that divides 6"
    ]


def test_the_world_size_moves_only_under_deepspeed_zero():
    for stage in (None, 1, 2, 3):
        old = _facts(zero_stage=stage)
        new = _facts(
            zero_stage=stage,
            world_size=1,
            gradient_accumulation_steps=2,
            contrastive_accumulation=True,
            dataloader_num_workers=2,
        )
        assert resume_problems(old, new) == (
            ["world size 2 -> 1: only DeepSpeed ZeRO checkpoints move to another number of ranks; resume on 2 ranks"]
            if stage is None
            else []
        ), stage


def test_four_ranks_with_half_the_micro_batch_share_the_two_ranks_readers():
    from disco_clip_ds.checkpoint.resume import ranks_per_reader

    old, four = _facts(), _facts(world_size=4, micro_batch_per_rank=2)
    assert ranks_per_reader(old, four) == 2 and resume_problems(old, four) == []
    # the 4-rank segment records the run's 2 readers: on 4 ranks again it splits again, on 2 it reads them itself
    split_run = _facts(world_size=4, micro_batch_per_rank=2, data_readers=2, ranks_per_reader=2)
    assert ranks_per_reader(split_run, four) == 2 and resume_problems(split_run, four) == []
    assert ranks_per_reader(split_run, old) == 1 and resume_problems(split_run, old) == []
    eight = _facts(world_size=8, micro_batch_per_rank=1)
    assert ranks_per_reader(old, eight) == 4 and resume_problems(old, eight) == []
    refused = [
        _facts(world_size=4, micro_batch_per_rank=2, dataloader_num_workers=2),  # 8 readers of their own
        _facts(world_size=4, micro_batch_per_rank=1, gradient_accumulation_steps=2),  # K changed
        _facts(world_size=4, micro_batch_per_rank=2, num_shards=None),  # a `datasets` dataset
    ]
    for new in refused:
        assert ranks_per_reader(old, new) == 1
        assert any(p.startswith("data readers") for p in resume_problems(old, new)), new
    # one rank read for all (dispatch_batches: 1 reader on 2 ranks), not a split
    assert ranks_per_reader(_facts(data_readers=1), _facts(world_size=4, micro_batch_per_rank=2)) == 1
    hf = _facts(num_shards=None)
    assert ranks_per_reader(hf, _facts(world_size=4, micro_batch_per_rank=2, num_shards=None)) == 1
    # 4 ranks of 4 pairs: the refusal names the flags that share the readers
    [line] = [p for p in resume_problems(old, _facts(world_size=4)) if p.startswith("data readers")]
    assert "2 -> 4: pass --per_device_train_batch_size 2 --dataloader_num_workers 1 to share each reader's" in line


def test_per_tower_optimizer_settings_stay_those_of_the_run():
    from types import SimpleNamespace

    from disco_clip_ds.checkpoint.resume import TOWER_FLAGS, tower_settings

    args = SimpleNamespace(**TOWER_FLAGS)
    assert tower_settings(args) == "none"  # kept by run.json, which drops a None: a later resume with them is refused
    args.vision_layer_decay, args.text_lr = 0.85, 2e-4
    assert tower_settings(args) == "--text_lr 0.0002 --vision_layer_decay 0.85"
    old = _facts(tower_settings="none")
    assert resume_problems(old, _facts(tower_settings="none")) == []
    assert resume_problems(old, _facts(tower_settings="--vision_layer_decay 0.85")) == [
        "per-tower optimizer settings 'none' -> '--vision_layer_decay 0.85': pass the run's (its optimizer state "
        "holds their parameter groups and rates), or export the checkpoint and start a new --output_dir"
    ]
    assert resume_problems(_facts(), _facts(tower_settings="--text_lr 0.0002")) == []  # an older run.json


def test_patch_dropout_is_recorded_and_a_resume_may_change_it():
    from types import SimpleNamespace

    from disco_clip_ds.checkpoint.resume import patch_dropout_setting

    assert patch_dropout_setting(SimpleNamespace(patch_dropout=0.0, patch_dropout_until_step=None)) is None
    assert patch_dropout_setting(SimpleNamespace(patch_dropout=0.75, patch_dropout_until_step=None)) == (
        "0.75 of the patches dropped"
    )
    masked = patch_dropout_setting(SimpleNamespace(patch_dropout=0.5, patch_dropout_until_step=900))
    assert masked == "0.5 of the patches dropped, every patch from step 900"
    # the masks are keyed by sample and pass and hold no optimizer state: not a resume fact
    assert resume_problems(_facts(patch_dropout=masked), _facts(patch_dropout=None)) == []


def test_locked_towers_stay_those_of_the_run():
    """The optimizer state holds the trainable parameters only: a resume that trains others is refused in one line;
    a run.json from before the record is not compared."""
    from types import SimpleNamespace

    from disco_clip_ds.checkpoint.resume import lock_settings

    unset = dict(
        lock_image_tower=False, lock_image_tower_unlocked_layers=None, lock_image_tower_freeze_norm=False,
        lock_text_tower=False, lock_text_tower_unlocked_layers=None,
    )  # fmt: skip
    assert lock_settings(SimpleNamespace(**unset)) == "none"
    partly = SimpleNamespace(
        **{**unset, "lock_image_tower": True, "lock_image_tower_unlocked_layers": 2, "lock_text_tower": True}
    )
    assert lock_settings(partly) == "--lock_image_tower --lock_image_tower_unlocked_layers 2 --lock_text_tower"
    partly.lock_image_tower_freeze_norm, partly.lock_text_tower_unlocked_layers = True, 0  # 0: the whole tower
    assert lock_settings(partly) == (
        "--lock_image_tower --lock_image_tower_unlocked_layers 2 --lock_image_tower_freeze_norm --lock_text_tower"
    )
    old = _facts(locked_towers="--lock_image_tower")
    assert resume_problems(old, _facts(locked_towers="--lock_image_tower")) == []
    assert resume_problems(old, _facts(locked_towers="--lock_image_tower --lock_image_tower_unlocked_layers 1")) == [
        "locked towers '--lock_image_tower' -> '--lock_image_tower --lock_image_tower_unlocked_layers 1': pass the "
        "run's (its optimizer state holds the parameters that train, and only those), or export the checkpoint and "
        "start a new --output_dir"
    ]
    assert len(resume_problems(_facts(locked_towers="none"), _facts(locked_towers="--lock_text_tower"))) == 1
    assert resume_problems(_facts(), _facts(locked_towers="--lock_text_tower")) == []  # an older run.json


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
    def stream(urls, rank, world, workers, **options):
        from disco_clip_ds.data.streams.shards import ShardStream

        class KeyStream(ShardStream):
            def _decode(self, sample, epoch):
                return f"{epoch}/{sample['__key__']}", None  # in place of (pixels, caption)

        return KeyStream(
            urls, 64, rank=rank, world_size=world, seed=7, shuffle_buffer=8, num_workers=workers, **options
        )

    @staticmethod
    def batches(stream, workers, count, size=PER_RANK, collate=None):
        import itertools

        from torch.utils.data import DataLoader

        loader = DataLoader(stream, batch_size=size, num_workers=workers, collate_fn=collate or _keys_of)
        return list(itertools.islice(loader, count))


def _keys_of(batch: list) -> list[str]:
    return [key for key, *_ in batch]  # each item: (key, None, its stream position)


def _keys_and_positions(batch: list) -> list[tuple[str, list[int]]]:
    return [(key, position.tolist()) for key, _, position in batch]


@pytest.mark.slow  # beyond the fast tier's time budget
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


@pytest.mark.slow  # beyond the fast tier's time budget
@pytest.mark.parametrize("workers", [1, 2])
def test_four_ranks_with_half_the_batch_read_the_two_ranks_samples_step_by_step(tmp_path, workers):
    """2 ranks x W workers x 4 pairs resumed on 4 ranks x W workers x 2 pairs (split=2): ranks 2k and 2k+1 read rank
    k's readers, each keeping its half of every batch, from the saved positions on; each step contrasts the same 8
    pairs, and the positions saved are the 2-rank run's."""
    from disco_clip_ds.data.streams.state import note_positions

    def newest(batches_by_rank, steps) -> dict:  # what stream_state.json keeps: each reader's newest row
        rows = {}
        for batches in batches_by_rank:
            note_positions(rows, torch.tensor([row for batch in batches[:steps] for _, row in batch]))
        return rows

    urls = write_shards(tmp_path / "shards", num_shards=4, per_shard=24, seed=1)
    ranks = [
        _Keys.batches(_Keys.stream(urls, r, 2, workers), workers, STEPS, collate=_keys_and_positions) for r in range(2)
    ]
    reference = [sorted(key for r in range(2) for key, _ in ranks[r][s]) for s in range(STEPS)]
    saved = {r: tuple(row[1:]) for r, row in newest(ranks, SAVE).items()}
    assert len(saved) == 2 * workers
    for start, positions in ((0, {}), (SAVE, saved)):
        split = []
        for r in range(4):
            stream = _Keys.stream(urls, r, 4, workers, split=2, micro_batch=PER_RANK // 2)
            assert stream.num_readers == 2 * workers == stream.state_facts()["num_readers"]
            stream.restore(positions, start)
            size = PER_RANK // 2
            split.append(_Keys.batches(stream, workers, STEPS - start, size=size, collate=_keys_and_positions))
        steps = [sorted(key for r in range(4) for key, _ in split[r][s - start]) for s in range(start, STEPS)]
        assert steps == reference[start:], start
        assert newest(split, STEPS) == newest(ranks, STEPS)


def test_a_checkpoint_keeping_an_ema_is_not_resumed_without_it_unless_dropped_on_purpose(tmp_path):
    """The EMA a checkpoint keeps (read from its ema/ files) is not dropped by a forgotten --ema_decay: the resume is
    refused naming both ways on; --drop_ema drops it on purpose; a checkpoint without an EMA resumes with or without."""
    from disco_clip_ds.checkpoint.ema import Fragment, write_fragments
    from disco_clip_ds.checkpoint.resume import checkpoint_facts

    checkpoint = tmp_path / "checkpoint-3"
    write_fragments(checkpoint, 0, [Fragment("w", 0, 2, (2,))], [torch.zeros(2)], {"decay": 0.99, "start_step": 0})
    old = {**_facts(), **checkpoint_facts(checkpoint)}
    assert old["ema_decay"] == 0.99
    (problem,) = resume_problems(old, _facts(ema_decay=None))
    assert problem == (
        "the checkpoint keeps an EMA of the weights (decay 0.99) and this command none: pass --ema_decay 0.99 to "
        "keep it, or --drop_ema true to go on without it"
    )
    assert resume_problems(old, _facts(ema_decay=None, drop_ema=True)) == []
    assert resume_problems(old, _facts(ema_decay=0.99)) == []
    assert "ema_decay" not in checkpoint_facts(tmp_path)
    assert resume_problems(_facts(), _facts(ema_decay=0.9)) == []


def test_data_rewritten_under_its_names_is_refused_unless_restarted_and_the_row_hint_does_not_hide_it(tmp_path):
    """Samples reordered in a shard keep its name and size, and a shrunk `datasets` source keeps its name: the names'
    digest cannot see either, the digest of the files' sizes and modification times recorded at the start can (one
    stat per file). The changed row count's hint (--train_num_samples OLD) is not offered then: passing it would
    resume on other data. --ignore_data_skip restarts the data and is not refused."""
    import os
    from types import SimpleNamespace

    from disco_clip_ds.checkpoint.resume import data_stat_digest

    urls = write_shards(tmp_path / "d", num_shards=2, per_shard=4, seed=0)
    before = data_stat_digest(urls)
    assert before == data_stat_digest(urls) and data_stat_digest(["https://host/0.tar"]) is None
    stat = os.stat(urls[0])
    data = open(urls[0], "rb").read()
    with open(urls[0], "r+b") as f:  # the same bytes in another order: same size, a new modification time
        f.write(data[512:1024] + data[:512] + data[1024:])
    os.utime(urls[0], ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
    after = data_stat_digest(urls)
    assert after != before
    old, new = _facts(data_stat_sha256=before), _facts(data_stat_sha256=after)
    (problem,) = resume_problems(old, new)
    assert problem.startswith("training data d/{0..3}.tar (4 shards) changed since the run read it"), problem
    assert "--ignore_data_skip" in problem and resume_problems(old, new, ignore_data_skip=True) == []
    assert resume_problems(old, _facts(data_stat_sha256=before)) == []

    (tmp_path / "rows.jsonl").write_text("".join(f'{{"image": "{i}.png", "caption": "c"}}\n' for i in range(120)))
    source = SimpleNamespace(train_file=str(tmp_path / "rows.jsonl"), dataset_name=None)
    before = data_stat_digest([], source)
    (tmp_path / "rows.jsonl").write_text("".join(f'{{"image": "{i}.png", "caption": "c"}}\n' for i in range(100)))
    old = _facts(num_shards=None, train_num_samples=120, data_stat_sha256=before)
    new = _facts(num_shards=None, train_num_samples=100, data_stat_sha256=data_stat_digest([], source))
    (problem,) = resume_problems(old, new)
    assert "changed since the run read it" in problem and "--train_num_samples" not in problem, problem
    (problem,) = resume_problems(old, {**new, "train_num_samples": 120})  # the old count given: still refused
    assert "changed since the run read it" in problem
