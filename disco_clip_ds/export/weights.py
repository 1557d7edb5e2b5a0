"""Trainer/DeepSpeed checkpoint -> plain CLIPModel (or SiglipModel) folder with a model card (`hub.py` uploads it).

An exported folder loads with transformers alone (`CLIPModel.from_pretrained`, `CLIPProcessor.from_pretrained`):
model.safetensors (fp32), config.json (architectures ["CLIPModel"]), tokenizer and image-processor files and
README.md recording how the model was trained and evaluated.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

from disco_clip_ds.checkpoint.final_model import final_model_problem
from disco_clip_ds.checkpoint.layout import (
    WEIGHT_FILES,
    checkpoint_folders,
    checkpoint_problem,
    has_weights,
    newest_complete,
)
from disco_clip_ds.checkpoint.manifest import MANIFEST, manifest_problem
from disco_clip_ds.errors import ExportError, UsageError

logger = logging.getLogger("disco_clip_ds.export.weights")
TOKENIZER_FILES = ("tokenizer.json", "vocab.json", "tokenizer_config.json")
IMAGE_PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json")


# ------------------------------------------------------------------------------------------ checkpoint


def resolve_checkpoint(path: str | os.PathLike) -> Path:
    """The folder to export, verified against its manifest where it has one. A run folder (one holding checkpoint-N
    folders) gives its final model, or when that is missing or does not verify its newest checkpoint that does,
    with one line for each one skipped and why. A checkpoint given by name that does not verify is refused, naming
    the newest one beside it that does."""
    path = Path(path)
    if not path.is_dir():
        raise ExportError(f"checkpoint folder '{path}' does not exist")
    holds_model = has_weights(path) or (path / "latest").is_file() or (path / MANIFEST).is_file()
    if checkpoint_folders(path):  # a run folder
        if holds_model:
            problem = final_model_problem(path)
            if problem is None:
                return path
            logger.warning("skipping the final model in %s: %s", path, problem)
        newest = newest_complete(path)
        if newest is None:
            raise ExportError(f"'{path}' holds no final model or checkpoint-N that verifies (see the lines above)")
        return newest
    if not holds_model:
        raise ExportError(
            f"'{path}' holds neither model weights ({', '.join(WEIGHT_FILES)}), a DeepSpeed checkpoint ('latest' "
            "file) nor complete checkpoint-N folders"
        )
    is_checkpoint = (path / "latest").is_file() or any(path.glob("rng_state*.pth"))  # the Trainer's resume state
    problem = (
        checkpoint_problem(path) if is_checkpoint else manifest_problem(path) if (path / MANIFEST).is_file() else None
    )
    if problem:
        step = path.name.split("-")[-1]
        good = newest_complete(path.parent, older_than=int(step) if step.isdigit() else None, warn=False)
        instead = f"the newest checkpoint beside it that verifies is {good}" if good else "none beside it verifies"
        raise ExportError(f"'{path}' does not verify: {problem}; {instead}")
    return path


def _deepspeed_tag_dir(checkpoint: Path) -> Path | None:
    latest = checkpoint / "latest"
    if not latest.is_file():
        return None
    tag_dir = checkpoint / latest.read_text().strip()
    if not tag_dir.is_dir():
        raise ExportError(
            f"partial checkpoint: '{latest}' names '{tag_dir.name}', which does not exist in {checkpoint}"
        )
    return tag_dir


def _is_zero_checkpoint(tag_dir: Path) -> bool:
    # ZeRO stages 1-3 write one optimizer partition per rank, named *zero_pp_rank_*; stage 0 writes none.
    return any(tag_dir.glob("*zero_pp_rank_*optim_states.pt"))


def load_state_dict(checkpoint: Path) -> tuple[dict, str]:
    """The checkpoint's weights and where they came from.

    A ZeRO (stage 1-3) checkpoint is consolidated from the fp32 master weights in the optimizer partitions
    with DeepSpeed's own zero_to_fp32 (exact even for bf16 runs; ZeRO-3 writes no full weights unless told
    to gather them); otherwise the Trainer's full weight file is used.
    """
    tag_dir = _deepspeed_tag_dir(checkpoint)
    if tag_dir is not None and _is_zero_checkpoint(tag_dir):
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        try:
            return get_fp32_state_dict_from_zero_checkpoint(
                str(checkpoint), tag=tag_dir.name
            ), f"DeepSpeed ZeRO fp32 partitions ({tag_dir.name})"
        except (ValueError, FileNotFoundError, RuntimeError, KeyError, EOFError) as e:
            raise ExportError(f"partial or corrupt DeepSpeed checkpoint in {tag_dir}: {e}") from e
    for name in WEIGHT_FILES:
        if (checkpoint / name).is_file():
            return _read_weight_file(checkpoint / name), name
    raise ExportError(
        f"no weights in '{checkpoint}': expected {' or '.join(WEIGHT_FILES)} or a DeepSpeed ZeRO checkpoint"
    )


def _read_weight_file(path: Path) -> dict:
    try:
        if path.name.endswith(".index.json"):  # sharded: the index maps each weight to its shard file
            shards = sorted(set(json.loads(path.read_text())["weight_map"].values()))
            return {name: tensor for shard in shards for name, tensor in _read_one_file(path.parent / shard).items()}
        return _read_one_file(path)
    except Exception as e:
        raise ExportError(f"cannot read weights '{path}': {e}") from e


def _read_one_file(path: Path) -> dict:
    import torch
    from safetensors.torch import load_file

    if path.suffix == ".safetensors":
        return load_file(str(path))
    return torch.load(path, map_location="cpu", weights_only=True)


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


def build_plain_model(checkpoint: Path, state_dict: dict):
    """The plain transformers model (CLIPModel or SiglipModel, by the checkpoint's config) holding `state_dict`,
    every parameter accounted for."""
    from transformers import AutoConfig, CLIPModel, SiglipModel

    if not (checkpoint / "config.json").is_file():
        raise ExportError(f"partial checkpoint: no config.json in {checkpoint}")
    config = AutoConfig.from_pretrained(checkpoint)
    plain = {"clip": CLIPModel, "siglip": SiglipModel}.get(config.model_type)
    if plain is None:
        raise ExportError(f"{checkpoint}: a {config.model_type} model; export reads CLIP and SigLIP checkpoints")
    config.architectures = [plain.__name__]
    model = plain(config)
    expected = model.state_dict()
    buffers = {name for name, _ in model.named_buffers()}
    fixed = {}
    for name, tensor in state_dict.items():
        if name not in expected:
            if name in buffers:  # a non-persistent buffer DeepSpeed recorded anyway
                continue
            raise ExportError(
                f"checkpoint weight '{name}' has no place in {type(model).__name__}: is config.json this run's?"
            )
        target = expected[name]
        if tensor.shape != target.shape:
            if tensor.numel() != target.numel():
                raise ExportError(
                    f"weight '{name}' has shape {tuple(tensor.shape)}, config.json wants {tuple(target.shape)}"
                )
            # DeepSpeed 0.19.8 trains CLIP's 0-dim logit_scale as a 1-element vector (see compat.py)
            tensor = tensor.reshape(target.shape)
        fixed[name] = tensor
    missing = sorted(set(expected) - set(fixed))
    if missing:
        raise ExportError(f"partial checkpoint: {len(missing)} weights missing, e.g. {missing[:3]}")
    model.load_state_dict(fixed, strict=True)
    return model


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


# ------------------------------------------------------------------------------------------- the card


def describe_run(checkpoint: Path) -> dict:
    """What the training run recorded about itself: run.json (written by `disco-clip train`: world size, batches,
    loss, ZeRO stage, precision, data, versions) and the Trainer's trainer_state.json (steps, last loss). Both are
    JSON: nothing is unpickled. Absent keys are unknown."""
    info: dict = {}
    config = json.loads((checkpoint / "config.json").read_text()) if (checkpoint / "config.json").is_file() else {}
    if config.get("loss_impl"):
        info["loss_impl"] = config["loss_impl"]
    info.update(_from_trainer_state(checkpoint / "trainer_state.json"))
    info.update(_run_file(checkpoint))
    if info.get("resumes"):  # run.json's facts hold for every step; a resume may have changed ranks and K
        from disco_clip_ds.checkpoint.resume import describe_resumes

        info["resumes"] = describe_resumes(info)
    versions = info.pop("versions", None) or {}
    if versions.get("deepspeed") and "zero_stage" in info:
        info["deepspeed"] = versions["deepspeed"]
    return {k: v for k, v in info.items() if v is not None}


def _from_trainer_state(path: Path) -> dict:
    if not path.is_file():
        return {}
    state = json.loads(path.read_text())
    info = {"steps": state.get("global_step")}
    losses = [e["loss"] for e in state.get("log_history", []) if "loss" in e]
    if losses:
        info["final_train_loss"] = round(float(losses[-1]), 4)
    return info


def _run_file(checkpoint: Path) -> dict:
    # train.py writes run.json in the run folder, beside the checkpoints; a copied checkpoint may carry its own.
    for folder in (checkpoint, checkpoint.parent):
        path = folder / "run.json"
        if path.is_file():
            try:
                return json.loads(path.read_text())
            except json.JSONDecodeError:
                return {}
    return {}


def _eval_records(eval_metrics) -> list[dict]:
    if not eval_metrics:
        return []
    records = eval_metrics if isinstance(eval_metrics, list) else [eval_metrics]
    return [r if "metrics" in r else {"task": "evaluation", "metrics": r} for r in records]


RUN_FIELDS = [
    ("global_contrastive_batch", "global contrastive batch (pairs per loss)"),
    ("world_size", "world size (data-parallel ranks)"),
    ("micro_batch_per_rank", "micro-batch per rank"),
    ("gradient_accumulation_steps", "gradient accumulation steps"),
    ("resumes", "resumed at (ranks x K from there)"),
    ("global_batch", "global batch per optimizer step"),
    ("loss_impl", "loss implementation"),
    ("zero_stage", "DeepSpeed ZeRO stage"),
    ("precision", "precision"),
    ("steps", "optimizer steps"),
    ("final_train_loss", "last logged training loss"),
    ("data", "training data"),
    ("deepspeed", "deepspeed version"),
]


CARD_FAMILY = {  # model_type -> (title, model class, the loss it was trained with)
    "clip": (
        "CLIP",
        "CLIPModel",
        "the exact distributed DisCo-CLIP contrastive loss ([arXiv 2304.08480](https://arxiv.org/abs/2304.08480))",
    ),
    "siglip": (
        "SigLIP",
        "SiglipModel",
        "SigLIP's sigmoid loss over the global batch ([arXiv 2303.15343](https://arxiv.org/abs/2303.15343)), "
        "computed exactly across ranks",
    ),
}


def model_card(run: dict, eval_records: list[dict], weights_from: str, model_type: str = "clip"):
    """A huggingface_hub ModelCard recording the set-up and the evaluation."""
    from huggingface_hub import ModelCard, ModelCardData

    title, class_name, loss = CARD_FAMILY[model_type]
    data = ModelCardData(
        library_name="transformers",
        pipeline_tag="zero-shot-image-classification",
        tags=[model_type, "disco-clip", "deepspeed"],
    )
    rows = [f"| {label} | {run[key]} |" for key, label in RUN_FIELDS if key in run]
    lines = [
        "---",
        data.to_yaml(),
        "---",
        "",
        f"# {title} trained with disco-clip-ds",
        "",
        f"A `transformers` {class_name} trained with disco-clip-ds, {loss}"
        + (" under DeepSpeed ZeRO." if "zero_stage" in run else "."),
        "",
        "## Training set-up",
        "",
        "| | |",
        "|---|---|",
        *rows,
        "",
        f"Weights exported in fp32 from {weights_from}.",
        "",
    ]
    if eval_records:
        lines += ["## Evaluation", ""]
        for record in eval_records:
            source = f" on `{record['dataset']}`" if record.get("dataset") else ""
            lines += [f"{record.get('task', 'evaluation')}{source}:", "", "| metric | value |", "|---|---|"]
            lines += [
                f"| {name} | {value:.4f} |" if isinstance(value, float) else f"| {name} | {value} |"
                for name, value in record["metrics"].items()
            ]
            lines.append("")
    lines += [
        "## Use",
        "",
        "```python",
        f"from transformers import {class_name}, CLIPProcessor",
        "",
        f'model = {class_name}.from_pretrained("THIS_FOLDER_OR_REPO")',
        'processor = CLIPProcessor.from_pretrained("THIS_FOLDER_OR_REPO")',
        "```",
        "",
    ]
    return ModelCard("\n".join(lines))


# --------------------------------------------------------------------------------------------- export


def _prepare_output(output_dir: Path) -> None:
    if output_dir.exists() and (not output_dir.is_dir() or any(output_dir.iterdir())):
        raise ExportError(f"output folder '{output_dir}' is not empty: choose a new folder or empty it")
    output_dir.parent.mkdir(parents=True, exist_ok=True)


def export_checkpoint(checkpoint_dir, output_dir, eval_metrics=None, processor_from=None) -> Path:
    """Write a plain CLIPModel folder from a Trainer/DeepSpeed checkpoint of any ZeRO stage; return its path.

    `eval_metrics`: one or a list of `disco-clip eval` result records (or bare {metric: value} dicts) for the
    model card. `processor_from`: where the tokenizer and image processor are saved, when not in the
    checkpoint or its parent. The folder appears complete or not at all: it is built beside `output_dir` and
    renamed into place at the end; `output_dir` must not exist or be empty.
    """
    from transformers import AutoImageProcessor, AutoTokenizer

    checkpoint = resolve_checkpoint(checkpoint_dir)
    output_dir = Path(output_dir)
    _prepare_output(output_dir)
    processor_source = _processor_source(checkpoint, processor_from)
    state_dict, weights_from = load_state_dict(checkpoint)
    check_weights(state_dict, checkpoint)
    model = build_plain_model(checkpoint, state_dict)
    staging = Path(tempfile.mkdtemp(prefix=f".{output_dir.name}.partial-", dir=output_dir.parent))
    try:
        model.save_pretrained(staging)
        AutoTokenizer.from_pretrained(processor_source).save_pretrained(staging)
        AutoImageProcessor.from_pretrained(processor_source).save_pretrained(staging)
        card = model_card(describe_run(checkpoint), _eval_records(eval_metrics), weights_from, model.config.model_type)
        card.save(staging / "README.md")
        staging.chmod(0o755)
        if output_dir.exists():
            output_dir.rmdir()  # empty, checked above
        os.rename(staging, output_dir)
    except BaseException as error:
        shutil.rmtree(staging, ignore_errors=True)
        if isinstance(error, OSError):  # e.g. a full disk: nothing is left behind
            raise ExportError(f"cannot write '{output_dir}': {error}") from error
        raise
    return output_dir


def export_main(argv: list[str] | None = None) -> int:
    """`disco-clip export CHECKPOINT_DIR OUTPUT_DIR [--eval_results FILE ...] [--processor_from DIR]`."""
    parser = argparse.ArgumentParser(prog="disco-clip export", description=export_checkpoint.__doc__.split("\n")[0])
    parser.add_argument("checkpoint_dir", help="Trainer checkpoint-N folder (or the run folder: its newest checkpoint)")
    parser.add_argument("output_dir", help="new or empty folder to write")
    parser.add_argument(
        "--eval_results", nargs="*", default=[], help="JSON files written by `disco-clip eval --output`"
    )
    parser.add_argument(
        "--processor_from", help="folder with tokenizer + image processor (default: the checkpoint or its parent)"
    )
    args = parser.parse_args(argv)
    records = [_read_eval_results(f) for f in args.eval_results]
    out = export_checkpoint(
        args.checkpoint_dir, args.output_dir, eval_metrics=records, processor_from=args.processor_from
    )
    print(f"exported {args.checkpoint_dir} -> {out}: {', '.join(sorted(p.name for p in out.iterdir()))}")
    return 0


def _read_eval_results(path: str) -> dict:
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError) as error:
        raise UsageError(f"--eval_results {path} is not a readable JSON file: {error}") from error
