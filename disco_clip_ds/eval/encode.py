"""The model side of evaluation: the CLIPModel / SiglipModel inside a wrapper, L2-normalised image and text
embeddings, the zero-shot classifier of class names x templates, eval mode for the duration.

Under ZeRO-3 every rank holds a slice of the weights and a forward is a collective, so these must run on every rank
over the same data; `encode_texts` deals its batches out across the ranks (eval/spread.py). Under FSDP2 the same
holds once `gathered` has all-gathered the root's own parameters (the embeddings, final norms, projections): each
sharded layer gathers its own in its forward hooks, but `get_text_features` / `get_image_features` are not the
root's forward, so its hooks never run.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from disco_clip_ds.eval.spread import spread


def unwrap(model):
    """The CLIPModel or SiglipModel inside a DeepSpeed engine or DDP wrapper (both keep it as `.module`)."""
    while hasattr(model, "module") and not hasattr(model, "get_image_features"):
        model = model.module
    return model


@contextlib.contextmanager
def gathered(model):
    """For the length of the block, an FSDP2-sharded model's root parameters whole on every rank (`unshard`, a
    collective: call it on every rank), sharded again on leaving it (`reshard`), so that the encoders' methods run on
    the full weights; any other model as it is. The root's parameters are unsharded once for a whole evaluation,
    not per batch: its token embedding alone is a large all-gather."""
    fsdp = sys.modules.get("torch.distributed.fsdp")  # not imported: no model is FSDP's (and importing it costs)
    root = unwrap(model)
    if fsdp is None or not isinstance(root, fsdp.FSDPModule):
        yield
        return
    root.unshard()
    try:
        yield
    finally:
        root.reshard()  # the optimizer and the EMA work on the shards: leave none of the root's gathered


def _first_param(model) -> torch.Tensor:
    return next(model.parameters())


@torch.no_grad()
def encode_images(model, pixel_values: torch.Tensor | dict[str, torch.Tensor]) -> torch.Tensor:
    """L2-normalised float32 image embeddings of `pixel_values`, or of a dict of image inputs (SigLIP 2's:
    pixel_values, pixel_attention_mask, spatial_shapes)."""
    model = unwrap(model)
    param = _first_param(model)
    inputs = pixel_values if isinstance(pixel_values, dict) else {"pixel_values": pixel_values}
    inputs = {k: v.to(param.device, param.dtype if v.is_floating_point() else v.dtype) for k, v in inputs.items()}
    out = model.get_image_features(**inputs).pooler_output
    return F.normalize(out.float(), dim=-1).cpu()


@torch.no_grad()
def encode_texts(model, tokenizer, texts: Sequence[str], batch_size: int = 256) -> torch.Tensor:
    """L2-normalised float32 text embeddings of `texts`, in batches of `batch_size` over their order, dealt out
    across ranks (eval/spread.py; call it on every rank with the same texts). SigLIP's text is padded to its fixed
    length, as it was trained (its text tower pools the last position); CLIP's to the longest in the batch."""
    model = unwrap(model)
    device = _first_param(model).device
    max_length = model.config.text_config.max_position_embeddings
    padding = "max_length" if model.config.model_type in ("siglip", "siglip2") else True

    def tokens(chunk):
        return tokenizer(chunk, padding=padding, truncation=True, max_length=max_length, return_tensors="pt")

    def forward(batch):
        batch = batch.to(device)
        out = model.get_text_features(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
        return F.normalize(out.pooler_output.float(), dim=-1).cpu()  # transformers 5: pooler_output, projected

    chunks = (list(texts[start : start + batch_size]) for start in range(0, len(texts), batch_size))
    embeddings = spread(chunks, tokens, forward)
    return torch.cat(embeddings) if embeddings else torch.empty(0, 0)  # no texts: no rows


def zeroshot_classifier(
    model, tokenizer, classnames: Sequence[str], templates: Sequence[str], batch_size: int = 256
) -> torch.Tensor:
    """(n_classes, d) classifier: per class, the renormalised mean of its normalised prompt embeddings."""
    prompts = [template.format(c=name) for name in classnames for template in templates]
    embeddings = encode_texts(model, tokenizer, prompts, batch_size).view(len(classnames), len(templates), -1)
    return F.normalize(embeddings.mean(1), dim=-1)


class EvalMode:
    """Switch a model to eval() for the duration, restoring its training flag after."""

    def __init__(self, model):
        self.model, self.was_training = model, model.training

    def __enter__(self):
        self.model.eval()

    def __exit__(self, *exc):
        self.model.train(self.was_training)
