"""The distillation losses against independent float64 single-process whole-batch references, on 1-4 gloo ranks."""

import math

import pytest
import torch
import torch.nn.functional as F

from disco_clip_ds.losses.distill import (
    SigmoidDistillLoss,
    SoftmaxDistillLoss,
    sigmoid_distill_loss,
    softmax_distill_loss,
)
from disco_clip_ds.testing.ranks import run_ranks

DIM, TEACHER_DIM = 16, 24  # the teacher is wider: only similarities are compared


def global_features(sizes, seed, dtype=torch.float32):
    """The whole batch, identical on every rank: the student's and the teacher's unit rows of the same samples
    (image and text paired, the teacher's similarities not the student's), rounded to `dtype`."""
    g = torch.Generator().manual_seed(seed)
    n = sum(sizes)
    out = []
    for dim in (DIM, TEACHER_DIM):
        x = F.normalize(torch.randn(n, dim, generator=g, dtype=torch.float64), dim=1)
        y = F.normalize(x + 0.7 * torch.randn(n, dim, generator=g, dtype=torch.float64), dim=1)
        out += [x.to(dtype), y.to(dtype)]
    return out  # x, y, teacher x, teacher y


def softmax_reference(x, y, xt, yt, log_scale, teacher_scale, weight=1.0):
    """KL(teacher || student) over the B columns of each image row and the B rows of each text column, in float64
    from the full B x B matrices, averaged as CLIP's cross-entropies; with weight W < 1, (1 - W) CLIP's loss (the
    mean of both directions' cross-entropies) + W that. Gradients w.r.t. x, y and the log scale."""
    x, y = x.double().requires_grad_(), y.double().requires_grad_()
    t = torch.tensor(log_scale, dtype=torch.float64, requires_grad=True)
    student = t.exp() * x @ y.T
    teacher = teacher_scale * xt.double() @ yt.double().T
    n = len(x)
    kl = lambda dim: F.kl_div(
        student.log_softmax(dim), teacher.log_softmax(dim), log_target=True, reduction="sum"
    )  # sum over rows (dim 1) or columns (dim 0) of their KLs
    labels = torch.arange(n)
    clip = (F.cross_entropy(student, labels) + F.cross_entropy(student.T, labels)) / 2
    loss = weight * (kl(1) / n + kl(0) / n) / 2 + (1 - weight) * clip
    loss.backward()
    return loss.item(), x.grad, y.grad, t.grad.item()


def sigmoid_reference(x, y, xt, yt, log_scale, bias, teacher_scale, teacher_bias, weight=1.0):
    """Per-pair BCE of the student's sigmoid against the teacher's, summed over the B x B pairs / B (SigLIP's
    normalisation), in float64; with weight W < 1, (1 - W) SigLIP's loss (labels +1 on the diagonal, -1 off it) + W
    that. Gradients w.r.t. x, y, log scale and bias."""
    x, y = x.double().requires_grad_(), y.double().requires_grad_()
    t = torch.tensor(log_scale, dtype=torch.float64, requires_grad=True)
    b = torch.tensor(bias, dtype=torch.float64, requires_grad=True)
    student = t.exp() * x @ y.T + b
    target = torch.sigmoid(teacher_scale * xt.double() @ yt.double().T + teacher_bias)
    distill = -(target * F.logsigmoid(student) + (1 - target) * F.logsigmoid(-student)).sum() / len(x)
    signs = 2 * torch.eye(len(x), dtype=torch.float64) - 1
    loss = weight * distill + (1 - weight) * -F.logsigmoid(signs * student).sum() / len(x)
    loss.backward()
    return loss.item(), x.grad, y.grad, t.grad.item(), b.grad.item()


CASES = [  # (sizes per rank as a function of world, dtype, chunk, distill weight)
    (lambda n: [5] * n, torch.float32, None, 1.0),
    (lambda n: [3, 7, 1, 4][:n], torch.float32, 2, 1.0),
    (lambda n: [6, 2, 5, 3][:n], torch.bfloat16, 4, 1.0),
    (lambda n: [4, 0, 3, 2][:n], torch.float32, 3, 1.0),  # a rank with no rows (epoch end)
    (lambda n: [3, 7, 1, 4][:n], torch.float32, 2, 0.3),  # mixed with the contrastive loss
    (lambda n: [4, 0, 3, 2][:n], torch.float32, 3, 0.0),  # the contrastive loss alone
]
SOFTMAX = (math.log(30.0), 1 / 0.05)  # student log scale; teacher scale (1 / temperature)
SIGMOID = (math.log(10.0), -5.0, 20.0, -8.0)  # student log scale and bias; teacher scale and bias


def _rank_losses(rank, world):
    """Both losses on every case on this rank: loss, gradients of the features, log scale (and bias)."""
    out = []
    for case, (sizes_of, dtype, chunk, weight) in enumerate(CASES):
        sizes = sizes_of(world)
        x, y, xt, yt = global_features(sizes, seed=case, dtype=dtype)
        mine = slice(sum(sizes[:rank]), sum(sizes[: rank + 1]))
        xi, yi = x[mine].clone().requires_grad_(), y[mine].clone().requires_grad_()
        t = torch.tensor(SOFTMAX[0], requires_grad=True)
        loss_fn = SoftmaxDistillLoss(chunk, distill_weight=weight)
        loss = loss_fn(xi, yi, t.exp(), xt[mine], yt[mine], torch.tensor(SOFTMAX[1]))
        loss.backward()
        soft = (loss.item(), xi.grad.double(), yi.grad.double(), t.grad.item())
        xi, yi = x[mine].clone().requires_grad_(), y[mine].clone().requires_grad_()
        t = torch.tensor([SIGMOID[0]], requires_grad=True)  # shape (1,), as SiglipModel's
        b = torch.tensor([SIGMOID[1]], requires_grad=True)
        loss_fn = SigmoidDistillLoss(chunk, distill_weight=weight)
        loss = loss_fn(xi, yi, t.exp(), b, xt[mine], yt[mine], *map(torch.tensor, SIGMOID[2:]))
        loss.backward()
        out.append((soft, (loss.item(), xi.grad.double(), yi.grad.double(), t.grad.item(), b.grad.item())))
    return out


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.slow
def test_distill_losses_match_float64_reference(world):
    per_rank = run_ranks(_rank_losses, world)
    for case, (sizes_of, dtype, chunk, weight) in enumerate(CASES):
        sizes = sizes_of(world)
        features = global_features(sizes, seed=case, dtype=dtype)
        rtol = 2e-2 if dtype == torch.bfloat16 else 1e-4
        refs = (softmax_reference(*features, *SOFTMAX, weight), sigmoid_reference(*features, *SIGMOID, weight))
        for which, ref in enumerate(refs):
            rows = [r[case][which] for r in per_rank]
            what = f"{('softmax', 'sigmoid')[which]} world={world} sizes={sizes} chunk={chunk} {dtype} W={weight}"
            assert sum(r[0] for r in rows) / world == pytest.approx(ref[0], rel=rtol), what  # mean_r l_r = L
            for k in (1, 2):  # each rank's feature gradient / N is the global gradient w.r.t. its rows
                got = torch.cat([r[k] for r in rows]) / world
                torch.testing.assert_close(got, ref[k], rtol=rtol, atol=rtol * ref[k].abs().max().item() / 10, msg=what)
            for k in range(3, len(ref)):  # the mean over ranks of the scale's (and bias's) gradient is the global one
                assert sum(r[k] for r in rows) / world == pytest.approx(ref[k], rel=rtol, abs=rtol / 10), what


def _weighted_rank(rank, world, sizes, weights):
    """Rank r back-propagates weights[r] * its loss (a per-rank loss scale): the gradients its features receive."""
    x, y, xt, yt = global_features(sizes, seed=7)
    mine = slice(sum(sizes[:rank]), sum(sizes[: rank + 1]))
    out = []
    for loss_fn, scalars in (
        (SoftmaxDistillLoss(2), lambda: (torch.tensor(30.0), xt[mine], yt[mine], torch.tensor(20.0))),
        (SigmoidDistillLoss(2), lambda: (torch.tensor(10.0), -5.0, xt[mine], yt[mine], 20.0, -8.0)),
    ):
        xi, yi = x[mine].clone().requires_grad_(), y[mine].clone().requires_grad_()
        (weights[rank] * loss_fn(xi, yi, *scalars())).backward()
        out.append((xi.grad.double(), yi.grad.double()))
    return out


@pytest.mark.slow
def test_per_rank_upstream_gradients_reach_the_owner_of_each_term():
    """A text column's KL is in its owner's loss, an image row's in its owner's, but their logits lie on every rank:
    each gradient must carry the right rank's upstream factor. Reference: float64 d(sum_r w_r l_r), with l_r written
    out per rank from the full matrices."""
    sizes, weights = [3, 5, 2], [1.0, 3.0, 0.5]
    per_rank = run_ranks(_weighted_rank, 3, sizes, weights)
    x, y, xt, yt = (t.double() for t in global_features(sizes, seed=7))
    owner = torch.tensor(weights, dtype=torch.float64).repeat_interleave(torch.tensor(sizes))
    n, world = sum(sizes), len(sizes)

    def softmax_terms(s, t):  # KL of image row i + KL of text column i, in owner i's loss
        kl = lambda dim: (t.softmax(dim) * (t.log_softmax(dim) - s.log_softmax(dim))).sum(dim)
        return (kl(1) + kl(0)) * world / (2 * n)

    def sigmoid_terms(s, t):  # image row i's pairs, in owner i's loss
        return F.binary_cross_entropy_with_logits(s, t.sigmoid(), reduction="none").sum(1) * world / n

    for which, (terms, (scale, bias, t_scale, t_bias)) in enumerate(
        ((softmax_terms, (30.0, 0.0, 20.0, 0.0)), (sigmoid_terms, (10.0, -5.0, 20.0, -8.0)))
    ):
        xr, yr = x.clone().requires_grad_(), y.clone().requires_grad_()
        (owner * terms(scale * xr @ yr.T + bias, t_scale * xt @ yt.T + t_bias)).sum().backward()
        torch.testing.assert_close(torch.cat([r[which][0] for r in per_rank]), xr.grad, rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(torch.cat([r[which][1] for r in per_rank]), yr.grad, rtol=1e-4, atol=1e-6)


@pytest.mark.slow  # beyond the fast tier's time budget
@pytest.mark.parametrize("weight", [1.0, 0.5, 0.0])
def test_without_distributed_matches_reference_for_every_tile_size(weight):
    x, y, xt, yt = global_features([9], seed=3)
    ref = softmax_reference(x, y, xt, yt, *SOFTMAX, weight)
    for chunk in (1, 4, None):
        xi, yi = x.clone().requires_grad_(), y.clone().requires_grad_()
        t = torch.tensor(SOFTMAX[0], requires_grad=True)
        loss = softmax_distill_loss(xi, yi, t.exp(), xt, yt, SOFTMAX[1], chunk_size=chunk, distill_weight=weight)
        loss.backward()
        assert loss.item() == pytest.approx(ref[0], rel=1e-5)
        torch.testing.assert_close(xi.grad.double(), ref[1], rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(yi.grad.double(), ref[2], rtol=1e-4, atol=1e-6)
        assert t.grad.item() == pytest.approx(ref[3], rel=1e-4)
    ref = sigmoid_reference(x, y, xt, yt, *SIGMOID, weight)
    for chunk in (1, 4, None):
        xi, yi = x.clone().requires_grad_(), y.clone().requires_grad_()
        t, b = torch.tensor(SIGMOID[0], requires_grad=True), torch.tensor(SIGMOID[1], requires_grad=True)
        loss = sigmoid_distill_loss(xi, yi, t.exp(), b, xt, yt, *SIGMOID[2:], chunk_size=chunk, distill_weight=weight)
        loss.backward()
        assert loss.item() == pytest.approx(ref[0], rel=1e-5)
        torch.testing.assert_close(xi.grad.double(), ref[1], rtol=1e-4, atol=1e-7)
        torch.testing.assert_close(yi.grad.double(), ref[2], rtol=1e-4, atol=1e-7)
        assert (t.grad.item(), b.grad.item()) == pytest.approx(ref[3:], rel=1e-4)


def test_teacher_equal_to_student_gives_zero_and_no_gradient():
    """KL of a distribution with itself: a student already matching its teacher has nothing to learn."""
    x, y, _, _ = global_features([8], seed=4)
    xi, yi = x.clone().requires_grad_(), y.clone().requires_grad_()
    loss = softmax_distill_loss(xi, yi, torch.tensor(20.0), x, y, 20.0, chunk_size=3)
    loss.backward()
    assert abs(loss.item()) < 1e-5 and xi.grad.abs().max() < 1e-5 and yi.grad.abs().max() < 1e-5


def test_teacher_features_get_no_gradient_and_autocast_keeps_fp32():
    x, y, xt, yt = global_features([8], seed=5)
    xt, yt = xt.clone().requires_grad_(), yt.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        soft = softmax_distill_loss(x.requires_grad_(), y, 30.0, xt, yt, 20.0)
        sig = sigmoid_distill_loss(x, y, 10.0, -5.0, xt, yt, 20.0, -8.0)
    (soft + sig).backward()
    assert xt.grad is None and yt.grad is None
    assert soft.dtype == sig.dtype == torch.float32
    assert soft.item() == pytest.approx(softmax_reference(x.detach(), y, xt.detach(), yt.detach(), math.log(30), 20)[0])


def test_argument_errors():
    x, y, xt, yt = global_features([4], seed=0)
    with pytest.raises(ValueError, match="chunk_size"):
        SoftmaxDistillLoss(chunk_size=0)
    with pytest.raises(ValueError, match=r"distill_weight must lie in \[0, 1\]"):
        SigmoidDistillLoss(distill_weight=1.5)
    with pytest.raises(ValueError, match=r"distill_weight must lie in \[0, 1\].*-0.1"):
        softmax_distill_loss(x, y, 10.0, xt, yt, 10.0, distill_weight=-0.1)
    with pytest.raises(ValueError, match="teacher's rows per rank"):
        softmax_distill_loss(x, y, 10.0, xt[:-1], yt[:-1], 10.0)
    with pytest.raises(ValueError, match=r"teacher features.*differ in shape"):
        sigmoid_distill_loss(x, y, 10.0, -5.0, xt, yt[:-1], 10.0, -5.0)
    with pytest.raises(ValueError, match="teacher_bias must be a 0-dim"):
        sigmoid_distill_loss(x, y, 10.0, -5.0, xt, yt, 10.0, torch.zeros(2))


def _bad_teacher_rank(rank, world):
    """Rank 1's teacher holds one row fewer than its student: every rank must refuse, none may hang."""
    x, y, xt, yt = global_features([4], seed=rank)
    if rank == 1:
        xt, yt = xt[:-1], yt[:-1]
    said = []
    for call in (
        lambda: softmax_distill_loss(x, y, 10.0, xt, yt, 10.0),
        lambda: sigmoid_distill_loss(x, y, 10.0, -5.0, xt, yt, 10.0, -5.0),
    ):
        try:
            call()
            said.append(None)
        except ValueError as e:
            said.append(str(e))
    return said


@pytest.mark.slow
def test_bad_teacher_input_raises_on_every_rank():
    for rank, said in enumerate(run_ranks(_bad_teacher_rank, 3, timeout=60)):
        for message in said:
            assert message is not None and "teacher's rows per rank [4, 3, 4]" in message, (rank, message)


def _peak_rank(rank, world, batch, dim) -> float:
    from disco_clip_ds.testing.memory import peak_extra_mib

    g = torch.Generator().manual_seed(rank)
    x, y, xt, yt = (F.normalize(torch.randn(batch, dim, generator=g), dim=1) for _ in range(4))
    x.requires_grad_(), y.requires_grad_()
    scale, bias = torch.tensor(10.0, requires_grad=True), torch.tensor(-10.0, requires_grad=True)
    loss_fn = SigmoidDistillLoss()
    loss_fn(x[:8], y[:8], scale, bias, xt[:8], yt[:8], 20.0, -8.0).backward()  # set-up costs once per process

    def step():
        loss_fn(x, y, scale, bias, xt, yt, 20.0, -8.0).backward()
        x.grad = y.grad = scale.grad = bias.grad = None

    return peak_extra_mib(step)


@pytest.mark.slow
def test_sigmoid_distillation_peak_memory_per_rank_does_not_grow_with_ranks():
    """Fixed local batch 2048, d = d' = 256, fp32: one rank's peak above its inputs on 2 and on 4 ranks. Gathering
    the student's or the teacher's texts would add (N - 1) x 2 MiB per further rank and modality, keeping each
    received block's logits (N - 1) x 16 MiB."""
    from disco_clip_ds.testing.memory import mmap_threshold_env

    batch, dim = 2048, 256
    peaks = {n: max(run_ranks(_peak_rank, n, batch, dim, env=mmap_threshold_env(1 << 20))) for n in (2, 4)}
    assert peaks[4] < peaks[2] * 1.1 + 2, peaks
