"""The losses make no host sync of their own once the ranks agreed on a shape: repeated forward + backward calls with
unchanged shapes, on 2 gloo ranks, call none of the tensor methods that copy a value from the device to the host."""

import contextlib
import math

import pytest
import torch
import torch.nn.functional as F

from disco_clip_ds.testing.ranks import run_ranks

# What reads a tensor's value on the host: on a GPU each one waits for the device's queue to drain.
SYNCING = ("item", "tolist", "nonzero", "__bool__", "__float__", "__int__")


@contextlib.contextmanager
def counted_syncs():
    """Count calls of SYNCING on any tensor (and of torch.nonzero) while the block runs: {name: calls}."""
    counts = dict.fromkeys([*SYNCING, "torch.nonzero"], 0)
    originals = {name: getattr(torch.Tensor, name) for name in SYNCING}
    original_nonzero = torch.nonzero

    def counting(name, fn):
        def wrapper(*args, **kwargs):
            counts[name] += 1
            return fn(*args, **kwargs)

        return wrapper

    for name, fn in originals.items():
        setattr(torch.Tensor, name, counting(name, fn))
    torch.nonzero = counting("torch.nonzero", original_nonzero)
    try:
        yield counts
    finally:
        for name, fn in originals.items():
            setattr(torch.Tensor, name, fn)
        torch.nonzero = original_nonzero


def _losses():
    """(name, loss(x, y, t, b, tx, ty)) for every loss and path: tiled softmax keeping its logits and recomputing
    them, disco, sigmoid, both distillations alone and mixed."""
    from disco_clip_ds.losses import disco_clip_loss
    from disco_clip_ds.losses.distill import sigmoid_distill_loss, softmax_distill_loss
    from disco_clip_ds.losses.sigmoid import sigmoid_loss

    ts, tb = torch.tensor(20.0), torch.tensor([-4.0])
    return [
        ("tiled kept", lambda x, y, t, b, tx, ty: disco_clip_loss(x, y, t.exp(), chunk_size=3)),
        ("tiled recomputed", lambda x, y, t, b, tx, ty: disco_clip_loss(x, y, t.exp(), chunk_size=3, keep_bytes=0)),
        ("disco", lambda x, y, t, b, tx, ty: disco_clip_loss(x, y, t.exp(), impl="disco")),
        ("sigmoid", lambda x, y, t, b, tx, ty: sigmoid_loss(x, y, t.exp().reshape(1), b, chunk_size=3)),
        (
            "softmax distill",
            lambda x, y, t, b, tx, ty: softmax_distill_loss(x, y, t.exp(), tx, ty, ts, 3, distill_weight=0.5),
        ),
        (
            "sigmoid distill",
            lambda x, y, t, b, tx, ty: sigmoid_distill_loss(x, y, t.exp(), b, tx, ty, ts, tb, 3, distill_weight=0.5),
        ),
    ]


def _rank_syncs(rank, world, calls):
    """{loss: [syncs of call 1, call 2, ...]}: each call a forward + backward on new features of unchanged shapes.
    The logit scale is 100, so that the backward's direct columns and the exact log-sum-exps are possible."""
    out = {}
    for name, loss_fn in _losses():
        per_call = []
        for call in range(calls):
            g = torch.Generator().manual_seed(100 * rank + call)
            x, y = (F.normalize(torch.randn(6, 8, generator=g), dim=1).requires_grad_() for _ in range(2))
            tx, ty = (F.normalize(torch.randn(6, 5, generator=g), dim=1) for _ in range(2))
            t, b = torch.tensor(math.log(100.0), requires_grad=True), torch.tensor([-10.0], requires_grad=True)
            with counted_syncs() as counts:
                loss_fn(x, y, t, b, tx, ty).backward()
            per_call.append(sum(counts.values()))
        out[name] = per_call
    return out


@pytest.mark.slow
def test_no_host_sync_after_the_first_call_of_a_shape():
    for rank, per_loss in enumerate(run_ranks(_rank_syncs, 2, 3, timeout=120)):
        # the first call agrees on the shapes (one read of every rank's shapes): the counter sees it
        assert per_loss["tiled kept"][0] >= 1, per_loss
        for name, syncs in per_loss.items():
            assert syncs[1:] == [0, 0], f"rank {rank}, {name}: host syncs per call {syncs}"


def test_the_counter_sees_every_kind_of_sync():
    """Each syncing call on a tensor is counted once, so a planted one cannot pass unseen."""
    x = torch.tensor([1.0, 0.0])
    with counted_syncs() as counts:
        x[0].item(), x.tolist(), x.nonzero(), torch.nonzero(x), bool(x[0]), float(x[0]), int(x[0])
    assert counts == {**dict.fromkeys(SYNCING, 1), "torch.nonzero": 1}


def _features(rows: list[int]):
    """Every rank's (images, texts), from one seed: rank r holds rows[r] pairs."""
    g = torch.Generator().manual_seed(7)
    return [
        tuple(F.normalize(torch.randn(n, 8, generator=g, dtype=torch.float64), dim=1) for _ in range(2)) for n in rows
    ]


def _ragged_after_uniform(rank, world):
    """A uniform call, then forget_agreements() on every rank, then a call in which rank 1 alone holds fewer rows (a
    finite loader's ragged last batch): ({this rank's loss of the ragged call}, syncs of that call)."""
    from disco_clip_ds.losses import disco_clip_loss
    from disco_clip_ds.losses.comm import forget_agreements

    scale = torch.tensor(10.0)
    x, y = _features([6, 6])[rank]
    disco_clip_loss(x.float(), y.float(), scale, chunk_size=3)
    forget_agreements()
    x, y = _features([6, 4])[rank]
    with counted_syncs() as counts:
        loss = disco_clip_loss(x.float(), y.float(), scale, chunk_size=3)
    return loss.item(), sum(counts.values())


@pytest.mark.slow
def test_forget_agreements_lets_one_rank_change_its_shape_alone():
    """Without the forget, rank 0 (shape unchanged) would skip the agreement that rank 1 (changed) enters and both
    would wait for ever; with it both agree again, and the loss is the float64 CLIP loss of all 10 pairs."""
    (l0, syncs0), (l1, syncs1) = run_ranks(_ragged_after_uniform, 2, timeout=120)
    assert syncs0 >= 1 and syncs1 >= 1  # the shapes were agreed again
    images, texts = (torch.cat([f[i] for f in _features([6, 4])]) for i in range(2))
    logits = 10.0 * images @ texts.T
    labels = torch.arange(10)
    reference = (F.cross_entropy(logits, labels) + F.cross_entropy(logits.T, labels)) / 2
    assert (l0 + l1) / 2 == pytest.approx(reference.item(), rel=1e-5)
