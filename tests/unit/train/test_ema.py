"""The EMA of the weights in one process (train/ema.py, checkpoint/ema.py): timm ModelEmaV3's decay schedule against
hand-computed values, the update against a float64 recomputation, the swap in and out, the per-rank files read back on
another split into ranks (the re-partitioning a change of world size does) and assembled for export, and the flags'
refusals. Under ZeRO-2, ZeRO-3 and FSDP2 on 2 ranks: launched/test_ema_runs.py."""

from types import SimpleNamespace

import pytest
import torch

from disco_clip_ds.checkpoint.ema import Fragment, fill_fragments, read_ema_state_dict, write_fragments
from disco_clip_ds.errors import CheckpointError, UsageError
from disco_clip_ds.testing.launch import REPO
from disco_clip_ds.train.ema import WeightsEma, ema_decay

# 2 ** (-2/3) = 0.6299605249474366, 9 ** (-2/3) = 0.2311204247835, 101 ** (-2/3) = 0.04619...: by hand (and bc -l)
HAND = [
    # (step, decay, start_step, warmup, expected)
    (1, 0.999, 0, True, 0.0),  # the first step copies the weights
    (2, 0.999, 0, True, 1 - 0.6299605249474366),
    (9, 0.999, 0, True, 1 - 0.2311204247835),
    (10**6, 0.999, 0, True, 0.999),  # the ramp reached the decay
    (9, 0.5, 0, True, 0.5),  # capped at the decay
    (2, 0.999, 0, False, 0.999),
    (6, 0.999, 5, True, 0.0),  # up to start_step + 1 the EMA copies the weights
    (7, 0.999, 5, True, 1 - 0.6299605249474366),
    (7, 0.999, 5, False, 0.999),
    (1, 0.0, 0, True, 0.0),
]


@pytest.mark.parametrize("step,decay,start,warmup,expected", HAND)
def test_the_decay_schedule_is_timm_model_ema_v3s(step, decay, start, warmup, expected):
    assert ema_decay(step, decay, start, warmup) == pytest.approx(expected, rel=1e-12, abs=1e-15)


def _trainer(model):
    return SimpleNamespace(
        model=model,
        args=SimpleNamespace(process_index=0, world_size=1),
        is_deepspeed_enabled=False,
        model_wrapped=model,
    )


def _model():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    model[1].bias.requires_grad_(False)  # frozen: not averaged
    return model


def test_the_update_matches_a_float64_recomputation_and_the_swap_is_exact():
    model = _model()
    ema = WeightsEma(_trainer(model), decay=0.8, start_step=1, warmup=True)
    ema.start(None)
    trained = [n for n, p in model.named_parameters() if p.requires_grad]
    assert [f.name for f in ema.fragments] == trained
    expected = {n: p.detach().double().clone() for n, p in model.named_parameters() if p.requires_grad}
    for step in range(1, 6):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p))  # an optimizer step
        ema.update(step)
        k = max(0, step - 2)  # timm: step - update_after_step - 1
        d = 0.0 if k == 0 else min(0.8, 1 - (1 + k) ** (-2 / 3))
        params = dict(model.named_parameters())
        expected = {n: d * e + (1 - d) * params[n].detach().double() for n, e in expected.items()}
    for fragment, value in zip(ema.fragments, ema.values):
        torch.testing.assert_close(value.double().view(fragment.shape), expected[fragment.name], rtol=1e-6, atol=1e-7)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    averaged = [value.clone() for value in ema.values]
    with ema.swapped():
        params = dict(model.named_parameters())
        for fragment, value, average in zip(ema.fragments, ema.values, averaged):
            assert torch.equal(params[fragment.name].detach().view(-1), average)
            assert torch.equal(value, before[fragment.name].view(-1))  # inside, `values` hold the weights
    assert all(torch.equal(p.detach(), before[n]) for n, p in model.named_parameters())


def _split(full: dict[str, torch.Tensor], ranks: int) -> list[tuple[list[Fragment], list[torch.Tensor]]]:
    """`full` cut as a ZeRO-1/2 flat partition is: the parameters end to end, cut into `ranks` equal pieces."""
    flat = torch.cat([t.view(-1) for t in full.values()])
    size = -(-flat.numel() // ranks)
    out, offset = [], 0
    bounds = {}
    for name, t in full.items():
        bounds[name] = (offset, offset + t.numel())
        offset += t.numel()
    for r in range(ranks):
        lo, hi = r * size, min((r + 1) * size, flat.numel())
        fragments, values = [], []
        for name, (a, b) in bounds.items():
            s, e = max(a, lo), min(b, hi)
            if s < e:
                fragments.append(Fragment(name, s - a, e - s, tuple(full[name].shape)))
                values.append(flat[s:e].clone())
        out.append((fragments, values))
    return out


@pytest.mark.parametrize("saved_on,read_on", [(2, 1), (1, 3), (3, 2)])
def test_per_rank_files_are_read_back_on_any_split_and_assembled_for_export(tmp_path, saved_on, read_on):
    full = {"a": torch.randn(5, 3), "b": torch.randn(7), "c": torch.randn(2, 2)}
    settings = {"decay": 0.9, "start_step": 0, "warmup": True}
    for rank, (fragments, values) in enumerate(_split(full, saved_on)):
        write_fragments(tmp_path, rank, fragments, values, settings)
    assembled, read_settings = read_ema_state_dict(tmp_path)
    assert read_settings == settings and all(torch.equal(assembled[n], full[n]) for n in full)
    for fragments, values in _split(full, read_on):
        zeros = [torch.zeros_like(v) for v in values]
        fill_fragments(tmp_path / "ema", fragments, zeros)
        assert all(torch.equal(z, v) for z, v in zip(zeros, values))


def test_a_missing_rank_file_is_refused_not_read_as_zeros(tmp_path):
    full = {"a": torch.randn(6)}
    for rank, (fragments, values) in enumerate(_split(full, 2)):
        if rank == 0:
            write_fragments(tmp_path, rank, fragments, values, {"decay": 0.9, "start_step": 0, "warmup": True})
    with pytest.raises(CheckpointError, match="the EMA of a is incomplete"):
        read_ema_state_dict(tmp_path)
    fragments, values = _split(full, 1)[0]
    with pytest.raises(CheckpointError, match="lacks the EMA of a"):
        fill_fragments(tmp_path / "ema", fragments, values)
    with pytest.raises(CheckpointError, match="holds no EMA"):
        read_ema_state_dict(tmp_path / "nowhere")


def test_a_checkpoint_with_fewer_ema_files_than_ranks_is_incomplete(tmp_path):
    from disco_clip_ds.checkpoint.layout import save_problem

    (tmp_path / "trainer_state.json").write_text('{"global_step": 2}')
    for r in (0, 1):
        (tmp_path / f"rng_state_{r}.pth").write_bytes(b"x")
    (tmp_path / "model.safetensors").write_bytes(b"x")
    write_fragments(tmp_path, 0, [Fragment("a", 0, 1, (1,))], [torch.zeros(1)], {})
    assert save_problem(tmp_path) == "1 EMA files for 2 ranks"
    write_fragments(tmp_path, 1, [Fragment("a", 0, 1, (1,))], [torch.zeros(1)], {})
    assert save_problem(tmp_path) is None


BAD = [
    (["--ema_decay", "1"], "--ema_decay 1: give a number at least 0 and below 1"),
    (["--ema_decay", "-0.5"], "--ema_decay -0.5: give a number"),
    (["--ema_decay", "nan"], "--ema_decay nan: give a number"),
    (["--ema_decay", "0.9", "--ema_start_step", "-1"], "--ema_start_step -1: give the step"),
    (["--eval_ema", "true"], "--eval_ema evaluates the EMA of the weights: give --ema_decay"),
    (["--ema_decay", "0.9", "--eval_ema", "true"], "--eval_ema runs with the in-training eval"),
]


@pytest.mark.parametrize("argv,message", BAD)
def test_bad_ema_flags_are_one_line_and_exit_2(argv, message, train_main, tmp_path, capsys):
    from disco_clip_ds.testing.images import write_shards

    write_shards(tmp_path / "data", num_shards=2, per_shard=4)
    model = ["--model_config", str(REPO / "recipes/models/tiny.json")]
    tokenizer = ["--tokenizer_name", str(REPO / "recipes/tokenizer")]
    assert train_main("--train_shards", str(tmp_path / "data"), *model, *tokenizer, *argv) == 2
    said = [line for line in capsys.readouterr().err.splitlines() if line.startswith("disco-clip train: ")]
    assert len(said) == 1 and message in said[0], said
    assert not (tmp_path / "out").exists()


def test_check_ema_accepts_the_edges():
    from disco_clip_ds.train.validate.training import check_ema

    for decay in (None, 0.0, 0.9999):
        check_ema(SimpleNamespace(ema_decay=decay, ema_start_step=0, eval_ema=False), 0)
    check_ema(SimpleNamespace(ema_decay=0.9, ema_start_step=0, eval_ema=True), 5)
    with pytest.raises(UsageError):
        check_ema(SimpleNamespace(ema_decay=float("inf"), ema_start_step=0, eval_ema=False), 0)


def test_an_ema_begun_at_a_resume_without_one_records_that_step_and_the_card_says_it(tmp_path):
    """Resuming a checkpoint without an EMA with --ema_decay starts the EMA from that step's weights: the saved
    settings say so and what export's card writes names that step, not step 0. A resume of the EMA keeps the step."""
    from disco_clip_ds.checkpoint.ema import saved_settings
    from disco_clip_ds.export.weights import ema_origin

    model = _model()
    without = tmp_path / "checkpoint-40"
    without.mkdir()  # a checkpoint the run saved before it kept an EMA
    ema = WeightsEma(_trainer(model), decay=0.9, start_step=0, warmup=False)
    ema.start(str(without), step=40)
    ema.save(tmp_path / "checkpoint-50")
    settings = saved_settings(tmp_path / "checkpoint-50")
    assert settings["begun_at"] == 40
    assert ema_origin(settings) == (
        "decay 0.9 from step 40 (started when the run was resumed at step 40 without an EMA) (timm ModelEmaV3's rule)"
    )
    again = WeightsEma(_trainer(_model()), decay=0.9, start_step=0, warmup=False)
    again.start(str(tmp_path / "checkpoint-50"), step=50)  # a resume of the EMA: it began at 40 still
    assert again.begun_at == 40 and all(torch.equal(a, b) for a, b in zip(again.values, ema.values))
    fresh = WeightsEma(_trainer(_model()), decay=0.9, start_step=5, warmup=True)
    fresh.start(None)
    fresh.save(tmp_path / "checkpoint-60")
    assert ema_origin(saved_settings(tmp_path / "checkpoint-60")) == (
        "decay 0.9 from step 5, with warmup (timm ModelEmaV3's rule)"
    )
    assert saved_settings(without) is None
