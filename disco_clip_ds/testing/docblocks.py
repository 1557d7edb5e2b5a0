"""The shell command blocks of the user docs (docs/*.md and README.md), as the docs test runs them.

A block is a fenced block whose info string is `bash`, `sh` or `console` (in a `console` block only the lines
after a `$ ` prompt, and their `\\`-continued lines, are commands: the others are the output shown). An HTML
comment on the line just above the fence marks a block the test cannot run here, with the reason:

    <!-- docs-test: skip (needs a GPU) -->
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from disco_clip_ds.testing.launch import finish

SHELLS = ("bash", "sh", "console")
_FENCE = re.compile(r"^ {0,3}(`{3,}(?!.*`)|~{3,})\s*([\w+-]*)")  # CommonMark: no backtick after a backtick fence
_MARK = re.compile(r"^\s*<!--\s*docs-test:\s*skip\s*\((?P<reason>.+)\)\s*-->\s*$")


@dataclass(frozen=True)
class Block:
    """One shell block of a page: its first line's number (1-based, the fence's), the commands and, for a marked
    block, the reason it is skipped."""

    page: str
    line: int
    commands: str
    skip: str | None = None


def pages(repo: Path) -> list[Path]:
    """The user docs: README.md and docs/*.md, in name order."""
    return [p for p in [repo / "README.md", *sorted((repo / "docs").glob("*.md"))] if p.is_file()]


def blocks(path: Path, name: str | None = None) -> list[Block]:
    """The shell blocks of one Markdown page, in page order."""
    lines = path.read_text(encoding="utf-8").splitlines()
    found, i = [], 0
    while i < len(lines):
        match = _FENCE.match(lines[i])
        if not match:
            i += 1
            continue
        fence, lang = match.group(1), match.group(2).lower()
        end = next((j for j in range(i + 1, len(lines)) if lines[j].strip().startswith(fence)), len(lines))
        if lang in SHELLS:
            body = lines[i + 1 : end]
            mark = _MARK.match(lines[i - 1]) if i > 0 else None
            commands = "\n".join(_prompted(body) if lang == "console" else body)
            found.append(Block(name or path.name, i + 1, commands, mark.group("reason") if mark else None))
        i = end + 1
    return found


def _prompted(body: list[str]) -> list[str]:
    """The command lines of a console block: those after a `$ ` prompt and the lines they continue onto."""
    out, going_on = [], False
    for text in body:
        if text.startswith("$ ") or going_on:
            out.append(text[2:] if text.startswith("$ ") and not going_on else text)
            going_on = text.rstrip().endswith("\\")
    return out


def copy_checkout(repo: Path, to: Path) -> Path:
    """The files of REPO that git tracks or would track (its committed and its new, not ignored, files) copied to
    TO, with TO/.venv pointing at this interpreter's venv: a scratch checkout for the docs to run in."""
    listed = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=repo, capture_output=True, check=True
    ).stdout.decode()
    for name in filter(None, listed.split("\0")):
        if (repo / name).is_file():
            (to / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(repo / name, to / name)
    (to / ".venv").symlink_to(sys.prefix, target_is_directory=True)
    return to


def block_env(checkout: Path, **extra: str) -> dict:
    """The environment a block runs in: the checkout's venv first on PATH (`disco-clip`, `python`, `deepspeed`,
    `torchrun`), the checkout importable, offline, one thread per process (the ranks share the cores)."""
    venv_bin = str(checkout / ".venv" / "bin")
    return {
        **os.environ,
        "PATH": f"{venv_bin}:{os.environ.get('PATH', '')}",
        "PYTHONPATH": str(checkout),
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "NO_ALBUMENTATIONS_UPDATE": "1",
        "OMP_NUM_THREADS": "1",
        **extra,
    }


def run_block(block: Block, cwd: Path, env: dict, log: Path, timeout: float) -> int:
    """Run a block's commands with `bash -e -o pipefail` in CWD, in a session of its own (killed with every process
    it started once it ends or times out), its output appended to LOG; the exit code (124 past TIMEOUT)."""

    with open(log, "a") as out:
        out.write(f"\n$ # {block.page}:{block.line}\n{block.commands}\n")
        out.flush()
        proc = subprocess.Popen(
            ["bash", "-e", "-o", "pipefail", "-c", block.commands],
            cwd=cwd,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    try:
        return finish(proc, timeout, linger=30)
    except subprocess.TimeoutExpired:
        return 124
