"""The planner's optimizer states under `--optim lamb`: LAMB keeps Adam's two fp32 moments per trained parameter
(train/lamb.py), so the plan's optimizer term is the same bytes, and the report says which states it counts."""

import torch

from disco_clip_ds.testing.launch import REPO

ARGV = ["--deepspeed", str(REPO / "ds_configs/cpu_zero2.json"), "--model", str(REPO / "recipes/models/tiny.json")]
ARGV += ["--gpus", "2", "--per_device_batch", "8", "--precision", "fp32", "--loss_impl", "tiled"]


def test_plan_optim_lamb_counts_two_moments_as_adamw(tmp_path, capsys):
    import json

    from disco_clip_ds.commands.plan import main

    for optim in ("adamw_torch", "lamb"):
        assert main([*ARGV, "--optim", optim, "--json", str(tmp_path / f"{optim}.json")]) == 0
    out = capsys.readouterr().out
    assert "LAMB states (2 fp32 moments per trained parameter, as Adam)" in out
    assert "AdamW states (2 fp32 moments per trained parameter)" in out
    adamw, lamb = (json.loads((tmp_path / f"{o}.json").read_text()) for o in ("adamw_torch", "lamb"))
    assert lamb["memory"] == adamw["memory"] and lamb["optimizer"]["name"] == "lamb"


def test_the_bytes_a_lamb_holds_are_the_planned_optimizer_term():
    """The planner's fp32 optimizer term without ZeRO (8 bytes per trained parameter) against what Lamb's state holds
    after a step (its moments; the step counts are one number per tensor, not per parameter)."""
    from disco_clip_ds.plan.memory import model_state_bytes
    from disco_clip_ds.train.lamb import Lamb

    params = [torch.nn.Parameter(torch.randn(s)) for s in [(5, 3), (7,), (4, 4)]]
    optimizer = Lamb(params)
    for p in params:
        p.grad = torch.ones_like(p)
    optimizer.step()
    held = sum(t.numel() * t.element_size() for s in optimizer.state.values() for k, t in s.items() if k != "step")
    trained = sum(p.numel() for p in params)
    assert held == model_state_bytes(trained, 16, 0, "fp32", 1)["optimizer"]
