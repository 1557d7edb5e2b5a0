"""The one schema of a benchmark's result rows, shared by every script under bench/ that writes a CSV.

Every row records what made it and how far to trust it:

- `command`: the command line that wrote the file (repository-relative);
- `commit`: the checked-out commit when the bench started, with `+dirty` when the tree had uncommitted changes;
- `machine`: the CPU model and core count, and the GPU's name where one was used;
- `rounds`: how many times each measured quantity was measured (an integer, or "not recorded" for a file written
  before this schema);
- `measured`: the names of the row's measured quantities, `;`-separated; each one `q` has the columns `q_min`,
  `q_median` and `q_max`, its spread over the rounds. A quantity that is computed, not measured (a plan, a count,
  a setting), is an ordinary column and not listed.

A comparison interleaves its sides in one invocation (A, B, A, B ... for `rounds` rounds, the same harness for both),
and its ratio is a measured quantity of its own: one ratio per round, against the other side of the same round.
"""

from __future__ import annotations

import csv
import os
import platform
import shlex
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SCHEMA = ("command", "commit", "machine", "rounds", "measured")
SPREAD = ("min", "median", "max")
NOT_RECORDED = "not recorded"


def spread(values, digits: int = 4) -> dict[str, float]:
    """min / median / max of one quantity's per-round values."""
    values = [float(v) for v in values]
    if not values:
        raise ValueError("a measured quantity needs at least one round")
    stats = (min(values), statistics.median(values), max(values))
    return {name: round(v, digits) for name, v in zip(SPREAD, stats)}


def bench_row(settings: dict, samples: dict[str, list], digits: int = 4) -> dict:
    """One result row: `settings` as they are, then each measured quantity's spread over its rounds (every
    quantity must have the same number of rounds)."""
    counts = {len(v) for v in samples.values()}
    if len(counts) > 1:
        counted = {k: len(v) for k, v in samples.items()}
        raise ValueError(f"measured quantities with different round counts: {counted}")
    row = dict(settings)
    row["rounds"] = counts.pop() if counts else 1
    row["measured"] = ";".join(samples)
    for name, values in samples.items():
        row.update({f"{name}_{stat}": v for stat, v in spread(values, digits).items()})
    return row


def ratios(side: list, base: list) -> list[float]:
    """Per-round ratios of one side to the other side of the same round (interleaved rounds)."""
    if len(side) != len(base):
        raise ValueError("ratios pair rounds: both sides need the same number")
    return [s / b for s, b in zip(side, base)]


def command_line(argv: list | None = None) -> str:
    """This process's command, as a user would type it from the repository root."""
    argv = list(sys.argv if argv is None else argv)
    script = Path(argv[0]).resolve() if argv else None
    if script is not None and script.is_relative_to(REPO):
        argv[0] = str(script.relative_to(REPO))
    return shlex.join(["python", *argv])


def commit() -> str:
    """The repository's commit (short), `+dirty` when tracked files have uncommitted changes."""
    git = ["git", "-C", str(REPO)]
    try:
        head = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True)
        status = subprocess.run([*git, "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True)
    except (OSError, subprocess.CalledProcessError):
        return "unknown (no git)"
    return head.stdout.strip() + ("+dirty" if status.stdout.strip() else "")


# Read when the bench starts (it imports this module first thing): the tree may change while a long run measures.
COMMIT_AT_START = commit()


def machine() -> str:
    """CPU model and core count (those this process may run on), and the GPU's name if torch sees one."""
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), model)
    except OSError:
        pass
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    described = f"{model}, {cores} cores"
    torch = sys.modules.get("torch")  # a bench that never imported torch ran no GPU work
    if torch is not None and torch.cuda.is_available():
        described += f", GPU {torch.cuda.get_device_name(0)} x {torch.cuda.device_count()}"
    return described


def write_rows(path, rows: list[dict], command: str | None = None, rounds: int | None = None) -> Path:
    """Write `rows` (from bench_row) to the CSV at `path`, each with the command, commit and machine; the columns
    are the union of the rows' in first-seen order, the schema's first. A row not made by bench_row (a computed
    result, or one whose script records its own spread) takes `rounds` and lists no measured quantity."""
    if not rows:
        raise ValueError(f"no rows to write to {path}")
    if rounds is None and any("rounds" not in row for row in rows):
        raise ValueError(f"rows for {path} without a round count: give rounds=")
    stamp = {"command": command or command_line(), "commit": COMMIT_AT_START, "machine": machine()}
    rows = [{**stamp, "rounds": rounds, "measured": "", **row} for row in rows]
    fields = list(SCHEMA)
    for row in rows:
        fields += [k for k in row if k not in fields]
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields, restval="")
        writer.writeheader()
        writer.writerows(rows)
    return path


def schema_problems(path) -> list[str]:
    """What keeps the CSV at `path` from following the schema; empty when it does."""
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        header = reader.fieldnames or []
        rows = list(reader)
    missing = [c for c in SCHEMA if c not in header]
    if missing:
        return [f"{path}: no column(s) {', '.join(missing)}"]
    problems = []
    for line, row in enumerate(rows, start=2):
        problems += [f"{path}:{line}: {row_problem}" for row_problem in _row_problems(row, header)]
    return problems


def _row_problems(row: dict, header: list) -> list[str]:
    problems = [f"empty {c}" for c in ("command", "commit", "machine", "rounds") if not (row[c] or "").strip()]
    rounds = (row["rounds"] or "").strip()
    if rounds and rounds != NOT_RECORDED and not (rounds.isdigit() and int(rounds) > 0):
        problems.append(f"rounds {rounds!r} is neither a positive count nor {NOT_RECORDED!r}")
    for name in filter(None, (row["measured"] or "").split(";")):
        columns = [f"{name}_{stat}" for stat in SPREAD]
        absent = [c for c in columns if c not in header]
        if absent:
            problems.append(f"measured {name} has no column(s) {', '.join(absent)}")
            continue
        try:
            low, mid, high = (float(row[c]) for c in columns)
        except (TypeError, ValueError):
            problems.append(f"measured {name}: min/median/max not numbers")
            continue
        if not low <= mid <= high:
            problems.append(f"measured {name}: min {low} <= median {mid} <= max {high} does not hold")
    return problems
