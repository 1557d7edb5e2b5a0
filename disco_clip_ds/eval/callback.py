"""Zero-shot classification during training (`ZeroShotCallback`), logged like the loss."""

from __future__ import annotations

import functools

from transformers import TrainerCallback

from disco_clip_ds.errors import UsageError
from disco_clip_ds.eval.tasks import find_templates, open_eval_data, zeroshot_classification


class ZeroShotCallback(TrainerCallback):
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
        self.trainer = None

    def attach(self, trainer) -> "ZeroShotCallback":
        """Add this callback to `trainer` and log through it."""
        self.trainer = trainer
        trainer.add_callback(self)
        return self

    def on_train_begin(self, args, state, control, **kwargs):
        if self.trainer is None:
            raise RuntimeError(
                "ZeroShotCallback needs the trainer to log through: use ZeroShotCallback(...).attach(trainer)"
            )

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
        metrics = evaluate()
        ema = getattr(self.trainer, "ema", None)
        if ema is not None and getattr(args, "eval_ema", False):  # --eval_ema: the EMA's figures beside the weights'
            with ema.swapped():
                metrics.update({f"ema_{name}": value for name, value in evaluate().items()})
        # trainer.log clears should_log (the CallbackHandler's on_log does): kept, or a step that both evaluates and
        # logs would lose its loss and grad_norm, and the next logging step would average over twice the steps
        should_log = control.should_log
        self.trainer.log({f"zeroshot_{name}": value for name, value in metrics.items()})
        control.should_log = should_log
