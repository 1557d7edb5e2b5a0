"""`disco-clip` command line: argparse subcommands and dispatch only.

Each command lives in its own module as `main(argv)` with its own parser, imported only when the command runs, so
that `disco-clip --help` and `disco-clip data --help` answer without importing torch. A command raises the package's
errors; `errors.run_main` turns them into a message and an exit code (listed in errors.py).
"""

from __future__ import annotations

import argparse
import copy
import difflib
import importlib
import re
import runpy
import sys
from pathlib import Path

from disco_clip_ds.errors import UsageError, run_main

# (group or None, name) -> (module or bench script, function, one-line help)
COMMANDS = {
    (None, "train"): ("disco_clip_ds.commands.train", "main", "train CLIP or SigLIP with the distributed loss"),
    ("data", "download"): ("disco_clip_ds.commands.data", "download_main", "download a dataset to shards"),
    ("data", "metadata"): ("disco_clip_ds.commands.data", "metadata_main", "fetch parquet metadata from the HF hub"),
    ("data", "verify"): ("disco_clip_ds.commands.data", "verify_main", "check shards, write sizes.json"),
    ("data", "embed"): ("disco_clip_ds.commands.data", "embed_main", "a teacher's embeddings of shards, stored once"),
    ("data", "filter"): ("disco_clip_ds.commands.data", "filter_main", "curate shards: CLIP score, clusters, dedup"),
    ("data", "demo"): ("disco_clip_ds.commands.data", "demo_main", "build the offline digits demo dataset"),
    (None, "eval"): ("disco_clip_ds.commands.eval", "main", "zero-shot classification / retrieval eval"),
    (None, "export"): ("disco_clip_ds.commands.export", "main", "checkpoint -> plain CLIPModel folder with model card"),
    (None, "push"): ("disco_clip_ds.commands.push", "main", "upload an exported folder to the HF hub"),
    (None, "plan"): ("disco_clip_ds.commands.plan", "main", "validate a DeepSpeed config; per-GPU memory and traffic"),
    (None, "slurm-launch"): ("disco_clip_ds.commands.slurm_launch", "main", "start this node's launcher from SLURM"),
    (None, "node-check"): ("disco_clip_ds.commands.node_check", "main", "check a node's hostfile and node rank"),
    ("bench", "loss"): ("bench/loss/loss_bench.py", None, "benchmark loss memory and time (naive/disco/tiled)"),
    ("bench", "train"): ("bench/train/train_bench.py", None, "benchmark training throughput per loss"),
}
GROUPS = {"data": "datasets", "bench": "benchmarks (source checkout only)"}


def group_help(group: str) -> str:
    """A command group's one line, naming its commands ("datasets: download, metadata, ..."), from COMMANDS."""
    verbs = [name for (where, name) in COMMANDS if where == group]
    return f"{GROUPS[group]}: {', '.join(verbs)}"


def did_you_mean(word: str, choices) -> str:
    """'; did you mean X?' for the choice nearest to `word` (difflib: Python 3.14's argparse suggest_on_error does this
    for commands; this package runs on 3.11), or '' when none is near."""
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f"; did you mean {close[0]}?" if close else ""


def unknown_option_problem(parser: argparse.ArgumentParser, unknown: list[str]) -> str | None:
    """'unknown option --X; did you mean --Y?' for the first option-like word of `unknown` (what `parse_known_args`
    left), or None when it holds none."""
    flags = [word.split("=", 1)[0] for word in unknown if word.startswith("-") and len(word) > 1]
    if not flags:
        return None
    return f"unknown option {flags[0]}{did_you_mean(flags[0], parser._option_string_actions)}"


def _suggestion(parser: argparse.ArgumentParser, message: str) -> str:
    """What argparse's `message` lacks: the nearest command to an invalid choice, the nearest option to an
    unrecognized one."""
    choice = re.search(r"invalid choice: '([^']*)' \(choose from (.*)\)", message)
    if choice:
        return did_you_mean(choice.group(1), re.findall(r"'([^']*)'", choice.group(2)))
    unrecognized = re.match(r"unrecognized arguments: (.*)", message)
    flags = (
        [word.split("=", 1)[0] for word in unrecognized.group(1).split() if word.startswith("-")]
        if unrecognized
        else []
    )
    return did_you_mean(flags[0], parser._option_string_actions) if flags else ""


def suggest_on_error(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """`parser` (any ArgumentParser, HfArgumentParser's included), its usage errors ending in "did you mean X?" where
    a command or option is near the mistyped one; returns `parser`."""
    error = parser.error
    parser.error = lambda message: error(message + _suggestion(parser, message))
    return parser


class ArgumentParser(argparse.ArgumentParser):
    """argparse's parser with `suggest_on_error`: every command's, and each command group's subparsers."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        suggest_on_error(self)


class DefaultsOnce(argparse.ArgumentDefaultsHelpFormatter):
    """The `--help` formatter of every command (HfArgumentParser's included, which would otherwise take argparse's
    ArgumentDefaultsHelpFormatter): each option's default stated once. argparse's "(default: X)" follows the help
    unless the help states the default in its own words ("(default: the model config's)" says more than the None
    behind it), or there is nothing to state: a required option, a default of None, a flag that takes no value."""

    _STATED = re.compile(r"(?:^|[(;,]\s*)defaults?\b", re.IGNORECASE)  # "(default: ...", "...; default: ..."

    def _get_help_string(self, action: argparse.Action) -> str | None:
        return super()._get_help_string(action) if self._states_default(action) else action.help

    def _format_action(self, action: argparse.Action) -> str:
        if not action.help and self._states_default(action):  # argparse states no default for an option without help
            action = copy.copy(action)
            action.help = "(default: %(default)s)"
        return super()._format_action(action)

    def _states_default(self, action: argparse.Action) -> bool:
        return not (
            action.required
            or action.default is None
            or action.default is argparse.SUPPRESS
            or action.nargs == 0
            or self._STATED.search(action.help or "")
        )


def build_parser() -> argparse.ArgumentParser:
    """The command tree. A command's own arguments are left unparsed here (its module parses them), so each
    command is a subparser without options of its own: `--help` after it reaches the module's parser."""
    parser = ArgumentParser(
        prog="disco-clip",
        description="DisCo-CLIP training with HF transformers and DeepSpeed",
        epilog="`disco-clip COMMAND --help` lists a command's arguments",
    )
    commands = parser.add_subparsers(title="commands", metavar="COMMAND", required=True)
    groups = {}
    for (group, name), (target, func, help_) in COMMANDS.items():
        if group is None:
            where = commands
        elif group in groups:
            where = groups[group]
        else:
            group_parser = commands.add_parser(group, help=group_help(group), description=group_help(group))
            where = groups[group] = group_parser.add_subparsers(title="commands", metavar="COMMAND", required=True)
        leaf = where.add_parser(name, help=help_, add_help=False, prefix_chars="\0")
        leaf.add_argument("argv", nargs="*")  # prefix_chars NUL: every word, -h and --flags included, is an argument
        leaf.set_defaults(target=target, func=func, prog=" ".join(filter(None, ("disco-clip", group, name))))
    return parser


def _script(rel_path: str):
    """`main(argv)` of a benchmark script in the repo's bench/ folder (not part of the installed package)."""

    def run(argv: list[str]) -> None:
        script = Path(__file__).resolve().parents[1] / rel_path
        if not script.exists():
            raise UsageError(f"{rel_path} not found; bench commands need a source checkout (pip install -e .)")
        sys.argv = [str(script), *argv]
        runpy.run_path(str(script), run_name="__main__")

    return run


def main(argv: list[str] | None = None) -> int:
    """Parse the command words and run the command through `errors.run_main`; return its exit code."""
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    if args.func is None:
        command = _script(args.target)
    else:
        command = getattr(importlib.import_module(args.target), args.func)
    return run_main(command, args.argv, args.prog)


if __name__ == "__main__":
    sys.exit(main())
