"""`disco-clip export CHECKPOINT_DIR OUTPUT_DIR [--eval_results FILE ...] [--processor_from DIR] [--ema]`: a
checkpoint (or a run folder: its final model or newest good checkpoint) -> a plain CLIPModel/SiglipModel folder with a
model card (disco_clip_ds.export.weights); --ema: the EMA of the weights that the run kept."""

from __future__ import annotations

import json

from disco_clip_ds.cli import ArgumentParser, DefaultsOnce
from disco_clip_ds.errors import UsageError
from disco_clip_ds.texts import read_text


def main(argv: list[str] | None = None) -> int:
    """Parse the arguments, export, print one line naming what was written; return 0."""
    from disco_clip_ds import compat
    from disco_clip_ds.distributed import startup
    from disco_clip_ds.export.weights import export_checkpoint

    compat.quiet_default_config_warnings()
    startup.cpu_accelerator_when_no_gpu()

    parser = ArgumentParser(
        formatter_class=DefaultsOnce, prog="disco-clip export", description=export_checkpoint.__doc__.split("\n")[0]
    )
    parser.add_argument("checkpoint_dir", help="Trainer checkpoint-N folder (or the run folder: its newest checkpoint)")
    parser.add_argument("output_dir", help="new or empty folder to write")
    parser.add_argument(
        "--eval_results", nargs="*", default=[], help="JSON files written by `disco-clip eval --output`"
    )
    parser.add_argument(
        "--processor_from", help="folder with tokenizer + image processor (default: the checkpoint or its parent)"
    )
    parser.add_argument(
        "--ema",
        action="store_true",
        help="export the EMA of the weights the run kept (--ema_decay); a run folder gives its newest checkpoint",
    )
    args = parser.parse_args(argv)
    records = [_read_eval_results(f) for f in args.eval_results]
    out = export_checkpoint(
        args.checkpoint_dir, args.output_dir, eval_metrics=records, processor_from=args.processor_from, ema=args.ema
    )
    print(f"exported {args.checkpoint_dir} -> {out}: {', '.join(sorted(p.name for p in out.iterdir()))}")
    return 0


def _read_eval_results(path: str) -> dict:
    text = read_text(path, "--eval_results")
    try:
        return json.loads(text)
    except ValueError as error:
        raise UsageError(f"--eval_results {path} is not a readable JSON file: {error}") from error
