"""A training rank exits with its code however its threads are busy (`preemption.exit_without_finalization`), in
fresh interpreters importing torch."""

import signal
import subprocess
import sys
import textwrap

import pytest

from disco_clip_ds.testing.launch import REPO

# A thread in a torch op (which releases the GIL in C++) when the interpreter finalizes: CPython ends it with
# pthread_exit, which aborts the process through the op's noexcept GIL guard, as gloo's worker threads can at a
# launched rank's exit. Deterministic enough: the thread spends nearly all its time inside the op.
_THREAD_IN_A_TORCH_OP_AT_EXIT = textwrap.dedent(
    """
    import sys, threading, time
    import torch

    def spin():
        a = torch.ones(64, 64)
        while True:
            a.mm(a)

    threading.Thread(target=spin, daemon=True).start()
    time.sleep(0.2)
    if sys.argv[1] == "without_finalization":
        import atexit
        from disco_clip_ds.distributed.preemption import exit_without_finalization

        atexit.register(print, "an atexit handler ran", flush=True)
        exit_without_finalization(75)
    sys.exit(75)
    """
)


def _exit_with_a_thread_in_torch(how: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", _THREAD_IN_A_TORCH_OP_AT_EXIT, how],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.slow  # six interpreters importing torch
def test_a_rank_exits_with_its_code_however_its_threads_are_busy():
    plain = [_exit_with_a_thread_in_torch("plain") for _ in range(3)]
    # the failure this avoids: an abort after the exit code was decided
    assert any(p.returncode == -signal.SIGABRT and "terminate called" in p.stderr for p in plain), plain
    for _ in range(3):
        done = _exit_with_a_thread_in_torch("without_finalization")
        assert done.returncode == 75 and "terminate" not in done.stderr, done.stderr
        assert "an atexit handler ran" in done.stdout
