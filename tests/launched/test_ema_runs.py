"""The EMA of the weights (train/ema.py), launched on 2 CPU ranks with the tiny CLIP, AdamW, a checkpoint every step:
- after each step the saved EMA equals a float64 recomputation, with timm ModelEmaV3's rule written out here, from the
  weights the same checkpoint saved, under ZeRO-2, ZeRO-3 and FSDP2; each rank saved only its shard of it;
- --eval_ema logs the EMA's zero-shot figures, which `disco-clip export --ema` and `disco-clip eval` reproduce, and
  hands the model its own weights back exactly (ZeRO-2, ZeRO-3);
- under FSDP2 the in-training evals run (the zero-shot set, its EMA, a suite) and log what `disco-clip eval` gives for
  the same weights; an evaluation that fails on one rank (DISCO_FAULT fail_in_eval on rank 1) is skipped on both and
  training goes on, and so does a suite holding a task whose class-name file is not UTF-8: every step's checkpoint is
  saved and verifies, and the final model is written;
- a resume from step 2 on 2 ranks ends with the uninterrupted run's EMA and weights bit for bit, and on 1 rank x K=2
  (a universal checkpoint under ZeRO-2, the EMA re-partitioned from its per-rank files) within the float noise of the
  other reduction order.
One module fixture runs the five trainings (three references, two resumes). The schedule by hand, the file layout and
the re-partitioning in one process: unit/train/test_ema.py."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch

from disco_clip_ds.checkpoint.consolidate import load_state_dict
from disco_clip_ds.checkpoint.ema import ema_files, read_ema_state_dict
from disco_clip_ds.checkpoint.layout import checkpoint_problem
from disco_clip_ds.data.prep.fetch import environ
from disco_clip_ds.testing.images import write_shards
from disco_clip_ds.testing.launch import QUICK, REPO, launch
from disco_clip_ds.testing.runs import assert_same_training, save_initial_model, weights
from disco_clip_ds.testing.zeroshot import write_eval_shards

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]

STEPS, DECAY, START, EVAL_AT = 4, 0.9, 1, 3
ADAMW = ["--optim", "adamw_torch", "--learning_rate", "1e-3", "--adam_epsilon", "1e-6", "--weight_decay", "0.1"]


def timm_decay(step: int) -> float:
    """ModelEmaV3.get_decay(step) with update_after_step=START, use_warmup=True, warmup_gamma 1, warmup_power 2/3."""
    k = max(0, step - START - 1)
    return 0.0 if k <= 0 else max(min(1 - (1 + k) ** (-2 / 3), DECAY), 0.0)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("ema")
    write_shards(root / "shards", num_shards=4, per_shard=24, seed=1)
    common = [
        "--model_name_or_path",
        str(save_initial_model(root / "tiny", 7)),
        "--train_shards",
        f"{root}/shards/{{00000..00003}}.tar",
        "--train_num_samples",
        "96",
        "--per_device_train_batch_size",
        "4",
        "--max_steps",
        str(STEPS),
        "--save_steps",
        "1",
        "--save_total_limit",
        "10",
        *ADAMW,
        "--ema_decay",
        str(DECAY),
        "--ema_start_step",
        str(START),
    ]
    evaluated = ["--eval_ema", "true", "--zeroshot_data", str(write_eval_shards(root / "eval")), "--zeroshot_steps"]
    evaluated.append(str(EVAL_AT))  # and at the last step
    launch(QUICK, 2, root / "zero2", *common, *evaluated)
    # ZeRO-3 keeping its small parameters (norms, biases, logit_scale) whole on every rank, the 64 x 64 partitioned:
    # the swap for --eval_ema must refresh both kinds
    zero3 = json.loads((REPO / "ds_configs/cpu_zero3.json").read_text())
    zero3["zero_optimization"]["stage3_param_persistence_threshold"] = 1000
    (root / "zero3.json").write_text(json.dumps(zero3))
    launch(QUICK, 2, root / "zero3", *common, *evaluated, ds_config=str(root / "zero3.json"))
    with environ(DISCO_FAULT=f"fail_in_eval:step={EVAL_AT},rank=1"):  # every eval of step 3 fails on rank 1
        launch("accelerate", 2, root / "fsdp", *common, *evaluated, *_suite(root), ds_config=None)
    for name in ("resumed", "one_rank"):  # the reference as it stood at step 2
        shutil.copytree(root / "zero2" / "checkpoint-2", root / name / "checkpoint-2")
        shutil.copy(root / "zero2" / "run.json", root / name / "run.json")
    resume = ["--resume_from_checkpoint", "latest"]
    launch(QUICK, 2, root / "resumed", *common, *resume)  # no eval: the reference's eval must leave no trace
    one_rank = ["--gradient_accumulation_steps", "2", "--dataloader_num_workers", "2"]  # 2 readers, as 2 ranks x 1
    launch(QUICK, 1, root / "one_rank", *common, *resume, *one_rank)  # its log: one_rank.log
    return root


SUITE_AT = 2  # the suite's training tasks at step 2, all of them at the last


def _suite(root: Path) -> list[str]:
    """A suite of the eval set (a training task) and a task whose class-name file is Latin-1, not UTF-8."""
    (root / "latin1.txt").write_bytes("z\xe9ro\nun\n".encode("latin-1"))
    tasks = f"digits:\n  path: eval\n  train: true\nbroken:\n  path: eval\n  classnames: {root / 'latin1.txt'}\n"
    (root / "tasks.yml").write_text(tasks)
    return ["--eval_tasks", str(root / "tasks.yml"), "--eval_steps", str(SUITE_AT)]


def _float64(state: dict) -> dict:
    return {name: tensor.double() for name, tensor in state.items()}


@pytest.mark.parametrize("run", ["zero2", "zero3", "fsdp"])
def test_the_ema_equals_a_float64_recomputation_from_each_steps_weights(runs, run):
    expected = None
    for step in range(1, STEPS + 1):
        checkpoint = runs / run / f"checkpoint-{step}"
        w = _float64(weights(checkpoint))  # the weights this checkpoint saved, after step `step`
        d = timm_decay(step)
        expected = w if expected is None else {n: d * expected[n] + (1 - d) * w[n] for n in expected}
        saved, settings = read_ema_state_dict(checkpoint)
        assert settings == {"decay": DECAY, "start_step": START, "warmup": True, "begun_at": 0}
        assert sorted(saved) == sorted(w)  # every parameter of the tiny CLIP is trained
        for name, value in saved.items():
            assert value.dtype == torch.float32
            value = value.reshape(expected[name].shape)  # logit_scale trains as a 1-vector, saves 0-dim
            # fp32 lerps against float64 over 4 steps of O(1e-2) weights: a few ulps
            torch.testing.assert_close(value.double(), expected[name], rtol=1e-6, atol=1e-7, msg=f"{run} {name}")
        if step > START + 1:  # the EMA has left the weights
            assert any(not torch.equal(saved[n].double().view(-1), w[n].view(-1)) for n in saved)
    # sharded like the fp32 masters: each rank's file holds about half of the elements, the two together all
    per_rank = [path.stat().st_size for path in ema_files(runs / run / f"checkpoint-{STEPS}")]
    full = sum(v.numel() * 4 for v in expected.values())
    assert len(per_rank) == 2 and all(size < 0.6 * full for size in per_rank), (per_rank, full)


@pytest.mark.parametrize("run", ["zero2", "zero3"])
def test_eval_ema_logs_the_ema_that_export_writes_and_leaves_the_weights_as_they_were(runs, run, tmp_path):
    from disco_clip_ds.commands import export as export_command
    from disco_clip_ds.commands.eval import EvalArguments, run_eval
    from disco_clip_ds.errors import run_main

    history = json.loads((runs / run / "trainer_state.json").read_text())["log_history"]
    during = {e["step"]: e for e in history if "zeroshot_ema_acc1" in e}
    assert sorted(during) == [EVAL_AT, STEPS]
    # the weights the step-3 checkpoint saved through the model (after the eval swapped the EMA out again) are the
    # fp32 masters in DeepSpeed's partitions: the model got its own weights back
    checkpoint = runs / run / f"checkpoint-{EVAL_AT}"
    masters, _ = load_state_dict(checkpoint)
    model_file = weights(checkpoint)
    assert all(torch.equal(masters[n].float().view(-1), model_file[n].view(-1)) for n in model_file)
    # `disco-clip export RUN --ema` takes the newest checkpoint's EMA; `disco-clip eval` of it gives the logged figures
    out = tmp_path / "ema_model"
    assert run_main(export_command.main, [str(runs / run), str(out), "--ema"], "disco-clip export") == 0
    saved, _ = read_ema_state_dict(runs / run / f"checkpoint-{STEPS}")
    exported = weights(out)
    assert all(torch.equal(exported[n].view(-1), saved[n].view(-1)) for n in saved)
    assert "exponential moving average (EMA) of the weights, decay 0.9" in (out / "README.md").read_text()
    metrics = run_eval(EvalArguments(model=str(out), data=str(runs / "eval")))["metrics"]
    logged = {k.removeprefix("zeroshot_ema_"): v for k, v in during[STEPS].items() if k.startswith("zeroshot_ema_")}
    assert metrics == pytest.approx(logged, abs=1e-6)


def test_under_fsdp2_the_evals_log_what_eval_gives_and_no_failure_stops_training(runs, tmp_path):
    from disco_clip_ds.commands import export as export_command
    from disco_clip_ds.commands.eval import EvalArguments, run_eval
    from disco_clip_ds.errors import run_main

    run = runs / "fsdp"
    history = json.loads((run / "trainer_state.json").read_text())["log_history"]
    zeroshot = {e["step"]: e for e in history if "zeroshot_acc1" in e}
    suite = {e["step"]: e for e in history if any(k.startswith("suite/") for k in e)}
    # step 3's evaluations failed on rank 1 alone and were skipped on both ranks; the suite ran at steps 2 and 4
    assert sorted(zeroshot) == [STEPS] and "zeroshot_ema_acc1" in zeroshot[STEPS]
    assert SUITE_AT in suite and all("suite/broken" not in e for e in history)
    log = (runs / "fsdp.log").read_text()
    for what in ("the zero-shot eval", "the zero-shot eval of the EMA"):
        assert f"step {EVAL_AT}: {what} failed on rank 1: RuntimeError: DISCO_FAULT: fail_in_eval" in log
        assert f"step {EVAL_AT}: {what} failed on another rank" in log
    assert re.search(rf"step {STEPS}: (task broken|the suite) failed", log)  # the Latin-1 task, logged
    assert "Traceback" not in log
    for step in range(1, STEPS + 1):  # the checkpoint of every step, an evaluation's included, complete
        assert checkpoint_problem(run / f"checkpoint-{step}") is None
    # training's figures are `disco-clip eval`'s of the same weights: the suite's at step 2 of that checkpoint's,
    # the last step's of the final model and of `export --ema`'s folder
    exported = run_main(export_command.main, [str(run / f"checkpoint-{SUITE_AT}"), str(tmp_path / "w2")], "export")
    assert exported == 0
    at_2 = run_eval(EvalArguments(model=str(tmp_path / "w2"), data=str(runs / "eval")))["metrics"]
    assert suite[SUITE_AT]["suite/digits"] == pytest.approx(at_2["acc1"], abs=1e-6)
    final = run_eval(EvalArguments(model=str(run), data=str(runs / "eval")))["metrics"]
    assert {k: zeroshot[STEPS][f"zeroshot_{k}"] for k in final} == pytest.approx(final, abs=1e-6)
    assert run_main(export_command.main, [str(run), str(tmp_path / "ema"), "--ema"], "export") == 0
    ema = run_eval(EvalArguments(model=str(tmp_path / "ema"), data=str(runs / "eval")))["metrics"]
    assert {k: zeroshot[STEPS][f"zeroshot_ema_{k}"] for k in ema} == pytest.approx(ema, abs=1e-6)
    # and the evaluations (the EMA swapped in and out, the root gathered and resharded) left training as it was: the
    # weights of the ZeRO-2 run, which evaluated at step 3 without a failure
    assert_same_training(run, runs / "zero2", weights(runs / "tiny"), STEPS)


def test_a_resume_on_the_same_ranks_ends_with_the_uninterrupted_ema_bit_for_bit(runs):
    last = f"checkpoint-{STEPS}"
    reference, resumed = read_ema_state_dict(runs / "zero2" / last)[0], read_ema_state_dict(runs / "resumed" / last)[0]
    assert all(torch.equal(reference[n], resumed[n]) for n in reference)
    uninterrupted, again = weights(runs / "zero2" / last), weights(runs / "resumed" / last)
    assert all(torch.equal(uninterrupted[n], again[n]) for n in uninterrupted)


def test_a_resume_on_one_rank_with_k2_re_partitions_the_ema(runs):
    log = (runs / "one_rank.log").read_text()
    assert "checkpoint-2, world size 2 -> 1: through a universal checkpoint" in log
    last = f"checkpoint-{STEPS}"
    assert len(ema_files(runs / "one_rank" / last)) == 1
    reference, resumed = read_ema_state_dict(runs / "zero2" / last)[0], read_ema_state_dict(runs / "one_rank" / last)[0]
    start = read_ema_state_dict(runs / "zero2" / "checkpoint-2")[0]
    # the EMA's move since step 2 agrees up to the other reduction order's noise, by assert_same_training's measure
    moved = torch.cat([(reference[n] - start[n]).view(-1) for n in reference])
    gap = torch.cat([(resumed[n] - reference[n]).view(-1) for n in reference])
    assert moved.norm() > 0 and gap.norm() <= 1e-4 * moved.norm(), f"{gap.norm() / moved.norm():.2e}"
    assert_same_training(runs / "one_rank", runs / "zero2", weights(runs / "tiny"), STEPS)  # and the weights


def test_one_process_without_warmup_averages_the_whole_model_at_the_flat_decay(tmp_path):
    """`--ema_warmup false`: d = 0.5 from step 2 on (timm's use_warmup=False); one process, no engine: the EMA is of
    the whole model, in one file."""
    from disco_clip_ds.testing.launch import launch_in_one_process

    write_shards(tmp_path / "shards", num_shards=2, per_shard=16, seed=1)
    out = tmp_path / "run"
    args = ["--model_name_or_path", str(save_initial_model(tmp_path / "tiny", 7)), "--train_shards"]
    args += [f"{tmp_path}/shards/{{00000..00001}}.tar", "--train_num_samples", "32", "--per_device_train_batch_size"]
    args += ["4", "--max_steps", "3", "--save_steps", "1", *ADAMW, "--ema_decay", "0.5", "--ema_warmup", "false"]
    launch_in_one_process([(out, args)])
    expected = None
    for step in (1, 2, 3):
        w = _float64(weights(out / f"checkpoint-{step}"))
        expected = w if expected is None else {n: 0.5 * expected[n] + 0.5 * w[n] for n in expected}
        saved, settings = read_ema_state_dict(out / f"checkpoint-{step}")
        assert settings["warmup"] is False and len(ema_files(out / f"checkpoint-{step}")) == 1
        for name, value in saved.items():
            value = value.double().reshape(expected[name].shape)
            torch.testing.assert_close(value, expected[name], rtol=1e-6, atol=1e-7)
