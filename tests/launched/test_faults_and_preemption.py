"""Faults and preemption on 2 CPU ranks under the deepspeed launcher (and torchrun), each fault injected at a named
point (DISCO_FAULT) or by a signal sent once a checkpoint exists, never by timing: a kill inside a save, SIGTERM
to one rank or to the whole process group, SIGTERM to the launcher alone, a second run in the same folder, a
finished run re-run. The user-visible result is checked: files, weights, exit codes, messages. A resumed
run continues with the losses and weights of the uninterrupted one; the ranks read their own shards, skipping bad ones.

A launch costs most of its time in imports; the uninterrupted reference run serves several tests. (A full disk, the
injected ENOSPC and a real one: launched/test_integrity_and_full_disk.py.)
"""

import json
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from disco_clip_ds.testing.images import write_shards
from disco_clip_ds.testing.launch import LAUNCH_COMMON, QUICK, REPO, SGD, run_to_end, start_run, train_env
from disco_clip_ds.testing.processes import alive, kill_group, ranks_of
from disco_clip_ds.testing.runs import complete_checkpoints, run_and_data, same_weights, save_initial_model, step_losses

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(900),
]  # launches take minutes on a busy 2-core machine
STEPS, SAVE, PER_RANK = 10, 2, 8
BAD_PER_PASS = 4  # two corrupt images, one sample without text, one missing shard (see `data`)
# The faults run under the deepspeed launcher, whose signal handling and exit codes they check; the reference and
# resumed runs, where the launcher plays no part, under QUICK (forked ranks, their imports done).
ARGS = [
    *LAUNCH_COMMON,  # tokenizer, logging, workers, shuffle buffer, seed; argparse keeps the last --save_steps
    "--train_num_samples",
    "96",
    "--per_device_train_batch_size",
    str(PER_RANK),
    "--save_steps",
    str(SAVE),
    *SGD,  # constant lr, no clipping: any change in the trajectory shows in the weights
    # progressive resolution (models/resolution.py): 32 px for steps 1-2, 48 for 3-5, 64 from 6: the resumed runs
    # (from steps 2 and 3) cross a stage boundary and train at each step's side, as the uninterrupted run did
    "--resolution_schedule",
    "0:32,0.25:48,0.5:64",
    "--deepspeed",
    str(REPO / "ds_configs/cpu_zero2.json"),
]


def train_args(output: Path, data: dict, launcher: str, *args: str) -> list[str]:
    """The training arguments of a run of this file (under accelerate its ZeRO-2 yaml replaces --deepspeed)."""
    base = ARGS[: ARGS.index("--deepspeed")] if launcher == "accelerate" else ARGS
    return [*run_and_data(output, data), *base, *args]


def start(output: Path, data: dict, *args: str, launcher="deepspeed", fault: str = "") -> subprocess.Popen:
    return start_run(output, train_args(output, data, launcher, *args), launcher=launcher, fault=fault)


def run(output: Path, data: dict, *args: str, launcher="deepspeed", fault: str = "", timeout=400) -> tuple[int, str]:
    return run_to_end(
        output, train_args(output, data, launcher, *args), launcher=launcher, fault=fault, timeout=timeout
    )


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """4 shards x 24 samples; the first sample of three shards is bad, and the list names a missing shard."""
    root = tmp_path_factory.mktemp("ckdata")
    write_shards(
        root / "shards",
        num_shards=4,
        per_shard=24,
        seed=1,
        bad={0: "corrupt", 24: "no_text", 48: "corrupt", 72: "gray", 73: "rgba"},
    )
    shards = f"{root}/shards/{{00000..00004}}.tar"  # 00004.tar is missing
    return {"shards": shards, "model": save_initial_model(root / "tiny", 7)}


@pytest.fixture(scope="module")
def full(tmp_path_factory, data):
    """The uninterrupted reference run: STEPS steps, checkpoints every SAVE, each rank reading its own shards."""
    out = tmp_path_factory.mktemp("full") / "run"
    rc, log = run(out, data, "--max_steps", str(STEPS), launcher=QUICK)
    assert rc == 0, log[-3000:]
    return out


def test_kill_inside_a_save_resumes_from_the_previous_complete_checkpoint(full, data, tmp_path):
    out = tmp_path / "run"
    rc, log = run(out, data, "--max_steps", str(STEPS), fault="kill_in_save:step=4")
    assert rc != 0 and "DISCO_FAULT: killing" in log
    # the save of step 4 had written weights and DeepSpeed files, not the Trainer state: it is not a checkpoint
    assert complete_checkpoints(out) == ["checkpoint-2"] and not (out / "checkpoint-4").exists()
    # a partial checkpoint-5, as a save cut short and copied by hand leaves it: no manifest, no trainer_state.json,
    # its DeepSpeed tag folder cut short
    shutil.copytree(out / "tmp-checkpoints" / "checkpoint-4", out / "checkpoint-5")
    shutil.rmtree(out / "checkpoint-5" / "global_step4")
    (out / "checkpoint-5" / "model.safetensors").unlink()
    from disco_clip_ds.commands.export import main as export_main
    from disco_clip_ds.errors import run_main

    argv = [str(out / "checkpoint-5"), str(tmp_path / "export")]
    assert run_main(export_main, argv, "disco-clip export") != 0  # export refuses partials too
    rc, log = run(out, data, "--max_steps", str(STEPS), "--resume_from_checkpoint", "latest", launcher=QUICK)
    assert rc == 0, log[-3000:]
    assert log.count("skipping checkpoint-5: no manifest.json: the save did not complete") == 1  # rank 0 decides
    assert "resume: " + str(out / "checkpoint-2") in log
    assert not (out / "tmp-checkpoints").exists()  # the interrupted save's leftovers are removed
    assert same_weights(out, full) <= 1e-6  # the same weights as the uninterrupted run


def test_sigusr1_on_one_rank_stops_every_rank_with_a_checkpoint_and_resumes_exactly(full, data, tmp_path):
    from disco_clip_ds.errors import EXIT_PREEMPTED

    out = tmp_path / "run"
    rc, log = run(out, data, "--max_steps", str(STEPS), fault="signal_at_step=SIGUSR1:step=3,rank=1")  # to rank 1 alone
    assert rc == EXIT_PREEMPTED, log[-3000:]  # deepspeed passes the ranks' code on
    assert "stopped by SIGUSR1 at step 3: checkpoint-3 saved" in log and "--resume_from_checkpoint latest" in log
    assert complete_checkpoints(out) == ["checkpoint-2", "checkpoint-3"]
    assert not (out / "model.safetensors").exists()  # not finished: no final model
    rc, log = run(out, data, "--max_steps", str(STEPS), "--resume_from_checkpoint", "latest", launcher=QUICK)
    assert rc == 0, log[-3000:]
    assert f"resume: {out / 'checkpoint-3'}" in log
    # the resumed state carries steps 1-3 from the checkpoint; the run itself logged steps 4 to STEPS
    assert log.count("{'loss': ") == STEPS - 3
    resumed = step_losses(out)
    assert len(resumed) == STEPS and resumed == pytest.approx(step_losses(full), rel=1e-6)
    assert same_weights(out, full) <= 1e-6


def test_ranks_read_their_own_shards_once(full):
    # STEPS x 16 samples = 160, plus what each rank's reader holds ahead (2 prefetched batches, the shuffle buffer,
    # a batch in the making: ~32 per rank here). Had accelerate re-sharded the ranks' own streams, each rank would
    # have decoded two batches per step: >= 320.
    consumed = STEPS * 2 * PER_RANK
    decoded = json.loads((full / "train_results.json").read_text())["decoded_samples"]
    assert consumed <= decoded < 1.75 * consumed


def test_bad_samples_of_the_fault_runs_are_skipped_counted_and_reported(full):
    skipped = json.loads((full / "train_results.json").read_text())["skipped_samples"]
    assert skipped >= BAD_PER_PASS  # every shard was opened at least once in STEPS x 16 samples
    assert f"skipped samples: {skipped}" in (full.parent / "run.log").read_text()


def test_sigterm_to_the_process_group_saves_a_resumable_checkpoint(full, data, tmp_path):
    """As SLURM does: the launcher, every rank and every DataLoader worker get it (sent by rank 0 to its group);
    deepspeed's launch.py then SIGTERMs each rank's process tree too."""
    out = tmp_path / "run"
    rc, log = run(
        out,
        data,
        "--max_steps",
        str(STEPS),
        "--stop_signals",
        "SIGTERM",
        fault="signal_group_at_step=SIGTERM:step=3,rank=0",
    )
    assert rc != 0
    assert "stopped by SIGTERM at step 3: checkpoint-3 saved" in log, log[-3000:]
    assert "DataLoader worker (pid" not in log  # torch's words for a worker killed by it: the workers ignore it
    assert complete_checkpoints(out) == ["checkpoint-2", "checkpoint-3"]
    rc, log = run(out, data, "--max_steps", str(STEPS), "--resume_from_checkpoint", "latest", launcher=QUICK)
    assert rc == 0, log[-3000:]
    assert same_weights(out, full) <= 1e-6


def test_a_killed_dataloader_worker_is_one_line_and_latest_resumes_exactly(full, data, tmp_path):
    """The kernel's out-of-memory killer SIGKILLs one DataLoader worker of rank 1 at step 3: the rank said ~40 lines
    of traceback ending in torch's `DataLoader worker (pid N) is killed by signal: Killed.`; now one line with the
    likely cause, the flags that lower the memory and the resume command, and `latest` resumes exactly."""
    out = tmp_path / "run"
    rc, log = run(out, data, "--max_steps", str(STEPS), fault="kill_worker_at_step:step=3,rank=1")
    assert rc != 0, log[-3000:]
    said = [line for line in log.splitlines() if "DataLoader worker (pid" in line and "rank 1:" in line]
    # torch's fetch finds it dead ("exited unexpectedly") or its SIGCHLD handler names the signal: either is a kill
    assert said and "most often by the kernel's out-of-memory killer (see `dmesg`)" in said[0], log[-3000:]
    assert "then re-run the same command with --resume_from_checkpoint latest" in said[0]
    assert "Traceback" not in log and "saving a checkpoint" not in log, log[-3000:]  # no rank promised one
    assert complete_checkpoints(out)[-1] == "checkpoint-2"
    rc, log = run(out, data, "--max_steps", str(STEPS), "--resume_from_checkpoint", "latest", launcher=QUICK)
    assert rc == 0, log[-3000:]
    assert same_weights(out, full) <= 1e-6


# deepspeed: the command dies, launch.py and the ranks would train on (the ranks watch their grandparent);
# torchrun and accelerate forward SIGTERM (the ranks checkpoint and stop) but die of SIGUSR1 (the ranks watch their
# parent; accelerate's SIGUSR1 is torchrun's, which it runs in-process)
@pytest.mark.parametrize(
    "launcher,sig",
    [("deepspeed", "SIGTERM"), ("torchrun", "SIGTERM"), ("torchrun", "SIGUSR1"), ("accelerate", "SIGTERM")],
)
def test_a_signal_to_the_launcher_alone_leaves_no_rank_running(data, tmp_path, launcher, sig):
    out = tmp_path / "run"
    proc = start(out, data, "--max_steps", "100000", launcher=launcher)
    try:
        deadline = time.monotonic() + 300
        while not (out / "checkpoint-2").exists():  # training is under way
            assert proc.poll() is None and time.monotonic() < deadline, (out.parent / "run.log").read_text()[-3000:]
            time.sleep(0.2)
        ranks = ranks_of(proc.pid)
        assert len(ranks) == 2, ranks
        proc.send_signal(signal.Signals[sig])  # as `timeout`, Popen.terminate() or a supervisor do
        proc.wait(timeout=60)
        deadline = time.monotonic() + 60
        while alive(ranks) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not alive(ranks), f"ranks {alive(ranks)} outlived the {launcher} launcher"
    finally:
        kill_group(proc.pid)
    assert not (out / "model.safetensors").exists()  # the run did not go on to the end
    log = (out.parent / "run.log").read_text()
    if sig == "SIGTERM" and launcher != "deepspeed":  # forwarded to the ranks (and their workers): a clean stop
        assert "stopped by SIGTERM at step" in log and "DataLoader worker (pid" not in log, log[-3000:]
    else:
        assert "launcher (pid " in log and "is gone: exiting" in log
    names = sorted(p.name for p in out.glob("checkpoint-*"))
    assert names and complete_checkpoints(out) == sorted(names, key=lambda n: int(n.split("-")[1]))


def test_a_finished_run_stays_finished(full, tmp_path, data):
    before = {str(p.relative_to(full)): p.stat().st_mtime_ns for p in full.rglob("*") if p.is_file()}
    rc, log = run(full, data, "--max_steps", str(STEPS), "--resume_from_checkpoint", "latest", launcher=QUICK)
    assert rc == 0, log[-3000:]
    assert f"run finished: checkpoint-{STEPS} reached step {STEPS} of --max_steps {STEPS}; nothing to do" in log
    after = {str(p.relative_to(full)): p.stat().st_mtime_ns for p in full.rglob("*") if p.is_file()}
    assert {k: v for k, v in after.items() if k != "run.lock"} == {k: v for k, v in before.items() if k != "run.lock"}
    assert "{'loss'" not in log  # not one step trained


# --- the run lock, in process (no launcher needed) ---


def _train_main(out: Path, data: dict, *args: str) -> int:
    """`disco-clip train` in this process: its exit code, its messages on stderr."""
    from disco_clip_ds.commands.train import main
    from disco_clip_ds.errors import run_main

    return run_main(
        main,
        [
            "--output_dir",
            str(out),
            "--model_name_or_path",
            str(data["model"]),
            "--train_shards",
            data["shards"],
            *ARGS[: ARGS.index("--deepspeed")],
            "--max_steps",
            "1",
            "--dataloader_num_workers",
            "0",
            *args,
        ],
        "disco-clip train",
    )


def test_a_second_run_in_the_same_folder_is_refused_and_touches_nothing(data, tmp_path, capsys):
    from disco_clip_ds.distributed import runlock

    out = tmp_path / "run"
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from disco_clip_ds.distributed.runlock import acquire_run_lock; "
            "acquire_run_lock(sys.argv[1]); print('locked', flush=True); time.sleep(600)",
            str(out),
        ],
        env=train_env(),
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        files = sorted(p.name for p in out.iterdir())
        assert _train_main(out, data) == 2
        err = capsys.readouterr().err
        assert f"{out} is in use by another run (host " in err and f"pid {holder.pid}" in err
        assert sorted(p.name for p in out.iterdir()) == files == [runlock.LOCK_FILE]
    finally:
        holder.kill()
        holder.wait()


def test_output_dir_that_is_a_file_and_bad_stop_signals_are_refused(data, tmp_path, capsys):
    (tmp_path / "file").write_text("x")
    assert _train_main(tmp_path / "file", data) == 2
    assert "--output_dir" in capsys.readouterr().err
    assert _train_main(tmp_path / "run", data, "--stop_signals", "SIGFOO") == 2
    assert "--stop_signals SIGFOO: unknown signal" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_a_larger_max_steps_continues_a_finished_run(full, data):
    """Last in the file: it extends the reference run."""
    rc, log = run(full, data, "--max_steps", str(STEPS + 1), "--resume_from_checkpoint", "latest", launcher=QUICK)
    assert rc == 0, log[-3000:]
    assert log.count("{'loss'") == 1 and f"checkpoint-{STEPS + 1}" in complete_checkpoints(full)


def test_bad_values_are_refused_before_the_model_is_built(data, tmp_path, capsys):
    bad_json = tmp_path / "bad.json"
    bad_json.write_text("{not json")
    cases = [
        (["--max_steps", "0"], "--max_steps 0 trains nothing"),
        (["--per_device_train_batch_size", "0"], "--per_device_train_batch_size 0: must be at least 1"),
        (
            ["--tokenizer_name", str(tmp_path / "no_tokenizer")],
            f"--tokenizer_name {tmp_path / 'no_tokenizer'}: no such folder",
        ),
        (
            ["--model_name_or_path", str(tmp_path / "no_model")],
            f"--model_name_or_path {tmp_path / 'no_model'}: no such folder",
        ),
    ]
    for argv, message in cases:
        assert _train_main(tmp_path / "run", data, *argv) == 2, argv
        assert message in capsys.readouterr().err, argv
    from disco_clip_ds.commands.train import main
    from disco_clip_ds.errors import run_main

    assert (
        run_main(
            main,
            [
                "--output_dir",
                str(tmp_path / "run"),
                "--model_config",
                str(bad_json),
                "--train_shards",
                data["shards"],
                "--tokenizer_name",
                str(REPO / "recipes/tokenizer"),
                "--report_to",
                "none",
            ],
            "disco-clip train",
        )
        == 2
    )
    assert f"--model_config {bad_json} is not a readable JSON file" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()  # refused before anything was written
