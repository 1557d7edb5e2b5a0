"""Distillation from an ensemble of teachers (MobileCLIP's mean of the teachers' softmaxes / sigmoids) against float64
single-process references built from the full B x B matrices by hand, on 1 process and on 2 gloo ranks."""

import math

import pytest
import torch
import torch.nn.functional as F

from disco_clip_ds.losses.distill import sigmoid_distill_loss, softmax_distill_loss
from disco_clip_ds.testing.ranks import run_ranks

DIM = 16
TEACHER_DIMS = (24, 8, 32)  # every teacher its own width: only similarities are compared
STUDENT = (math.log(30.0), -5.0)  # the student's log scale and (SigLIP) bias
TEACHERS = ((20.0, -8.0), (50.0, -12.0), (10.0, -3.0))  # each teacher's own multiplier and bias


def features(n, teachers, seed):
    """The student's unit rows (x, y) and each teacher's [(x', y')] of the same n samples, fp32."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for dim in (DIM, *TEACHER_DIMS[:teachers]):
        x = F.normalize(torch.randn(n, dim, generator=g, dtype=torch.float64), dim=1)
        y = F.normalize(x + 0.8 * torch.randn(n, dim, generator=g, dtype=torch.float64), dim=1)
        out.append((x.float(), y.float()))
    return out[0], out[1:]


def teacher_logits(teachers, with_bias):
    return [s * xt.double() @ yt.double().T + (b if with_bias else 0.0) for (xt, yt), (s, b) in zip(teachers, TEACHERS)]


def softmax_reference(student, teachers, weight):
    """W * (1/2B) sum of the KLs of the rows' and the columns' mean teacher softmax from the student's, + (1 - W)
    CLIP's loss; value and gradients w.r.t. x, y and the log scale, in float64."""
    x, y = (f.double().requires_grad_() for f in student)
    log_s = torch.tensor(STUDENT[0], dtype=torch.float64, requires_grad=True)
    s = log_s.exp() * x @ y.T
    n = len(x)
    logits = teacher_logits(teachers, with_bias=False)
    kl = 0
    for dim in (1, 0):
        target = sum(t.softmax(dim) for t in logits) / len(logits)
        kl = kl + (target * (target.log() - s.log_softmax(dim))).sum()
    labels = torch.arange(n)
    clip = (F.cross_entropy(s, labels) + F.cross_entropy(s.T, labels)) / 2
    loss = weight * kl / (2 * n) + (1 - weight) * clip
    loss.backward()
    return loss.item(), x.grad, y.grad, log_s.grad.item()


def sigmoid_reference(student, teachers, weight):
    """W * the BCE of the student's sigmoid against the mean of the teachers' sigmoids, over the B x B pairs / B, +
    (1 - W) SigLIP's loss; value and gradients w.r.t. x, y, log scale and bias, in float64."""
    x, y = (f.double().requires_grad_() for f in student)
    log_s = torch.tensor(STUDENT[0], dtype=torch.float64, requires_grad=True)
    bias = torch.tensor(STUDENT[1], dtype=torch.float64, requires_grad=True)
    s = log_s.exp() * x @ y.T + bias
    n = len(x)
    target = sum(t.sigmoid() for t in teacher_logits(teachers, with_bias=True)) / len(teachers)
    distill = -(target * F.logsigmoid(s) + (1 - target) * F.logsigmoid(-s)).sum() / n
    signs = 2 * torch.eye(n, dtype=torch.float64) - 1
    loss = weight * distill + (1 - weight) * -F.logsigmoid(signs * s).sum() / n
    loss.backward()
    return loss.item(), x.grad, y.grad, log_s.grad.item(), bias.grad.item()


def run_softmax(student, teachers, rows=slice(None), chunk=None, weight=1.0, group=None):
    """The tiled loss on `rows` of the batch: (value, grad x, grad y, grad log scale)."""
    x, y = (f[rows].clone().requires_grad_() for f in student)
    log_s = torch.tensor(STUDENT[0], requires_grad=True)
    loss = softmax_distill_loss(
        x,
        y,
        log_s.exp(),
        [xt[rows] for xt, _ in teachers],
        [yt[rows] for _, yt in teachers],
        [torch.tensor(s) for s, _ in TEACHERS[: len(teachers)]],
        chunk_size=chunk,
        group=group,
        distill_weight=weight,
    )
    loss.backward()
    return loss.item(), x.grad.double(), y.grad.double(), log_s.grad.item()


def run_sigmoid(student, teachers, rows=slice(None), chunk=None, weight=1.0, group=None):
    """The ring loss on `rows` of the batch: (value, grad x, grad y, grad log scale, grad bias)."""
    x, y = (f[rows].clone().requires_grad_() for f in student)
    log_s, bias = torch.tensor(STUDENT[0], requires_grad=True), torch.tensor([STUDENT[1]], requires_grad=True)
    loss = sigmoid_distill_loss(
        x,
        y,
        log_s.exp(),
        bias,
        [xt[rows] for xt, _ in teachers],
        [yt[rows] for _, yt in teachers],
        [s for s, _ in TEACHERS[: len(teachers)]],
        [torch.tensor([b]) for _, b in TEACHERS[: len(teachers)]],  # shape (1,), as SiglipModel's
        chunk_size=chunk,
        group=group,
        distill_weight=weight,
    )
    loss.backward()
    return loss.item(), x.grad.double(), y.grad.double(), log_s.grad.item(), bias.grad.item()


def assert_matches(got, ref, what, rtol=1e-4):
    assert got[0] == pytest.approx(ref[0], rel=rtol), what
    for k in (1, 2):
        torch.testing.assert_close(got[k], ref[k], rtol=rtol, atol=rtol * ref[k].abs().max().item() / 10, msg=what)
    assert got[3:] == pytest.approx(ref[3:], rel=rtol, abs=rtol / 10), what


@pytest.mark.slow  # beyond the fast tier's time budget
def test_one_teacher_as_a_list_is_todays_single_teacher_loss_exactly():
    student, teachers = features(7, 1, seed=0)
    (xt, yt), (s, b) = teachers[0], TEACHERS[0]
    for weight in (1.0, 0.4):
        listed = run_softmax(student, teachers, chunk=3, weight=weight)
        x, y = (f.clone().requires_grad_() for f in student)
        log_s = torch.tensor(STUDENT[0], requires_grad=True)
        loss = softmax_distill_loss(x, y, log_s.exp(), xt, yt, torch.tensor(s), chunk_size=3, distill_weight=weight)
        loss.backward()
        assert listed[0] == loss.item() and listed[3] == log_s.grad.item()
        assert torch.equal(listed[1], x.grad.double()) and torch.equal(listed[2], y.grad.double())
        assert_matches(listed, softmax_reference(student, teachers, weight), f"softmax W={weight}")
        listed = run_sigmoid(student, teachers, chunk=3, weight=weight)
        x, y = (f.clone().requires_grad_() for f in student)
        log_s, bias = torch.tensor(STUDENT[0], requires_grad=True), torch.tensor([STUDENT[1]], requires_grad=True)
        loss = sigmoid_distill_loss(x, y, log_s.exp(), bias, xt, yt, s, b, chunk_size=3, distill_weight=weight)
        loss.backward()
        assert listed[0] == loss.item() and listed[3:] == (log_s.grad.item(), bias.grad.item())
        assert torch.equal(listed[1], x.grad.double()) and torch.equal(listed[2], y.grad.double())
        assert_matches(listed, sigmoid_reference(student, teachers, weight), f"sigmoid W={weight}")


@pytest.mark.slow  # beyond the fast tier's time budget
@pytest.mark.parametrize("teachers", [2, 3])
@pytest.mark.parametrize("weight", [1.0, 0.5])
def test_ensemble_matches_float64_reference_for_every_tile_size(teachers, weight):
    student, members = features(9, teachers, seed=teachers)
    soft, sig = softmax_reference(student, members, weight), sigmoid_reference(student, members, weight)
    for chunk in (1, 4, None):
        assert_matches(run_softmax(student, members, chunk=chunk, weight=weight), soft, f"softmax chunk={chunk}")
        assert_matches(run_sigmoid(student, members, chunk=chunk, weight=weight), sig, f"sigmoid chunk={chunk}")


@pytest.mark.slow  # beyond the fast tier's time budget
def test_ensemble_is_not_the_first_teacher_nor_the_mean_of_logits():
    """The reference itself must tell an ensemble from its parts: the mean of softmaxes differs from one teacher's
    softmax and from the softmax of the mean logits (a test that could not fail otherwise)."""
    student, members = features(9, 2, seed=5)
    both = softmax_reference(student, members, 1.0)[0]
    assert both != pytest.approx(softmax_reference(student, members[:1], 1.0)[0], rel=1e-3)
    assert run_softmax(student, members)[0] == pytest.approx(both, rel=1e-5)
    x, y = student
    mean_logits = sum(teacher_logits(members, with_bias=False)) / 2
    s = math.exp(STUDENT[0]) * x.double() @ y.double().T
    kl = sum(F.kl_div(s.log_softmax(d), mean_logits.log_softmax(d), log_target=True, reduction="sum") for d in (1, 0))
    assert both != pytest.approx(kl.item() / 18, rel=1e-3)


def test_ensemble_argument_errors():
    student, members = features(4, 2, seed=0)
    (xa, ya), (xb, yb) = members
    x, y = student
    with pytest.raises(ValueError, match="one entry per teacher in each teacher argument, got 2 image, 2 text, 1"):
        softmax_distill_loss(x, y, 30.0, [xa, xb], [ya, yb], [20.0])
    with pytest.raises(ValueError, match="one entry per teacher"):
        sigmoid_distill_loss(x, y, 10.0, -5.0, [xa, xb], [ya], [20.0, 5.0], [0.0, 0.0])
    with pytest.raises(ValueError, match=r"teacher 1's features.*differ in shape"):
        softmax_distill_loss(x, y, 30.0, [xa, xb], [ya, yb[:, :4]], [20.0, 5.0])
    with pytest.raises(ValueError, match="teacher 0's rows per rank"):
        sigmoid_distill_loss(x, y, 10.0, -5.0, [xa[:-1], xb], [ya[:-1], yb], [20.0, 5.0], [0.0, 0.0])
    with pytest.raises(ValueError, match=r"teacher_bias\[1\] must be a 0-dim"):
        sigmoid_distill_loss(x, y, 10.0, -5.0, [xa, xb], [ya, yb], [20.0, 5.0], [0.0, torch.zeros(2)])


SIZES = [3, 5]  # uneven rows per rank


def _rank_ensembles(rank, world):
    rows = slice(sum(SIZES[:rank]), sum(SIZES[: rank + 1]))
    out = []
    for teachers in (2, 3):
        student, members = features(sum(SIZES), teachers, seed=10 + teachers)
        for weight in (1.0, 0.5):
            out.append(run_softmax(student, members, rows, chunk=2, weight=weight))
            out.append(run_sigmoid(student, members, rows, chunk=2, weight=weight))
    return out


@pytest.mark.slow
def test_ensemble_on_two_ranks_matches_float64_reference():
    """Each rank's loss and gradients: mean_r l_r = L, each rank's feature gradient / N the global gradient w.r.t.
    its rows, and the mean over ranks of the scale's (and bias's) gradient the global one."""
    per_rank = run_ranks(_rank_ensembles, 2)
    case = 0
    for teachers in (2, 3):
        student, members = features(sum(SIZES), teachers, seed=10 + teachers)
        for weight in (1.0, 0.5):
            for reference in (softmax_reference, sigmoid_reference):
                ref = reference(student, members, weight)
                got = [r[case] for r in per_rank]
                merged = (
                    sum(g[0] for g in got) / 2,
                    torch.cat([g[1] for g in got]) / 2,
                    torch.cat([g[2] for g in got]) / 2,
                    *(sum(g[k] for g in got) / 2 for k in range(3, len(ref))),
                )
                assert_matches(merged, ref, f"{reference.__name__} M={teachers} W={weight}")
                case += 1
