"""SigLIP's pairwise sigmoid loss over the global batch of all ranks, each logit computed once. Torch only.

Notation as in softmax.py: rank r holds b_r image rows x_i and text rows y_j (L2-normalised), B = sum_r b_r,
s = exp(logit_scale), t = logit_bias, u_ij = s x_i . y_j + t, z_ij = +1 when i = j and -1 otherwise. The global
loss (Zhai et al., 2023) is

    L = -(1/B) sum_i sum_j log sigmoid(z_ij u_ij) = (1/B) sum_ij [softplus(u_ij) - [i = j] u_ij].

Rank r returns l_r = N/B * (its image rows' terms against all B texts), so mean_r l_r = L. With no normaliser
over a row or column, the B x B pairs split into blocks that need nothing from each other: rank r walks its
image rows against one rank's text block at a time, the text blocks passing rank to rank around a ring, so a
rank never holds more than two text blocks and a tile of logits, whatever the number of ranks. Only the texts
travel. In backward the blocks go round again with their gradient, each rank adding its rows' part, so that
after the last step every text block is back with its owner carrying d(sum_r g_r l_r)/d(its rows) for any
upstream gradients g_r: data-parallel averaging then gives every encoder parameter, s and t exactly dL/dtheta,
as for the softmax loss. The logits are recomputed in backward rather than kept (they are b x B per rank).

d/du_ij of the summand is sigmoid(u_ij) - [i = j], so a tile's gradient is one sigmoid of its logits.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from disco_clip_ds.losses.comm import check_inputs, rank_and_world
from disco_clip_ds.losses.tiles import Ring, add_ring_tile_gradient, as_fp32, as_scalar, check_options, tile_rows

default_chunk_size = tile_rows  # image rows per tile against one rank's text block of `block_rows` rows


class _RingSigmoid(torch.autograd.Function):
    """sum over this rank's image rows i and all texts j of softplus(u_ij) - [i = j] u_ij, texts streamed round
    the ring (forward: N - 1 steps of text blocks; backward: N - 1 of text blocks and N of their fp32
    gradients, the last one bringing each gradient home)."""

    @staticmethod
    def forward(ctx, images, texts, scale, bias, sizes, group, chunk):
        images32 = images.float()
        total = images32.new_zeros(())
        for own, rows, (block32,) in Ring(sizes, group, chunk, texts).walk(images32):
            logits = torch.addmm(bias, images32[rows] * scale, block32.T)
            total += F.softplus(logits).sum()
            if own:  # the positive pairs (i, i) lie on this block's diagonal
                total -= logits.diagonal(rows.start).sum()
        ctx.save_for_backward(images, texts, scale, bias)
        ctx.meta = (sizes, group, chunk)
        return total

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_total):
        images, texts, scale, bias = ctx.saved_tensors
        g = grad_total.float()
        images32 = images.float()
        grad_i = torch.zeros_like(images32)
        sums = [images32.new_zeros(()), images32.new_zeros(())]  # dL/ds, dL/dt
        ring = Ring(*ctx.meta, texts)
        ring.grad = torch.zeros(texts.shape, dtype=torch.float32, device=texts.device)
        for own, rows, (block32,) in ring.walk(images32, backward=True):
            q = images32[rows]
            dots = q @ block32.T
            grad = torch.sigmoid(dots * scale + bias)
            if own:
                grad.diagonal(rows.start).sub_(1.0)
            add_ring_tile_gradient(grad.mul_(g), rows, q, dots, block32, scale, grad_i, ring.grad, sums)
        return (
            grad_i.to(images.dtype),
            ring.grad.to(texts.dtype),
            sums[0].to(scale.dtype),
            sums[1].to(bias.dtype),
            None,
            None,
            None,
        )


def sigmoid_loss(image_features, text_features, logit_scale, logit_bias, chunk_size=None, group=None) -> torch.Tensor:
    """Functional form of :class:`SigmoidLoss`; see the module docstring for the exact contract."""
    check_options(chunk_size)
    logit_scale, logit_bias = as_scalar(logit_scale), as_scalar(logit_bias)
    scalars = {"logit_scale": logit_scale, "logit_bias": logit_bias}
    sizes = check_inputs(image_features, text_features, scalars, group, "SigmoidLoss")
    world, total = rank_and_world(group)[1], sum(sizes)
    device = image_features.device
    # Autocast would run the logit matmuls in 16 bits: the loss keeps its own fp32.
    with torch.autocast(device_type=device.type, enabled=False):
        scale, bias = as_fp32(logit_scale, device), as_fp32(logit_bias, device)
        chunk = chunk_size or default_chunk_size(max(sizes))
        terms = _RingSigmoid.apply(image_features, text_features, scale, bias, sizes, group, chunk)
        return terms * (world / total) if total else terms


class SigmoidLoss(nn.Module):
    """Global-batch sigmoid (SigLIP) loss over all ranks of `group`, each rank computing only its own rows.

    forward(image_features, text_features, logit_scale, logit_bias): this rank's (b, d) L2-normalised features
    (ranks may hold different b, or none), the logit multiplier (e.g. `model.logit_scale.exp()`) and the bias.
    Returns this rank's share l_r with mean_r l_r = the single-device loss over the global batch, and gradients
    such that data-parallel averaging yields exactly the global-batch gradient. Without torch.distributed it is
    SigLIP's loss on the local batch. `chunk_size`: image rows per tile (None: about 8 MiB of logits per tile).
    """

    def __init__(self, chunk_size: int | None = None, group=None):
        super().__init__()
        check_options(chunk_size)
        self.chunk_size, self.group = chunk_size, group

    def forward(self, image_features, text_features, logit_scale, logit_bias) -> torch.Tensor:
        return sigmoid_loss(image_features, text_features, logit_scale, logit_bias, self.chunk_size, self.group)

    def extra_repr(self) -> str:
        return f"chunk_size={self.chunk_size}"
