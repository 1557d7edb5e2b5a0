"""Evaluation during training, logged like the loss: one zero-shot set (`ZeroShotCallback`) or a task list
(`SuiteCallback`).

Both run on every rank together, as the Trainer calls them (ZeRO-3 forwards are collectives): each rank reads the
same sets whole and encodes its share of their batches, in rounds of one forward per rank (eval/spread.py), and every
rank gets the same metrics; no rank waits on another at the next collective for longer than their skew, far within
--ddp_timeout as long as the evaluation itself is."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from pathlib import Path

from transformers import TrainerCallback

from disco_clip_ds import faults
from disco_clip_ds.distributed.ranks import all_true, rank
from disco_clip_ds.errors import DiscoClipError, UsageError
from disco_clip_ds.eval.encode import gathered
from disco_clip_ds.eval.suite import error_line, load_tasks, run_suite, scalars, training_tasks, write_suite
from disco_clip_ds.eval.tasks import find_templates, open_eval_data, zeroshot_classification

logger = logging.getLogger("disco_clip_ds.eval")
SUITE_FOLDER = "suite"  # the final model's suite, in the run folder (export/card.py reads suite.json there)


class LoggingCallback(TrainerCallback):
    """A callback that logs metrics through its trainer (`attach`) without taking the step's own log from it."""

    trainer = None

    def attach(self, trainer):
        """Add this callback to `trainer` and log through it."""
        self.trainer = trainer
        trainer.add_callback(self)
        return self

    def on_train_begin(self, args, state, control, **kwargs):
        if self.trainer is None:
            name = type(self).__name__
            raise RuntimeError(f"{name} needs the trainer to log through: use {name}(...).attach(trainer)")

    def log(self, control, metrics: dict) -> None:
        # trainer.log clears should_log (the CallbackHandler's on_log does): kept, or a step that both evaluates and
        # logs would lose its loss and grad_norm, and the next logging step would average over twice the steps
        should_log = control.should_log
        self.trainer.log(metrics)
        control.should_log = should_log

    def evaluated(self, args, step: int, what: str, model, evaluate: Callable):
        """`evaluate()` run on every rank (under FSDP2 with `model`'s root parameters gathered), or None on every rank
        when it raised on any: each rank that failed logs its error, rank 0 logs a failure elsewhere, and training
        goes on (the module docstring)."""
        error = None
        try:
            with gathered(model):
                result = evaluate()
            faults.after_eval(step)
        except Exception as e:  # anything: an in-training evaluation must not end the run (nor lose its checkpoint)
            error, result = e, None
        if all_true(error is None, getattr(args, "device", None)):
            return result
        if error is not None:
            logger.warning("step %d: %s failed on rank %d: %s; training goes on", step, what, rank(), _line(error))
        elif rank() == 0:
            logger.warning("step %d: %s failed on another rank (its own line says why); training goes on", step, what)
        return None


def _line(error: BaseException) -> str:
    """An error in one line: a project error's own message, any other with its type (a UnicodeDecodeError's text
    does not say what it is)."""
    line = error_line(error)
    return line if isinstance(error, DiscoClipError) else f"{type(error).__name__}: {line}"


class ZeroShotCallback(LoggingCallback):
    """Zero-shot classification every `every_n_steps` optimizer steps (and at the last), logged like the loss.

    `data_dir` is what `disco-clip eval --data` takes: shards, or a 🤗 datasets source (then `split`, `config`,
    `image_column` and `label_column` as `DatasetSource.open` takes them; by default the only split and column
    of each kind). `image_processor` is the one the run trains with: the model's own normalisation (SigLIP's 0.5,
    not CLIP's), so that the numbers are those `disco-clip eval` gives for the same weights. Runs on every rank
    (ZeRO-3 forwards are collectives) and logs through `trainer.log`, so the metrics reach the console,
    TensorBoard and `trainer_state.json` as `zeroshot_acc1` etc. Register it with
    `ZeroShotCallback(...).attach(trainer)`, which also gives it the trainer to log through. Under --eval_ema the EMA
    of the weights (the trainer's `ema`) is evaluated too, swapped into the model and out, logged as `zeroshot_ema_*`.
    """

    def __init__(
        self,
        data_dir,
        tokenizer,
        image_processor,
        every_n_steps: int,
        batch_size: int = 64,
        classnames=None,
        templates=None,
        *,
        split: str | None = None,
        config: str | None = None,
        image_column: str | None = None,
        label_column: str | None = None,
    ):
        if every_n_steps <= 0:
            raise UsageError(f"every_n_steps must be positive, got {every_n_steps}")
        self.data = str(data_dir)
        self.source, self.classnames = open_eval_data(
            self.data,
            "zeroshot_classification",
            split=split,
            config=config,
            image_column=image_column,
            label_column=label_column,
            classnames=classnames,
        )
        self.templates = find_templates(self.data, templates)
        self.tokenizer, self.image_processor = tokenizer, image_processor
        self.every_n_steps, self.batch_size = every_n_steps, batch_size

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if state.global_step % self.every_n_steps and state.global_step != state.max_steps:
            return
        evaluate = functools.partial(
            zeroshot_classification,
            model,
            self.tokenizer,
            self.source,
            self.classnames,
            self.templates,
            image_processor=self.image_processor,
            batch_size=self.batch_size,
            progress=False,
        )
        step = state.global_step
        metrics = self.evaluated(args, step, "the zero-shot eval", model, evaluate) or {}
        ema = getattr(self.trainer, "ema", None)
        if ema is not None and getattr(args, "eval_ema", False):  # --eval_ema: the EMA's figures beside the weights'
            with ema.swapped():  # the EMA into the shards first, then (FSDP2) gathered from them
                averaged = self.evaluated(args, step, "the zero-shot eval of the EMA", model, evaluate) or {}
            metrics.update({f"ema_{name}": value for name, value in averaged.items()})
        if metrics:
            self.log(control, {f"zeroshot_{name}": value for name, value in metrics.items()})


class SuiteCallback(LoggingCallback):
    """A task list (eval/suite.py) during training: every `every_n_steps` optimizer steps (0: never) its training
    tasks (those marked `train: true`, or all), and at the last step all of them; each task's main metric and the
    average logged like the loss (`suite/<key>`, `suite/average`: console, TensorBoard, trainer_state.json). The
    last step's suite, the final model's, is written to the run folder (`output_dir/suite/`: each task's
    CLIP_benchmark JSON, suite.md, suite.csv, suite.json), from where the model card takes it.

    A task that fails is logged as a warning with its error and left out of the average; training goes on (a
    failure of the whole suite is logged as the module docstring says). Its files are opened on every rank before
    its first forward, and a task that fails to open on any rank is skipped on all (`run_suite`'s `agree`), so that
    no rank waits for the others in a ZeRO-3 or FSDP2 forward. The task list is read when the callback is made,
    before training: a malformed one is a UsageError on every rank.
    `image_processor` is the one the run trains with, as for `ZeroShotCallback`."""

    def __init__(self, tasks_file, tokenizer, image_processor, every_n_steps: int, batch_size: int = 64):
        if every_n_steps < 0:
            raise UsageError(f"--eval_steps must be 0 (the final model only) or positive, got {every_n_steps}")
        self.tasks = load_tasks(tasks_file, flag="--eval_tasks")
        self.tokenizer, self.image_processor = tokenizer, image_processor
        self.every_n_steps, self.batch_size = every_n_steps, batch_size

    def on_step_end(self, args, state, control, model=None, **kwargs):
        last = state.global_step == state.max_steps
        if not last and (not self.every_n_steps or state.global_step % self.every_n_steps):
            return
        tasks = self.tasks if last else training_tasks(self.tasks)
        evaluate = functools.partial(
            run_suite,
            tasks,
            model,
            self.tokenizer,
            self.image_processor,
            batch_size=self.batch_size,
            progress=False,
            agree=lambda opened: all_true(opened, args.device),  # a task runs on every rank or on none
        )
        results = self.evaluated(args, state.global_step, "the suite", model, evaluate)
        if results is None:
            return
        for result in results:
            if result.error is not None and state.is_world_process_zero:
                step, key = state.global_step, result.task.key
                logger.warning("step %d: task %s failed: %s", step, key, error_line(result.error))
        self.log(control, scalars(results))
        if last and state.is_world_process_zero:
            write_suite(results, Path(args.output_dir) / SUITE_FOLDER)
