"""`disco-clip train`, the library side: one run of CLIP (or SigLIP) pretraining under the HF Trainer (+ DeepSpeed ZeRO)
with the distributed contrastive loss computed inside the model's forward, as numbered steps (`train`), the way
HF's run_clip.py main() reads. The command line is `disco_clip_ds.commands.train`; the arguments,
`disco_clip_ds.train.args`; every refusal, `disco_clip_ds.train.validate`; the Trainer, `disco_clip_ds.train.trainer`.
What the checks resolved (configs, DeepSpeed JSON, tokenizer, counts, defaults) is read from their `CheckedRun`, never
again from the files: the arguments as given are kept for what records them as given (the node facts).
"""

from __future__ import annotations

import contextlib
import logging
import math
from pathlib import Path

import torch
from transformers import (
    AutoImageProcessor,
    CLIPProcessor,
    Siglip2Processor,
    set_seed,
)

from disco_clip_ds import compat
from disco_clip_ds.checkpoint import resume, universal
from disco_clip_ds.checkpoint.final_model import keep_final_model
from disco_clip_ds.checkpoint.layout import (
    STAGING,
    checkpoint_folders,
    checkpoint_step,
    has_weights,
    newest_complete,
    resolve_latest,
    verify_resumable,
)
from disco_clip_ds.checkpoint.runfile import read_run_file
from disco_clip_ds.checkpoint.space import check_space_at_start
from disco_clip_ds.data.collate import ClipCollator
from disco_clip_ds.data.embeddings import EmbeddingStore
from disco_clip_ds.data.mix import MixtureStream
from disco_clip_ds.data.shards import write_json
from disco_clip_ds.data.streams.base import ReaderStream
from disco_clip_ds.data.streams.hf import HFStream
from disco_clip_ds.data.streams.reinforced import Reinforcement
from disco_clip_ds.data.streams.shards import ShardStream
from disco_clip_ds.distributed import nodes, peers, startup
from disco_clip_ds.distributed.preemption import finished_message, resume_hint
from disco_clip_ds.distributed.ranks import decided_on_rank0
from disco_clip_ds.distributed.runlock import acquire_run_lock, release_run_lock
from disco_clip_ds.errors import CheckpointError, Preempted, UsageError
from disco_clip_ds.models.build import build_model
from disco_clip_ds.models.patch_dropout import patch_counts, stage_patch_counts
from disco_clip_ds.models.processor import at_image_size, pin_processor
from disco_clip_ds.models.resolution import parse_schedule
from disco_clip_ds.train.args import DataArguments, DiscoTrainingArguments, ModelArguments
from disco_clip_ds.train.compile import compile_towers, take_compile_settings
from disco_clip_ds.train.data_failure import worker_lost
from disco_clip_ds.train.distill import load_teacher, stored_teacher, teacher_inputs
from disco_clip_ds.train.host_memory import log_host_memory
from disco_clip_ds.train.locking import lock_towers
from disco_clip_ds.train.node_facts import node_facts
from disco_clip_ds.train.trainer import DiscoTrainer
from disco_clip_ds.train.validate import CheckedRun, validate
from disco_clip_ds.train.validate.teacher import teachers

logger = logging.getLogger("disco_clip_ds.train")


def train(model_args: ModelArguments, data_args: DataArguments, args: DiscoTrainingArguments) -> dict:
    """Run training; returns the train metrics (with `skipped_samples`, `decoded_samples`). Saves the final model
    to output_dir. Validates every argument first; holds output_dir's run lock throughout; raises Preempted after
    a stop signal's checkpoint. (The process group is up already: TrainingArguments joined it.)"""
    # 1. Check the nodes: every rank started alike, one --output_dir seen by all.
    nodes.check_nodes(args, lambda: node_facts(model_args, data_args, args))

    # 2. Validate every argument, before any work: shard lists, counts, tokenizer and model config. From here on the
    # model arguments are the checked ones, with their defaults filled in (run.json and resumes record those).
    checked = validate(model_args, data_args, args)
    model_args = checked.model_args
    startup.at_startup_point(startup.VALIDATED)  # DISCO_FAULT signal_at_startup:stage=1

    # 3. Lock output_dir, once a full disk would have been one line (before the lock and run.json are written) and
    # an explicit --resume_from_checkpoint folder is found to be there and to verify: a refusal leaves no run.lock.
    if args.resume_from_checkpoint not in (None, "latest"):
        # on rank 0 against its manifest: a missing folder is bad usage (exit 2), one that does not verify a failed
        # run (exit 1) naming the newest checkpoint beside it that does
        verify_resumable(args.resume_from_checkpoint)
    check_space_at_start(args.output_dir)
    with _run_lock(args.output_dir), peers.watching(args.ddp_timeout):
        startup.at_startup_point(startup.LOCKED)  # DISCO_FAULT signal_at_startup:stage=2
        # 4. The resume point: a checkpoint whose run's settings match this command's, or None (a fresh start).
        resume_from, split = _resume_point(args, model_args, data_args, checked)
        set_seed(args.seed)
        args.max_steps = checked.max_steps
        finished = finished_message(resume_from and checkpoint_step(resume_from), args.max_steps, resume_from)
        if finished:  # resuming would train one step past the end and change the final model
            repaired = keep_final_model(args.output_dir, resume_from)  # a final save cut short is written again
            if args.process_index == 0:
                print(repaired or finished)
            return {}

        # 5. The model, its locked towers, compiled with --torch_compile (towers alone, not the loss), its processor.
        args.push_to_hub = False  # never let the Trainer push raw DeepSpeed state: we export and push at the end
        startup.start_deepspeed_comm(args)  # compat.init_deepspeed_comm, with DISCO_FAULT signal_at_startup:stage=3
        model = build_model(
            model_args.model_name_or_path,
            model_args.model_config,
            model_args.loss_impl,
            model_args.chunk_size,
            config=checked.config,
            image_size=checked.image_size,  # --resolution_schedule's last side: the position embeddings resized once
        )
        lock_towers(model, model_args)
        compile_towers(model, take_compile_settings(args), fsdp=bool(args.fsdp))
        # saved with each checkpoint and the final model, pinned so that the Auto classes load it back as it is
        processor = _processor(checked, model_args.model_name_or_path, model.config)
        pin_processor(processor, model.config.model_type)
        teacher, teacher_extra = _teacher(model_args, args, checked, processor)

        # 6. The data: each rank's readers of the shards (or of the `datasets` dataset), and the collator.
        reads_own_shards = not args.accelerator_config.dispatch_batches
        patches = patch_counts(model.config.vision_config, args.patch_dropout)
        # under --resolution_schedule each sample's masks at every stage's grid; the step keeps its own (trainer)
        sides = [stage.size for stage in parse_schedule(args.resolution_schedule)] if args.resolution_schedule else []
        stage_patches = stage_patch_counts(model.config.vision_config, args.patch_dropout, sides)
        reinforcement = _reinforcement(model_args, checked)  # the sidecars' crops, captions and targets, when stored
        stream = _stream(data_args, args, checked, reads_own_shards, split, patches, reinforcement, stage_patches)
        # on a GPU the normalisation is ~free and the workers hand over 4x fewer bytes; on CPU ranks it would slow
        # the training loop, so by default the workers keep it there
        on_device = {"true": True, "false": False}.get(data_args.normalize_on_device, args.device.type == "cuda")
        if on_device:
            logger.info("the DataLoader hands over uint8 batches, normalised on %s", args.device)
        collator = ClipCollator(
            processor.tokenizer,
            checked.max_length,
            mean=processor.image_processor.image_mean,
            std=processor.image_processor.image_std,
            normalize=not on_device,
            patch_dropout=patches is not None,
            teacher=teacher_extra,
            max_num_patches=checked.naflex and checked.naflex[1],
        )

        startup.at_startup_point(startup.BUILT)  # DISCO_FAULT signal_at_startup:stage=4

        # 7. The trainer (and the zero-shot eval during training, when asked for).
        trainer = DiscoTrainer(
            model=model,
            args=args,
            train_dataset=stream,
            data_collator=collator,
            processing_class=processor,
            reads_own_shards=reads_own_shards,
            stop_signals=checked.stop_signals,
            teacher=teacher,
            samples_per_epoch=checked.num_samples,
        )
        if data_args.zeroshot_steps > 0:
            _attach_zeroshot(trainer, data_args, processor, checked.image_size)
        if data_args.eval_tasks:
            _attach_suite(trainer, data_args, processor)
        _log_plan(args, checked, trainer, model)
        log_host_memory(args, data_args, checked, model, teacher, on_device)  # warns when it passes MemTotal

        # 8. Train, with run.json written first (a resume adds a segment to it).
        if trainer.is_world_process_zero():
            _write_run_file(args, model_args, data_args, checked, resume_from, split)
        try:
            result = trainer.train(resume_from_checkpoint=resume_from)
        except RuntimeError as error:  # a DataLoader worker that died outside the fetch (torch's SIGCHLD handler)
            lost = worker_lost(error, args.process_index)
            if lost is None:
                raise
            raise lost from error
        if trainer.stopper.stopped:
            raise Preempted(resume_hint(args.output_dir, trainer.stopper.describe(), trainer.state.global_step))

        # 9. The final save: metrics, model, state, then the manifest that makes the final model verifiable.
        skipped, decoded = _stream_totals(trainer, stream)
        metrics = {**result.metrics, "skipped_samples": skipped, "decoded_samples": decoded}
        trainer.log_metrics("train", metrics)
        trainer.save_final(metrics)

        # 10. Report, then export and push to the hub when asked for.
        if trainer.is_world_process_zero():
            _report(args, metrics)
            if checked.hub_model_id:
                _export_and_push(args, checked.hub_model_id)
        return metrics


@contextlib.contextmanager
def _run_lock(output_dir: str):
    """output_dir's run lock, held throughout (decided on rank 0)."""
    acquire_run_lock(output_dir, staging=STAGING)
    try:
        yield
    finally:
        release_run_lock()


def _teacher(model_args: ModelArguments, args: DiscoTrainingArguments, checked: CheckedRun, processor):
    """The distillation teacher on this rank's device, sharded under ZeRO-3 (`distill.load_teacher`; an Ensemble for
    several --teacher; None without --teacher), and what its inputs need beyond the student's
    (`distill.teacher_inputs`)."""
    if model_args.teacher is None:
        return None, None
    names = " + ".join(model_args.teacher)
    if model_args.teacher_embeddings is not None and not model_args.live_teacher:
        logger.info("distilling from %s's embeddings in %s", names, model_args.teacher_embeddings)
        return stored_teacher(
            teachers(model_args),
            checked.teacher_store,
            model_args.distill_weight,
            model_args.distill_temperature,
            config=checked.teacher_config[0],
        )
    teacher = load_teacher(
        model_args.teacher,
        model_args.distill_weight,
        model_args.distill_temperature,
        args,
        config=checked.teacher_config,
        deepspeed=checked.deepspeed,
    )
    extra = teacher_inputs(
        teacher,
        model_args.teacher,
        checked.tokenizer,
        checked.max_length,
        processor.image_processor,
        checked.image_size,
    )
    logger.info(
        "distilling from %s (weight %g, %s)%s",
        names,
        model_args.distill_weight,
        f"temperature {model_args.distill_temperature:g}" if model_args.distill_temperature else "its own logit scale",
        "" if extra is None else ", with its own inputs",
    )
    return teacher, extra


def _reinforcement(model_args: ModelArguments, checked: CheckedRun) -> Reinforcement | None:
    """How the stream reads the sidecars of --teacher_embeddings (data/streams/reinforced.py); None without them."""
    if checked.teacher_store is None:
        return None
    augmentations, synthetic = checked.reinforced
    checked_store = checked.teacher_store
    return Reinforcement(
        # a store of its own, with nothing loaded yet: the DataLoader's workers each load the sidecars they read, and
        # none starts with a copy of the one the checks read their settings from
        EmbeddingStore(
            checked_store.folder,
            checked_store.fingerprints,
            sources=1 if checked.mixture is None else len(checked.mixture.sources),  # the sidecars it keeps open
        ),
        augmentations,
        model_args.augmentation_pool,
        model_args.synthetic_caption_ratio or 0.0,
        synthetic,
        targets=not model_args.live_teacher,
    )


def _stream(
    data_args: DataArguments,
    args: DiscoTrainingArguments,
    checked: CheckedRun,
    reads_own_shards: bool,
    split: int,
    patches: tuple[int, int] | None,
    reinforcement: Reinforcement | None = None,
    stage_patches: tuple[tuple[int, int], ...] = (),
):
    """This rank's training stream (rank 0's for all, under dispatch_batches; `split` ranks sharing each reader;
    each sample with its kept patches when `patches`, and those of a schedule's earlier grids, `stage_patches`;
    cropped, captioned and with its stored targets as the `reinforcement` says, with --teacher_embeddings)."""
    rank, world = (args.process_index, args.world_size) if reads_own_shards else (0, 1)
    extra = {"reinforcement": reinforcement} if reinforcement is not None else {}
    if checked.naflex is not None:  # SigLIP 2: NaFlex patch grids (data/naflex.py)
        extra["naflex"] = checked.naflex
    if checked.hf is not None:
        source, data = HFStream, checked.hf
    else:  # one stream of the shards, or a weighted mixture of the '::' sources (data/mix.py)
        source, data = (ShardStream, checked.urls) if checked.mixture is None else (MixtureStream, checked.mixture)
        extra["resampled"] = data_args.dataset_resampled
    return source(
        data,
        checked.image_size,
        rank=rank,
        world_size=world,
        seed=args.seed,
        shuffle_buffer=data_args.shuffle_buffer,
        num_workers=args.dataloader_num_workers,
        max_image_pixels=data_args.max_image_pixels,
        split=split,
        micro_batch=args.per_device_train_batch_size,
        patches=patches,
        stage_patches=stage_patches,
        **extra,
    )


def _log_plan(args: DiscoTrainingArguments, checked: CheckedRun, trainer: DiscoTrainer, model) -> None:
    logger.info(
        "%d samples per epoch, %d steps of %d x %d ranks x %d micro-steps (global contrastive batch %d), loss %s",
        checked.num_samples,
        args.max_steps,
        args.per_device_train_batch_size,
        args.world_size,
        args.gradient_accumulation_steps,
        trainer.contrastive_batch_size(),
        model.config.loss_impl,
    )


def _processor(checked: CheckedRun, model_name_or_path: str | None, config):
    """The processor saved with the model, at the run's image size: the pretrained model's own image processor when
    it has one (its normalisation is what its weights expect: SigLIP's is 0.5, not CLIP's), else CLIP's; for
    SigLIP 2, Siglip2ImageProcessor at the run's patch size and budget (the NaFlex pipeline's eval path)."""
    tokenizer, image_size = checked.tokenizer, checked.image_size
    if checked.naflex is not None:
        patch_size, budget = checked.naflex
        image_processor = compat.image_processor_class("Siglip2ImageProcessor")(
            patch_size=patch_size, max_num_patches=budget
        )
        return Siglip2Processor(image_processor=image_processor, tokenizer=tokenizer)
    image_processor = None
    if model_name_or_path:
        try:
            # with the config as loaded: AutoImageProcessor would load it again to find the processor's class
            image_processor = AutoImageProcessor.from_pretrained(model_name_or_path, config=checked.config)
        except (OSError, ValueError):  # a folder of weights without a preprocessor_config.json
            image_processor = None
    if image_processor is None:
        image_processor = compat.image_processor_class("CLIPImageProcessor")(
            size={"shortest_edge": image_size}, crop_size={"height": image_size, "width": image_size}
        )
    return CLIPProcessor(image_processor=at_image_size(image_processor, image_size), tokenizer=tokenizer)


def _resume_point(
    args: DiscoTrainingArguments, model_args: ModelArguments, data_args: DataArguments, checked: CheckedRun
) -> tuple[str | None, int]:
    """The checkpoint to resume (None: a fresh start), once its run's fixed settings are found to match this
    command's (`resume.check_resume`: one line naming what differs), before the model is built; on another world
    size, its universal conversion (`universal.universal_checkpoint`). And how many ranks share each of the run's
    data readers (`resume.ranks_per_reader`: 1, or p on p x the ranks with 1/p of the micro-batch)."""
    if args.resume_from_checkpoint is None:
        existing = checkpoint_folders(args.output_dir)
        if existing:  # a fresh run there would overwrite and rotate away the earlier run's checkpoints
            raise UsageError(
                f"{args.output_dir} holds checkpoints ({existing[0]}): pass --resume_from_checkpoint latest "
                "to continue that run, or choose a new --output_dir"
            )
        return None, 1
    if args.resume_from_checkpoint != "latest":
        last = args.resume_from_checkpoint  # verified before the lock was taken (step 3)
    else:
        last = resolve_latest(args.output_dir)  # on rank 0, skipping incomplete checkpoints; every rank resumes it
        logger.info("resume: %s", last or f"no checkpoint in {args.output_dir}, starting fresh")
    if last is None:
        return None, 1
    step = checkpoint_step(last)
    new = {
        **resume.launch_facts(
            args, data_args, checked.urls, checked.num_samples, checked.max_steps, model_args=model_args
        ),
        "model": resume.architecture(checked.config.to_dict(), checked.image_size),
        "ema_decay": args.ema_decay,
        "drop_ema": args.drop_ema,
        "data_stat_sha256": decided_on_rank0(lambda: resume.data_stat_digest(checked.urls, data_args)),
    }
    old = resume.check_resume(last, step, new, args.ignore_data_skip)
    if old.get("ema_decay") is not None and args.ema_decay is None:
        logger.warning("resume: --drop_ema: the EMA of the weights kept in %s is dropped", last)
    split = 1 if args.ignore_data_skip else resume.ranks_per_reader(old, new)
    if old.get("world_size", args.world_size) == args.world_size or step >= checked.max_steps:
        universal.drop_universal(args.output_dir)
        return last, split
    logger.info(
        "resume: %s, world size %d -> %d: through a universal checkpoint", last, old["world_size"], args.world_size
    )
    universal.load_universal(args)
    return str(universal.universal_checkpoint(last, args.output_dir)), split


def _stream_totals(trainer: DiscoTrainer, stream: ReaderStream) -> tuple[int, int]:
    """(skipped, decoded) samples over all ranks: skipped in the data trained on (the readers' newest positions
    count it, across resumes: train/stream_state.py); decoded ~ steps x global batch, plus what was prefetched."""
    local = torch.tensor([[float(stream.decoded.value)]], device=trainer.args.device)
    decoded = trainer.accelerator.gather(local).sum().item()
    figures = trainer.stream_state.figures(
        stream, trainer.args.dataloader_num_workers, trainer.accelerator, trainer.args.device
    )
    return figures["skipped_samples"], int(decoded)


def _attach_zeroshot(trainer, data_args: DataArguments, processor, image_size: int) -> None:
    from disco_clip_ds.eval.callback import ZeroShotCallback  # imported only when asked for

    # the image processor the run trains with: its normalisation (SigLIP's 0.5, not CLIP's) is what the weights
    # expect, and what `disco-clip eval` of the saved model uses
    ZeroShotCallback(
        data_args.zeroshot_data,
        processor.tokenizer,
        processor.image_processor,
        data_args.zeroshot_steps,
        batch_size=trainer.args.per_device_eval_batch_size,
    ).attach(trainer)


def _attach_suite(trainer, data_args: DataArguments, processor) -> None:
    """The task list during training, every --eval_steps (HF's flag: N steps, or a fraction of --max_steps) and on
    the final model, with the image processor the run trains with (see `_attach_zeroshot`)."""
    from disco_clip_ds.eval.callback import SuiteCallback  # imported only when asked for

    every = trainer.args.eval_steps or 0
    if 0 < every < 1:
        every = math.ceil(every * trainer.args.max_steps)
    SuiteCallback(
        data_args.eval_tasks,
        processor.tokenizer,
        processor.image_processor,
        int(every),
        batch_size=trainer.args.per_device_eval_batch_size,
    ).attach(trainer)


def _report(args: DiscoTrainingArguments, metrics: dict) -> None:
    out = Path(args.output_dir).resolve()
    print(
        f"\nmodel:  {out}"
        + (
            ""
            if has_weights(out)
            else "  (no weights: ZeRO-3 without stage3_gather_16bit_weights_on_model_save; "
            f"run `disco-clip export {newest_complete(out)} DIR`)"
        )
    )
    print(f"logs:   {out / 'runs'}  (tensorboard --logdir {out / 'runs'}), trainer_state.json")
    print(f"skipped samples: {metrics['skipped_samples']}")


def _write_run_file(
    args: DiscoTrainingArguments,
    model_args: ModelArguments,
    data_args: DataArguments,
    checked: CheckedRun,
    resume_from: str | None,
    split: int,
) -> None:
    """Every fact of the set-up that the exported model card states (export.py reads run.json, and nothing pickled).
    Written at a run's first launch; a resume adds a segment (`resume.with_resume`) and leaves the facts as they were,
    so that they stay true of every step."""
    facts = resume.launch_facts(
        args, data_args, checked.urls, checked.num_samples, checked.max_steps, split, model_args
    )
    facts["data_stat_sha256"] = resume.data_stat_digest(checked.urls, data_args)  # rank 0 alone writes run.json
    path = Path(args.output_dir) / "run.json"
    if resume_from is None:
        run = {
            **facts,
            **_mixture_facts(data_args, checked),
            "loss_impl": model_args.loss_impl,
            "precision": "bf16" if args.bf16 else "fp16" if args.fp16 else "fp32",
            "versions": {
                name: _version(name) for name in ("disco-clip-ds", "torch", "transformers", "deepspeed", "accelerate")
            },
        }
    else:
        recorded = read_run_file(args.output_dir) or read_run_file(Path(resume_from).parent)
        converted = Path(resume_from).parent.name == universal.UNIVERSAL_DIR
        run = resume.with_resume(recorded, checkpoint_step(resume_from), facts, converted, args.ignore_data_skip)
    write_json(path, {k: v for k, v in run.items() if v is not None})


def _mixture_facts(data_args: DataArguments, checked: CheckedRun) -> dict:
    """run.json's record of a mixture (the model card shows it): each source's weight, by its public description,
    and whether shards were drawn with replacement."""
    facts = {"dataset_resampled": True} if data_args.dataset_resampled else {}
    if checked.mixture is not None:
        mixture = checked.mixture
        facts["data_weights"] = ", ".join(f"{w:.4g} {name}" for w, name in zip(mixture.weights, mixture.names))
    return facts


def _version(package: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def _export_and_push(args: DiscoTrainingArguments, repo_id: str) -> None:
    from disco_clip_ds.export.hub import push_folder
    from disco_clip_ds.export.weights import export_checkpoint

    checkpoint = newest_complete(args.output_dir)
    if checkpoint is None:
        raise CheckpointError(f"no complete checkpoint in {args.output_dir} to export for --push_to_hub")
    folder = Path(args.output_dir) / f"export-{checkpoint.name}"  # one per checkpoint: a re-run reuses it
    if not folder.exists():
        folder = export_checkpoint(checkpoint, folder)
    print(f"pushed: {push_folder(folder, repo_id, private=bool(args.hub_private_repo), revision=args.hub_revision)}")
