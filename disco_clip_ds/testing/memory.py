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
