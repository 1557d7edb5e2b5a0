"""The processes of a launched run: its process group (the launcher's session), waited for and killed, and the
training ranks under a launcher."""

from __future__ import annotations

import os
import signal
import time


def wait_group(pgid: int, timeout: float) -> None:
    """Wait until no live process is left in process group PGID (or TIMEOUT s)."""
    import psutil

    def members():
        found = []
        for p in psutil.process_iter():
            try:
                if os.getpgid(p.pid) == pgid and p.status() != psutil.STATUS_ZOMBIE:
                    found.append(p.pid)
            except (ProcessLookupError, psutil.Error):
                pass
        return found

    deadline = time.monotonic() + timeout
    while members() and time.monotonic() < deadline:
        time.sleep(0.2)


def kill_group(pgid: int) -> None:
    """SIGKILL every process of group PGID (none left: nothing to do)."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def descendants(pid: int) -> list:
    """The live descendants of PID (psutil processes; none when PID has ended)."""
    import psutil

    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return []


def kill_all(processes: list) -> None:
    """SIGKILL each of PROCESSES (psutil processes) still running."""
    import psutil

    for process in processes:
        try:
            process.kill()
        except psutil.Error:
            pass


def wait_gone(processes: list, timeout: float) -> None:
    """Wait up to TIMEOUT s for PROCESSES (psutil processes) to end."""
    import psutil

    psutil.wait_procs(processes, timeout=timeout)


def ranks_of(launcher_pid: int) -> list[int]:
    """pids of the training ranks under a launcher (children of any depth running disco_clip_ds.train)."""
    import psutil

    def facts(p) -> tuple[list[str], int]:  # a child may exit (or be a zombie) between listing and reading it
        try:
            return p.cmdline(), p.ppid()
        except psutil.Error:
            return [], -1

    launcher = psutil.Process(launcher_pid)
    if "disco_clip_ds.testing.zygote" in " ".join(facts(launcher)[0]):  # testing/forked.py: ranks forked by it
        return [p.pid for p in launcher.children()]
    children = {p.pid: facts(p) for p in launcher.children(recursive=True)}
    train = {
        pid: parent
        for pid, (command, parent) in children.items()
        if "disco_clip_ds.train" in " ".join(command) and "launch" not in " ".join(command[:4])
    }
    return [pid for pid, parent in train.items() if parent not in train]  # not their (forked) DataLoader workers


def alive(pids: list[int]) -> list[int]:
    """The PIDS still running (zombies are not)."""
    import psutil

    return [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
