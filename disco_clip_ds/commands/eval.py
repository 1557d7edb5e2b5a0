"""`disco-clip eval`: zero-shot classification or retrieval of a model on one set (`--data`), printed (and written) as
CLIP_benchmark's result record, or a whole task list (`--tasks`, eval/suite.py) with its summary table. The arguments
are `EvalArguments` (HfArgumentParser); the work is eval/. Under torchrun the ranks split the work and rank 0 prints
and writes (`main`)."""

from __future__ import annotations

import contextlib
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path

from disco_clip_ds import compat
from disco_clip_ds.checkpoint.layout import TRAINER_STATE, has_weights, trainer_state, verify_model_folder
from disco_clip_ds.cli import DefaultsOnce, suggest_on_error, unknown_option_problem
from disco_clip_ds.data.shards import write_json
from disco_clip_ds.distributed.ranks import launched, process_group, rank
from disco_clip_ds.distributed.runlock import writer_lock
from disco_clip_ds.errors import CheckpointError, DataError, DiscoClipError, UsageError
from disco_clip_ds.eval.tasks import find_templates, open_eval_data, zeroshot_classification, zeroshot_retrieval
from disco_clip_ds.models.processor import declared_tokenizer_class, load_saved_tokenizer
from disco_clip_ds.models.source import check_model_source

logger = logging.getLogger("disco_clip_ds.eval")


@dataclass
class EvalArguments:
    model: str = field(metadata={"help": "exported model folder, Trainer checkpoint folder with weights, or hub id"})
    data: str | None = field(
        default=None,
        metadata={
            "help": "webdataset shards (a folder, CLIP_benchmark's wds layout, 'dir/{00000..00009}.tar', or sources "
            "joined by '::'), or a datasets dataset: a save_to_disk or parquet folder, a parquet/arrow/csv/json file, "
            "or a hub id"
        },
    )
    tasks: str | None = field(
        default=None,
        metadata={
            "help": "a task list (YAML, DataComp's tasklist.yml form; docs/evaluation.md) evaluated in one process "
            "instead of --data: --output is then a folder for each task's JSON and the summary table"
        },
    )
    run_dir: str | None = field(
        default=None, metadata={"help": "with --tasks: also log the main metrics as TensorBoard scalars here"}
    )
    task: str = field(
        default="zeroshot_classification", metadata={"choices": ["zeroshot_classification", "zeroshot_retrieval"]}
    )
    split: str | None = field(default=None, metadata={"help": "split of a datasets dataset (default: its only one)"})
    dataset_config_name: str | None = field(default=None, metadata={"help": "config of a datasets dataset"})
    image_column: str | None = field(
        default=None, metadata={"help": "datasets: the image column (default: the only Image column)"}
    )
    label_column: str | None = field(
        default=None,
        metadata={"help": "datasets, zeroshot_classification: the class column (default: the only ClassLabel)"},
    )
    caption_column: str | None = field(
        default=None,
        metadata={
            "help": "datasets, zeroshot_retrieval: a string or list of strings per image (default: the only such "
            "column)"
        },
    )
    classnames: str | None = field(
        default=None,
        metadata={
            "help": "class names file or 'imagenet1k' (default: classnames.txt beside the shards, or a datasets "
            "ClassLabel's names)"
        },
    )
    templates: str | None = field(
        default=None, metadata={"help": "templates file or 'openai_imagenet' (default: beside the shards, or OpenAI's)"}
    )
    batch_size: int = field(default=64)
    output: str | None = field(
        default=None,
        metadata={"help": "write the CLIP_benchmark-style JSON here too (with --tasks: a folder for all of it)"},
    )
    device: str = field(default="cpu", metadata={"help": "torch device, e.g. cpu or cuda"})
    max_num_patches: int | None = field(
        default=None,
        metadata={"help": "SigLIP 2 (NaFlex): the patch budget per image (default: the model's processor's)"},
    )


def load_for_eval(model_id: str, device: str = "cpu"):
    """(CLIPModel or SiglipModel, tokenizer, image processor) from a folder or hub id, with transformers alone. A
    folder without full weights, or one transformers cannot read, is a UsageError saying what to pass instead; a
    checkpoint, final or exported model whose files do not match its manifest is refused as `disco-clip export`
    refuses it (a CheckpointError naming a checkpoint that verifies), and weights that safetensors cannot read
    (cut short, with no manifest to say so first) are a CheckpointError too."""
    from safetensors import SafetensorError
    from transformers import AutoImageProcessor, AutoModel

    compat.quiet_default_config_warnings()  # from_pretrained logs the config: SigLIP's would warn about default ids
    folder = Path(model_id).expanduser()
    check_model_path(model_id)
    if folder.is_dir() and not has_weights(folder):
        hint = "a DeepSpeed checkpoint without full weights (ZeRO-3): " if (folder / "latest").is_file() else ""
        raise UsageError(
            f"no model weights in '{folder}' ({hint}run `disco-clip export {folder} OUT_DIR` and evaluate OUT_DIR)"
        )
    verify_model_folder(model_id, "--model")
    try:
        model = AutoModel.from_pretrained(model_id).to(device)
        return model, _tokenizer(model_id), AutoImageProcessor.from_pretrained(model_id)
    except OSError as e:  # no such folder or hub id, or one without the config / processor files
        raise UsageError(f"--model {model_id}: {e}") from e
    except SafetensorError as e:
        raise CheckpointError(f"--model {model_id}: its weights cannot be read ({e}): a damaged or partial copy") from e


def _tokenizer(model_id: str):
    """The tokenizer as transformers' AutoTokenizer loads it, which is the run's own for a folder this version saved
    (models/processor.py). A folder saved before that, whose tokenizer AutoTokenizer loads as another class than the
    one it was saved as, is evaluated with the saved class, and a warning says to re-export it."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_id)
    declared = declared_tokenizer_class(model_id) if Path(model_id).expanduser().is_dir() else None
    if declared and type(tokenizer).__name__.removesuffix("Fast") != declared.removesuffix("Fast"):
        logger.warning(
            "%s: AutoTokenizer loads %s, but the tokenizer was saved as %s: evaluating with %s; re-export the folder "
            "with this version so that AutoTokenizer, AutoProcessor and pipelines load it too",
            model_id,
            type(tokenizer).__name__,
            declared,
            declared,
        )
        tokenizer = load_saved_tokenizer(Path(model_id).expanduser())
    return tokenizer


def set_budget(model, image_processor, max_num_patches: int) -> None:
    """Evaluate a SigLIP 2 at `max_num_patches` patches per image, at least one: its processor's budget. Any budget
    fits the model, which resizes its position-embedding grid to each image's patch rows and columns as transformers'
    Siglip2 does; a one-line UsageError for another model."""
    if model.config.model_type != "siglip2":
        raise UsageError(f"--max_num_patches is SigLIP 2's (NaFlex); {model.config.model_type} models take none")
    if max_num_patches < 1:
        raise UsageError(f"--max_num_patches {max_num_patches}: give at least 1 (patches per image)")
    image_processor.max_num_patches = max_num_patches


def check_model_path(model_id: str) -> None:
    """A --model spelled as a path must be there, and a hub id needs the hub (models/source.py): otherwise
    transformers would retry the hub for half a minute, then say it could not connect."""
    check_model_source(model_id, "--model")


def run_eval(args: EvalArguments) -> dict:
    """Evaluate one set as the CLI does and return CLIP_benchmark's result record."""
    if args.batch_size <= 0:
        raise UsageError(f"--batch_size must be positive, got {args.batch_size}")
    if not args.data:
        raise UsageError("give --data (one set) or --tasks FILE (a task list)")
    check_model_path(args.model)  # before the data is opened: a missing input is refused before any work
    classify = args.task == "zeroshot_classification"
    data, classnames = open_eval_data(
        args.data,
        args.task,
        split=args.split,
        config=args.dataset_config_name,
        image_column=args.image_column,
        label_column=args.label_column,
        caption_column=args.caption_column,
        classnames=args.classnames,
    )
    templates = find_templates(args.data, args.templates) if classify else None
    model, tokenizer, image_processor = load_for_eval(args.model, args.device)
    if args.max_num_patches is not None:
        set_budget(model, image_processor, args.max_num_patches)
    if classify:
        metrics = zeroshot_classification(
            model, tokenizer, data, classnames, templates, image_processor=image_processor, batch_size=args.batch_size
        )
    else:
        metrics = zeroshot_retrieval(
            model, tokenizer, data, image_processor=image_processor, batch_size=args.batch_size
        )
    return {
        "dataset": args.data,
        "model": args.model,
        "pretrained": args.model,
        "task": args.task,
        "metrics": metrics,
        "language": "en",
    }


SINGLE_SET_FLAGS = ("data", "split", "dataset_config_name", "image_column", "label_column", "caption_column")


def run_tasks(args: EvalArguments) -> tuple[list, list[dict]]:
    """Evaluate a task list as the CLI does: the model and processor loaded once, every task run (a failing one
    recorded in its row), the table written to --output and the scalars to --run_dir. Returns (results, rows)."""
    from disco_clip_ds.eval.suite import check_output, load_tasks, log_tensorboard, run_suite, summary_rows, write_suite

    if args.batch_size <= 0:
        raise UsageError(f"--batch_size must be positive, got {args.batch_size}")
    given = [f"--{name}" for name in SINGLE_SET_FLAGS if getattr(args, name)]
    if given:  # each task names its own set, split and columns
        raise UsageError(f"--tasks FILE: {', '.join(given)} belong to a single set; name them in the task list")
    check_model_path(args.model)
    tasks = load_tasks(args.tasks)  # a malformed list is refused before the model loads
    if args.output:
        check_output(args.output)
    with output_lock(args.output, beside=False):  # one writer of the folder, before the model loads
        model, tokenizer, image_processor = load_for_eval(args.model, args.device)
        if args.max_num_patches is not None:
            set_budget(model, image_processor, args.max_num_patches)
        results = run_suite(tasks, model, tokenizer, image_processor, batch_size=args.batch_size, model_name=args.model)
        rows = write_suite(results, args.output) if args.output and rank() == 0 else summary_rows(results)
    if args.run_dir and rank() == 0:
        log_tensorboard(results, args.run_dir, _step_of(args.model))
    return results, rows


def output_lock(output: str | None, beside: bool):
    """The lock on --output for the block (every rank enters it; rank 0 holds it): the suite's folder, or (`beside`)
    the single set's record file, locked by a file beside it; nothing without --output."""
    if not output:
        return contextlib.nullcontext()
    return writer_lock(output, "--output", "disco-clip eval", beside=beside, every_rank=True)


def _step_of(model_id: str) -> int:
    """The optimizer step of a checkpoint folder (its trainer_state.json), for the TensorBoard scalars; else 0."""
    folder = Path(model_id).expanduser()
    return int(trainer_state(folder).get("global_step") or 0) if (folder / TRAINER_STATE).is_file() else 0


def suite_main(args: EvalArguments) -> int:
    """Print the suite's table; a failed task makes the exit code that of its error (errors.py's map: a missing
    folder or bad task field 2, an unreadable shard 1), after every task has run."""
    from disco_clip_ds.eval.suite import markdown

    results, rows = run_tasks(args)
    if rank() == 0:
        print(markdown(rows), end="")
        if args.output:
            print(f"each task's record and the table (suite.md) in {args.output}")
    failed = [r for r in results if r.error is not None]
    if failed:
        first = failed[0].error
        error = type(first) if isinstance(first, DiscoClipError) else DataError
        raise error(
            f"{len(failed)} of {len(results)} tasks failed ({', '.join(r.task.key for r in failed)}; each error is in "
            "its row of the table above)"
        )
    return 0


def launched_device(device: str) -> str:
    """Under torchrun, each rank's device: `cuda` is the GPU of its LOCAL_RANK."""
    _, world, local = launched()
    return f"cuda:{local}" if world > 1 and device == "cuda" else device


def main(argv: list[str] | None = None) -> int:
    """`disco-clip eval`: print (and optionally write) the result record, or a task list's table. Under torchrun
    the ranks join one process group and split the work (eval/spread.py); rank 0 prints and writes."""
    import torch
    from transformers import HfArgumentParser

    parser = suggest_on_error(HfArgumentParser(EvalArguments, prog="disco-clip eval", formatter_class=DefaultsOnce))
    problem = unknown_option_problem(parser, parser.parse_known_args(argv)[1])
    if problem:  # one line with the nearest known option, where HfArgumentParser lists the unknown ones
        raise UsageError(f"{problem} (`disco-clip eval --help` lists the arguments)")
    try:
        (args,) = parser.parse_args_into_dataclasses(args=argv)
    except ValueError as e:  # HfArgumentParser's word for argument names it does not know
        raise UsageError(f"{e} (`disco-clip eval --help` lists the arguments)") from e
    args.device = launched_device(args.device)
    with process_group(launched()[1], torch.device(args.device)):
        if args.tasks:
            return suite_main(args)
        with output_lock(args.output, beside=True):
            record = run_eval(args)
            if rank() == 0:
                print(json.dumps(record, indent=2))
                if args.output:
                    write_json(args.output, record)
    return 0
