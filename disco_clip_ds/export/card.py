"""The model card of an exported model: the training set-up from run.json and the checkpoint's trainer state, the
final model's benchmark suite (suite/suite.json in the run folder, written by `--eval_tasks`), and the evaluation
records of `disco-clip eval`, as a huggingface_hub ModelCard."""

from __future__ import annotations

import json
from pathlib import Path

from disco_clip_ds.checkpoint.layout import TRAINER_STATE, trainer_state
from disco_clip_ds.checkpoint.resume import describe_ranks
from disco_clip_ds.checkpoint.runfile import public_distillation, run_file_of
from disco_clip_ds.data.redact import describe_data, public_text


def describe_run(checkpoint: Path) -> dict:
    """What the training run recorded about itself: run.json (written by `disco-clip train`: world size, batches,
    loss, ZeRO stage, precision, data, versions) and the checkpoint's trainer_state.json (steps, last loss). Both are
    JSON: nothing is unpickled. Absent keys are unknown."""
    info: dict = {}
    config = json.loads((checkpoint / "config.json").read_text()) if (checkpoint / "config.json").is_file() else {}
    for key in ("loss_impl", "chunk_size"):  # training settings: the exported config.json leaves them out
        if config.get(key) is not None:
            info[key] = config[key]
    info.update(_from_trainer_state(checkpoint))
    info.update(run_file_of(checkpoint) or {})
    suite = checkpoint / SUITE_FILE  # the final model's, in the run folder: a checkpoint-N folder has none
    if suite.is_file():
        info["suite"] = json.loads(suite.read_text()).get("rows") or None
    if info.get("resumes"):  # run.json's facts hold for every step; a resume may have changed ranks and K
        info["resumes"] = describe_resumes(info)
    versions = info.pop("versions", None) or {}
    if versions.get("deepspeed") and "zero_stage" in info:
        info["deepspeed"] = versions["deepspeed"]
    if isinstance(info.get("distillation"), str):  # run.json of an older version holds the paths as given
        info["distillation"] = public_distillation(info["distillation"])
    if isinstance(info.get("data"), str):  # run.json of an older version holds the source as given, secrets included
        info["data"] = describe_data(info["data"])
    return {k: v for k, v in info.items() if v is not None}


def describe_resumes(run: dict) -> str | None:
    """The resumes in run.json, for the model card: where each started and what it trained with."""
    parts = []
    for s in run.get("resumes", []):
        moved = (
            [f"{describe_ranks(s['world_size'])} x K {s['gradient_accumulation_steps']}"] if "world_size" in s else []
        )
        if s.get("data_restarted"):
            moved.append("data stream restarted")
        parts.append(f"step {s['from_step']}" + (f" ({', '.join(moved)})" if moved else ""))
    return "; ".join(parts) or None


SUITE_FILE = "suite/suite.json"  # eval/callback.py writes it at the last step


def _from_trainer_state(checkpoint: Path) -> dict:
    """The steps and the last logged loss of the checkpoint (facts of the checkpoint, not of the run)."""
    if not (checkpoint / TRAINER_STATE).is_file():
        return {}
    state = trainer_state(checkpoint)
    info = {"steps": state.get("global_step")}
    losses = [e["loss"] for e in state.get("log_history", []) if "loss" in e]
    if losses:
        info["final_train_loss"] = round(float(losses[-1]), 4)
    return info


def eval_records(eval_metrics) -> list[dict]:
    """`disco-clip eval` result records (one or a list; a bare {metric: value} dict becomes one record)."""
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
    ("chunk_size", "loss tile size (chunk_size)"),
    ("zero_stage", "DeepSpeed ZeRO stage"),
    ("tower_settings", "per-tower learning rates and layer decay"),
    ("patch_dropout", "patch dropout (FLIP)"),
    ("resolution_schedule", "progressive resolution (image side, or SigLIP 2 patch budget, from step)"),
    ("max_num_patches", "NaFlex patch budget per image (max_num_patches)"),
    ("locked_towers", "locked towers"),
    ("distillation", "distilled (teacher, weight, temperature)"),
    ("precision", "precision"),
    ("steps", "optimizer steps"),
    ("final_train_loss", "last logged training loss"),
    ("data", "training data"),
    ("data_weights", "data mixture (weight per source)"),
    ("dataset_resampled", "shards drawn with replacement"),
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
    "siglip2": (
        "SigLIP 2 (NaFlex)",
        "Siglip2Model",
        "SigLIP's sigmoid loss over the global batch ([arXiv 2303.15343](https://arxiv.org/abs/2303.15343)), "
        "computed exactly across ranks, each image at its native aspect ratio within a patch budget (NaFlex, "
        "[arXiv 2502.14786](https://arxiv.org/abs/2502.14786))",
    ),
}


USAGE_FOLDER, USAGE_IMAGE = "THIS_FOLDER_OR_REPO", "IMAGE.jpg"  # the placeholders of the card's usage code


def usage(model_type: str, text_length: int = 64) -> list[str]:
    """The card's usage code, as lines: the exported folder through AutoProcessor, as its training and eval saw
    images and text. SigLIP pads text to its fixed length (its text tower pools the last position, and the
    attention mask keeps the padding out) and scores each pair by a sigmoid; CLIP pads to the longest text and
    takes a softmax over the texts."""
    class_name = CARD_FAMILY[model_type][1]
    siglip = model_type in ("siglip", "siglip2")
    padding = f'padding="max_length", max_length={text_length}' if siglip else "padding=True"
    score = "logits_per_image.sigmoid()" if siglip else "logits_per_image.softmax(dim=-1)"
    return [
        "from PIL import Image",
        f"from transformers import AutoProcessor, {class_name}",
        "",
        f'model = {class_name}.from_pretrained("{USAGE_FOLDER}")',
        f'processor = AutoProcessor.from_pretrained("{USAGE_FOLDER}")',
        f'image = Image.open("{USAGE_IMAGE}")',
        'texts = ["a photo of a cat", "a photo of a dog"]',
        f'inputs = processor(images=image, text=texts, {padding}, return_tensors="pt")',
        f"probs = model(**inputs).{score}  # per image, one score per text",
    ]


def suite_section(rows: list[dict]) -> list[str]:
    """The card's table of the final model's suite: each task's main metric, and their average (the last row)."""
    if not rows:
        return []
    lines = ["## Benchmark suite", "", "The final model on the run's task list (`--eval_tasks`):", ""]
    lines += ["| task | type | main metric | value |", "|---|---|---|---|"]
    for row in rows:
        value = row.get("value")
        shown = f"{value:.4f}" if isinstance(value, (int, float)) else f"failed: {public_text(row.get('error'))}"
        cells = [public_text(row.get(key) or "") for key in ("task", "type", "main_metric")]
        lines.append(f"| {' | '.join(cells)} | {shown} |")
    return [*lines, ""]


def model_card(run: dict, records: list[dict], weights_from: str, model_type: str = "clip", text_length: int = 64):
    """A huggingface_hub ModelCard recording the set-up (`describe_run`) and the evaluation (`eval_records`), and how
    to use the model (`usage`; `text_length`: the text tower's positions, to which SigLIP pads)."""
    from huggingface_hub import ModelCard, ModelCardData

    title, class_name, loss = CARD_FAMILY[model_type]
    data = ModelCardData(
        library_name="transformers",
        pipeline_tag="zero-shot-image-classification",
        tags=[model_type, "disco-clip", "deepspeed"],
    )
    # every shown value passes `public_text` (secrets, local paths, Markdown and HTML), whatever run.json held
    rows = [f"| {label} | {public_text(run[key])} |" for key, label in RUN_FIELDS if key in run]
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
    lines += suite_section(run.get("suite") or [])
    if records:
        lines += ["## Evaluation", ""]
        for record in records:
            source = f" on {public_text(record['dataset'])}" if record.get("dataset") else ""
            task = public_text(record.get("task", "evaluation"))
            lines += [f"{task}{source}:", "", "| metric | value |", "|---|---|"]
            lines += [
                f"| {public_text(name)} | {value:.4f} |"
                if isinstance(value, float)
                else f"| {public_text(name)} | {public_text(value)} |"
                for name, value in record["metrics"].items()
            ]
            lines.append("")
    lines += ["## Use", "", "```python", *usage(model_type, text_length), "```", ""]
    return ModelCard("\n".join(lines))
