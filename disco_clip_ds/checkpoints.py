"""Surviving preemption and faults: checkpoints that are complete or absent, one writer per run folder, a clean
stop on SIGTERM/SIGUSR1, ranks that do not outlive their launcher, and a one-line "disk full" error.

The Trainer writes checkpoint-N in place, so a kill mid-save leaves a folder that `get_last_checkpoint` picks and
every resume then fails on. Neither transformers (5.x dropped its tmp-checkpoint staging) nor DeepSpeed stages
a multi-rank save, hence `CompleteCheckpointsMixin`: the Trainer writes into tmp-checkpoints/checkpoint-N and
rank 0 renames it to checkpoint-N once every rank has written its part.

Exit codes of `disco-clip train`: 0 done (or already finished), 2 bad arguments or a run folder in use,
75 (EX_TEMPFAIL) stopped by a signal after saving a checkpoint: resumable, 143 a rank whose launcher died,
1 anything else (a full disk included).

Faults for tests: DISCO_FAULT="ACTION:step=N[,rank=R]" with ACTION one of kill_in_save (SIGKILL at the named
point inside the save, after the model and DeepSpeed files, before the RNG and Trainer state), enospc_in_save
(raise ENOSPC at that point), disk_free_mib=M (the free-space check sees M MiB), signal_at_step[=SIG] (SIGTERM or
SIG to this rank at the end of step N), signal_group_at_step[=SIG] (to this rank's process group, as SLURM does).
"""

from __future__ import annotations

import atexit
import errno
import fcntl
import json
import logging
import os
import shutil
import signal
import socket
import sys
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, rotate_checkpoints

from .errors import DiscoClipError, UsageError

logger = logging.getLogger("disco_clip_ds.checkpoints")

EXIT_PREEMPTED = 75  # sysexits.h EX_TEMPFAIL: "temporary failure, the user is invited to retry"
EXIT_LAUNCHER_GONE = 143  # as if terminated by SIGTERM along with the launcher
STAGING = "tmp-checkpoints"
LOCK_FILE = "run.lock"
WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)


class CheckpointError(DiscoClipError, RuntimeError):
    """A save that failed; the message says why in one line and what is still intact."""


class Preempted(Exception):
    """Training stopped on a signal after saving a complete checkpoint; main() exits with EXIT_PREEMPTED."""


# --- collectives that work before and after the Trainer exists (no-ops in a single process) ---


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _rank() -> int:
    return dist.get_rank() if _distributed() else 0


def from_rank0(value):
    """`value` as computed on rank 0, on every rank."""
    if not _distributed():
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _all_true(flag: bool, device) -> bool:
    if not _distributed():
        return flag
    t = torch.tensor([1.0 if flag else 0.0], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return bool(t.item())


def _any_true(flag: bool, device) -> bool:
    return not _all_true(not flag, device)


# --- deterministic fault injection ---


def fault(action: str, step: int) -> dict | None:
    """The DISCO_FAULT entry for `action` when it applies to this step and rank, else None."""
    for spec in filter(None, os.environ.get("DISCO_FAULT", "").split(";")):
        name, _, params = spec.partition(":")
        name, _, value = name.partition("=")
        if name != action:
            continue
        opts = dict(p.split("=", 1) for p in params.split(",") if p)
        if "step" in opts and int(opts["step"]) != step or "rank" in opts and int(opts["rank"]) != _rank():
            continue
        return {"value": value, **opts}
    return None


def _inject_save_faults(step: int) -> None:
    if fault("kill_in_save", step):
        logger.warning("DISCO_FAULT: killing rank %d inside the save of step %d", _rank(), step)
        os.kill(os.getpid(), signal.SIGKILL)
    if fault("enospc_in_save", step):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "(DISCO_FAULT)")


# --- what counts as a complete checkpoint ---


def checkpoint_problem(folder: str | os.PathLike) -> str | None:
    """Why `folder` cannot be resumed from (None when it is complete): Trainer state, weights, and every rank's
    DeepSpeed files. Checkpoints written by this module are complete by construction; this catches those from
    older runs or copied by hand."""
    folder = Path(folder)
    try:
        json.loads((folder / "trainer_state.json").read_text())["global_step"]
    except (OSError, ValueError, KeyError):
        return "no readable trainer_state.json"
    ranks = len(list(folder.glob("rng_state_*.pth"))) or int((folder / "rng_state.pth").exists())
    if not ranks:
        return "no rng_state*.pth"
    latest = folder / "latest"
    if latest.is_file():  # DeepSpeed: the tag folder holds model states and one optimizer shard per rank
        tag = folder / latest.read_text().strip()
        if not any(tag.glob("*model_states.pt")):
            return f"no DeepSpeed model states in {tag.name}"
        shards = list(tag.glob("*optim_states.pt"))
        if shards and len(shards) != ranks:
            return f"{len(shards)} DeepSpeed optimizer shards for {ranks} ranks"
        return None
    if any((folder / f).exists() for f in WEIGHT_FILES) or any(folder.glob("pytorch_model_fsdp_*")):
        return None
    return "no weights"


def checkpoint_step(folder: str | os.PathLike) -> int:
    return json.loads((Path(folder) / "trainer_state.json").read_text())["global_step"]


def _checkpoints(output_dir: Path) -> list[Path]:
    """checkpoint-N folders, newest first."""
    found = [p for p in output_dir.glob(f"{PREFIX_CHECKPOINT_DIR}-*") if p.is_dir() and p.name.split("-")[-1].isdigit()]
    return sorted(found, key=lambda p: int(p.name.split("-")[-1]), reverse=True)


def _newest_complete(output_dir: Path) -> str | None:
    if not output_dir.is_dir():
        return None
    for folder in _checkpoints(output_dir):
        problem = checkpoint_problem(folder)
        if problem is None:
            return str(folder)
        logger.warning("skipping incomplete checkpoint %s (%s)", folder, problem)
    return None


def resolve_latest(output_dir: str | os.PathLike) -> str | None:
    """The newest complete checkpoint in output_dir, chosen on rank 0 (so every rank resumes the same one)."""
    return from_rank0(_newest_complete(Path(output_dir)) if _rank() == 0 else None)


# --- one writer per run folder ---

_lock_fd: int | None = None


def acquire_run_lock(output_dir: str | os.PathLike) -> None:
    """Rank 0 holds an exclusive lock on OUTPUT_DIR/run.lock until the process exits. A second run is refused
    (UsageError on every rank, before it writes anything); a lock left by a dead run is taken
    over with a warning. flock, not a pid file: the kernel releases it when its holder dies, however it dies."""
    error = _take_lock(Path(output_dir)) if _rank() == 0 else None
    error = from_rank0(error)
    if error:
        raise UsageError(error)


def _take_lock(output_dir: Path) -> str | None:
    global _lock_fd
    if output_dir.exists() and not output_dir.is_dir():
        return f"--output_dir {output_dir} is a file: give a folder"
    output_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(output_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    holder = os.read(fd, 4096).decode(errors="replace").strip()
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return (
            f"{output_dir} is in use by another run ({holder or 'holder unknown'}): wait for it to end, "
            "or choose another --output_dir"
        )
    if holder:  # the previous holder died without releasing it (a clean exit empties the file)
        logger.warning("taking over the lock of a run that is no longer running (%s) in %s", holder, output_dir)
    os.ftruncate(fd, 0)
    os.pwrite(
        fd, f"host {socket.gethostname()}, pid {os.getpid()}, since {time.strftime('%Y-%m-%d %H:%M:%S')}".encode(), 0
    )
    _lock_fd = fd
    _clean_staging(output_dir)
    return None


def release_run_lock() -> None:
    """Empty and unlock run.lock (a lock file with content means its holder died)."""
    global _lock_fd
    if _lock_fd is not None:
        os.ftruncate(_lock_fd, 0)
        os.close(_lock_fd)
        _lock_fd = None


def _clean_staging(output_dir: Path) -> None:
    staging = output_dir / STAGING
    if staging.exists() and any(staging.iterdir()):
        logger.warning("removing %s: partial checkpoints of an interrupted save", [p.name for p in staging.iterdir()])
    shutil.rmtree(staging, ignore_errors=True)


# --- disk space ---


def _folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def _size(n: float) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB"


def _free_bytes(output_dir: Path, step: int) -> int:
    forced = fault("disk_free_mib", step)
    return int(forced["value"]) * 2**20 if forced else shutil.disk_usage(output_dir).free


def disk_full_message(output_dir: Path, needed: int | None, step: int) -> str:
    last = _newest_complete(output_dir)
    need = f"needs ~{_size(needed)}, " if needed else ""
    return (
        f"no space left in {output_dir} ({need}{_size(_free_bytes(output_dir, step))} free) while saving "
        f"checkpoint-{step}; "
        f"{'the last complete checkpoint ' + Path(last).name + ' is intact' if last else 'no checkpoint was saved'}: "
        "free space, then resume with --resume_from_checkpoint latest"
    )


def _is_disk_full(error: BaseException) -> bool:
    if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    # torch.save's C++ writer loses the errno: "basic_ios::clear: iostream error", "file write failed"
    text = str(error)
    return isinstance(error, RuntimeError) and any(
        s in text for s in ("iostream error", "write failed", "No space left", "unexpected pos")
    )


# --- the Trainer side ---


class CompleteCheckpointsMixin:
    """Mix into a Trainer subclass (before Trainer): checkpoint-N appears complete or not at all, rotation
    (save_total_limit) only counts complete ones, a full disk is one clear error, and DataLoader workers ignore
    the stop signals (the rank handles them; a worker killed by SIGTERM would abort the run)."""

    _staging_dir: Path | None = None
    stop_signals: tuple[int, ...] = ()

    def _get_output_dir(self, trial) -> str:
        # The stock _save_checkpoint writes into _get_output_dir(trial)/checkpoint-N: point it at the staging area.
        return str(self._staging_dir) if self._staging_dir is not None else super()._get_output_dir(trial)

    def _save_rng_state(self, output_dir: str) -> None:
        _inject_save_faults(self.state.global_step)  # the named point: model and DeepSpeed files written, state not
        super()._save_rng_state(output_dir)

    def _save_checkpoint(self, model, trial) -> None:
        run_dir = Path(super()._get_output_dir(trial))
        step, name, device = (
            self.state.global_step,
            f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}",
            self.args.device,
        )
        staging = run_dir / STAGING
        needed = None
        if _rank() == 0:
            previous = _newest_complete(run_dir)
            needed = int(1.1 * _folder_bytes(Path(previous))) if previous else None
        # the check on rank 0, the verdict on every rank: all ranks stop together, before writing anything
        enough = _all_true(_rank() != 0 or not needed or _free_bytes(run_dir, step) >= needed, device)
        if not enough:
            raise CheckpointError(disk_full_message(run_dir, from_rank0(needed), step))
        if _rank() == 0 and (staging / name).exists():
            shutil.rmtree(staging / name)
        self._staging_dir, error = staging, None
        try:
            super()._save_checkpoint(model, trial)
        except (OSError, RuntimeError) as e:
            error = e
        finally:
            self._staging_dir = None
        if not _all_true(error is None, device):
            if _rank() == 0:
                shutil.rmtree(staging / name, ignore_errors=True)
            if error is None:
                raise CheckpointError(f"another rank failed to save {name}; the last complete checkpoint is intact")
            if _is_disk_full(error):
                raise CheckpointError(disk_full_message(run_dir, needed, step)) from error
            raise error
        if _rank() == 0:
            self._publish(staging / name, run_dir / name)
        if _distributed():
            dist.barrier()  # no rank moves on (or exits) before checkpoint-N exists

    def _publish(self, staged: Path, final: Path) -> None:
        problem = checkpoint_problem(staged)
        if problem:
            raise CheckpointError(f"{staged} is incomplete after every rank saved ({problem})")
        if final.exists():
            shutil.rmtree(final)
        os.replace(staged, final)  # atomic on one filesystem: checkpoint-N is complete or absent
        if not any(staged.parent.iterdir()):
            staged.parent.rmdir()
        dir_fd = os.open(final.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
        best = self.state.best_model_checkpoint
        rotate_checkpoints(
            output_dir=str(final.parent),
            save_total_limit=self.args.save_total_limit,
            best_model_checkpoint=None if best is None or STAGING in best else best,
        )

    def get_train_dataloader(self):
        loader = super().get_train_dataloader()
        base = getattr(loader, "base_dataloader", loader)  # accelerate's wrapper iterates the DataLoader it holds
        if self.stop_signals and getattr(base, "num_workers", 0) > 0:
            base.worker_init_fn = _IgnoreSignals(self.stop_signals, base.worker_init_fn)
            atexit.register(_kill_workers)
        return loader


class _IgnoreSignals:
    """worker_init_fn: ignore the stop signals, then run the previous init (picklable, for spawn)."""

    def __init__(self, signals, then):
        self.signals, self.then = signals, then

    def __call__(self, worker_id):
        for s in self.signals:
            signal.signal(s, signal.SIG_IGN)
        if self.then is not None:
            self.then(worker_id)


def _kill_workers() -> None:
    # Workers that ignore SIGTERM would make multiprocessing's exit handler (terminate, then join) wait forever
    # when the rank leaves on an error; at exit they hold nothing worth keeping.
    import multiprocessing

    signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # not torch's handler: a killed worker is no error now
    for worker in multiprocessing.active_children():
        worker.kill()
        worker.join(timeout=5)


def parse_signals(names: str) -> tuple[int, ...]:
    """'SIGTERM,SIGUSR1' -> signal numbers; '' or 'none' -> ()."""
    if names.strip().lower() in ("", "none"):
        return ()
    try:
        return tuple(
            signal.Signals[n.strip().upper() if n.strip().upper().startswith("SIG") else "SIG" + n.strip().upper()]
            for n in names.split(",")
        )
    except KeyError as e:
        raise UsageError(f"--stop_signals {names}: unknown signal {e}; e.g. SIGTERM,SIGUSR1") from None


class StopOnSignal(TrainerCallback):
    """On a stop signal at any rank, every rank stops at the next step boundary (one all-reduce of a flag per
    step), the Trainer saves a checkpoint, and `stopped` names the signal. Installs the handlers at once, so that
    DataLoader workers forked later inherit them before their init ignores them.

    Also watches the launcher: a rank whose launcher died without a stop signal exits at once (EXIT_LAUNCHER_GONE)
    instead of training on unsupervised. Its last complete checkpoint stays usable."""

    def __init__(self, signals: tuple[int, ...], watch_launcher: bool = True, poll_s: float = 0.5):
        self.signals, self.received, self.stopped = signals, None, None
        self._wakeup_r = None
        if signals and threading.current_thread() is threading.main_thread():
            r, w = os.pipe()
            os.set_blocking(r, False)
            os.set_blocking(w, False)
            if signal.set_wakeup_fd(w, warn_on_full_buffer=False) == -1:
                self._wakeup_r = r  # the C-level handler writes here at once, even while Python is busy in C
            for s in signals:
                signal.signal(s, self._on_signal)
        if watch_launcher and os.environ.get("LOCAL_RANK") is not None and Path("/proc").is_dir():
            threading.Thread(target=self._watch_launcher, args=(poll_s,), daemon=True, name="launcher-watch").start()

    def _on_signal(self, signum, frame):
        if self.received is None:
            self.received = signum
            print(
                f"[rank {_rank()}] {signal.Signals(signum).name}: stopping after this step, with a checkpoint",
                file=sys.stderr,
                flush=True,
            )

    def _signal_seen(self) -> bool:
        if self.received is not None:
            return True
        if self._wakeup_r is not None:
            try:
                return bool(os.read(self._wakeup_r, 64))
            except BlockingIOError:
                return False
        return False

    def _watch_launcher(self, poll_s: float) -> None:
        # The deepspeed command runs launch.py, which runs the ranks: killing the command alone leaves launch.py
        # and the ranks running (measured), so watch the grandparent too. torchrun and accelerate are the parent.
        parent = os.getppid()
        chain = [parent]
        if b"deepspeed.launcher.launch" in _read_proc(parent, "cmdline"):
            chain.append(_ppid(parent))
        while True:
            time.sleep(poll_s)
            if self._signal_seen():
                return  # a stop is under way: it saves and exits on its own, whatever the launcher does
            if os.getppid() != parent or (len(chain) > 1 and _ppid(parent) != chain[1]):
                print(
                    f"[rank {_rank()}] launcher (pid {chain[-1]}) is gone: exiting, the last complete checkpoint "
                    "stays usable",
                    file=sys.stderr,
                    flush=True,
                )
                os._exit(EXIT_LAUNCHER_GONE)

    def on_step_end(self, args, state, control, **kwargs):
        _inject_signal_faults(state.global_step)
        if self.signals and _any_true(self._stop_requested(), args.device) and state.global_step < state.max_steps:
            # (at max_steps the run ends and saves anyway: finished, not preempted)
            self.stopped = self.received or "a signal on another rank"
            control.should_save = control.should_training_stop = True
        return control

    def _stop_requested(self) -> bool:
        # a call of its own: CPython runs pending signal handlers on entering a function, so a signal this rank
        # sent itself just before is seen here, deterministically
        return self.received is not None

    def describe(self) -> str:
        return self.stopped if isinstance(self.stopped, str) else signal.Signals(self.stopped).name


def _inject_signal_faults(step: int) -> None:
    for action, send in (
        ("signal_at_step", lambda s: os.kill(os.getpid(), s)),
        ("signal_group_at_step", lambda s: os.killpg(os.getpgid(0), s)),
    ):
        spec = fault(action, step)
        if spec:
            send(parse_signals(spec["value"] or "SIGTERM")[0])


def _read_proc(pid: int, name: str) -> bytes:
    try:
        return Path(f"/proc/{pid}/{name}").read_bytes()
    except OSError:
        return b""


def _ppid(pid: int) -> int:
    stat = _read_proc(pid, "stat")
    return int(stat.rsplit(b")", 1)[1].split()[1]) if stat else -1


# --- a finished run stays finished ---


def finished_message(checkpoint: str | None, max_steps: int) -> str | None:
    """A message when `checkpoint` has already reached max_steps (re-running would train past the end)."""
    if checkpoint is None:
        return None
    step = checkpoint_step(checkpoint)
    if step < max_steps:
        return None
    return (
        f"run finished: {Path(checkpoint).name} reached step {step} of --max_steps {max_steps}; nothing to do "
        f"(raise --max_steps to train on)"
    )


def resume_hint(output_dir: str, signame: str, step: int) -> str:
    argv = " ".join(a for a in sys.argv[1:])
    again = "" if "--resume_from_checkpoint" in argv else " --resume_from_checkpoint latest"
    return (
        f"stopped by {signame} at step {step}: checkpoint-{step} saved in {output_dir}; resumable: re-run the same "
        f"command{again and ' with' + again} (exit code {EXIT_PREEMPTED})"
    )
