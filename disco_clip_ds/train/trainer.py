"""DiscoTrainer: the stock Trainer with each hook it changes overridden once, here, delegating to small components
(contrastive accumulation, the finite check, stop signals, data failures, complete checkpoints, stream state,
throughput), so that what one step does reads top to bottom in this file.

Host syncs: outside logging and saving steps, the step's one host read of ours is the end-of-step flags
(train/step_flags.py; the run's first fetch adds one, train/data_failure.py). The Trainer's own remain: under
`logging_nan_inf_filter` (its default) it tests each micro-step's loss for NaN and inf on the host, and under DeepSpeed
it reads the gradient norm (`grad_norm.item()`) every step."""

from __future__ import annotations

import functools
import resource
import time
from pathlib import Path

import torch
from transformers import Trainer
from transformers.trainer_utils import get_last_checkpoint

from disco_clip_ds import compat, faults
from disco_clip_ds.checkpoint.universal import repair_zero3_universal_load
from disco_clip_ds.data.collate import POSITION_KEY
from disco_clip_ds.data.streams.base import ReaderStream
from disco_clip_ds.models.patch_dropout import at_grid
from disco_clip_ds.train.accumulation import ContrastiveAccumulation, logit_params
from disco_clip_ds.train.checkpointing import CompleteCheckpoints
from disco_clip_ds.train.data_failure import DataFailures
from disco_clip_ds.train.distill import split_inputs
from disco_clip_ds.train.ema import WeightsEma
from disco_clip_ds.train.finite import FiniteCheck, non_finite_parameters
from disco_clip_ds.train.lamb import Lamb
from disco_clip_ds.train.optim import parameter_groups, tower_rates, warmup_from_first_step, without_clip_no_decay
from disco_clip_ds.train.resolution import StepResolution
from disco_clip_ds.train.step_flags import exchange
from disco_clip_ds.train.stopping import StopSignals
from disco_clip_ds.train.stream_state import StreamPositions
from disco_clip_ds.train.throughput import Throughput, flops_per_sample, peak_tflops


class DiscoTrainer(Trainer):
    """The stock Trainer plus CLIP logging (logit scale, global batch, throughput, data vs step time, peak
    memory, skipped samples), OpenCLIP's weight-decay exclusions and contrastive accumulation over
    gradient_accumulation_steps (`accumulation`). The loss comes from the model.

    Checkpoints are complete or absent (`checkpoints`); `stop_signals=(...)` stop training at the next step with a
    checkpoint (`stopper.stopped` says whether one did); a loss or gradient norm that is not finite stops every rank
    before anything of that step is saved (`finite`). With --ema_decay an EMA of the weights is kept, saved and
    restored with every checkpoint (`ema`). Each batch's stream positions are kept and saved in every
    checkpoint, and a resume restores them (`stream_state`) instead of skipping batches.
    """

    def __init__(
        self,
        *args,
        reads_own_shards: bool = True,
        stop_signals: tuple[int, ...] = (),
        teacher=None,
        samples_per_epoch: int | None = None,
        **kwargs,
    ):
        self.signals = StopSignals(stop_signals)  # before the DataLoader forks its workers
        self.stopper = self.signals.stopper
        kwargs["callbacks"] = [*(kwargs.get("callbacks") or []), self.stopper]
        self.checkpoints = CompleteCheckpoints(self)
        self.finite = FiniteCheck()
        self.data_failures = DataFailures()
        self.stream_state = StreamPositions()
        super().__init__(*args, **kwargs)
        self.ema = None  # the EMA of the weights (`ema`), updated at each optimizer step, before the other callbacks
        if getattr(self.args, "ema_decay", None) is not None:
            self.ema = WeightsEma(self, self.args.ema_decay, self.args.ema_start_step, self.args.ema_warmup)
            self.add_callback(self.ema)
        self.accumulation = ContrastiveAccumulation(self.args)
        if self.accumulation.enabled:
            # compute_loss returns loss / K itself: the Trainer must not divide again (its documented switch).
            self.loss_is_scaled_for_ga = True
        self.reads_own_shards = reads_own_shards
        self.teacher = teacher  # a distillation teacher (train/distill.py), held here: never saved with the model
        max_num_patches = getattr(self.data_collator, "max_num_patches", None)  # SigLIP 2's NaFlex budget
        self.resolution = StepResolution(self.args, self.model.config)  # --resolution_schedule's size per step
        flops = flops_per_sample(self.model.config, self.args, max_num_patches, teacher, self.resolution.size_at)
        peak, why_no_peak = peak_tflops(self.args, self.args.device)  # why no MFU: said once, by rank 0
        self.throughput = Throughput(flops, peak, why_no_peak if self.args.process_index == 0 else "")
        self._data_time, self._settled_step = 0.0, None
        self._resume_checkpoint = None
        self.samples_per_epoch = samples_per_epoch  # of the stream, which has no length the Trainer could read

    def contrastive_batch_size(self) -> int:
        """The pairs each optimizer step contrasts: micro x world (x K when accumulating contrastively)."""
        return self.accumulation.contrastive_batch_size()

    # --- set-up ---

    def create_accelerator_and_postprocess(self):
        super().create_accelerator_and_postprocess()
        if compat.fsdp_on_cpu(self.accelerator.state, self.args.fsdp_plugin_args):  # before is_fsdp_enabled is read
            self.is_fsdp_enabled = True

    def get_decay_parameter_names(self, model) -> list[str]:
        return without_clip_no_decay(super().get_decay_parameter_names(model))

    def create_optimizer(self, model=None):
        """The Trainer's optimizer, over per-tower, per-layer groups when a tower's rate is set (`optim`)."""
        opt_model = self.model if model is None else model
        towers = tower_rates(self.args, opt_model.config)
        if self.optimizer is None and towers:
            decay = set(self.get_decay_parameter_names(opt_model))
            groups = parameter_groups(
                opt_model.named_parameters(), decay, self.args.learning_rate, self.args.weight_decay, towers
            )
            optimizer_cls, optimizer_kwargs = self.get_optimizer_cls_and_kwargs(self.args, opt_model)
            self.optimizer = optimizer_cls(groups, **optimizer_kwargs)
        optimizer = super().create_optimizer(model)  # with self.optimizer set, it only wraps it where needed
        if isinstance(self.optimizer, Lamb) and self.is_deepspeed_enabled:
            from disco_clip_ds.train.lamb_shards import zero_pieces

            # read at the first step: by then the engine (model_wrapped) has flattened the groups into its partitions
            self.optimizer.layout = lambda: zero_pieces(self.model_wrapped)
        return optimizer

    def get_optimizer_cls_and_kwargs(self, args, model=None):
        """The Trainer's, plus --optim lamb (train/lamb.py) with --adam_beta1/2 and --adam_epsilon."""
        if args.optim == "lamb":
            betas = (args.adam_beta1, args.adam_beta2)
            return Lamb, {"lr": args.learning_rate, "betas": betas, "eps": args.adam_epsilon}
        return super().get_optimizer_cls_and_kwargs(args, model)

    def create_scheduler(self, num_training_steps: int, optimizer=None):
        scheduler = super().create_scheduler(num_training_steps, optimizer)
        warmup = self.args.get_warmup_steps(num_training_steps)
        if warmup > 0 and isinstance(scheduler, torch.optim.lr_scheduler.LambdaLR) and not hasattr(scheduler, "warmup"):
            self.lr_scheduler = scheduler = warmup_from_first_step(scheduler, warmup)  # the Trainer may ask again
        return scheduler

    # --- data ---

    def get_train_dataloader(self):
        loader = self.signals.leave_to_rank(super().get_train_dataloader())
        if self.reads_own_shards:
            compat.unshard_iterable_dataset(loader)
        return loader

    def train(self, resume_from_checkpoint=None, *args, **kwargs):
        self._resume_checkpoint = resume_from_checkpoint  # for get_resumed_dataloader, which is not told it
        return super().train(resume_from_checkpoint, *args, **kwargs)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        super()._load_optimizer_and_scheduler(checkpoint)  # after the engine loaded `checkpoint` (DeepSpeed)
        if checkpoint is not None and self.is_deepspeed_enabled:
            repair_zero3_universal_load(self.model_wrapped.optimizer, checkpoint)
        if self.ema is not None:  # the Trainer calls this only when resuming; the EMA starts at on_train_begin
            self.ema.resume_from = checkpoint

    def get_resumed_dataloader(self, dataloader, num_batches: int):
        """Resume the stream where each reader stood (stream_state.json) instead of reading and decoding the
        `num_batches` batches trained on."""
        checkpoint = self._resume_checkpoint
        if isinstance(checkpoint, bool):
            checkpoint = get_last_checkpoint(self.args.output_dir)
        if not isinstance(self.train_dataset, ReaderStream):
            return super().get_resumed_dataloader(dataloader, num_batches)
        config = self.args.accelerator_config
        # under dispatch_batches rank 0's loader hands out `world` batches per step (one, with split_batches)
        per_step = self.args.world_size if config.dispatch_batches and not config.split_batches else 1
        self.stream_state.restore(self.train_dataset, checkpoint, num_batches, per_step)
        return dataloader

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        start = time.perf_counter()
        self.throughput.started(start, self.state.global_step)  # after a resume, global_step is the restored one
        fetch = functools.partial(super().get_batch_samples, epoch_iterator, num_batches, device)
        # a rank whose loading fails trains this step on a stand-in; every rank raises at its end (_settle_step)
        batches = self.data_failures.fetch(fetch, num_batches, self.args.process_index, self.args.device)
        until = self.args.patch_dropout_until_step  # the first step (1-based, as logged) that sees every patch
        unmasked = until is not None and self.state.global_step + 1 >= until
        grid = self.resolution.patches_per_image(self.state.global_step)  # None: no schedule
        for batch in batches[0]:  # the stream's positions ride in the batch; the model must not see them
            self.stream_state.note(batch.pop(POSITION_KEY, None))
            # FLIP's unmasked tuning, and under a schedule the masks of the step's grid: the step decides, so a
            # resumed run switches where the first did
            if unmasked or grid is not None:
                at_grid(batch, None if unmasked else grid)
        # the step's micro-batches, each forward taking its stage's share of them (--stage_micro_batch_sizes)
        self.accumulation.record(batches[0], self.resolution.merged_at(self.state.global_step))
        self._data_time += time.perf_counter() - start
        return batches

    def _prepare_inputs(self, inputs):
        # Every training forward passes here (training_step; the contrastive accumulation's embedding pass), and so
        # does evaluation. A uint8 batch (ClipCollator(normalize=False)) is normalised on the device by the
        # collator's own Normalize, then cast as the Trainer casts float inputs (DeepSpeed's dtype): what the model
        # sees is bit for bit what the workers would have made. A new dict: the raw batch stays uint8 for the next call.
        inputs = super()._prepare_inputs(inputs)
        pixels = inputs.get("pixel_values")
        if pixels is not None and pixels.dtype == torch.uint8:
            mask = inputs.get("pixel_attention_mask")  # NaFlex: its padding stays 0, as the image processor pads
            normalized = self.data_collator.normalize.batch(pixels, *(() if mask is None else (mask,)))
            inputs = {**inputs, "pixel_values": self._prepare_input(normalized)}
        return self.resolution.resized(inputs)  # a training step's size under --resolution_schedule

    # --- the step ---

    def training_step(self, model, inputs, num_items_in_batch=None):
        inputs = self.accumulation.take(inputs)  # a stage's larger micro-batch: the run's last item takes them all
        if inputs is None:
            return torch.zeros((), device=self.args.device)
        embed_and_cache = functools.partial(
            self.accumulation.embed_and_cache,
            model=model,
            unwrapped=self.model,
            prepare_inputs=self._prepare_inputs,
            autocast=self.compute_loss_context_manager,
            teacher=self.teacher,
        )
        # the step's size (--resolution_schedule) holds for every forward of the step, the embedding pass's too
        with self.resolution.at_step(self.state.global_step), self.accumulation.micro_step(inputs, embed_and_cache):
            loss = super().training_step(model, inputs, num_items_in_batch)
        self.finite.add(loss)
        return loss

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if self.accumulation.in_step:  # the micro-batch's share of the accumulated contrastive loss
            return self.accumulation.loss(model, self.model, split_inputs(inputs)[0], return_outputs)
        if self.teacher is not None:
            return self._distilled_loss(model, inputs, return_outputs)
        # return_loss rides here, not in the batch: accelerate's dispatch_batches broadcasts tensors only.
        inputs = {**inputs, "return_loss": True}
        return super().compute_loss(model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch)

    def _distilled_loss(self, model, inputs, return_outputs: bool):
        """(1 - W) contrastive + W distillation on this batch: the student's embeddings, then the mixed loss outside
        its forward (as contrastive accumulation computes its loss), the teacher's embeddings without grad."""
        student, teacher_inputs = split_inputs(inputs)
        outputs = model(**{**student, "return_loss": False, "return_logits": False})
        loss_fn = self.teacher.loss_fn(*self.teacher.embed(teacher_inputs))
        loss = loss_fn(outputs.image_embeds, outputs.text_embeds, *logit_params(self.model, outputs))
        return (loss, outputs) if return_outputs else loss

    def _maybe_log_save_evaluate(self, tr_loss, grad_norm, model, *args, **kwargs):
        step = self.state.global_step
        if step != self._settled_step:  # the Trainer comes again, for the same step, at an epoch's end
            self._settled_step = step
            self._settle_step(step, grad_norm, model)
        return super()._maybe_log_save_evaluate(tr_loss, grad_norm, model, *args, **kwargs)

    def _settle_step(self, step: int, grad_norm, model) -> None:
        """Before the Trainer logs, evaluates or saves anything of the step, every rank learns in one all-reduce
        (step_flags.exchange) whether some rank's data loading failed, whether the step was finite (its loss, its
        gradient norm, at a saving step the weights to be saved) and whether some rank received a stop signal; each
        rank then raises, stops with a checkpoint or trains on, all alike."""
        saves = self.control.should_save
        bad = non_finite_parameters(model) if saves else 0  # what the save would write
        flags = exchange(
            self.finite.take_loss(),
            grad_norm,
            bad,
            self.data_failures.failed,
            self.stopper.requested(),
            self.args.device,
        )
        if flags.data_failed:  # first: a stand-in step's numbers mean nothing
            self.data_failures.raise_everywhere(self.args.process_index)
        self.finite.check(step, flags.loss, flags.grad_norm, flags.weights_finite)
        if self.stopper.stop(self.state, self.control, flags.stop) and not saves:
            # the stop's checkpoint must hold finite weights too: a second exchange, at this one step of the run
            weights = exchange(0.0, None, non_finite_parameters(model), False, False, self.args.device)
            self.finite.check(step, flags.loss, flags.grad_norm, weights.weights_finite)

    # --- saving ---

    def _get_output_dir(self, trial) -> str:
        # The stock _save_checkpoint writes into _get_output_dir(trial)/checkpoint-N: point it at the staging area.
        staging = self.checkpoints.staging_dir
        return str(staging) if staging is not None else super()._get_output_dir(trial)

    def _save_checkpoint(self, model, trial) -> None:
        self.stream_state.gather(
            self.train_dataset, self.args.dataloader_num_workers, self.accelerator, self.args.device
        )
        run_dir = Path(super()._get_output_dir(trial))
        self.checkpoints.save_checkpoint(functools.partial(super()._save_checkpoint, model, trial), run_dir)

    def _save_rng_state(self, output_dir: str) -> None:
        faults.in_save(self.state.global_step)  # the named point: model and DeepSpeed files written, state not
        super()._save_rng_state(output_dir)
        self.stream_state.write(self.train_dataset, output_dir, self.is_world_process_zero())
        if self.ema is not None:
            self.ema.save(output_dir)  # every rank its own part: the checkpoint's manifest covers it

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        self.checkpoints.save_model(super().save_model, output_dir, _internal_call)

    def save_final(self, metrics: dict) -> None:
        """The final save into output_dir (train metrics, model, Trainer state), then its manifest, written last:
        a kill or a full disk on the way leaves none, and the next run repairs the final model (`keep_final_model`)."""
        self.checkpoints.save_final(metrics)

    # --- logging ---

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if self.samples_per_epoch:
            # The stream has no length, so the Trainer's epoch is global_step / max_steps (1.0 at the end of any run,
            # after 53 passes over the demo): logged instead, the passes over the data trained on so far.
            self.state.epoch = self.state.global_step * self._samples_per_step() / self.samples_per_epoch
        if "loss" in logs:  # the training log, reached by every rank at the same step
            logs.update(self._training_metrics())
        elif "train_runtime" in logs:  # the Trainer's final log, whose dict train() returns (train_results.json)
            logs.update(self.throughput.run_figures(self._samples_per_step(), self.args.world_size))
        super().log(logs, start_time)

    def _training_metrics(self) -> dict[str, float]:
        # A logging step: the Trainer reads its loss on the host here anyway, so the figures below may read theirs.
        now, step, world = time.perf_counter(), self.state.global_step, self.args.world_size
        steps = max(1, step - self.throughput.last[1])
        self.stream_state.fold()
        local = torch.tensor(
            [self._data_time, _peak_memory_gib(self.args.device)], dtype=torch.float64, device=self.args.device
        )
        per_rank = self.accelerator.gather(local[None]).reshape(world, 2).cpu()
        self._data_time = 0.0
        metrics = {
            "logit_scale": float(getattr(self.model, "last_logit_scale", float("nan"))),
            "global_contrastive_batch": self.contrastive_batch_size(),
            **self.throughput.figures(now, step, self._samples_per_step(), world),
            "data_time_s": per_rank[:, 0].max().item() / steps,
            "peak_mem_gib_max": per_rank[:, 1].max().item(),
            **self.stream_state.figures(  # skipped_samples, and per source of a mixture
                self.train_dataset, self.args.dataloader_num_workers, self.accelerator, self.args.device
            ),
        }
        if self.resolution.schedule is not None:  # the stage of the logged step: its MFU is that stage's
            key = "max_num_patches" if self.resolution.naflex else "image_size"
            metrics[key] = self.resolution.size_at(step - 1)
            metrics["micro_batch_per_rank"] = (
                self.accumulation.last_forward_rows or self.args.per_device_train_batch_size
            )
        if world <= 16:
            metrics.update({f"peak_mem_gib_rank{r}": per_rank[r, 1].item() for r in range(world)})
        return metrics

    def _samples_per_step(self) -> int:
        """The samples of one optimizer step over all devices."""
        return self.args.per_device_train_batch_size * self.args.gradient_accumulation_steps * self.args.world_size


def _peak_memory_gib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux: this rank's peak RSS
