"""Trainer/DeepSpeed checkpoint -> plain CLIPModel (or SiglipModel) folder with a model card (`card.py`); `hub.py`
uploads it.

An exported folder loads with transformers alone (`CLIPModel.from_pretrained`, `AutoProcessor.from_pretrained`, the
zero-shot pipeline): model.safetensors (fp32), config.json (architectures ["CLIPModel"]), the run's tokenizer and
image-processor files (pinned by models/processor.py, so that the Auto classes load what the run trained with) and
README.md recording how the model was trained and evaluated, and its usage. The weights come from
checkpoint/consolidate.py (also used to rewrite a final model); here they are checked finite before anything is
written.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from pathlib import Path

from disco_clip_ds.checkpoint.consolidate import build_plain_model, load_state_dict
from disco_clip_ds.checkpoint.ema import ema_files, read_ema_state_dict
from disco_clip_ds.checkpoint.final_model import final_model_problem
from disco_clip_ds.checkpoint.layout import (
    WEIGHT_FILES,
    checkpoint_folders,
    deepspeed_tag,
    has_weights,
    model_folder_problem,
    newest_complete,
    newest_complete_before,
)
from disco_clip_ds.checkpoint.manifest import MANIFEST
from disco_clip_ds.distributed.runlock import writer_lock
from disco_clip_ds.errors import CheckpointError, ExportError, UsageError
from disco_clip_ds.export.card import describe_run, eval_records, model_card
from disco_clip_ds.models.processor import load_saved_tokenizer, pin_tokenizer

logger = logging.getLogger("disco_clip_ds.export.weights")
TOKENIZER_FILES = ("tokenizer.json", "vocab.json", "tokenizer_config.json")
IMAGE_PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json")


# ------------------------------------------------------------------------------------------ checkpoint


def resolve_checkpoint(path: str | os.PathLike) -> Path:
    """The folder to export, verified. A run folder (one holding checkpoint-N folders) gives its final model, or
    when that is missing or does not verify its newest checkpoint that does, with one line for each one skipped and
    why. A Trainer checkpoint given by name must verify (`checkpoint_problem`), a folder of weights with a manifest
    must match it; one that does not is refused, naming the newest checkpoint beside it that does."""
    path = Path(path)
    if not path.exists():
        raise UsageError(f"checkpoint folder '{path}' does not exist")
    if not path.is_dir():
        raise UsageError(
            f"'{path}' is a file, not a checkpoint folder: pass the checkpoint-N folder (or the run folder) it is in"
        )
    holds_model = has_weights(path) or deepspeed_tag(path) is not None or (path / MANIFEST).is_file()
    if checkpoint_folders(path):  # a run folder
        return _final_or_newest(path, holds_model)
    if not holds_model:
        raise ExportError(
            f"'{path}' holds neither model weights ({', '.join(WEIGHT_FILES)}), a DeepSpeed checkpoint ('latest' "
            "file) nor complete checkpoint-N folders"
        )
    problem = model_folder_problem(path)  # a checkpoint, or an exported or final model against its manifest
    if problem:
        good = newest_complete_before(path)
        instead = f"the newest checkpoint beside it that verifies is {good}" if good else "none beside it verifies"
        raise ExportError(f"'{path}' does not verify: {problem}; {instead}")
    return path


def _final_or_newest(run_dir: Path, holds_model: bool) -> Path:
    if holds_model:
        problem = final_model_problem(run_dir)
        if problem is None:
            return run_dir
        logger.warning("skipping the final model in %s: %s", run_dir, problem)
    newest = newest_complete(run_dir)
    if newest is None:
        raise ExportError(f"'{run_dir}' holds no final model or checkpoint-N that verifies (see the lines above)")
    return newest


def _ema_checkpoint(path) -> Path:
    """The checkpoint whose EMA `export --ema` writes: `path` itself, or a run folder's newest complete checkpoint."""
    path = Path(path)
    if path.is_dir() and checkpoint_folders(path):
        newest = newest_complete(path)
        if newest is None:
            raise ExportError(f"'{path}' holds no checkpoint-N that verifies (see the lines above): no EMA to export")
        path = newest
    checkpoint = resolve_checkpoint(path)
    if not ema_files(checkpoint):
        raise UsageError(f"--ema: '{checkpoint}' holds no EMA of the weights; train with --ema_decay D to keep one")
    return checkpoint


def _with_ema(checkpoint: Path, state_dict: dict) -> tuple[dict, str]:
    """`state_dict` with every trained parameter replaced by its EMA, and what the card says the weights are."""
    try:
        averaged, settings = read_ema_state_dict(checkpoint)
    except (CheckpointError, OSError, ValueError, KeyError) as error:
        raise ExportError(f"cannot read the EMA in {checkpoint}: {error}") from error
    unknown = sorted(n for n in averaged if n not in state_dict or averaged[n].numel() != state_dict[n].numel())
    if unknown:
        raise ExportError(f"the EMA in {checkpoint} holds {unknown[0]}, which the model has not (of that size)")
    # the saved model's shapes: CLIP's logit_scale trains as a 1-vector (compat.adopt_vector_logit_scale)
    averaged = {name: value.reshape(state_dict[name].shape) for name, value in averaged.items()}
    described = f"the exponential moving average (EMA) of the weights, {ema_origin(settings)}, at {checkpoint.name}"
    return {**state_dict, **averaged}, described


def ema_origin(settings: dict) -> str:
    """Where an EMA (its saved settings) started and by which rule: averaging from step max(start_step, begun_at),
    begun_at being the step a run resumed at without an EMA (older EMA files lack it: from the start)."""
    warmup = ", with warmup" if settings.get("warmup") else ""
    begun = settings.get("begun_at", 0)
    first = max(settings["start_step"], begun)
    resumed = begun > settings["start_step"]
    why = f" (started when the run was resumed at step {begun} without an EMA)" if resumed else ""
    return f"decay {settings['decay']:g} from step {first}{why}{warmup} (timm ModelEmaV3's rule)"


# Trained CLIP weights are O(1) (logit_scale at most ln 100). Beyond 1e15 the dot product of two such rows over a
# hidden width of a few thousand comes within a few orders of magnitude of float32's limit (3.4e38): such weights come
# from a diverged run, and a model exported from them yields inf and NaN embeddings.
ABSURD_WEIGHT = 1e15


def check_weights(state_dict: dict, source: Path) -> None:
    """Refuse (one line naming the tensor) weights with NaN or inf, or of absurd magnitude (> ABSURD_WEIGHT)."""
    import torch

    for name, tensor in state_dict.items():
        if not torch.is_tensor(tensor) or not tensor.is_floating_point():
            continue
        bad = (~torch.isfinite(tensor)).sum().item()
        if bad:
            raise ExportError(
                f"weight '{name}' in {source} holds {bad} NaN or inf values of {tensor.numel()}: the run diverged "
                "before this checkpoint; export an earlier one"
            )
        peak = tensor.abs().max().item() if tensor.numel() else 0.0
        if peak > ABSURD_WEIGHT:
            raise ExportError(
                f"weight '{name}' in {source} reaches |w| = {peak:.3g} (trained CLIP weights are O(1); above "
                f"{ABSURD_WEIGHT:.0e} its products overflow float32): the run diverged; export an earlier checkpoint"
            )


def _processor_source(checkpoint: Path, processor_from: str | os.PathLike | None) -> Path:
    candidates = [Path(processor_from)] if processor_from else [checkpoint, checkpoint.parent]
    for folder in candidates:
        if any((folder / f).is_file() for f in TOKENIZER_FILES) and any(
            (folder / f).is_file() for f in IMAGE_PROCESSOR_FILES
        ):
            return folder
    raise ExportError(
        f"no tokenizer + image-processor files in {' or '.join(map(str, candidates))}: pass --processor_from DIR "
        "(a folder saved by CLIPProcessor/tokenizer.save_pretrained and CLIPImageProcessor.save_pretrained)"
    )


def _save_processor(source: Path, model_type: str, staging: Path) -> None:
    """The run's tokenizer and image processor into `staging`, as one processor, saved as training saves it (so the
    export holds the files transformers' processor `save_pretrained` writes, processor_config.json among them): the
    tokenizer as the class it was saved as (a folder saved before models/processor.py's pin reloads through
    AutoTokenizer as another class) and pinned, so that the export's Auto classes give the ids and the NaFlex budget
    the run trained with."""
    from transformers import AutoImageProcessor, CLIPProcessor, Siglip2Processor

    image_processor = AutoImageProcessor.from_pretrained(source)
    tokenizer = pin_tokenizer(load_saved_tokenizer(source), model_type, image_processor)
    processor_class = Siglip2Processor if model_type == "siglip2" else CLIPProcessor  # train/run.py's processors
    processor_class(image_processor=image_processor, tokenizer=tokenizer).save_pretrained(staging)


# --------------------------------------------------------------------------------------------- export


def _staging_for(output_dir: Path) -> Path:
    """A new hidden folder beside `output_dir` to build the export in, after checking `output_dir` is new or empty
    and its parent writable (before any weights are read: a read-only or full disk is one line, not a traceback)."""
    if output_dir.exists() and (not output_dir.is_dir() or any(output_dir.iterdir())):
        raise ExportError(f"output folder '{output_dir}' is not empty: choose a new folder or empty it")
    try:
        output_dir.parent.mkdir(parents=True, exist_ok=True)
        return Path(tempfile.mkdtemp(prefix=f".{output_dir.name}.partial-", dir=output_dir.parent))
    except OSError as error:
        reason = error.strerror or error
        raise ExportError(f"cannot write '{output_dir}': {reason}: choose a writable folder") from error


def _make_readable(folder: Path) -> None:
    """The export's folder and files as a plain `cp` would leave them (0755 / 0644 under the usual umask): some
    writers (a temporary file renamed into place) leave 0600, and a model folder is for others to read."""
    umask = os.umask(0)
    os.umask(umask)
    folder.chmod(0o777 & ~umask)
    for path in folder.rglob("*"):
        path.chmod((0o777 if path.is_dir() else 0o666) & ~umask)


def export_checkpoint(checkpoint_dir, output_dir, eval_metrics=None, processor_from=None, ema: bool = False) -> Path:
    """Write a plain CLIPModel folder from a Trainer/DeepSpeed checkpoint of any ZeRO stage; return its path.

    `eval_metrics`: one or a list of `disco-clip eval` result records (or bare {metric: value} dicts) for the
    model card. `processor_from`: where the tokenizer and image processor are saved, when not in the
    checkpoint or its parent. `ema`: export the EMA of the weights the run kept (--ema_decay) instead of the weights;
    a run folder then gives its newest complete checkpoint (the final model holds no EMA). The folder appears complete
    or not at all: it is built beside `output_dir` and renamed into place at the end; `output_dir` must not exist or be
    empty.
    """
    checkpoint = _ema_checkpoint(checkpoint_dir) if ema else resolve_checkpoint(checkpoint_dir)
    output_dir = Path(output_dir)
    # one export at a time writes OUTPUT_DIR (the lock beside it: the folder itself must stay empty until the rename)
    with writer_lock(output_dir, "OUTPUT_DIR", "disco-clip export", beside=True):
        return _export_into(output_dir, checkpoint, eval_metrics, processor_from, ema)


def _export_into(output_dir: Path, checkpoint: Path, eval_metrics, processor_from, ema: bool) -> Path:
    """`export_checkpoint`'s work, the lock held."""
    staging = _staging_for(output_dir)
    try:
        processor_source = _processor_source(checkpoint, processor_from)
        state_dict, weights_from = load_state_dict(checkpoint)
        if ema:
            state_dict, weights_from = _with_ema(checkpoint, state_dict)
        check_weights(state_dict, checkpoint)
        model = build_plain_model(checkpoint, state_dict)
        run, records = describe_run(checkpoint), eval_records(eval_metrics)
        text_length = model.config.text_config.max_position_embeddings  # SigLIP's text padding, as eval/encode.py's
        card = model_card(run, records, weights_from, model.config.model_type, text_length)
        try:
            model.save_pretrained(staging)
            _save_processor(processor_source, model.config.model_type, staging)
            card.save(staging / "README.md")
            _make_readable(staging)
            if output_dir.exists():
                output_dir.rmdir()  # empty, checked above
            os.rename(staging, output_dir)
        except OSError as error:  # e.g. a full disk: nothing is left behind
            raise ExportError(f"cannot write '{output_dir}': {error}") from error
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return output_dir
