"""Deterministic fault injection for the tests: faults fire at named points of the code, never by timing.

One environment variable names them, entries separated by ';':

    DISCO_FAULT="ACTION[=VALUE]:KEY=N,KEY=N;ACTION[=VALUE]:KEY=N"

An entry fires at its point when every KEY=N holds there: `step` (the optimizer step), `shard` (a download shard),
`rank` (this process's training rank), `attempt` (torchrun's restart count, TORCHELASTIC_RESTART_COUNT: 0 on the
first start and counted per node, so that a fault does not fire again in the workers an elastic launch restarts on
that node; inside a Spark task, the task's attempt number: 0 the first time, 1 when Spark runs it again). A VALUE
holds no ':' or ';'. The actions, by point:

In a training rank's checkpoint save (`train/checkpointing.py`), after the model and DeepSpeed files are written
and before the RNG and Trainer state:
    kill_in_save:step=N[,rank=R]        SIGKILL to this rank
At each DeepSpeed file write of a save (checkpoint or final; rank 0's model states, every rank's optimizer shard), in
the middle of DeepSpeed's collectives:
    enospc_in_save:step=N[,rank=R]      an OSError ENOSPC, as a full disk raises it (with rank=R: on that rank alone)
Before a save (checkpoint or final), in the free-space check of every rank:
    disk_free_mib=M:step=N              the check sees M MiB free
In the final save (`train/checkpointing.py`), after the final weights are written and before the Trainer state and the
manifest:
    kill_in_final_save[:rank=R]         SIGKILL to this rank
During start-up, at stage S (`distributed/startup.py`; no stage: the first, 0):
    signal_at_startup[=SIG][:stage=S][,rank=R]  SIGTERM (or SIG) to this rank; the stages, in their order:
        0  the arguments parsed, the process group joined (`commands/train.py`)
        1  every argument validated, output_dir not locked yet (`train/run.py`)
        2  output_dir's run lock held (`train/run.py`)
        3  DeepSpeed's comm up, its /dev/shm buffers still named (`startup.start_deepspeed_comm`)
        4  the model and the data built, the Trainer (whose stop handlers take over) not yet (`train/run.py`)
At the end of a training step (`distributed/preemption.py`):
    signal_at_step[=SIG]:step=N[,rank=R]        SIGTERM (or SIG) to this rank
    signal_group_at_step[=SIG]:step=N[,rank=R]  the same to this rank's process group, as SLURM sends it
    kill_worker_at_step:step=N[,rank=R]         SIGKILL to this rank's first DataLoader worker, as the kernel's
                                                out-of-memory killer sends it
At the end of each in-training evaluation (`eval/callback.py`: the zero-shot set, its EMA, the suite), after its
forwards, before the ranks agree on whether it succeeded:
    fail_in_eval:step=N[,rank=R]        a RuntimeError on this rank (with rank=R: on that rank alone)
In the download worker of shard K (`data/prep/download.py`):
    exit_before:shard=K                 the worker process ends (exit code 3) before the shard starts, as a crashed
                                        executor would
    hold_after=FILE:shard=K             once the shard is written, the worker writes its pid to FILE and stops itself
                                        (SIGSTOP), so that a test can kill the run in a known state
In `disco-clip data embed` (`data/prep/embed.py`), once the sidecar of shard K (its index in --shards) is written:
    kill_after_sidecar:shard=K          SIGKILL to the embedding process (kill -9)
In `disco-clip data filter` (`data/curate/pipeline.py`), once output shard K is complete:
    kill_after_output:shard=K           SIGKILL to the filter's worker processes, then to the filter itself (kill -9)
    hold_after_output=FILE:shard=K      the filter writes its pid to FILE and stops itself (SIGSTOP), so that a test
                                        can kill its process group in a known state
In the task that writes the filter's output shard K (`data/curate/reshard.py`: a --processes worker, a Spark
executor's Python worker), once its tar is written to its temporary file and before the rename:
    kill_in_write[=executor]:shard=K[,attempt=A]  SIGKILL to the process running the task; with =executor, first to
                                        its Spark executor (the nearest `java` process above it), as a lost machine
"""

from __future__ import annotations

import errno
import logging
import os
import signal
import sys
from dataclasses import dataclass, field
from pathlib import Path

logger = logging.getLogger("disco_clip_ds.faults")
ENV = "DISCO_FAULT"


@dataclass(frozen=True)
class Fault:
    """One DISCO_FAULT entry: its action, its VALUE ('' when none) and the conditions for it to fire."""

    action: str
    value: str = ""
    where: dict[str, int] = field(default_factory=dict)


def parse(text: str) -> list[Fault]:
    """The entries of a DISCO_FAULT value."""
    faults = []
    for entry in filter(None, (e.strip() for e in text.split(";"))):
        head, _, conditions = entry.partition(":")
        action, _, value = head.partition("=")
        where = dict(c.split("=", 1) for c in conditions.split(",") if c)
        faults.append(Fault(action, value, {key: int(n) for key, n in where.items()}))
    return faults


def fault(action: str, **at: int) -> Fault | None:
    """The DISCO_FAULT entry for `action` whose conditions all hold at this point (`at`: step=..., shard=...), else
    None. A condition on `rank` is checked against this process's training rank."""
    for candidate in parse(os.environ.get(ENV, "")):
        if candidate.action == action and all(_holds(key, n, at) for key, n in candidate.where.items()):
            return candidate
    return None


def _holds(key: str, n: int, at: dict[str, int]) -> bool:
    if key == "rank":
        return _rank() == n
    if key == "attempt":
        return _attempt() == n
    return at.get(key) == n


def _attempt() -> int:
    """Inside a Spark task its attempt number, else torchrun's restart count (0 without either). pyspark is asked
    only where it is imported already: a Spark Python worker has it, no other process needs it."""
    if "pyspark" in sys.modules:
        from pyspark import TaskContext

        context = TaskContext.get()
        if context is not None:
            return context.attemptNumber()
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT") or 0)


# --- the points ---


def in_save(step: int) -> None:
    """The point inside a checkpoint save: kill_in_save."""
    if fault("kill_in_save", step=step):
        _kill(f"inside the save of step {step}")


def in_deepspeed_write(step: int) -> None:
    """The point at each DeepSpeed file write of a save: enospc_in_save."""
    if fault("enospc_in_save", step=step):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), f"({ENV})")


def in_final_save(step: int) -> None:
    """The point inside the final save, weights written, Trainer state and manifest not: kill_in_final_save."""
    if fault("kill_in_final_save"):
        _kill(f"inside the final save (step {step})")


def _rank() -> int:
    """This process's training rank (0 outside a process group), asked of torch itself: faults sit below
    distributed/ (whose StopOnSignal calls them), and torch is imported here only when asked, so the download
    workers, which never ask for a rank, do not import it."""
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _kill(where: str) -> None:
    logger.warning("%s: killing rank %d %s", ENV, _rank(), where)
    os.kill(os.getpid(), signal.SIGKILL)


def forced_free_bytes(step: int) -> int | None:
    """What the free-space check before the save of `step` is to see (disk_free_mib), or None: measure it."""
    forced = fault("disk_free_mib", step=step)
    return int(forced.value) * 2**20 if forced else None


def at_step_end(step: int) -> None:
    """The point at the end of a training step: signal_at_step, signal_group_at_step, kill_worker_at_step."""
    if fault("kill_worker_at_step", step=step):
        import multiprocessing

        workers = multiprocessing.active_children()  # a rank's children are its DataLoader workers
        logger.warning("%s: killing DataLoader worker %s of rank %d at step %d", ENV, workers[0].pid, _rank(), step)
        os.kill(workers[0].pid, signal.SIGKILL)
    for action, send in (
        ("signal_at_step", lambda s: os.kill(os.getpid(), s)),
        ("signal_group_at_step", lambda s: os.killpg(os.getpgid(0), s)),
    ):
        spec = fault(action, step=step)
        if spec:
            name = (spec.value or "SIGTERM").upper()
            send(signal.Signals[name if name.startswith("SIG") else "SIG" + name])


def after_eval(step: int) -> None:
    """The point at the end of an in-training evaluation: fail_in_eval."""
    if fault("fail_in_eval", step=step):
        raise RuntimeError(f"{ENV}: fail_in_eval at step {step} on rank {_rank()}")


def before_shard(shard: int) -> None:
    """The point before a download worker starts shard `shard`: exit_before."""
    if fault("exit_before", shard=shard):
        os._exit(3)


def after_shard(shard: int) -> None:
    """The point after a download worker wrote shard `shard`: hold_after."""
    _hold(fault("hold_after", shard=shard))


def _hold(spec: Fault | None) -> None:
    """A hold: this process's pid written to the entry's FILE, then SIGSTOP to itself."""
    if spec:
        Path(spec.value).write_text(str(os.getpid()))
        os.kill(os.getpid(), signal.SIGSTOP)


def after_output_shard(shard: int) -> None:
    """The point after the filter's output shard `shard` is complete: kill_after_output kills the filter and its
    workers, as `kill -9` of the whole job would."""
    if fault("kill_after_output", shard=shard):
        import multiprocessing

        for child in multiprocessing.active_children():
            os.kill(child.pid, signal.SIGKILL)
        logger.warning("%s: killing the filter after output shard %d", ENV, shard)
        os.kill(os.getpid(), signal.SIGKILL)
    _hold(fault("hold_after_output", shard=shard))


def in_output_write(shard: int) -> None:
    """The point inside the task writing the filter's output shard `shard`, its tar staged, not renamed yet:
    kill_in_write."""
    spec = fault("kill_in_write", shard=shard)
    if spec is None:
        return
    if spec.value == "executor":
        executor = _java_ancestor()
        logger.warning("%s: killing the executor (pid %s) writing output shard %d", ENV, executor, shard)
        if executor is not None:
            os.kill(executor, signal.SIGKILL)
    logger.warning("%s: killing the process writing output shard %d", ENV, shard)
    os.kill(os.getpid(), signal.SIGKILL)


def _java_ancestor() -> int | None:
    """The nearest process above this one whose command is `java` (a Spark Python worker's executor), or None."""
    pid = os.getppid()
    while pid > 1:
        with open(f"/proc/{pid}/stat") as stat:  # "PID (COMM) STATE PPID ...": COMM may hold spaces
            text = stat.read()
        if text[text.index("(") + 1 : text.rindex(")")] == "java":
            return pid
        pid = int(text[text.rindex(")") + 2 :].split()[1])
    return None


def after_sidecar(shard: int) -> None:
    """The point after `data embed` wrote the sidecar of shard `shard` (its index in --shards): kill_after_sidecar."""
    if fault("kill_after_sidecar", shard=shard):
        _kill(f"after the sidecar of shard {shard}")
