"""Peak memory of a piece of work: resident memory on CPU (Linux), the caching allocator's count on CUDA.

On CPU the peak is the process's VmHWM, reset to the current resident size through /proc/self/clear_refs just
before the work. glibc keeps freed blocks below its mmap threshold for reuse, so that resident memory tracks
what the allocator caches rather than what torch holds; a process measured this way starts with a fixed
threshold (`mmap_threshold_env`), which glibc reads only at process start.
"""

from __future__ import annotations

MMAP_THRESHOLD = "MALLOC_MMAP_THRESHOLD_"


def mmap_threshold_env(nbytes: int = 1 << 20) -> dict[str, str]:
    """The environment variable that makes glibc serve every block of `nbytes` or more with mmap and return it
    to the system on free; give it to the measured process when it starts."""
    return {MMAP_THRESHOLD: str(nbytes)}


def rss_mib(field: str = "VmRSS") -> float:
    """A memory figure of this process from /proc/self/status (VmRSS, VmHWM, VmData...), in MiB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def reset_peak_rss() -> float:
    """Reset the peak resident size (VmHWM) to the current one and return that, in MiB."""
    with open("/proc/self/clear_refs", "w") as f:  # "5" resets the peak RSS to the current RSS
        f.write("5")
    return rss_mib("VmRSS")


def peak_extra_mib(work, device=None) -> float:
    """Run `work()` once; return the peak memory above the level before it, in MiB (CUDA: allocated on
    `device`; otherwise: this process's resident memory)."""
    import torch

    if device is not None and torch.device(device).type == "cuda":
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        work()
        torch.cuda.synchronize()
        return (torch.cuda.max_memory_allocated() - base) / 2**20
    base = reset_peak_rss()
    work()
    return rss_mib("VmHWM") - base


def forked_peak_mib(work, limit_mib: float = 2048) -> tuple[str, float]:
    """Run `work()` in a forked child whose address space may grow by at most `limit_mib` (RLIMIT_AS, so that a
    runaway allocation fails there with a MemoryError instead of taking the machine's memory); return (its outcome,
    its peak resident memory above the level at the fork, in MiB). The outcome is "ok", the one-line message of a
    DiscoClipError (a skip's reason), or "Name: message" of any other exception (e.g. "MemoryError: "). Linux only:
    the child resets its peak through /proc/self/clear_refs, as `peak_extra_mib` does."""
    import gc
    import json
    import os
    import resource
    import sys

    read, write = os.pipe()
    gc.freeze()  # the parent's objects out of the child's collections: a collection would touch (copy) their pages
    pid = os.fork()
    if pid == 0:  # the child: measure, report through the pipe, exit without running the parent's cleanup
        os.close(read)
        outcome, extra = "ok", float("nan")
        try:
            if "torch" in sys.modules:  # OpenMP's thread team does not survive a fork: a parallel op in the child
                sys.modules["torch"].set_num_threads(1)  # would wait at its barrier forever; one thread runs inline
            resource.setrlimit(resource.RLIMIT_AS, (int((rss_mib("VmSize") + limit_mib) * 2**20),) * 2)
            base = reset_peak_rss()
            try:
                work()
            except Exception as error:  # the outcome is what is measured
                from disco_clip_ds.errors import DiscoClipError

                name = "" if isinstance(error, DiscoClipError) else f"{type(error).__name__}: "
                outcome = f"{name}{error}".splitlines()[0] if f"{name}{error}" else type(error).__name__
            extra = rss_mib("VmHWM") - base
        finally:
            os.write(write, json.dumps([outcome, extra]).encode())
            os._exit(0)
    gc.unfreeze()
    os.close(write)
    with os.fdopen(read, "rb") as pipe:
        report = pipe.read()
    _, status = os.waitpid(pid, 0)
    if not report:
        raise RuntimeError(f"the measured child died without a report (wait status {status})")
    outcome, extra = json.loads(report)
    return outcome, extra
