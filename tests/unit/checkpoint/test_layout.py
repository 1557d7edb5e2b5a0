"""checkpoint.layout on checkpoint folders made in place (the files a 2-rank ZeRO save writes, with their real names):
what a complete save holds, that a checkpoint verifies only with its manifest, the newest one that verifies, and the
refusal of an explicit --resume_from_checkpoint. (On real launched checkpoints: launched/test_integrity_and_full_
disk.py.)"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from disco_clip_ds.checkpoint import layout
from disco_clip_ds.checkpoint.manifest import MANIFEST, write_manifest
from disco_clip_ds.errors import CheckpointError, UsageError


def zero_save(folder: Path, step: int, ranks: int = 2, stage: int = 2) -> Path:
    """The files of a DeepSpeed ZeRO save of `ranks` ranks at `step`, as the Trainer writes them (no manifest)."""
    tag = folder / f"global_step{step}"
    tag.mkdir(parents=True)
    (folder / "latest").write_text(f"global_step{step}")
    (folder / "trainer_state.json").write_text(json.dumps({"global_step": step, "log_history": []}))
    (folder / "model.safetensors").write_bytes(b"weights")
    for rank in range(ranks):
        (folder / f"rng_state_{rank}.pth").write_bytes(b"rng")
        (tag / f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt").write_bytes(b"partition")
        if stage == 3:
            (tag / f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt").write_bytes(b"model")
    if stage != 3:
        (tag / "mp_rank_00_model_states.pt").write_bytes(b"model")
    return folder


def published(folder: Path, step: int, **kw) -> Path:
    """A checkpoint as CompleteCheckpointsMixin publishes it: the save, then its manifest."""
    zero_save(folder, step, **kw)
    write_manifest(folder)
    return folder


def test_what_a_checkpoint_says_of_itself(tmp_path):
    two = zero_save(tmp_path / "checkpoint-4", 4)
    assert layout.checkpoint_step(two) == 4 and layout.saved_ranks(two) == 2
    assert layout.deepspeed_tag(two) == two / "global_step4"
    assert layout.has_zero_partitions(two) and not layout.is_zero3(two)
    three = zero_save(tmp_path / "checkpoint-6", 6, ranks=3, stage=3)
    assert layout.saved_ranks(three) == 3 and layout.is_zero3(three)
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "rng_state.pth").write_bytes(b"rng")  # one process writes no rank suffix
    assert layout.saved_ranks(plain) == 1 and layout.deepspeed_tag(plain) is None
    assert not layout.has_zero_partitions(plain) and not layout.is_zero3(plain)


@pytest.mark.parametrize(
    "damage,problem",
    [
        (lambda c: (c / "trainer_state.json").unlink(), "no readable trainer_state.json"),
        (lambda c: (c / "trainer_state.json").write_text("{"), "no readable trainer_state.json"),
        (lambda c: [p.unlink() for p in c.glob("rng_state_*.pth")], "no rng_state*.pth"),
        (lambda c: (c / "global_step4" / "mp_rank_00_model_states.pt").unlink(), "no DeepSpeed model states in"),
        (
            lambda c: (c / "global_step4" / "zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink(),
            "1 DeepSpeed optimizer shards for 2 ranks",
        ),
        (lambda c: (c / "latest").write_text("global_step9"), "no DeepSpeed model states in global_step9"),
    ],
)
def test_a_save_that_lacks_a_part_is_named(tmp_path, damage, problem):
    checkpoint = zero_save(tmp_path / "checkpoint-4", 4)
    assert layout.save_problem(checkpoint) is None
    damage(checkpoint)
    assert layout.save_problem(checkpoint).startswith(problem)


def test_a_save_without_deepspeed_needs_weights(tmp_path):
    checkpoint = tmp_path / "checkpoint-1"
    checkpoint.mkdir()
    (checkpoint / "trainer_state.json").write_text(json.dumps({"global_step": 1}))
    (checkpoint / "rng_state.pth").write_bytes(b"rng")
    assert layout.save_problem(checkpoint) == "no weights"
    (checkpoint / "pytorch_model_fsdp_0").mkdir()  # FSDP's sharded model state
    assert layout.save_problem(checkpoint) is None


def test_a_checkpoint_verifies_only_with_its_manifest_and_matching_it(tmp_path):
    checkpoint = zero_save(tmp_path / "checkpoint-4", 4)
    assert layout.checkpoint_problem(checkpoint) == f"no {MANIFEST}: the save did not complete"
    write_manifest(checkpoint)
    assert layout.checkpoint_problem(checkpoint) is None
    (checkpoint / "model.safetensors").write_bytes(b"WEIGHTS")  # same size, other bytes
    assert layout.checkpoint_problem(checkpoint, checksums=False) is None  # sizes alone pass it
    assert layout.checkpoint_problem(checkpoint) == "model.safetensors does not match its checksum in the manifest"


def test_a_checkpoint_deleted_while_it_is_checked_is_a_problem_not_a_crash(tmp_path, monkeypatch):
    """The Trainer's rotation may delete a checkpoint while another process (a watcher, a test) verifies it: the file
    goes between the size check and the checksum. The injected hook deletes it at exactly that point."""
    from disco_clip_ds.checkpoint import manifest

    checkpoint = published(tmp_path / "checkpoint-4", 4)
    checksum = manifest._checksum

    def rotated_away(path: Path) -> str:
        path.unlink(missing_ok=True)
        return checksum(path)

    monkeypatch.setattr(manifest, "_checksum", rotated_away)
    assert layout.checkpoint_problem(checkpoint).endswith("vanished while it was checked")


def test_the_newest_complete_checkpoint_skips_the_others_naming_why(tmp_path, caplog):
    run = tmp_path / "run"
    for step in (2, 4):
        published(run / f"checkpoint-{step}", step)
    zero_save(run / "checkpoint-6", 6)  # a save that did not complete
    (run / "checkpoint-8").mkdir()
    (run / "checkpoint-x").mkdir()  # not a checkpoint-N
    (run / "checkpoint-4" / "scheduler.pt").write_bytes(b"")
    newest_first = ["checkpoint-8", "checkpoint-6", "checkpoint-4", "checkpoint-2"]
    assert [p.name for p in layout.checkpoint_folders(run)] == newest_first
    with caplog.at_level(logging.WARNING, logger="disco_clip_ds"):
        assert layout.newest_complete(run) == run / "checkpoint-4"  # scheduler.pt is not in its manifest: no matter
    assert caplog.messages == [
        f"skipping checkpoint-8: no {MANIFEST}: the save did not complete",
        f"skipping checkpoint-6: no {MANIFEST}: the save did not complete",
    ]
    assert layout.newest_complete(run, older_than=4) == run / "checkpoint-2"
    assert layout.newest_complete_before(run / "checkpoint-6") == run / "checkpoint-4"
    assert layout.newest_complete_before(run / "checkpoint-2") is None
    assert layout.resolve_latest(run) == str(run / "checkpoint-4")  # one process: rank 0's choice
    assert layout.resolve_latest(tmp_path / "nothing") is None


def test_an_explicit_checkpoint_that_does_not_verify_is_refused_naming_the_newest_that_does(tmp_path):
    run = tmp_path / "run"
    published(run / "checkpoint-2", 2)
    bad = published(run / "checkpoint-4", 4)
    (bad / "global_step4" / "zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()
    layout.verify_resumable(run / "checkpoint-2")
    missing = "global_step4/zero_pp_rank_1_mp_rank_00_optim_states.pt is missing (the manifest lists it)"
    with pytest.raises(CheckpointError) as refused:
        layout.verify_resumable(bad)
    assert str(refused.value) == (
        f"cannot resume from {bad}: {missing}; the newest checkpoint that verifies is {run / 'checkpoint-2'}"
    )
    (run / "checkpoint-2" / MANIFEST).unlink()
    with pytest.raises(CheckpointError, match=f"; no checkpoint in {run} verifies$"):
        layout.verify_resumable(bad)
    with pytest.raises(UsageError, match="checkpoint-9: no such folder"):  # a typo is bad usage (exit 2)
        layout.verify_resumable(run / "checkpoint-9")


def test_a_model_folder_is_checked_as_export_checks_it(tmp_path):
    """`model_folder_problem` / `verify_model_folder`, what every reader of weights calls: a checkpoint by
    `checkpoint_problem`, a run's final model (or an export) by its manifest, which a run's final model must have,
    save_pretrained's folder not at all; a damaged final model names the newest checkpoint in its run that
    verifies."""
    run = tmp_path / "run"
    published(run / "checkpoint-1", 1)
    published(run / "checkpoint-2", 2)
    (run / "checkpoint-2" / "latest").write_text("global_step9")  # the same size, another tag
    (run / "model.safetensors").write_bytes(b"final")
    write_manifest(run, ["model.safetensors"])
    assert layout.model_folder_problem(run) is None
    assert layout.model_folder_problem(run / "checkpoint-1") is None
    assert layout.model_folder_problem(run / "checkpoint-2") == "latest does not match its checksum in the manifest"
    (run / "model.safetensors").write_bytes(b"fin4l")
    with pytest.raises(CheckpointError) as refused:
        layout.verify_model_folder(str(run), "--model")
    assert str(refused.value) == (
        f"--model {run} does not verify: model.safetensors does not match its checksum in the manifest; the newest "
        f"checkpoint in it that verifies is {run / 'checkpoint-1'}"
    )
    (run / MANIFEST).unlink()  # a final save cut short: its weights are there, its manifest not
    assert layout.model_folder_problem(run) == f"no {MANIFEST}: the final save did not complete"
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "model.safetensors").write_bytes(b"anything")  # nothing to check it against
    assert layout.model_folder_problem(plain) is None
    layout.verify_model_folder("org/hub-id", "--model")  # not a folder: the hub's
