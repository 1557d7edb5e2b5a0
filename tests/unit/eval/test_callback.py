"""eval/callback.py: zero-shot classification during training, logged through the trainer, on the images the run
trains on (the model's own image processor)."""

from __future__ import annotations

import pytest
import torch

from disco_clip_ds.eval.callback import LoggingCallback, ZeroShotCallback
from disco_clip_ds.eval.tasks import zeroshot_classification

from unit.eval.sets import CLASSNAMES, TEMPLATES, tiny_clip, tiny_tokenizer, tiny_trainer


@pytest.mark.slow  # beyond the fast tier's time budget
@pytest.mark.parametrize("source", ["shards", "datasets"])
def test_callback_logs_zeroshot_metrics_through_the_trainer(cls_set, hf_cls, tmp_path, source):
    """Logged every 2 steps and at the last, equal to an eval of the final model on the shards: from the shards
    themselves, or from the same set as a parquet dataset (its split and columns named, class names from its
    ClassLabel)."""

    folder, images, labels = cls_set
    model, tokenizer, processor = tiny_clip()
    trainer = tiny_trainer(model, tokenizer, processor, images, tmp_path)
    if source == "shards":
        callback = ZeroShotCallback(folder, tokenizer, processor, every_n_steps=2, batch_size=4)
    else:
        columns = dict(split="test", image_column="image", label_column="label")
        callback = ZeroShotCallback(hf_cls["parquet"], tokenizer, processor, every_n_steps=2, batch_size=4, **columns)
    callback.attach(trainer)
    trainer.train()
    logged = {e["step"]: e for e in trainer.state.log_history if "zeroshot_acc1" in e}
    assert sorted(logged) == [2, 3]  # every 2 steps, and the last
    final = zeroshot_classification(
        model, tokenizer, str(folder), CLASSNAMES, TEMPLATES, image_processor=processor, progress=False
    )
    assert {k: logged[3][f"zeroshot_{k}"] for k in final} == pytest.approx(final)


@pytest.mark.slow  # beyond the fast tier's time budget
def test_in_training_zeroshot_of_a_siglip_uses_its_own_processor_and_equals_the_final_eval(cls_set, tmp_path):
    """train/run.py's `_attach_zeroshot` driven as the Trainer drives the callback: a pretrained SigLIP (image
    processor mean/std 0.5) is evaluated during training on the images it trains on, normalised as its own processor
    does (not with CLIP's mean/std), and the last step logs what `disco-clip eval` of the same weights reports."""
    from types import SimpleNamespace

    from transformers import CLIPProcessor, SiglipImageProcessor, TrainerControl, TrainerState

    from disco_clip_ds.commands.eval import EvalArguments, run_eval
    from disco_clip_ds.models.build import build_model
    from disco_clip_ds.testing.launch import REPO
    from disco_clip_ds.train.run import _attach_zeroshot

    folder = cls_set[0]
    torch.manual_seed(5)
    model = build_model(model_config=str(REPO / "recipes/models/siglip_tiny.json")).eval()
    tokenizer = tiny_tokenizer()  # 258 tokens: within SigLIP tiny's 539
    image_processor = SiglipImageProcessor(size={"height": 64, "width": 64})
    assert list(image_processor.image_mean) == [0.5, 0.5, 0.5]
    saved = tmp_path / "siglip"
    model.save_pretrained(saved)
    tokenizer.save_pretrained(saved)
    image_processor.save_pretrained(saved)
    final = run_eval(EvalArguments(model=str(saved), data=str(folder), batch_size=4))["metrics"]

    logged, callbacks = [], []
    trainer = SimpleNamespace(
        args=SimpleNamespace(per_device_eval_batch_size=4), add_callback=callbacks.append, log=logged.append
    )
    data_args = SimpleNamespace(zeroshot_data=str(folder), zeroshot_steps=2)
    processor = CLIPProcessor(image_processor=image_processor, tokenizer=tokenizer)  # as train/run.py's _processor
    _attach_zeroshot(trainer, data_args, processor, 64)
    (callback,) = callbacks
    assert list(callback.image_processor.image_mean) == list(callback.image_processor.image_std) == [0.5] * 3
    state, control = TrainerState(global_step=3, max_steps=3), TrainerControl()
    callback.on_train_begin(None, state, control)
    callback.on_step_end(None, state, control, model=model)
    (metrics,) = logged
    assert metrics["zeroshot_acc1"] == pytest.approx(final["acc1"])
    assert {k: metrics[f"zeroshot_{k}"] for k in final} == pytest.approx(final, nan_ok=True)


# --- an in-training evaluation never ends the run ---


def _args():
    from types import SimpleNamespace

    return SimpleNamespace(device=torch.device("cpu"), eval_ema=False)


def test_whatever_an_evaluation_raises_is_logged_and_its_figures_left_out(caplog):
    """`evaluated` (one process: the ranks' agreement is this rank's outcome): a result passes through; an error of
    any kind, or the fail_in_eval fault after a successful evaluation, gives None and one warning with the step, what
    failed and the error's type; training goes on (nothing raised)."""
    callback = LoggingCallback()
    model = torch.nn.Linear(1, 1)
    assert callback.evaluated(_args(), 4, "the zero-shot eval", model, lambda: {"acc1": 0.5}) == {"acc1": 0.5}

    def broken():
        return b"\xff".decode("utf-8")

    with caplog.at_level("WARNING", logger="disco_clip_ds.eval"):
        assert callback.evaluated(_args(), 4, "the suite", model, broken) is None
    (line,) = [r.getMessage() for r in caplog.records]
    assert line.startswith("step 4: the suite failed on rank 0: UnicodeDecodeError: 'utf-8' codec can't decode")
    assert line.endswith("; training goes on")


def test_the_fail_in_eval_fault_fires_at_its_step_only(monkeypatch, caplog):
    callback = LoggingCallback()
    monkeypatch.setenv("DISCO_FAULT", "fail_in_eval:step=3")
    model = torch.nn.Linear(1, 1)
    assert callback.evaluated(_args(), 2, "the suite", model, lambda: 1) == 1
    with caplog.at_level("WARNING", logger="disco_clip_ds.eval"):
        assert callback.evaluated(_args(), 3, "the suite", model, lambda: 1) is None
    assert "step 3: the suite failed on rank 0: RuntimeError: DISCO_FAULT: fail_in_eval at step 3" in caplog.text


def test_a_task_file_that_is_not_utf8_does_not_stop_training(cls_set, tmp_path, caplog):
    """The suite during training with a task whose class-name file is not UTF-8: the step's evaluation is logged as
    failed and `on_step_end` returns (before the fix it raised UnicodeDecodeError on every rank, before the step's
    checkpoint); nothing of that task is logged as a figure."""
    from types import SimpleNamespace

    from transformers import TrainerControl, TrainerState

    from disco_clip_ds.eval.callback import SuiteCallback

    (tmp_path / "latin1.txt").write_bytes("z\xe9ro\nun\n".encode("latin-1"))
    (tmp_path / "tasks.yml").write_text(f"broken:\n  path: {cls_set[0]}\n  classnames: {tmp_path / 'latin1.txt'}\n")
    logged = []
    trainer = SimpleNamespace(log=logged.append, add_callback=lambda c: None)
    callback = SuiteCallback(tmp_path / "tasks.yml", None, None, every_n_steps=1).attach(trainer)
    args = SimpleNamespace(device=torch.device("cpu"), output_dir=str(tmp_path / "run"))
    state, control = TrainerState(global_step=1, max_steps=3), TrainerControl()
    with caplog.at_level("WARNING", logger="disco_clip_ds.eval"):
        callback.on_step_end(args, state, control, model=torch.nn.Linear(1, 1))
    assert "step 1: " in caplog.text and ("broken" in caplog.text or "the suite failed" in caplog.text)
    assert not any("suite/broken" in metrics for metrics in logged)
