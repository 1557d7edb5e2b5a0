"""train/lamb.py and train/lamb_shards.py: LAMB with its trust ratio per original parameter, against timm's own
`Lamb` (its file, `disco_clip_ds.testing.timm_reference`) on one process, unsharded; and under DeepSpeed ZeRO-1/2/3
and FSDP2 on 2 gloo ranks with gradient accumulation and a stop/resume."""

from __future__ import annotations

import os

import pytest
import torch

from disco_clip_ds.testing.ranks import release_shm_buffers, run_ranks
from disco_clip_ds.testing.timm_reference import timm_optim
from disco_clip_ds.train.lamb import Lamb, Pieces
from disco_clip_ds.train.optim import TowerRates, parameter_groups

LR, BETAS, EPS, WD = 2e-3, (0.9, 0.98), 1e-6, 0.1


class _Tower(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder = torch.nn.Module()
        self.encoder.layers = torch.nn.ModuleList([torch.nn.Linear(6, 10), torch.nn.Linear(10, 10)])
        self.post_layernorm = torch.nn.LayerNorm(10)


class Tiny(torch.nn.Module):
    """Parameters named as a CLIP vision tower's, so that train/optim.py's weight-decay and layer-decay groups apply;
    123 elements, so that ZeRO-1/2's two partitions cut parameters in two."""

    def __init__(self):
        super().__init__()
        self.vision_model = _Tower()
        self.visual_projection = torch.nn.Linear(10, 3, bias=False)

    def forward(self, x, y):
        h = x
        for layer in self.vision_model.encoder.layers:
            h = torch.tanh(layer(h))
        return (self.visual_projection(self.vision_model.post_layernorm(h)) - y).square().mean()


def _groups(model) -> list[dict]:
    """The AdamW path's groups: weights decay, biases and norms do not; layer decay 0.8 over the 2 layers."""
    decay = {n for n, _ in model.named_parameters() if n.endswith("weight") and "layernorm" not in n}
    return parameter_groups(model.named_parameters(), decay, LR, WD, {"vision": TowerRates(LR, WD, 0.8, 2)})


def _batch(step: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(step)
    return torch.randn(rows, 6, generator=generator), torch.randn(rows, 3, generator=generator)


def _timm_lamb(params, **kwargs):
    # timm's defaults but its in-optimizer clipping: the Trainer / DeepSpeed clip the global norm (docstring)
    return timm_optim("lamb").Lamb(params, lr=LR, betas=BETAS, eps=EPS, max_grad_norm=None, **kwargs)


def _reference(steps: int, rows: int) -> dict[str, torch.Tensor]:
    """timm's Lamb on one process over the whole batch of each step."""
    torch.manual_seed(0)
    model = Tiny()
    optimizer = _timm_lamb(_groups(model))
    for step in range(steps):
        model(*_batch(step, rows)).backward()
        optimizer.step()
        optimizer.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


# --- one process -------------------------------------------------------------------------------------------------


def _params():
    torch.manual_seed(0)
    return [torch.nn.Parameter(torch.randn(s)) for s in [(5, 3), (7,), (4, 4), (1,)]]


def _step_both(ours, timms, theirs, steps=4):
    for step in range(steps):
        generator = torch.Generator().manual_seed(step)
        for a, b in zip(ours, theirs):
            a.grad = b.grad = torch.randn(a.shape, generator=generator)
        timms.step()
        yield step


def test_unsharded_steps_are_timms_bit_for_bit():
    """Per-tensor LAMB on whole parameters, two groups (decay and not, so one takes no trust ratio): timm's
    single-tensor path exactly, its foreach path within the fp32 bound."""
    ours, theirs, foreach = _params(), _params(), _params()
    groups = lambda ps: [{"params": ps[:2], "weight_decay": WD}, {"params": ps[2:], "weight_decay": 0.0}]  # noqa: E731
    mine = Lamb(groups(ours), lr=LR, betas=BETAS, eps=EPS)
    single, multi = _timm_lamb(groups(theirs), foreach=False), _timm_lamb(groups(foreach), foreach=True)
    for step in range(4):
        generator = torch.Generator().manual_seed(step)
        for a, b, c in zip(ours, theirs, foreach):
            a.grad = torch.randn(a.shape, generator=generator)
            b.grad, c.grad = a.grad.clone(), a.grad.clone()
        for optimizer in (mine, single, multi):
            optimizer.step()
    for a, b, c in zip(ours, theirs, foreach):
        assert torch.equal(a, b)
        torch.testing.assert_close(a, c, rtol=0, atol=1e-6)
    assert mine.state[ours[0]]["exp_avg_sq"].abs().sum() > 0


def test_a_flat_of_several_parameters_takes_one_ratio_per_parameter():
    """Four parameters held as one flat tensor (ZeRO's layout at one rank), described by their Pieces: the same
    weights as timm's Lamb over the four; without the Pieces (one norm over the flat) they differ."""
    theirs = _params()
    flats = [torch.nn.Parameter(torch.cat([p.detach().reshape(-1) for p in _params()])) for _ in range(2)]
    sizes = [p.numel() for p in theirs]
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    pieces = Pieces(tuple((s, n, k) for k, (s, n) in enumerate(zip(starts, sizes))), len(sizes))
    split = Lamb([flats[0]], lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, layout=lambda: {id(flats[0]): pieces})
    whole = Lamb([flats[1]], lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
    timms = _timm_lamb(theirs, weight_decay=WD, foreach=False)
    for step in range(3):
        generator = torch.Generator().manual_seed(step)
        for p in theirs:
            p.grad = torch.randn(p.shape, generator=generator)
        flats[0].grad = torch.cat([p.grad.reshape(-1) for p in theirs])
        flats[1].grad = flats[0].grad.clone()
        for optimizer in (split, whole, timms):
            optimizer.step()
    expected = torch.cat([p.detach().reshape(-1) for p in theirs])
    torch.testing.assert_close(flats[0].detach(), expected, rtol=0, atol=1e-7)
    assert (flats[1].detach() - expected).abs().max() > 1e-4  # a per-flat norm is another optimizer


def test_resumed_optimizer_state_continues_the_run():
    """state_dict / load_state_dict mid-run (what every checkpoint does): the same weights as without the stop."""
    straight, stopped = _params(), _params()
    first = Lamb([{"params": straight, "weight_decay": WD}], lr=LR, betas=BETAS, eps=EPS)
    second = Lamb([{"params": stopped, "weight_decay": WD}], lr=LR, betas=BETAS, eps=EPS)
    for step in range(4):
        if step == 2:
            saved = second.state_dict()
            second = Lamb([{"params": stopped, "weight_decay": WD}], lr=LR, betas=BETAS, eps=EPS)
            second.load_state_dict(saved)
        generator = torch.Generator().manual_seed(step)
        for a, b in zip(straight, stopped):
            a.grad = torch.randn(a.shape, generator=generator)
            b.grad = a.grad.clone()
        first.step()
        second.step()
    assert all(torch.equal(a, b) for a, b in zip(straight, stopped))


# --- sharded, on 2 gloo ranks ------------------------------------------------------------------------------------

STEPS, SAVE_AT, K, MICRO = 5, 2, 2, 3  # optimizer steps, the stop after step SAVE_AT, micro-steps, rows per micro


def _micro(step: int, rank: int, world: int, k: int):
    x, y = _batch(step, world * K * MICRO)
    rows = slice((k * world + rank) * MICRO, (k * world + rank + 1) * MICRO)
    return x[rows], y[rows]


def _zero_run(stage: int, rank: int, world: int, folder, pieces: bool = True) -> dict:
    """ZeRO-`stage` over Lamb with K micro-steps per optimizer step, stopped after SAVE_AT steps and resumed from its
    checkpoint by a fresh engine (pieces=False: no Pieces, no stop: one trust ratio per flat partition)."""
    import deepspeed

    from disco_clip_ds.train.lamb_shards import zero_pieces

    def engine():
        torch.manual_seed(0)
        model = Tiny()
        optimizer = Lamb(_groups(model), lr=LR, betas=BETAS, eps=EPS)
        config = {
            "train_micro_batch_size_per_gpu": MICRO,
            "gradient_accumulation_steps": K,
            "zero_optimization": {"stage": stage},
            "zero_allow_untested_optimizer": True,  # what the Trainer sets for an optimizer it builds
            "gradient_clipping": 0.0,  # DeepSpeed's default clips at 1.0; the reference does not clip
        }
        built = deepspeed.initialize(model=model, optimizer=optimizer, config=config)[0]
        if pieces:
            optimizer.layout = lambda: zero_pieces(built)
        return built

    run = engine()
    for step in range(STEPS):
        if pieces and step == SAVE_AT:
            run.save_checkpoint(str(folder), tag="stop")
            run = engine()
            run.load_checkpoint(str(folder), tag="stop")
        for k in range(K):
            run.backward(run(*_micro(step, rank, world, k)))
            run.step()
    params = list(run.module.parameters())
    with deepspeed.zero.GatheredParameters(params, enabled=stage == 3):
        return {n: p.detach().clone() for n, p in run.module.named_parameters()}


def _fsdp_run(rank: int, world: int, folder) -> dict:
    """FSDP2 (fully_shard per layer and at the root) over Lamb, K micro-steps, stopped after SAVE_AT steps and resumed
    from full state dicts saved to disk, as accelerate saves an FSDP2 run's model and optimizer."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )
    from torch.distributed.fsdp import fully_shard

    def sharded():
        torch.manual_seed(0)
        model = Tiny()
        for layer in model.vision_model.encoder.layers:
            fully_shard(layer)
        fully_shard(model)
        return model, Lamb(_groups(model), lr=LR, betas=BETAS, eps=EPS)

    full = StateDictOptions(full_state_dict=True)
    model, optimizer = sharded()
    for step in range(STEPS):
        if step == SAVE_AT:
            path = folder / f"rank{rank}.pt"
            folder.mkdir(parents=True, exist_ok=True)
            torch.save(
                (get_model_state_dict(model, options=full), get_optimizer_state_dict(model, optimizer, options=full)),
                path,
            )
            model, optimizer = sharded()
            weights, state = torch.load(path, weights_only=False)
            set_model_state_dict(model, weights, options=full)
            set_optimizer_state_dict(model, optimizer, state, options=full)
        for k in range(K):
            (model(*_micro(step, rank, world, k)) / K).backward()
        optimizer.step()
        optimizer.zero_grad()
    return {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}


def _sharded_runs(rank: int, world: int, folder) -> dict:
    os.environ.update(DS_ACCELERATOR="cpu", LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    runs = {f"zero{stage}": _zero_run(stage, rank, world, folder / f"zero{stage}") for stage in (1, 2, 3)}
    runs["zero2, a ratio per partition"] = _zero_run(2, rank, world, folder / "control", pieces=False)
    runs["fsdp2"] = _fsdp_run(rank, world, folder / "fsdp2")
    return runs


@pytest.mark.slow  # spawns 2 ranks that import DeepSpeed
def test_sharded_lamb_equals_timms_lamb_on_one_process(tmp_path):
    """ZeRO-1, 2 and 3 and FSDP2 on 2 ranks, K = 2 micro-steps, a stop and resume after step 2: after 5 steps every
    parameter equals timm's Lamb over the whole batch on one process, within the fp32 bound, on both ranks. The
    control (ZeRO-2 with a ratio per flat partition, as timm's Lamb would take there) misses it by far more."""
    try:
        results = run_ranks(_sharded_runs, 2, tmp_path, timeout=900)
    finally:
        release_shm_buffers()
    reference = _reference(STEPS, 2 * K * MICRO)
    for runs in results:
        for name, weights in runs.items():
            worst = max((weights[n] - reference[n]).abs().max().item() for n in reference)
            if name.startswith("zero2, a ratio"):
                assert worst > 1e-4, (name, worst)
            else:
                assert worst < 2e-6, (name, worst)
