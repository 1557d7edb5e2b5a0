"""Contrastive gradient accumulation: a global contrastive batch of micro x world x K pairs at the activation
memory of one micro-batch (gradient caching, Gao et al. 2021, arXiv 2101.06983), under the stock HF Trainer with
DeepSpeed ZeRO-1/2/3, FSDP (accelerate) or DDP.

Plain gradient accumulation adds no negatives to a contrastive loss: each micro-step's loss sees only its own
batch. Here every optimizer step of K micro-batches
  1. embeds all K micro-batches without grad, saving the RNG state before each so that dropout is replayed;
  2. computes the global-batch loss (`disco_clip_ds.losses`: CLIP's or SigLIP's) over the K x micro rows of every
     rank, i.e. over all micro x world x K pairs, and its gradient w.r.t. each cached embedding and the logit
     parameters (CLIP's multiplier; SigLIP's multiplier and bias);
  3. re-runs each micro-batch with grad, RNG restored, and back-propagates (embedding . cached gradient) plus
     the logit parameters' terms, through the Trainer's ordinary `training_step`: one engine/accelerator backward per
     micro-batch, so ZeRO's, FSDP's and DDP's own accumulation and reduction paths run unchanged.

By the chain rule the summed micro-step gradients are exactly the gradient of the global-batch loss; the loss
module's per-rank contract (mean over ranks = global loss) makes data-parallel averaging exact as without
accumulation. No library does this under DeepSpeed: sentence-transformers' cached losses call backward inside
the loss (nested in the engine's), which ZeRO rejects, hence the hand-written component below, which DiscoTrainer's
hooks call (`disco_clip_ds.train.trainer`).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch

from disco_clip_ds.train.distill import split_inputs


def _at_least_fp32(tensor: torch.Tensor) -> torch.dtype:
    return torch.promote_types(tensor.dtype, torch.float32)


def _rng_state() -> tuple:
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    return torch.get_rng_state(), cuda


def _set_rng_state(state: tuple) -> None:
    cpu, cuda = state
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state_all(cuda)


@dataclass
class _Update:
    """The K micro-batches of one optimizer step (`items`, as fetched), the batches its forwards take (`batches`: the
    items, or runs of `merged` of them concatenated) and what step 2 cached for them."""

    items: list
    merged: int = 1
    batches: list = field(default_factory=list)
    taken: int = 0  # items the Trainer has stepped on
    index: int = 0  # the batch at hand
    rng: list = field(default_factory=list)  # RNG state before each micro-batch's first forward
    rng_after: tuple | None = None  # after all first forwards: the stream continues from here
    grads: list = field(default_factory=list)  # (d l/d image_embeds, d l/d text_embeds) per micro-batch
    param_grads: tuple = ()  # d l/d each logit parameter (multiplier, bias)
    loss: torch.Tensor | None = None  # this rank's share of the global-batch loss (mean over ranks = the loss)


def cached_embedding_gradients(image_embeds: list[torch.Tensor], text_embeds: list[torch.Tensor], params, loss_fn):
    """Step 2: this rank's loss over all its micro-batches' rows, and its gradient w.r.t. each of them.

    image_embeds, text_embeds: per micro-batch (b_k, d) L2-normalised embeddings (no grad); params: the 0-dim logit
    parameters the loss takes after the features (CLIP: the multiplier; SigLIP: the multiplier and the bias);
    loss_fn(images, texts, *params): the global-batch loss (the model's `global_loss`). Returns (loss,
    [(grad_image_k, grad_text_k)], (grad of each param)), gradients in fp32 (fp64 for fp64 embeddings).
    Collective under torch.distributed (all ranks call it at once)."""
    sizes = [e.shape[0] for e in image_embeds]
    dtype = _at_least_fp32(image_embeds[0])
    images = torch.cat(image_embeds).detach().to(dtype).requires_grad_()
    texts = torch.cat(text_embeds).detach().to(dtype).requires_grad_()
    leaves = tuple(p.detach().to(dtype).reshape(()).requires_grad_() for p in params)
    with torch.enable_grad():
        loss = loss_fn(images, texts, *leaves)
        grad_images, grad_texts, *param_grads = torch.autograd.grad(loss, (images, texts, *leaves))
    return loss.detach(), list(zip(grad_images.split(sizes), grad_texts.split(sizes))), tuple(param_grads)


def surrogate_loss(image_embeds, text_embeds, params, grads, param_grads, num_micro: int) -> torch.Tensor:
    """Step 3: a scalar whose gradient w.r.t. the model is this micro-batch's share of the global-batch gradient.

    The logit parameters' terms are split evenly over the K micro-batches (summing to their whole gradient) rather
    than given to one: every parameter then gets a gradient in every micro-step, as in ordinary accumulation,
    which ZeRO's per-micro-step gradient bookkeeping expects."""
    grad_images, grad_texts = grads
    dtype = grad_images.dtype  # 16-bit embeddings meet their fp32 gradients in fp32
    value = (image_embeds.to(dtype) * grad_images).sum() + (text_embeds.to(dtype) * grad_texts).sum()
    for param, grad in zip(params, param_grads):
        value = value + param.to(dtype).reshape(()) * (grad / num_micro)
    return value


def logit_params(model, outputs) -> tuple[torch.Tensor, ...]:
    """The logit parameters as the model's forward used them (its output carries each of `model.PARAM_NAMES`)."""
    names = getattr(model, "PARAM_NAMES", None)
    found = tuple(getattr(outputs, name, None) for name in names or ())
    if not names or any(p is None for p in found):
        raise RuntimeError(
            f"{type(model).__name__}'s output lacks its logit parameters: contrastive accumulation needs "
            "disco_clip_ds's DiscoCLIPModel or DiscoSiglipModel (or --contrastive_accumulation false)"
        )
    return found


_ORDER = (
    "contrastive accumulation expects the Trainer to fetch an update's batches with get_batch_samples and then call "
    "training_step on each in order (transformers 5.x)"
)


def _concatenated(batches: list):
    """One batch of the rows of `batches` (dicts of tensors, rows first); a single batch itself."""
    if len(batches) == 1:
        return batches[0]
    return {key: torch.cat([batch[key] for batch in batches]) for key in batches[0]}


class ContrastiveAccumulation:
    """With `gradient_accumulation_steps` K > 1 and `args.contrastive_accumulation`, each optimizer step trains on
    the contrastive loss over all K micro-batches of all ranks (see the module docstring).

    DiscoTrainer's hooks call it: `get_batch_samples` (the Trainer 5 fetches an update's K batches up front, then
    loops `training_step` over them) hands the batches to `record`; each `training_step` asks `take` for the batch it
    runs (under --stage_micro_batch_sizes several micro-batches make one) and runs inside `micro_step`,
    whose first one runs steps 1-2; `compute_loss` returns `loss` (the surrogate for the micro-batch at hand), valued
    at the global-batch loss / K so the Trainer's logged loss is the true one. The model must be a DiscoCLIPModel or
    DiscoSiglipModel (`disco_clip_ds.models`): its output carries `image_embeds`, `text_embeds` and its logit
    parameters, and `global_loss` computes the loss from them."""

    def __init__(self, args):
        self.args = args
        self.update: _Update | None = None
        self.in_step = False  # inside an accumulated micro-step: compute_loss returns the surrogate
        self.last_forward_rows = None  # the rows of the last training forward with grad (a stage's micro-batch)

    @property
    def enabled(self) -> bool:
        """True when optimizer steps accumulate K > 1 micro-batches into one contrastive batch."""
        return bool(getattr(self.args, "contrastive_accumulation", False)) and self.args.gradient_accumulation_steps > 1

    def contrastive_batch_size(self) -> int:
        """The pairs each optimizer step contrasts: micro x world (x K when accumulating contrastively)."""
        size = self.args.per_device_train_batch_size * self.args.world_size
        return size * self.args.gradient_accumulation_steps if self.enabled else size

    def record(self, batches: list, merged: int = 1) -> None:
        """The K micro-batches the Trainer fetched for the next optimizer step; `merged`: how many of them each
        forward takes at once (a stage's micro-batch under --stage_micro_batch_sizes; a divisor of K)."""
        if self.enabled:
            runs = [batches[i : i + merged] for i in range(0, len(batches), merged)]
            self.update = _Update(items=batches, merged=merged, batches=[_concatenated(run) for run in runs])

    def take(self, inputs):
        """The batch the Trainer's training_step on micro-batch `inputs` runs: `inputs` itself, or with micro-batches
        merged, None for each but the last of a run (its step does nothing) and for the last the run concatenated.
        The last item of the update ends a run, so the step's last backward is the Trainer's synchronising one (a
        DeepSpeed engine's accumulation boundary: accelerate sets it from the Trainer's sync flag)."""
        update = self.update
        if not self.enabled or update is None or update.merged == 1:
            return inputs
        if update.taken >= len(update.items) or update.items[update.taken] is not inputs:
            raise RuntimeError(_ORDER)
        update.taken += 1
        return update.batches[(update.taken - 1) // update.merged] if update.taken % update.merged == 0 else None

    @contextlib.contextmanager
    def micro_step(self, inputs, embed_and_cache):
        """Around the Trainer's training_step on `inputs`: before the update's first micro-batch,
        `embed_and_cache(update)` (steps 1-2); each micro-batch's forward replays its RNG state."""
        if not self.enabled:
            yield
            return
        update = self.update
        if update is None or update.index >= len(update.batches) or update.batches[update.index] is not inputs:
            raise RuntimeError(_ORDER)
        if update.index == 0:
            embed_and_cache(update)
        _set_rng_state(update.rng[update.index])
        self.in_step = True
        try:
            yield
        finally:
            self.in_step = False
            update.index += 1
            if update.index == len(update.batches):
                _set_rng_state(update.rng_after)
                self.update = None

    def loss(self, model, unwrapped, inputs, return_outputs: bool):
        """Step 3's loss for the micro-batch at hand (`model`: as wrapped for training; `unwrapped`: the model)."""
        update = self.update
        outputs = model(**{**inputs, "return_loss": False, "return_logits": False})  # embeddings only
        num_micro, self.last_forward_rows = len(update.batches), outputs.image_embeds.shape[0]
        surrogate = surrogate_loss(
            outputs.image_embeds,
            outputs.text_embeds,
            logit_params(unwrapped, outputs),
            update.grads[update.index],
            update.param_grads,
            num_micro,
        )
        # Valued at loss / K (the Trainer sums the K micro-step values for its log), with the surrogate's gradient.
        loss = surrogate + (update.loss / num_micro - surrogate).detach()
        return (loss, outputs) if return_outputs else loss

    @staticmethod
    def embed_and_cache(update: _Update, model, unwrapped, prepare_inputs, autocast, teacher=None) -> None:
        """Steps 1 and 2 for the whole update (`prepare_inputs`, `autocast`: the Trainer's); collective under
        torch.distributed. With a distillation `teacher` (train/distill.py) its embeddings of the K micro-batches are
        computed here, once per optimizer step, and the cached gradients are those of the mixed loss over all rows."""
        model.train()
        image_embeds, text_embeds, teacher_embeds, outputs = [], [], [], None
        with torch.no_grad(), autocast():
            for batch in update.batches:
                update.rng.append(_rng_state())
                student, teacher_inputs = split_inputs(prepare_inputs(batch))
                outputs = model(**{**student, "return_loss": False, "return_logits": False})
                image_embeds.append(outputs.image_embeds)
                text_embeds.append(outputs.text_embeds)
                if teacher is not None:  # eval mode, no dropout: it draws nothing from the replayed RNG stream
                    teacher_embeds.append(teacher.embed(teacher_inputs))
        params = logit_params(unwrapped, outputs)
        update.rng_after = _rng_state()
        loss_fn = unwrapped.global_loss
        if teacher is not None:  # the teacher's multiplier (and bias) are the same for every micro-batch
            images, texts, teacher_params = zip(*teacher_embeds)
            loss_fn = teacher.loss_fn(_cat_rows(images), _cat_rows(texts), teacher_params[0])
        update.loss, update.grads, update.param_grads = cached_embedding_gradients(
            image_embeds, text_embeds, params, loss_fn
        )


def _cat_rows(parts: tuple) -> torch.Tensor | list[torch.Tensor]:
    """The micro-batches' teacher embeddings as one batch: one teacher's tensors concatenated, or an ensemble's
    (a list per micro-batch, one tensor per teacher) concatenated teacher by teacher."""
    return torch.cat(parts) if torch.is_tensor(parts[0]) else [torch.cat(rows) for rows in zip(*parts)]
