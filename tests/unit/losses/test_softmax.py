"""DiscoClipLoss against an independent float64 single-process CLIP loss, on 1-4 gloo ranks."""

import math

import pytest
import torch
import torch.nn.functional as F

from disco_clip_ds.losses import DEFAULT_KEEP_BYTES, DiscoClipLoss, disco_clip_loss
from disco_clip_ds.testing.ranks import run_ranks
from disco_clip_ds.testing.wire import WireBytes

DIM = 16
# (impl, chunk_size, keep_bytes): the tiled loss on a ragged multi-tile walk, recomputing its logits in backward
# and keeping them, and with its default single tile (kept: it fits the default budget).
IMPLS = [("disco", None, 0), ("tiled", 3, 0), ("tiled", 3, 1 << 30), ("tiled", None, DEFAULT_KEEP_BYTES)]


def global_features(sizes, seed, dtype=torch.float32):
    """The whole batch, identical on every rank: random unit rows, rounded to `dtype`."""
    g = torch.Generator().manual_seed(seed)
    x = F.normalize(torch.randn(sum(sizes), DIM, generator=g, dtype=torch.float64), dim=1)
    y = F.normalize(torch.randn(sum(sizes), DIM, generator=g, dtype=torch.float64), dim=1)
    return x.to(dtype), y.to(dtype)


def negative_column_features(sizes, seed, dtype=torch.float32):
    """Images all near e1; even texts near e1, odd texts near -e1. At scale 100 an odd text's column holds only
    logits near -100 while every row's maximum is near +100: exp(column - row max) ~ e^-200 underflows fp32."""
    g = torch.Generator().manual_seed(seed)
    n = sum(sizes)
    e1 = F.one_hot(torch.zeros(n, dtype=torch.long), DIM).double()
    x = F.normalize(e1 + 0.05 * torch.randn(n, DIM, generator=g, dtype=torch.float64), dim=1)
    sign = 1.0 - 2.0 * (torch.arange(n) % 2).double()[:, None]
    y = F.normalize(sign * e1 + 0.05 * torch.randn(n, DIM, generator=g, dtype=torch.float64), dim=1)
    return x.to(dtype), y.to(dtype)


def reference(x, y, log_scale):
    """Single-device CLIP loss in float64 and its gradients w.r.t. x, y and the log of the scale."""
    x, y = x.double().requires_grad_(), y.double().requires_grad_()
    t = torch.tensor(log_scale, dtype=torch.float64, requires_grad=True)
    logits = t.exp() * x @ y.T
    labels = torch.arange(len(x))
    loss = (F.cross_entropy(logits, labels) + F.cross_entropy(logits.T, labels)) / 2
    loss.backward()
    return loss.item(), x.grad, y.grad, t.grad.item()


CASES = [  # (sizes per rank as a function of world, log scale, dtype, features)
    (lambda n: [5] * n, math.log(1 / 0.07), torch.float32, global_features),
    (lambda n: [3, 7, 1, 4][:n], math.log(100.0), torch.float32, global_features),
    (lambda n: [6, 2, 5, 3][:n], math.log(1 / 0.07), torch.bfloat16, global_features),
    (lambda n: [4, 0, 3, 2][:n], math.log(1 / 0.07), torch.float32, global_features),  # a rank with no rows (epoch end)
    (lambda n: [6, 3, 5, 4][:n], math.log(100.0), torch.float32, negative_column_features),  # columns far below rows
]


def _rank_losses(rank, world):
    """Every case on this rank: its loss, feature gradients and log-scale gradient."""
    out = []
    for case, (sizes_of, log_scale, dtype, features) in enumerate(CASES):
        sizes = sizes_of(world)
        x, y = features(sizes, seed=case, dtype=dtype)
        lo = sum(sizes[:rank])
        for impl, chunk, keep in IMPLS:
            xi = x[lo : lo + sizes[rank]].clone().requires_grad_()
            yi = y[lo : lo + sizes[rank]].clone().requires_grad_()
            t = torch.tensor(log_scale, requires_grad=True)
            loss = DiscoClipLoss(impl, chunk_size=chunk, keep_bytes=keep)(xi, yi, t.exp())
            loss.backward()
            out.append((case, impl, (chunk, keep), loss.item(), xi.grad.double(), yi.grad.double(), t.grad.item()))
    return out


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.slow
def test_softmax_loss_matches_float64_reference(world):
    per_rank = run_ranks(_rank_losses, world)
    for k, (case, impl, chunk, *_) in enumerate(per_rank[0]):
        sizes_of, log_scale, dtype, features = CASES[case]
        sizes = sizes_of(world)
        ref_loss, ref_gx, ref_gy, ref_gt = reference(*features(sizes, seed=case, dtype=dtype), log_scale)
        assert math.isfinite(ref_loss)
        rows = [r[k] for r in per_rank]
        rtol = 2e-2 if dtype == torch.bfloat16 else 1e-4
        what = (
            f"world={world} sizes={sizes} impl={impl} (chunk, keep)={chunk} dtype={dtype} features={features.__name__}"
        )
        # mean over ranks of the returned values is the global loss
        assert sum(r[3] for r in rows) / world == pytest.approx(ref_loss, rel=rtol), what
        # each rank's feature gradient / N is the global gradient w.r.t. its rows
        for got, ref in (
            (torch.cat([r[4] for r in rows]) / world, ref_gx),
            (torch.cat([r[5] for r in rows]) / world, ref_gy),
        ):
            torch.testing.assert_close(got, ref, rtol=rtol, atol=rtol * ref.abs().max().item() / 10, msg=what)
        # mean over ranks of the logit scale's gradient is the global one
        assert sum(r[6] for r in rows) / world == pytest.approx(ref_gt, rel=rtol, abs=rtol / 10), what


@pytest.mark.parametrize("impl", ["disco", "tiled"])
def test_without_distributed_is_plain_clip_loss(impl):
    x, y = global_features([9], seed=3)
    xi, yi = x.clone().requires_grad_(), y.clone().requires_grad_()
    t = torch.tensor(math.log(20.0), requires_grad=True)
    loss = disco_clip_loss(xi, yi, t.exp(), impl=impl, chunk_size=4)
    loss.backward()
    ref_loss, ref_gx, ref_gy, ref_gt = reference(x, y, math.log(20.0))
    assert loss.item() == pytest.approx(ref_loss, rel=1e-5)
    torch.testing.assert_close(xi.grad.double(), ref_gx, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(yi.grad.double(), ref_gy, rtol=1e-4, atol=1e-6)
    assert t.grad.item() == pytest.approx(ref_gt, rel=1e-4)


def mixed_far_features(n=10, seed=0):
    """Images near e1 (first half) or e2; texts near e1, -e1 or e2 in turn. At scale 100 a tile of e1 images has
    its maximum near +100 while the e2 texts' logits there are near 0 (their sums in that tile underflow, though
    the e2 images give those columns large log-sum-exps) and the -e1 texts' near -100 (their log-sum-exps, ~0 + log
    n, lie ~100 below the e1 rows': the backward's shared rescaling would overflow): exact paths in both passes."""
    g = torch.Generator().manual_seed(seed)
    e = torch.eye(DIM, dtype=torch.float64)
    x = torch.stack([e[0] if i < n // 2 else e[1] for i in range(n)])
    y = torch.stack([(e[0], -e[0], e[1])[j % 3] for j in range(n)])
    noise = lambda: 0.05 * torch.randn(n, DIM, generator=g, dtype=torch.float64)
    return F.normalize(x + noise(), dim=1).float(), F.normalize(y + noise(), dim=1).float()


def band_edge_features():
    """At scale 100: image e1 meets text e1 (the tile's maximum, 100); image e2 meets two texts at 52.5 and 51.5,
    1 nat apart on either side of the edge 48 below that maximum, so that e2's row sums two bands (its top one and
    the one below, both significant). With the roles swapped (texts as rows) the same holds for a column."""
    e = torch.eye(DIM, dtype=torch.float64)
    x = torch.stack([e[0], e[1], e[4]])
    y = torch.stack(
        [e[0], 0.525 * e[1] + math.sqrt(1 - 0.525**2) * e[2], 0.515 * e[1] + math.sqrt(1 - 0.515**2) * e[3]]
    )
    return x.float(), y.float()


def _loss_and_grads(x, y, log_scale, **options):
    xi, yi = x.clone().requires_grad_(), y.clone().requires_grad_()
    t = torch.tensor(log_scale, requires_grad=True)
    loss = disco_clip_loss(xi, yi, t.exp(), **options)
    loss.backward()
    return loss.item(), xi.grad.double(), yi.grad.double(), t.grad.item()


def _assert_matches(got, ref, rtol=1e-4):
    loss, gx, gy, gt = got
    assert loss == pytest.approx(ref[0], rel=rtol)
    torch.testing.assert_close(gx, ref[1], rtol=rtol, atol=rtol / 10 * ref[1].abs().max().item())
    torch.testing.assert_close(gy, ref[2], rtol=rtol, atol=rtol / 10 * ref[2].abs().max().item())
    assert gt == pytest.approx(ref[3], rel=rtol, abs=rtol / 10)


FAR_CASES = {  # name: (features, log scale, chunk_size); each spans over 100 nats within a tile
    "far rows and columns": (mixed_far_features, math.log(100.0), 4),
    "band edge, rows": (band_edge_features, math.log(100.0), None),
    "band edge, columns": (lambda: band_edge_features()[::-1], math.log(100.0), None),
    "spans 2000 nats": (lambda: mixed_far_features(30, seed=1), math.log(1000.0), 7),
}


@pytest.mark.slow  # beyond the fast tier's time budget
@pytest.mark.parametrize("keep", [0, 1 << 30])
@pytest.mark.parametrize("case", FAR_CASES)
def test_far_logits_exact_in_bands(case, keep):
    """The one exponential per logit in bands (softmax._BAND) against float64 autograd, values and gradients, where
    a tile's logits span 100 to 2000 nats: rows and columns far below the tile's maximum, and a row or column whose
    significant terms straddle a band edge."""
    features, log_scale, chunk = FAR_CASES[case]
    x, y = features()
    _assert_matches(_loss_and_grads(x, y, log_scale, chunk_size=chunk, keep_bytes=keep), reference(x, y, log_scale))


@pytest.mark.parametrize(
    "case, name, off",
    [
        ("far rows and columns", "_BAND", 1e30),  # one band: exp(S - tile max) underflows the far rows and columns
        ("band edge, rows", "_NEXT", 0.0),  # the band below the top one dropped: the row loses its second term
        ("band edge, columns", "_NEXT", 0.0),
    ],
)
def test_the_far_cases_need_the_bands(monkeypatch, case, name, off):
    """Turning each part of the bands off breaks its case (the band edges: the forward's loss value already), so
    the cases above do reach them."""
    from disco_clip_ds.losses import softmax as L

    features, log_scale, chunk = FAR_CASES[case]
    x, y = features()
    ref = reference(x, y, log_scale)
    monkeypatch.setattr(L, name, off)
    loss, _, gy, _ = _loss_and_grads(x, y, log_scale, chunk_size=chunk)
    assert not torch.allclose(gy, ref[2], rtol=1e-3, atol=1e-5), f"{name} = {off} still matched"
    if name == "_NEXT":
        assert not math.isclose(loss, ref[0], rel_tol=1e-3), f"{name} = {off}: the forward still matched"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("impl", ["disco", "tiled"])
def test_finite_at_max_scale_with_identical_rows(impl, dtype):
    # Every logit equals the max scale 100: the worst case for an exp without a max shift.
    x = F.normalize(torch.ones(6, 8), dim=1).to(dtype).requires_grad_()
    y = x.detach().clone().requires_grad_()
    loss = disco_clip_loss(x, y, torch.tensor(100.0), impl=impl, chunk_size=4)
    loss.backward()
    assert loss.item() == pytest.approx(math.log(6), rel=1e-2)  # uniform softmax over 6 columns
    assert torch.isfinite(x.grad.float()).all() and torch.isfinite(y.grad.float()).all()


def test_half_inputs_keep_fp32_logits():
    # bf16 logits of magnitude ~100 would be rounded by 0.25-0.5; the loss must not see that.
    x, y = global_features([32], seed=5, dtype=torch.bfloat16)
    ref_loss = reference(x, y, math.log(100.0))[0]
    for impl in ("disco", "tiled"):
        assert disco_clip_loss(x, y, torch.tensor(100.0), impl=impl).item() == pytest.approx(ref_loss, rel=1e-4)


@pytest.mark.parametrize("impl", ["disco", "tiled"])
def test_autocast_keeps_fp32_logits(impl):
    x, y = global_features([32], seed=6)
    ref_loss = reference(x, y, math.log(100.0))[0]
    xi = x.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = disco_clip_loss(xi, y, torch.tensor(100.0), impl=impl)
    loss.backward()
    assert loss.dtype == torch.float32 and loss.item() == pytest.approx(ref_loss, rel=1e-5)
    assert torch.isfinite(xi.grad).all()


def test_no_grad_and_argument_errors():
    x, y = global_features([4], seed=0)
    with torch.no_grad():
        assert torch.isfinite(disco_clip_loss(x, y, torch.tensor(10.0), impl="tiled"))
    with pytest.raises(ValueError, match="impl must be one of"):
        DiscoClipLoss("naive")
    with pytest.raises(ValueError, match="chunk_size"):
        disco_clip_loss(x, y, torch.tensor(10.0), chunk_size=0)
    with pytest.raises(ValueError, match="keep_bytes"):
        DiscoClipLoss(keep_bytes=-1)


BAD_INPUTS = {  # what rank 1 passes; every rank must raise, naming the problem
    "3-D features": (lambda x, y: (x[None], y[None]), "must be 2-D"),
    "image/text mismatch": (lambda x, y: (x, y[:-1]), "differ in shape"),
    "feature dim differs": (lambda x, y: (x[:, :-1], y[:, :-1]), "feature dim differs between ranks"),
}


BAD_SCALE = ("scale not 0-dim", "logit_scale must be a 0-dim")


def _bad_input_rank(rank, world):
    """Every case of BAD_INPUTS and BAD_SCALE in turn, in one process group (a refused call leaves the ranks in
    step, so the next case starts clean): {case: the message this rank raised, or None}."""
    said = {}
    for case in [*BAD_INPUTS, BAD_SCALE[0]]:
        x, y = global_features([4], seed=rank)
        scale = torch.tensor(10.0)
        if case == BAD_SCALE[0]:
            scale = scale.reshape(1) if rank == 1 else scale
        elif rank == 1:
            x, y = BAD_INPUTS[case][0](x, y)
        try:
            DiscoClipLoss("tiled")(x, y, scale).backward()
            said[case] = None
        except ValueError as e:
            said[case] = str(e)
    return said


@pytest.mark.slow
def test_bad_input_raises_on_every_rank():
    expected = {**{case: message for case, (_, message) in BAD_INPUTS.items()}, BAD_SCALE[0]: BAD_SCALE[1]}
    for rank, said in enumerate(run_ranks(_bad_input_rank, 3, timeout=60)):
        for case, message in said.items():
            assert message is not None and expected[case] in message, f"{case}, rank {rank}: {message}"
            if case != "feature dim differs":
                assert "rank 1" in message, f"{case}, rank {rank}: {message}"


def _weighted_rank(rank, world, sizes, weights):
    """Rank r back-propagates weights[r] * its loss (a per-rank loss scale): the gradients it receives."""
    x, y = global_features(sizes, seed=7)
    lo = sum(sizes[:rank])
    out = []
    for keep in (0, 1 << 30):
        xi = x[lo : lo + sizes[rank]].clone().requires_grad_()
        yi = y[lo : lo + sizes[rank]].clone().requires_grad_()
        t = torch.tensor(math.log(30.0), requires_grad=True)
        (weights[rank] * DiscoClipLoss("tiled", chunk_size=2, keep_bytes=keep)(xi, yi, t.exp())).backward()
        out.append((xi.grad.double(), yi.grad.double(), t.grad.item()))
    return out


@pytest.mark.slow
def test_per_rank_upstream_gradients_reach_the_right_columns():
    """A text's column log-sum-exp is in its owner's loss but its logits are on every rank: its gradient must
    carry the owner's upstream factor. Reference: float64 d(sum_r w_r l_r) with l_r written out per rank."""
    sizes, weights = [3, 5, 2], [1.0, 3.0, 0.5]
    per_rank = run_ranks(_weighted_rank, 3, sizes, weights)
    x, y = (t.double().requires_grad_() for t in global_features(sizes, seed=7))
    t = torch.tensor(math.log(30.0), dtype=torch.float64, requires_grad=True)
    logits = t.exp() * x @ y.T
    terms = logits.logsumexp(1) + logits.logsumexp(0) - 2 * logits.diag()  # row i, column i, positive i
    owner_weight = torch.tensor(weights, dtype=torch.float64).repeat_interleave(torch.tensor(sizes))
    (len(sizes) / (2 * sum(sizes)) * (owner_weight * terms).sum()).backward()
    for keep in range(2):
        torch.testing.assert_close(torch.cat([r[keep][0] for r in per_rank]), x.grad, rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(torch.cat([r[keep][1] for r in per_rank]), y.grad, rtol=1e-4, atol=1e-6)
        assert sum(r[keep][2] for r in per_rank) == pytest.approx(t.grad.item(), rel=1e-4)


def _wire_rank(rank, world, sizes, dim, dtypes):
    """Bytes this rank sends through each collective during one forward + backward, per dtype and impl."""
    return {dtype: _wire_bytes(rank, sizes, dim, dtype) for dtype in dtypes}


def _wire_bytes(rank, sizes, dim, dtype):
    g = torch.Generator().manual_seed(rank)
    out = {}
    for impl in ("disco", "tiled"):
        x, y = (
            F.normalize(torch.randn(sizes[rank], dim, generator=g), dim=1).to(dtype).requires_grad_() for _ in range(2)
        )
        with WireBytes() as wire:
            DiscoClipLoss(impl)(x, y, torch.tensor(20.0)).backward()
        out[impl] = wire.total
    return out


@pytest.mark.slow
def test_wire_bytes_per_rank_halve():
    """Bytes on the wire per rank per step, counted at torch.distributed's collectives (ring algorithms), against
    the hand count: the one-block loss gathers and reduce-scatters the texts only, plus two all-reduces of B
    fp32 column values and one of the N upstream gradients; disco (and the earlier two-block tiled loss, kept as
    a baseline in bench/loss, whose collectives are disco's) move both modalities."""
    sizes, dim, dtypes = [6, 3, 5], 512, (torch.float32, torch.bfloat16)
    for rank, per_dtype in enumerate(run_ranks(_wire_rank, len(sizes), sizes, dim, dtypes)):
        for dtype, got in per_dtype.items():
            _check_wire_bytes(got, sizes, dim, dtype.itemsize, f"rank {rank}, {dtype}")


def _check_wire_bytes(got: dict, sizes: list[int], dim: int, elem: int, where: str) -> None:
    n, pad, total = len(sizes), max(sizes), sum(sizes)
    shape_check = (n - 1) * 7 * 8  # every rank's 7 int64 shape values
    feature = (n - 1) * pad * dim * elem  # one modality's (padded) rows, all-gathered or reduce-scattered
    twoblock = shape_check + 4 * feature  # both modalities gathered, their gradients reduce-scattered
    expected = {
        "disco": shape_check + 4 * feature,
        "tiled": shape_check + 2 * feature + 2 * (2 * (n - 1) / n * total * 4) + (n - 1) * 4,
    }
    assert got == pytest.approx(expected), where
    assert got["tiled"] / twoblock < 0.51, where
