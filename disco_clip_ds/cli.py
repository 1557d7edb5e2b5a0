"""`disco-clip` command line: parsing of the subcommand name and dispatch only.

Each subcommand lives in its own module as `main(argv) -> int | None`; it is imported only when
called so that `disco-clip --help` answers without importing torch.
"""

from __future__ import annotations

import importlib
import runpy
import sys
from pathlib import Path

# command -> (module, function, one-line help)
COMMANDS = {
    "train": ("disco_clip_ds.train", "main", "train a CLIP model under DeepSpeed with the distributed loss"),
    "data download": ("disco_clip_ds.data.prep", "download_main", "download a dataset to webdataset shards with img2dataset"),
    "data metadata": ("disco_clip_ds.data.prep", "metadata_main", "fetch parquet metadata from the HF hub"),
    "data verify": ("disco_clip_ds.data.prep", "verify_main", "check shards, write sizes.json"),
    "data demo": ("disco_clip_ds.data.demo", "main", "build the offline digits demo dataset"),
    "eval": ("disco_clip_ds.evaluate", "main", "zero-shot classification / retrieval eval"),
    "export": ("disco_clip_ds.export", "export_main", "checkpoint -> plain CLIPModel folder with model card"),
    "push": ("disco_clip_ds.export", "push_main", "upload an exported folder to the HF hub"),
    "plan": ("disco_clip_ds.plan", "main", "validate a DeepSpeed config; per-GPU memory and traffic plan"),
    "bench loss": ("bench/loss_bench.py", None, "benchmark loss memory and time (naive/disco/tiled)"),
    "bench train": ("bench/train_bench.py", None, "benchmark training throughput per loss"),
}


def _usage() -> str:
    lines = ["usage: disco-clip COMMAND [ARGS...]   (disco-clip COMMAND --help for its arguments)", "", "commands:"]
    lines += [f"  {name:<15} {help_}" for name, (_, _, help_) in COMMANDS.items()]
    return "\n".join(lines)


def _run_script(rel_path: str, argv: list[str]) -> int | None:
    # Benchmarks are scripts in the repo's bench/ folder, not part of the installed package.
    script = Path(__file__).resolve().parents[1] / rel_path
    if not script.exists():
        sys.exit(f"disco-clip: {rel_path} not found; bench commands need a source checkout (pip install -e .)")
    sys.argv = [str(script), *argv]
    runpy.run_path(str(script), run_name="__main__")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(_usage())
        return 0
    for words in (2, 1):
        name = " ".join(argv[:words])
        if name in COMMANDS:
            target, func, _ = COMMANDS[name]
            rest = argv[words:]
            if func is None:
                return _run_script(target, rest) or 0
            return getattr(importlib.import_module(target), func)(rest) or 0
    group = [n for n in COMMANDS if n.startswith(argv[0] + " ")]
    hint = f"; '{argv[0]}' takes one of: " + ", ".join(n.split()[1] for n in group) if group else ""
    print(f"disco-clip: unknown command '{' '.join(argv[:2])}'{hint}\n\n{_usage()}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
