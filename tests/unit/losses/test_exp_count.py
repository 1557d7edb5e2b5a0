"""Exponentials per logit of the tiled CLIP loss, counted at torch's dispatcher: every aten op that computes an
exponential (exp, logsumexp, softmax, logaddexp, sigmoid, pow, ...), weighted by the elements it exponentiates."""

import math

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from disco_clip_ds.losses import disco_clip_loss

# aten ops (overload packets) that compute one exponential per element of their largest tensor argument or result;
# a reduction such as logsumexp one per input element.
EXPONENTIALS = {
    "exp", "exp_", "exp2", "exp2_", "expm1", "expm1_", "logaddexp", "logaddexp2", "logsumexp", "_softmax",
    "_log_softmax", "softmax", "log_softmax", "sigmoid", "sigmoid_", "tanh", "tanh_", "pow", "pow_", "float_power",
    "_softmax_backward_data", "_log_softmax_backward_data", "sinh", "cosh", "elu", "softplus", "silu", "mish",
}  # fmt: skip


class CountedExponentials(TorchDispatchMode):
    """Counts the exponentials the ops of EXPONENTIALS compute while the mode is active: {op name: elements}."""

    def __init__(self):
        super().__init__()
        self.counts: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if name in EXPONENTIALS:
            tensors = [t for t in (*args, *(kwargs or {}).values(), out) if isinstance(t, torch.Tensor)]
            self.counts[name] = self.counts.get(name, 0) + max(t.numel() for t in tensors)
        return out

    @property
    def total(self) -> int:
        return sum(self.counts.values())


def _count(batch, chunk, keep_bytes):
    """(forward, backward) exponentials of one tiled loss call on `batch` pairs in tiles of `chunk` rows."""
    g = torch.Generator().manual_seed(0)
    x, y = (F.normalize(torch.randn(batch, 16, generator=g), dim=1).requires_grad_() for _ in range(2))
    scale = torch.tensor(math.log(100.0), requires_grad=True)
    with CountedExponentials() as forward:
        loss = disco_clip_loss(x, y, scale.exp(), chunk_size=chunk, keep_bytes=keep_bytes)
    with CountedExponentials() as backward:
        loss.backward()
    return forward, backward


@pytest.mark.slow  # beyond the fast tier's time budget
@pytest.mark.parametrize("keep_bytes", [0, 1 << 30])
def test_one_exponential_per_logit_each_pass(keep_bytes):
    """B x B logits in B / R tiles of R rows: each pass exponentiates every logit once; besides, the forward merges
    each tile's B column sums into the running column log-sum-exps (logaddexp: B per tile) and the backward
    rescales each tile's R rows and B columns (R + B per tile). The scale's own exp is 1."""
    batch, rows = 64, 8
    tiles, logits = batch // rows, batch * batch
    forward, backward = _count(batch, rows, keep_bytes)
    assert forward.total == logits + tiles * batch + 1, forward.counts
    assert backward.total == logits + tiles * (rows + batch), backward.counts
    assert forward.total / logits < 1.2 and backward.total / logits < 1.2


def test_the_counter_sees_each_kind_of_exponential():
    """A planted exponential of each kind is counted with its elements, so a second pass cannot hide."""
    x = torch.randn(4, 5)
    with CountedExponentials() as counted:
        x.exp(), torch.logsumexp(x, 1), torch.softmax(x, 0), torch.logaddexp(x, x), torch.sigmoid(x), 2.0**x
    assert counted.total == 6 * 20, counted.counts
