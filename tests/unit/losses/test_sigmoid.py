"""SigmoidLoss against an independent float64 single-process SigLIP loss, on 1-4 gloo ranks."""

import math

import pytest
import torch
import torch.nn.functional as F

from disco_clip_ds.losses.sigmoid import SigmoidLoss, sigmoid_loss
from disco_clip_ds.testing.ranks import run_ranks

DIM = 16
LOG_SCALE, BIAS = math.log(10.0), -10.0  # SigLIP's initialisation


def global_features(sizes, seed, dtype=torch.float32):
    """The whole batch, identical on every rank: random unit rows, rounded to `dtype`."""
    g = torch.Generator().manual_seed(seed)
    x = F.normalize(torch.randn(sum(sizes), DIM, generator=g, dtype=torch.float64), dim=1)
    y = F.normalize(x + 0.5 * torch.randn(sum(sizes), DIM, generator=g, dtype=torch.float64), dim=1)  # paired
    return x.to(dtype), y.to(dtype)


def reference(x, y, log_scale, bias):
    """The paper's loss in float64, written from its formula, and its gradients w.r.t. x, y, log scale, bias."""
    x, y = x.double().requires_grad_(), y.double().requires_grad_()
    t = torch.tensor(log_scale, dtype=torch.float64, requires_grad=True)
    b = torch.tensor(bias, dtype=torch.float64, requires_grad=True)
    n = len(x)
    z = 2 * torch.eye(n, dtype=torch.float64) - 1
    loss = -F.logsigmoid(z * (t.exp() * x @ y.T + b)).sum() / n
    loss.backward()
    return loss.item(), x.grad, y.grad, t.grad.item(), b.grad.item()


CASES = [  # (sizes per rank as a function of world, log scale, bias, dtype, chunk)
    (lambda n: [5] * n, LOG_SCALE, BIAS, torch.float32, None),
    (lambda n: [3, 7, 1, 4][:n], math.log(100.0), -3.0, torch.float32, 2),
    (lambda n: [6, 2, 5, 3][:n], LOG_SCALE, BIAS, torch.bfloat16, 4),
    (lambda n: [4, 0, 3, 2][:n], math.log(30.0), 0.5, torch.float32, 3),  # a rank with no rows
]


def _rank_losses(rank, world):
    out = []
    for case, (sizes_of, log_scale, bias, dtype, chunk) in enumerate(CASES):
        sizes = sizes_of(world)
        x, y = global_features(sizes, seed=case, dtype=dtype)
        lo = sum(sizes[:rank])
        xi = x[lo : lo + sizes[rank]].clone().requires_grad_()
        yi = y[lo : lo + sizes[rank]].clone().requires_grad_()
        t = torch.tensor([log_scale], requires_grad=True)  # shape (1,), as SiglipModel's
        b = torch.tensor([bias], requires_grad=True)
        loss = SigmoidLoss(chunk_size=chunk)(xi, yi, t.exp(), b)
        loss.backward()
        out.append((loss.item(), xi.grad.double(), yi.grad.double(), t.grad.item(), b.grad.item()))
    return out


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.slow
def test_sigmoid_loss_matches_float64_reference(world):
    per_rank = run_ranks(_rank_losses, world)
    for case, (sizes_of, log_scale, bias, dtype, chunk) in enumerate(CASES):
        sizes = sizes_of(world)
        ref_loss, ref_gx, ref_gy, ref_gt, ref_gb = reference(*global_features(sizes, case, dtype), log_scale, bias)
        rows = [r[case] for r in per_rank]
        rtol = 2e-2 if dtype == torch.bfloat16 else 1e-4
        what = f"world={world} sizes={sizes} chunk={chunk} dtype={dtype}"
        assert sum(r[0] for r in rows) / world == pytest.approx(ref_loss, rel=rtol), what  # mean_r l_r = L
        for got, ref in ((torch.cat([r[1] for r in rows]), ref_gx), (torch.cat([r[2] for r in rows]), ref_gy)):
            # each rank's feature gradient / N is the global gradient w.r.t. its rows
            torch.testing.assert_close(got / world, ref, rtol=rtol, atol=rtol * ref.abs().max().item() / 10, msg=what)
        # the mean over ranks of the scale's and the bias's gradients are the global ones
        assert sum(r[3] for r in rows) / world == pytest.approx(ref_gt, rel=rtol, abs=rtol / 10), what
        assert sum(r[4] for r in rows) / world == pytest.approx(ref_gb, rel=rtol, abs=rtol / 10), what


def _weighted_rank(rank, world, sizes, weights):
    """Rank r back-propagates weights[r] * its loss: the gradients its features receive."""
    x, y = global_features(sizes, seed=7)
    lo = sum(sizes[:rank])
    xi = x[lo : lo + sizes[rank]].clone().requires_grad_()
    yi = y[lo : lo + sizes[rank]].clone().requires_grad_()
    (weights[rank] * SigmoidLoss(chunk_size=2)(xi, yi, torch.tensor(10.0), torch.tensor(-10.0))).backward()
    return xi.grad.double(), yi.grad.double()


@pytest.mark.slow
def test_per_rank_upstream_gradients_reach_the_owner_of_each_text():
    """A text's logits are on every rank, each in that rank's loss: its gradient sums each rank's upstream factor
    times that rank's part. Reference: float64 d(sum_r w_r l_r), l_r written out per rank from the formula."""
    sizes, weights = [3, 5, 2], [1.0, 3.0, 0.5]
    per_rank = run_ranks(_weighted_rank, 3, sizes, weights)
    x, y = (t.double().requires_grad_() for t in global_features(sizes, seed=7))
    n = sum(sizes)
    z = 2 * torch.eye(n, dtype=torch.float64) - 1
    row_terms = -F.logsigmoid(z * (10.0 * x @ y.T - 10.0)).sum(1)  # image i's terms, in its owner's loss
    row_weight = torch.tensor(weights, dtype=torch.float64).repeat_interleave(torch.tensor(sizes))
    (len(sizes) / n * (row_weight * row_terms).sum()).backward()
    torch.testing.assert_close(torch.cat([r[0] for r in per_rank]), x.grad, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(torch.cat([r[1] for r in per_rank]), y.grad, rtol=1e-4, atol=1e-6)


def test_without_distributed_is_siglip_loss():
    """One process: the value and gradients of the float64 formula, for every tile size."""
    x, y = global_features([9], seed=3)
    ref_loss, ref_gx, ref_gy, ref_gt, ref_gb = reference(x, y, LOG_SCALE, BIAS)
    for chunk in (1, 4, None):
        xi, yi = x.clone().requires_grad_(), y.clone().requires_grad_()
        t, b = torch.tensor(LOG_SCALE, requires_grad=True), torch.tensor(BIAS, requires_grad=True)
        loss = sigmoid_loss(xi, yi, t.exp(), b, chunk_size=chunk)
        loss.backward()
        assert loss.item() == pytest.approx(ref_loss, rel=1e-5)
        torch.testing.assert_close(xi.grad.double(), ref_gx, rtol=1e-4, atol=1e-7)
        torch.testing.assert_close(yi.grad.double(), ref_gy, rtol=1e-4, atol=1e-7)
        assert (t.grad.item(), b.grad.item()) == pytest.approx((ref_gt, ref_gb), rel=1e-4)


@pytest.mark.slow  # imports transformers
def test_matches_transformers_siglip_loss():
    """transformers' SiglipModel computes the same loss on a local batch (its own formula and code)."""
    from transformers import SiglipConfig, SiglipModel

    torch.manual_seed(0)
    config = SiglipConfig(
        text_config={
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "vocab_size": 50,
            "max_position_embeddings": 8,
        },
        vision_config={
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "image_size": 16,
            "patch_size": 8,
        },
    )
    model = SiglipModel(config).eval()
    with torch.no_grad():
        model.logit_scale.fill_(LOG_SCALE)
        model.logit_bias.fill_(BIAS)
        ids = torch.randint(0, 50, (6, 8))
        out = model(input_ids=ids, pixel_values=torch.randn(6, 3, 16, 16), return_loss=True)
        ours = sigmoid_loss(out.image_embeds, out.text_embeds, model.logit_scale.exp(), model.logit_bias)
    assert ours.item() == pytest.approx(out.loss.item(), rel=1e-5)


def test_argument_errors():
    x, y = global_features([4], seed=0)
    with pytest.raises(ValueError, match="chunk_size"):
        SigmoidLoss(chunk_size=0)
    with pytest.raises(ValueError, match="logit_bias must be a 0-dim"):
        sigmoid_loss(x, y, torch.tensor(10.0), torch.zeros(2))
    with pytest.raises(ValueError, match="differ in shape"):
        sigmoid_loss(x, y[:-1], torch.tensor(10.0), -10.0)
    with torch.no_grad():
        assert torch.isfinite(sigmoid_loss(x, y, torch.tensor(10.0), -10.0))


def _wire_rank(rank, world, sizes, dim, dtypes):
    """Bytes this rank sends during one forward + backward, per dtype."""
    from disco_clip_ds.testing.wire import WireBytes

    sent = {}
    for dtype in dtypes:
        g = torch.Generator().manual_seed(rank)
        x, y = (F.normalize(torch.randn(sizes[rank], dim, generator=g), dim=1).to(dtype).requires_grad_() for _ in "xy")
        with WireBytes() as wire:
            SigmoidLoss()(x, y, torch.tensor(10.0), torch.tensor(-10.0)).backward()
        sent[dtype] = wire.total
    return sent


@pytest.mark.slow
def test_only_texts_travel():
    """Hand count per rank: the shape check (an all-gather of 8 int64), then the other ranks' text blocks pass
    through every rank but one in forward and again in backward, and each block's fp32 gradient makes the full
    round (N sends) to come home. Each rank forwards the blocks of all ranks but its left neighbour."""
    sizes, dim, n = [6, 3, 5], 512, 3
    for rank, per_dtype in enumerate(run_ranks(_wire_rank, n, sizes, dim, (torch.float32, torch.bfloat16))):
        for dtype, got in per_dtype.items():
            forwarded = [sizes[(rank - k) % n] for k in range(n - 1)]  # the blocks this rank sends on, hop by hop
            texts = 2 * sum(forwarded) * dim * dtype.itemsize
            grads = sum(sizes[(rank - k) % n] for k in range(n)) * dim * 4
            assert got == (n - 1) * 8 * 8 + texts + grads, f"rank {rank}, {dtype}"


def _peak_rank(rank, world, batch, dim) -> float:
    from disco_clip_ds.testing.memory import peak_extra_mib

    g = torch.Generator().manual_seed(rank)
    x, y = (F.normalize(torch.randn(batch, dim, generator=g), dim=1).requires_grad_() for _ in "xy")
    scale, bias = torch.tensor(10.0, requires_grad=True), torch.tensor(-10.0, requires_grad=True)
    loss_fn = SigmoidLoss()
    loss_fn(x[:8], y[:8], scale, bias).backward()  # thread pools and gloo buffers are set up once per process

    def step():
        loss_fn(x, y, scale, bias).backward()
        x.grad = y.grad = scale.grad = bias.grad = None

    return peak_extra_mib(step)


@pytest.mark.slow
def test_peak_memory_per_rank_does_not_grow_with_ranks():
    """Fixed local batch 2048, d = 256, fp32: one rank's peak above its inputs on 2 and on 4 ranks. A loss that
    gathered the texts (or kept every received block's logits, as autograd through a ring would) would add
    (N - 1) x its 2 MiB block and its 16 MiB of logits per further rank."""
    from disco_clip_ds.testing.memory import mmap_threshold_env

    batch, dim = 2048, 256
    peaks = {n: max(run_ranks(_peak_rank, n, batch, dim, env=mmap_threshold_env(1 << 20))) for n in (2, 4)}
    assert peaks[4] < peaks[2] * 1.1 + 2, peaks
