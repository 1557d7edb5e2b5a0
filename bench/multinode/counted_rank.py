"""A training rank (`disco_clip_ds.train`, same arguments) that records, at the end of every optimizer step, the
bytes its own TCP sockets have sent so far, as the kernel counts them (`ss -ti`: bytes_sent), one JSON line per step
in $BENCH_BYTES_DIR/rank{RANK}.jsonl. Launched by multinode_bench.py in place of `-m disco_clip_ds.train`.

The kernel's count is independent of the planner's model: it is what gloo actually sent (its algorithm, its
headers, the store's traffic), where `disco_clip_ds.testing.wire.WireBytes` applies the planner's own ring formulas
at each call."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

from disco_clip_ds import faults
from disco_clip_ds.commands.train import main
from disco_clip_ds.errors import run_main

_OWNER = re.compile(r"pid=(\d+)")
_SENT = re.compile(r"bytes_sent:(\d+)")


def tcp_bytes_sent(pid: int) -> int:
    """Bytes sent so far by the TCP sockets that process PID holds (its DataLoader workers, forked after the process
    group was joined, hold the same sockets and never write to them)."""
    lines = subprocess.run(["ss", "-tinpH"], capture_output=True, text=True, check=True).stdout.splitlines()
    total, owned = 0, False
    for line in lines:
        if not line[:1].isspace():  # a socket's line: its owners; the indented line after it: its counters
            owned = str(pid) in _OWNER.findall(line)
        elif owned and (sent := _SENT.search(line)):
            total += int(sent.group(1))
    return total


def _recording(at_step_end):
    out = Path(os.environ["BENCH_BYTES_DIR"]) / f"rank{os.environ.get('RANK', '0')}.jsonl"

    def record(step: int) -> None:
        with out.open("a") as f:
            f.write(json.dumps({"step": step, "tcp_bytes_sent": tcp_bytes_sent(os.getpid())}) + "\n")
        at_step_end(step)

    return record


if __name__ == "__main__":
    faults.at_step_end = _recording(faults.at_step_end)  # the named point every rank passes at each step's end
    sys.exit(run_main(main, None, "disco-clip train"))
