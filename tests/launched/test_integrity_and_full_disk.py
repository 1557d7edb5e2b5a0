"""Nothing lost, nothing silent, launched on 2 CPU ranks: checkpoints and the final model carry manifests (size and
checksum of every file); `latest` and export skip what does not verify, naming it, and resume or export the newest
that does; a finished run whose final model was cut short, truncated or deleted is repaired on re-run from its last
checkpoint; a full disk, injected (ENOSPC in one rank's write) or real (a tmpfs mounted here, as root), during the
first save, a later save or the final save, or full at start, ends every rank with one line and exit 1, the last
complete checkpoint intact. (What a checkpoint must hold to verify, on folders made in place:
unit/checkpoint/test_layout.py.)

Corruption is real (files truncated, deleted, a byte flipped on disk); the real full disk is a tmpfs of a measured
size and so is its ENOSPC, only the free-space check before a save is blinded (`disk_free_mib`) where the test needs
the write itself to fail. The uninterrupted reference run serves every comparison of weights.
"""

import logging
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from disco_clip_ds.testing.images import write_shards
from disco_clip_ds.testing.launch import LAUNCH_COMMON, QUICK, REPO, SGD, run_to_end, start_run
from disco_clip_ds.testing.processes import kill_group, wait_group
from disco_clip_ds.testing.runs import complete_checkpoints, same_weights, save_initial_model

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
STEPS = 8
# QUICK (forked ranks, imports done) starts sooner; the deepspeed launcher where its exit codes matter (full disk)
ARGS = [
    *LAUNCH_COMMON,
    "--train_num_samples",
    "96",
    "--per_device_train_batch_size",
    "8",
    *SGD,
    "--deepspeed",
    str(REPO / "ds_configs/cpu_zero2.json"),
    "--save_total_limit",
    "20",
]
FINAL = ("all_results.json", "train_results.json", "model.safetensors", "config.json", "trainer_state.json")


def run(out: Path, data: dict, *args: str, launcher=QUICK, fault="", steps=STEPS, save=1, timeout=300):
    """A launched run of STEPS steps (a checkpoint every SAVE): (exit code, its log). A hang fails at `timeout`."""
    argv = ["--output_dir", str(out), "--model_name_or_path", str(data["model"]), "--train_shards", data["shards"]]
    argv += [*ARGS, "--max_steps", str(steps), "--save_steps", str(save), *args]
    return run_to_end(out, argv, launcher=launcher, fault=fault, timeout=timeout)


def run_after(marker: Path, out: Path, data: dict, *args: str, **kw) -> tuple[int, str, float]:
    """`run` under the deepspeed launcher, also timing how long its ranks lived on once MARKER appeared (the save
    that fails has begun): (exit code, log, seconds)."""
    argv = ["--output_dir", str(out), "--model_name_or_path", str(data["model"]), "--train_shards", data["shards"]]
    argv += [*ARGS, "--max_steps", str(kw.pop("steps")), "--save_steps", str(kw.pop("save")), *args]
    logfile = out.parent / f"{out.name}.log"
    proc = start_run(out, argv, launcher="deepspeed", **kw)
    try:
        while not marker.exists() and proc.poll() is None:
            time.sleep(0.05)
        began = time.monotonic()
        proc.wait(timeout=300)  # a hang (gloo's own timeout is 30 min) fails here
        wait_group(proc.pid, timeout=120)
        return proc.returncode, logfile.read_text(), time.monotonic() - began
    finally:
        kill_group(proc.pid)


def lines(log: str, start: str) -> list[str]:
    return [line for line in log.splitlines() if line.startswith(start)]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("integrity")
    write_shards(root / "shards", num_shards=4, per_shard=24, seed=1)
    return {"shards": f"{root}/shards/{{00000..00003}}.tar", "model": save_initial_model(root / "tiny", 7)}


@pytest.fixture(scope="module")
def full(tmp_path_factory, data):
    """The uninterrupted reference: STEPS steps, a checkpoint at every step, all kept."""
    out = tmp_path_factory.mktemp("full") / "run"
    rc, log = run(out, data)
    assert rc == 0, log[-3000:]
    assert complete_checkpoints(out) == [f"checkpoint-{n}" for n in range(1, STEPS + 1)]
    return out


def truncate(path: Path) -> str:
    """Cut PATH to half its size; the skip line that names it."""
    size = path.stat().st_size
    with open(path, "r+b") as f:
        f.truncate(size // 2)
    name = f"{path.parent.name}/{path.name}" if path.parent.name.startswith("global_step") else path.name
    return f"{name} is {size // 2} bytes, the manifest says {size}"


def copy_unfinished(full: Path, out: Path, last: int) -> Path:
    """The reference run as it was after checkpoint-LAST: its checkpoints up to LAST and run.json, no final model."""
    out.mkdir(parents=True)
    shutil.copy(full / "run.json", out)
    for n in range(1, last + 1):
        shutil.copytree(full / f"checkpoint-{n}", out / f"checkpoint-{n}")
    return out


def test_latest_skips_every_checkpoint_that_does_not_verify_and_resumes_exactly(full, data, tmp_path, caplog):
    from disco_clip_ds.checkpoint.layout import checkpoint_problem
    from disco_clip_ds.export import weights as ex

    out = copy_unfinished(full, tmp_path / "run", STEPS)
    c = {n: out / f"checkpoint-{n}" for n in range(1, STEPS + 1)}
    flipped = c[8] / "model.safetensors"  # same size, one byte changed: only the checksum sees it
    blob = bytearray(flipped.read_bytes())
    blob[-10] ^= 0xFF
    flipped.write_bytes(bytes(blob))
    skipped = {
        8: "model.safetensors does not match its checksum in the manifest",
        7: truncate(c[7] / "global_step7" / "mp_rank_00_model_states.pt"),
        6: truncate(c[6] / "global_step6" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"),
        5: truncate(c[5] / "rng_state_1.pth"),
        4: truncate(c[4] / "scheduler.pt"),
        3: "global_step3/zero_pp_rank_0_mp_rank_00_optim_states.pt is missing (the manifest lists it)",
        2: "scheduler.pt is missing (the manifest lists it)",
    }
    for shard in (c[3] / "global_step3").glob("*optim_states.pt"):
        shard.unlink()
    (c[2] / "scheduler.pt").unlink()
    assert checkpoint_problem(c[8], checksums=False) is None  # sizes alone pass it

    # export: the run folder gives its newest checkpoint that verifies; a bad one given by name is refused
    with caplog.at_level(logging.WARNING, logger="disco_clip_ds"):
        assert ex.resolve_checkpoint(out) == c[1]
    assert caplog.messages == [f"skipping checkpoint-{n}: {why}" for n, why in skipped.items()]
    with pytest.raises(
        ex.ExportError, match=f"does not verify: {skipped[7]}; the newest checkpoint beside it .* {c[1]}"
    ):
        ex.resolve_checkpoint(c[7])

    # an explicit folder that does not verify: one line per rank, exit 1, naming the newest one that does
    rc, log = run(out, data, "--resume_from_checkpoint", str(c[7]), launcher="deepspeed")  # passes the code on
    assert rc == 1 and "Traceback" not in log, log[-3000:]
    assert lines(log, "disco-clip train: ") == 2 * [
        f"disco-clip train: cannot resume from {c[7]}: {skipped[7]}; the newest checkpoint that verifies is {c[1]}"
    ]

    rc, log = run(out, data, "--resume_from_checkpoint", "latest")
    assert rc == 0, log[-3000:]
    for n, why in skipped.items():
        assert log.count(f"skipping checkpoint-{n}: {why}") == 1, (n, log[-5000:])  # one line, from rank 0
    assert f"resume: {c[1]}" in log and "Traceback" not in log
    assert same_weights(out, full) <= 1e-6  # the uninterrupted run's weights


def test_a_final_model_cut_short_truncated_or_deleted_is_repaired_on_rerun(full, data, tmp_path, caplog):
    from disco_clip_ds.checkpoint.final_model import final_model_problem
    from disco_clip_ds.checkpoint.manifest import MANIFEST
    from disco_clip_ds.commands.eval import load_for_eval
    from disco_clip_ds.export import weights as ex

    out = tmp_path / "run"
    rc, log = run(out, data, fault="kill_in_final_save:rank=0")
    assert rc != 0 and "DISCO_FAULT: killing rank 0 inside the final save" in log, log[-3000:]
    assert (out / "model.safetensors").is_file() and not (out / MANIFEST).exists()  # weights written, not verified
    assert complete_checkpoints(out)[-1] == f"checkpoint-{STEPS}"
    with caplog.at_level(logging.WARNING, logger="disco_clip_ds"):  # export takes the last checkpoint meanwhile
        assert ex.resolve_checkpoint(out) == out / f"checkpoint-{STEPS}"
    assert caplog.messages == [f"skipping the final model in {out}: no {MANIFEST}: the final save did not complete"]

    repaired = f"run finished at checkpoint-{STEPS}, but its final model was not usable ("
    for damage, problem in (
        (lambda: None, f"no {MANIFEST}: the final save did not complete"),
        (lambda: truncate(out / "model.safetensors"), "model.safetensors is "),
    ):  # a deleted file is found the same way (test_final_model.py); the rerun repairs any problem alike
        damage()
        assert final_model_problem(out).startswith(problem)
        rc, log = run(out, data, "--resume_from_checkpoint", "latest")
        assert rc == 0 and "{'loss'" not in log, log[-3000:]  # not one step trained
        assert len(lines(log, repaired)) == 1 and f"({problem}" in lines(log, repaired)[0], log[-3000:]
        assert final_model_problem(out) is None and same_weights(out, full) == 0  # bit-exact: the same step's weights
    load_for_eval(str(out))  # eval reads the run folder again

    # a finished run whose final model verifies stays untouched
    before = {p.name: p.stat().st_mtime_ns for p in out.iterdir() if p.is_file() and p.name != "run.lock"}
    rc, log = run(out, data, "--resume_from_checkpoint", "latest")
    assert rc == 0 and f"run finished: checkpoint-{STEPS} reached step {STEPS}" in log and repaired not in log
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir() if p.is_file() and p.name != "run.lock"} == before


def test_a_checkpoint_without_full_weights_repairs_the_final_model_from_its_partitions(full, tmp_path):
    """As ZeRO-3 writes them without stage3_gather_16bit_weights_on_model_save: the fp32 weights consolidated from
    the optimizer partitions, as export does (in process: no launch needed for the repair itself)."""
    from disco_clip_ds.checkpoint.final_model import final_model_problem, keep_final_model
    from disco_clip_ds.checkpoint.manifest import write_manifest

    out = copy_unfinished(full, tmp_path / "run", 0)
    checkpoint = out / f"checkpoint-{STEPS}"
    shutil.copytree(full / checkpoint.name, checkpoint)
    (checkpoint / "model.safetensors").unlink()
    write_manifest(checkpoint)
    message = keep_final_model(out, checkpoint)
    assert message.startswith(f"run finished at {checkpoint.name}, but its final model was not usable (missing)")
    assert final_model_problem(out) is None and same_weights(out, full) == 0  # fp32 master weights = the model's


# --- a full disk: injected, then real (a tmpfs of a measured size as the output folder) ---


def test_a_full_disk_is_one_clear_line_and_the_last_checkpoint_stays_usable(data, tmp_path):
    """ENOSPC injected in one rank's write (and a free-space check blinded): the same lines as a real full disk."""
    out = tmp_path / "run"
    # on rank 1 alone, in its DeepSpeed optimizer shard: rank 0 goes on through DeepSpeed's barriers, and so must rank 1
    rc, log = run(out, data, launcher="deepspeed", steps=10, save=2, fault="enospc_in_save:step=4,rank=1")
    assert rc == 1, log[-3000:]
    said = lines(log, "disco-clip train: no space left in")
    assert len(said) == 2, log[-3000:]  # one per rank
    assert f"no space left in {out} (" in said[0] and "checkpoint-2 is intact" in said[0]
    assert "Traceback" not in log
    assert complete_checkpoints(out) == ["checkpoint-2"] and not (out / "checkpoint-4").exists()
    assert not (out / "tmp-checkpoints" / "checkpoint-4").exists()
    # the free-space check before a save: the last checkpoint's size does not fit, nothing is written
    rc, log = run(
        out,
        data,
        "--resume_from_checkpoint",
        "latest",
        launcher="deepspeed",
        steps=10,
        save=2,
        fault="disk_free_mib=1:step=4",
    )
    assert rc == 1 and "free) while saving checkpoint-4" in log and "needs ~" in log, log[-3000:]
    assert complete_checkpoints(out) == ["checkpoint-2"] and not (out / "tmp-checkpoints").exists()


# a real full disk: a tmpfs mounted for the test


@pytest.fixture
def disk(tmp_path):
    """mount(KiB) -> an empty tmpfs of that size (a real filesystem that fills up), unmounted afterwards."""
    mounted = []

    def mount(kib: int) -> Path:
        folder = tmp_path / f"disk{len(mounted)}"
        folder.mkdir()
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={kib}k", "tmpfs", str(folder)], capture_output=True)
        if done.returncode:
            pytest.skip(f"cannot mount a tmpfs here ({done.stderr.decode().strip()}): a real full disk needs root")
        mounted.append(folder)
        return folder

    yield mount
    for folder in mounted:
        subprocess.run(["umount", "-l", str(folder)], check=False)


# The tiny model's checkpoint takes ~3.6 MB (model.safetensors 1.2 MB, model states 1.2 MB, two optimizer shards),
# its final model ~1.25 MB; the first save's estimate before any checkpoint exists is ~5 MB.
def full_disk_lines(log: str, out: Path, what: str, intact: str | None) -> list[str]:
    got = lines(log, "disco-clip train: ")
    assert len(got) == 2 and "Traceback" not in log, log[-3000:]  # one line per rank, no hang
    after = f"the last complete checkpoint {intact} is intact" if intact else "no checkpoint was saved"
    for line in got:
        assert line.startswith(f"disco-clip train: no space left in {out} (needs ~"), line
        assert f" free) while saving {what}; {after}: free space, then resume" in line, line
    return got


def test_a_real_full_disk_at_the_first_a_later_and_the_final_save_is_one_line(data, disk):
    from disco_clip_ds.checkpoint.layout import checkpoint_problem

    out = disk(3 * 1024)  # the first checkpoint does not fit: the check before the save refuses it
    rc, log = run(out, data, launcher="deepspeed", steps=2, save=2)
    assert rc == 1
    assert "(needs ~5 MiB, 3 MiB free)" in full_disk_lines(log, out, "checkpoint-2", None)[0]
    assert sorted(p.name for p in out.iterdir()) == ["run.json", "run.lock"]

    out = disk(6 * 1024)  # checkpoint-2 fits, checkpoint-4 does not: the write fails inside DeepSpeed's save
    marker = out / "tmp-checkpoints" / "checkpoint-4"
    rc, log, took = run_after(marker, out, data, steps=4, save=2, fault="disk_free_mib=100000:step=4")
    assert rc == 1 and took < 60
    full_disk_lines(log, out, "checkpoint-4", "checkpoint-2")
    assert checkpoint_problem(out / "checkpoint-2") is None and not (out / "tmp-checkpoints").exists()

    out = disk(4800)  # checkpoint-2 fits, the final model does not: safetensors' write fails on rank 0 alone
    rc, log, took = run_after(out / "checkpoint-2", out, data, steps=2, save=2, fault="disk_free_mib=100000:step=2")
    assert rc == 1 and took < 60
    full_disk_lines(log, out, "the final model", "checkpoint-2")
    assert checkpoint_problem(out / "checkpoint-2") is None
    # space freed (the tmpfs grown), the same command again: the final model is written from checkpoint-2
    subprocess.run(["mount", "-o", "remount,size=16m", str(out)], check=True)
    rc, log = run(out, data, "--resume_from_checkpoint", "latest", steps=2, save=2)
    assert rc == 0 and len(lines(log, "run finished at checkpoint-2, but its final model was not usable")) == 1


def test_a_disk_full_at_start_is_one_line(data, disk):
    out = disk(1024)
    with open(out / "filler", "wb") as f:  # fill it up
        try:
            while f.write(b"\0" * 65536):
                pass
        except OSError:
            pass
    rc, log = run(out, data, launcher="deepspeed")
    assert rc == 1 and "Traceback" not in log, log[-3000:]
    assert lines(log, "disco-clip train: ") == 2 * [
        f"disco-clip train: no space left in {out} (0 KiB free, a run needs at least 1 MiB to start and room for "
        "its checkpoints): free space or choose another --output_dir"
    ]
