"""`disco-clip train` / `python -m disco_clip_ds.train`: CLIP under the HF Trainer (+ DeepSpeed ZeRO) with the
distributed contrastive loss computed inside the model's forward.

Starts the same way under every launcher (`deepspeed`, `torchrun`, `accelerate launch`, or plain python); on a
machine without a GPU it runs on CPU with no extra flag. Arguments: the Trainer's own (`--help` lists them) plus
the ModelArguments and DataArguments below.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import resource
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import (
    AutoImageProcessor,
    AutoTokenizer,
    CLIPImageProcessor,
    CLIPProcessor,
    HfArgumentParser,
    Trainer,
    TrainingArguments,
    set_seed,
)

from disco_clip_ds import LOSS_IMPLS, compat
from disco_clip_ds.checkpoint import resume
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
from disco_clip_ds.data.collate import POSITION_KEY, ClipCollator
from disco_clip_ds.data.hf_io import HFData, load_training_dataset
from disco_clip_ds.data.shards import count_samples, empty_reader, expand_shards, shards_for_reader, write_json
from disco_clip_ds.data.streams.base import ReaderStream, error_message
from disco_clip_ds.data.streams.hf import HFStream
from disco_clip_ds.data.streams.shards import ShardStream
from disco_clip_ds.data.streams.state import POSITION_FIELDS, STATE_FILE, as_rows, note_positions, read_stream_state
from disco_clip_ds.data.transforms import MAX_IMAGE_PIXELS
from disco_clip_ds.distributed import nodes, peers
from disco_clip_ds.distributed.preemption import (
    exit_without_finalization,
    finished_message,
    parse_signals,
    resume_hint,
)
from disco_clip_ds.distributed.ranks import any_true
from disco_clip_ds.distributed.runlock import acquire_run_lock, release_run_lock
from disco_clip_ds.errors import (
    EXIT_PREEMPTED,
    CheckpointError,
    DataError,
    DiscoClipError,
    ExportError,
    Preempted,
    UsageError,
)
from disco_clip_ds.models.build import MODEL_CLASSES, build_model, load_config
from disco_clip_ds.train.accumulation import ContrastiveAccumulationMixin, check_contrastive_accumulation
from disco_clip_ds.train.checkpointing import CompleteCheckpointsMixin
from disco_clip_ds.train.finite import FiniteStepsMixin
from disco_clip_ds.train.node_facts import node_facts
from disco_clip_ds.train.optim import warmup_from_first_step, without_clip_no_decay
from disco_clip_ds.train.stopping import StopSignalsMixin

logger = logging.getLogger("disco_clip_ds.train")


@dataclass
class ModelArguments:
    model_name_or_path: str | None = field(default=None, metadata={"help": "pretrained CLIP weights: hub id or folder"})
    model_config: str | None = field(
        default=None,
        metadata={
            "help": "CLIPConfig or SiglipConfig JSON to train from scratch, e.g. recipes/models/tiny.json, "
            "recipes/models/siglip_tiny.json"
        },
    )
    tokenizer_name: str | None = field(
        default=None,
        metadata={
            "help": "tokenizer hub id or folder (default: model_name_or_path), e.g. openai/clip-vit-base-patch32"
        },
    )
    loss_impl: str = field(
        default="tiled",
        metadata={
            "choices": list(LOSS_IMPLS),
            "help": "tiled / disco: global-batch loss; local: each device's own batch (HF's example)",
        },
    )
    chunk_size: int | None = field(
        default=None, metadata={"help": "rows per tile of the tiled loss (default: automatic)"}
    )
    image_size: int | None = field(default=None, metadata={"help": "training resolution (default: the model config's)"})
    max_text_length: int | None = field(
        default=None, metadata={"help": "tokens per caption (default: the model's max_position_embeddings)"}
    )
    lock_image_tower: bool = field(default=False, metadata={"help": "freeze the vision encoder and its projection"})
    lock_text_tower: bool = field(default=False, metadata={"help": "freeze the text encoder and its projection"})


@dataclass
class DataArguments:
    train_shards: str | None = field(
        default=None,
        metadata={
            "help": "webdataset shards: 'dir/{00000..00099}.tar', a folder, or several joined by '::' (or give "
            "--dataset_name / --train_file)"
        },
    )
    dataset_name: str | None = field(
        default=None,
        metadata={
            "help": "a 🤗 datasets dataset to train from: hub id, or a folder (save_to_disk, parquet files, "
            "imagefolder with metadata.jsonl)"
        },
    )
    dataset_config_name: str | None = field(default=None, metadata={"help": "the configuration of --dataset_name"})
    train_split: str = field(default="train", metadata={"help": "the split of --dataset_name to train on"})
    train_file: str | None = field(
        default=None, metadata={"help": "a csv, json(l) or parquet file of image paths (or bytes) and captions"}
    )
    image_column: str = field(
        default="image",
        metadata={"help": "column of --dataset_name/--train_file with the images: an Image feature, bytes or paths"},
    )
    caption_column: str = field(
        default="caption",
        metadata={"help": "column with the captions: a string, or a list of strings (one drawn per pass)"},
    )
    streaming: bool = field(
        default=False,
        metadata={"help": "stream --dataset_name/--train_file (an IterableDataset) instead of loading it"},
    )
    train_num_samples: int | None = field(
        default=None,
        metadata={
            "help": "samples per epoch (default: from sizes.json or img2dataset *_stats.json, or the dataset's "
            "number of rows)"
        },
    )
    shuffle_buffer: int = field(
        default=1000,
        metadata={
            "help": "samples in each reader's shuffle buffer (0: stream order; a map-style dataset is permuted "
            "whole each pass unless 0)"
        },
    )
    zeroshot_data: str | None = field(
        default=None, metadata={"help": "eval shards (CLIP_benchmark layout) for zero-shot accuracy during training"}
    )
    zeroshot_steps: int = field(default=0, metadata={"help": "run the zero-shot eval every N steps (0: never)"})
    max_image_pixels: int = field(
        default=MAX_IMAGE_PIXELS,
        metadata={"help": "skip (and count) training images of more pixels, read from the header before decoding"},
    )
    normalize_on_device: str = field(
        default="auto",
        metadata={
            "choices": ["auto", "true", "false"],
            "help": "hand the batch over as uint8 and normalise it on the device (bit-identical; auto: on a GPU), "
            "else in the DataLoader workers",
        },
    )


@dataclass
class DiscoTrainingArguments(TrainingArguments):
    """TrainingArguments with CLIP-pretraining defaults; CPU is chosen automatically when there is no GPU, and each
    rank reads its own shards unless --accelerator_config says dispatch_batches."""

    remove_unused_columns: bool = field(default=False, metadata={"help": "kept False: batches hold only model inputs"})
    report_to: None | str | list[str] = field(default="tensorboard", metadata={"help": "tensorboard, wandb, none, ..."})
    logging_steps: float = field(default=10)
    save_steps: float = field(default=500)
    save_total_limit: int | None = field(default=3)
    weight_decay: float = field(default=0.1)
    warmup_steps: float = field(default=0)
    dataloader_num_workers: int = field(default=2)
    resume_from_checkpoint: str | None = field(
        default=None,
        metadata={
            "help": "a checkpoint folder, or 'latest' (the newest complete one in output_dir; fresh start if none)"
        },
    )
    contrastive_accumulation: bool = field(
        default=True,
        metadata={
            "help": "with --gradient_accumulation_steps K > 1, contrast all micro x world x K pairs of an optimizer "
            "step (gradient caching); false: independent micro-batch losses"
        },
    )
    # A lost peer (frozen, hung, cut off) ends its survivors after this many seconds instead of torch's 30 minutes.
    # 10 minutes (DeepSpeed's own default) is longer than the slowest collective a healthy run waits in: rank 0
    # writing a large model's checkpoint while the others wait at a barrier, the first step's ZeRO-3 gather and
    # setup at scale, a zero-shot eval (every rank runs it, so none waits long); short enough to free the nodes for
    # a restart well within a preemptible job's slot. Raise it for a very slow shared filesystem.
    ddp_timeout: int = field(
        default=600,
        metadata={"help": "seconds a rank waits for the others (joining, and every collective) before it stops"},
    )
    stop_signals: str = field(
        default="SIGTERM,SIGUSR1",
        metadata={
            "help": "signals that stop every rank at the next step with a checkpoint, "
            f"exit code {EXIT_PREEMPTED} ('none': off)"
        },
    )

    def __post_init__(self):
        compat.use_cpu_without_gpu(self)
        with peers.joining(self.ddp_timeout):  # TrainingArguments joins the process group while it is set up
            compat.init_cpu_process_group(self)
            super().__post_init__()
        if self.accelerator_config.dispatch_batches is None:
            # Each rank reads its own shards (ShardStream); rank 0 reading for everyone does not scale.
            self.accelerator_config.dispatch_batches = False


class DiscoTrainer(
    compat.FsdpOnCpuMixin,
    FiniteStepsMixin,
    CompleteCheckpointsMixin,
    StopSignalsMixin,
    ContrastiveAccumulationMixin,
    Trainer,
):
    """The stock Trainer plus CLIP logging (logit scale, global batch, throughput, data vs step time, peak
    memory, skipped samples), OpenCLIP's weight-decay exclusions and contrastive accumulation over
    gradient_accumulation_steps (`disco_clip_ds.train.accumulation`). The loss comes from the model.

    Checkpoints are complete or absent (`checkpoints.CompleteCheckpointsMixin`); `stop_signals=(...)` stop training
    at the next step with a checkpoint (`preemption.StopSignalsMixin`; `self.stopper.stopped` says whether one did);
    a loss or gradient norm that is not finite stops every rank before anything of that step is saved
    (`numerics.FiniteStepsMixin`). Each batch's stream positions are kept and saved in every checkpoint, and a
    resume restores them (`get_resumed_dataloader`) instead of skipping batches.
    """

    def __init__(self, *args, reads_own_shards: bool = True, **kwargs):
        super().__init__(*args, **kwargs)
        self.reads_own_shards = reads_own_shards
        self._data_time, self._last_log = 0.0, None
        self._stream_positions: dict[int, list[int]] = {}  # reader -> newest position trained on (stream_state.py)
        self._stream_rows, self._resume_checkpoint, self._skipped_on_resume = None, None, False

    def train(self, resume_from_checkpoint=None, *args, **kwargs):
        self._resume_checkpoint = resume_from_checkpoint  # for get_resumed_dataloader, which is not told it
        return super().train(resume_from_checkpoint, *args, **kwargs)

    def get_resumed_dataloader(self, dataloader, num_batches: int):
        """Resume the stream where each reader stood (stream_state.json) instead of reading and decoding the
        `num_batches` batches trained on; a checkpoint without that file falls back to the Trainer's skipping."""
        checkpoint, stream = self._resume_checkpoint, self.train_dataset
        if isinstance(checkpoint, bool):
            from transformers.trainer_utils import get_last_checkpoint

            checkpoint = get_last_checkpoint(self.args.output_dir)
        state = read_stream_state(checkpoint) if isinstance(stream, ReaderStream) else None
        if state is None:
            logger.info(
                "resume: %s has no %s (saved by an older version): fast-forwarding the data stream by reading and "
                "decoding the %d batches per rank trained on",
                checkpoint,
                STATE_FILE,
                num_batches,
            )
            self._skipped_on_resume = True  # the skipped batches' positions are never seen
            return super().get_resumed_dataloader(dataloader, num_batches)
        positions = stream.positions_from(state, checkpoint)
        config = self.args.accelerator_config
        # under dispatch_batches rank 0's loader hands out `world` batches per step (one, with split_batches)
        per_step = self.args.world_size if config.dispatch_batches and not config.split_batches else 1
        stream.restore(positions, num_batches * per_step)
        # this rank's readers stand there until their next batch: a save before it must keep their positions
        mine = range(stream.rank * stream.workers, (stream.rank + 1) * stream.workers)
        self._stream_positions.update({r: [r, *pos] for r, pos in positions.items() if r in mine})
        logger.info("resume: the data stream seeks to where %d readers stood in %s", len(positions), checkpoint)
        return dataloader

    def _save_checkpoint(self, model, trial) -> None:
        # every rank's newest stream positions, gathered before anything is written: a collective inside the save
        # would hang when one rank's write fails before it
        width = len(getattr(self.train_dataset, "position_fields", POSITION_FIELDS))
        rows = as_rows(self._stream_positions, max(1, self.args.dataloader_num_workers), width)
        self._stream_rows = self.accelerator.gather(rows.to(self.args.device)).cpu()
        super()._save_checkpoint(model, trial)

    def _save_rng_state(self, output_dir: str) -> None:
        super()._save_rng_state(output_dir)
        stream = self.train_dataset
        if not (self.is_world_process_zero() and self._stream_rows is not None and isinstance(stream, ReaderStream)):
            return
        seen = len(set(self._stream_rows[:, 0].tolist()) - {-1})
        if self._skipped_on_resume and seen < stream.num_readers:
            # after skipping, a reader that has not handed out a batch since stands at an unknown place
            logger.info(
                "%s gets no %s: %d of %d readers have a known position",
                output_dir,
                STATE_FILE,
                seen,
                stream.num_readers,
            )
            return
        stream.write_state(output_dir, self._stream_rows)

    def get_train_dataloader(self):
        loader = super().get_train_dataloader()
        if self.reads_own_shards:
            compat.unshard_iterable_dataset(loader)
        return loader

    def _prepare_inputs(self, inputs):
        # Every training forward passes here (training_step; the contrastive accumulation's embedding pass), and so
        # does evaluation. A uint8 batch (ClipCollator(normalize=False)) is normalised on the device by the
        # collator's own Normalize, then cast as the Trainer casts float inputs (DeepSpeed's dtype): what the model
        # sees is bit for bit what the workers would have made. A new dict: the raw batch stays uint8 for the next call.
        inputs = super()._prepare_inputs(inputs)
        pixels = inputs.get("pixel_values")
        if pixels is not None and pixels.dtype == torch.uint8:
            inputs = {**inputs, "pixel_values": self._prepare_input(self.data_collator.normalize.batch(pixels))}
        return inputs

    def compute_loss(self, model, inputs, *args, **kwargs):
        # return_loss rides here, not in the batch: accelerate's dispatch_batches broadcasts tensors only.
        return super().compute_loss(model, {**inputs, "return_loss": True}, *args, **kwargs)

    def get_decay_parameter_names(self, model) -> list[str]:
        return without_clip_no_decay(super().get_decay_parameter_names(model))

    def create_scheduler(self, num_training_steps: int, optimizer=None):
        scheduler = super().create_scheduler(num_training_steps, optimizer)
        warmup = self.args.get_warmup_steps(num_training_steps)
        if warmup > 0 and isinstance(scheduler, torch.optim.lr_scheduler.LambdaLR) and not hasattr(scheduler, "warmup"):
            self.lr_scheduler = scheduler = warmup_from_first_step(scheduler, warmup)  # the Trainer may ask again
        return scheduler

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        start = time.perf_counter()
        if self._last_log is None:  # the clock starts at the first batch: no start-up time, and after a resume
            self._last_log = (start, self.state.global_step)  # global_step is the restored one
        failure = None
        try:
            batches = super().get_batch_samples(epoch_iterator, num_batches, device)
        except Exception as error:  # every rank must learn of it: see _stream_failed
            failure, batches = error, ([], None)
        if any_true(failure is not None, self.args.device):  # a collective every step: no rank waits on a dead one
            self._stream_failed(failure)
        for batch in batches[0]:  # the stream's positions ride in the batch; the model must not see them
            note_positions(self._stream_positions, batch.pop(POSITION_KEY, None))
        self._data_time += time.perf_counter() - start
        return batches

    def _stream_failed(self, failure: BaseException | None):
        """Raise on every rank once any rank's data loading failed: its DataError as one line (the same on every
        rank); any other error, a bug, with its traceback on the rank that hit it."""
        mine = None
        if failure is not None:  # a DataError names its reader and rank; anything else gets the rank put first
            mine = error_message(failure).splitlines()[0] if isinstance(failure, DataError) else None
            mine = mine or f"rank {self.args.process_index}'s data loading failed: {type(failure).__name__}: {failure}"
            mine = mine.splitlines()[0]
        messages = [mine]
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            messages = [None] * torch.distributed.get_world_size()
            torch.distributed.all_gather_object(messages, mine)
        if failure is not None and not isinstance(failure, DataError):
            raise failure
        raise DataError(next(m for m in messages if m is not None)) from failure

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if "loss" in logs:  # the training log, reached by every rank at the same step
            logs.update(self._training_metrics())
        super().log(logs, start_time)

    def _training_metrics(self) -> dict[str, float]:
        now, step, world = time.perf_counter(), self.state.global_step, self.args.world_size
        last_time, last_step = self._last_log
        steps = max(1, step - last_step)
        elapsed = now - last_time
        local = torch.tensor(
            [self._data_time, _peak_memory_gib(self.args.device), self.train_dataset.skipped.value],
            dtype=torch.float64,
            device=self.args.device,
        )
        per_rank = self.accelerator.gather(local[None]).reshape(world, 3).cpu()
        self._data_time, self._last_log = 0.0, (now, step)
        samples = steps * self.args.per_device_train_batch_size * self.args.gradient_accumulation_steps * world
        metrics = {
            "logit_scale": float(getattr(self.model, "last_logit_scale", float("nan"))),
            "global_contrastive_batch": self.contrastive_batch_size(),
            "samples_per_s": samples / elapsed,
            "samples_per_s_per_rank": samples / elapsed / world,
            "step_time_s": elapsed / steps,
            "data_time_s": per_rank[:, 0].max().item() / steps,
            "peak_mem_gib_max": per_rank[:, 1].max().item(),
            "skipped_samples": int(per_rank[:, 2].sum().item()),
        }
        if world <= 16:
            metrics.update({f"peak_mem_gib_rank{r}": per_rank[r, 1].item() for r in range(world)})
        return metrics


def _peak_memory_gib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux: this rank's peak RSS


def parse_args(argv: list[str] | None = None):
    """(ModelArguments, DataArguments, DiscoTrainingArguments) from argv, or from one .json/.yaml file. Values that
    TrainingArguments refuses while parsing are a UsageError."""
    parser = HfArgumentParser((ModelArguments, DataArguments, DiscoTrainingArguments))
    argv = list(sys.argv[1:] if argv is None else argv)
    from_file = len(argv) == 1 and argv[0].endswith((".json", ".yaml", ".yml"))
    values = _read_arguments_file(argv[0]) if from_file else vars(parser.parse_known_args(argv)[0])
    deepspeed = values.get("deepspeed")
    if isinstance(deepspeed, str) and not deepspeed.lstrip().startswith("{"):
        _read_json("--deepspeed", deepspeed)  # TrainingArguments reads it while parsing, and would not name the file
    # unknown names, and what TrainingArguments.__post_init__ refuses as not working together, are ValueErrors
    with _usage_error(suffix=" (`disco-clip train --help` lists the arguments)"):
        return parser.parse_dict(values) if from_file else parser.parse_args_into_dataclasses(args=argv)


def _read_arguments_file(path: str) -> dict:
    import yaml

    try:
        text = Path(path).read_text()
        values = json.loads(text) if path.endswith(".json") else yaml.safe_load(text)
    except (OSError, ValueError, yaml.YAMLError) as error:
        raise UsageError(f"{path} is not a readable arguments file: {error}") from error
    if not isinstance(values, dict):
        raise UsageError(f"{path} holds no argument names and values")
    return values


def _read_json(flag: str, path: str) -> dict:
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError) as error:
        raise UsageError(f"{flag} {path} is not a readable JSON file: {error}") from error


@contextlib.contextmanager
def _usage_error(prefix: str = "", suffix: str = ""):
    """A plain ValueError or OSError raised inside (by a reader of the user's input) becomes a UsageError."""
    try:
        yield
    except (ValueError, OSError) as error:
        if isinstance(error, DiscoClipError):
            raise
        raise UsageError(f"{prefix}{error}{suffix}") from error


@dataclass
class CheckedRun:
    """What `validate` established on the way, for training to use as is."""

    urls: list[str]
    num_samples: int
    max_steps: int
    stop_signals: tuple[int, ...]
    hub_model_id: str | None
    tokenizer: object
    image_size: int
    max_length: int
    hf: HFData | None = None  # the `datasets` dataset to train from, when the source is one


def validate(model_args: ModelArguments, data_args: DataArguments, args: DiscoTrainingArguments) -> CheckedRun:
    """Every check of the arguments, before any work: a UsageError (or AccumulationError) saying what to change.

    Reads the shard lists (or loads and checks the `datasets` dataset), the tokenizer and the model's config (not
    its weights), so that a tokenizer or image size that does not fit the model is refused before the model is
    built. Identical on every rank."""
    check_contrastive_accumulation(args, model_args.loss_impl)
    check_deepspeed_batch(args)
    _check_numbers(args)
    _check_model_source(model_args)
    hub_model_id = _check_hub_and_zeroshot(data_args, args)
    stop_signals = parse_signals(args.stop_signals)
    hf, urls = _check_source(data_args, args), []
    with _usage_error():  # unreadable shard lists and counts: the messages name the fix
        if hf is None:
            urls = expand_shards(data_args.train_shards)
        max_steps, num_samples = _steps_and_samples(data_args, args, urls, hf)
        if hf is None:
            _check_readers(data_args, args, urls)
    tokenizer, image_size, max_length = _check_tokenizer_and_sizes(model_args)
    return CheckedRun(urls, num_samples, max_steps, stop_signals, hub_model_id, tokenizer, image_size, max_length, hf)


def _check_source(data_args: DataArguments, args: DiscoTrainingArguments) -> HFData | None:
    """Exactly one training source: shards (None returned), or a `datasets` dataset, loaded and checked."""
    hf_flags = [f for f, v in (("--dataset_name", data_args.dataset_name), ("--train_file", data_args.train_file)) if v]
    if bool(data_args.train_shards) == bool(hf_flags) or len(hf_flags) > 1:
        given = (["--train_shards"] if data_args.train_shards else []) + hf_flags
        raise UsageError(
            f"give exactly one training source: --train_shards, --dataset_name or --train_file (got "
            f"{' and '.join(given) or 'none'})"
        )
    if not hf_flags:
        return None
    ranks = 1 if args.accelerator_config.dispatch_batches else args.world_size
    return load_training_dataset(data_args, ranks * max(1, args.dataloader_num_workers))


def _check_readers(data_args: DataArguments, args: DiscoTrainingArguments, urls: list[str]) -> None:
    """Every reader (rank x DataLoader worker) gets a shard, and, where the shards' counts are recorded, a sample:
    a reader with none would fail only once training has started."""
    if data_args.max_image_pixels < 1:
        raise UsageError(f"--max_image_pixels {data_args.max_image_pixels}: give a positive number of pixels")
    ranks = 1 if args.accelerator_config.dispatch_batches else args.world_size
    workers = max(1, args.dataloader_num_workers)
    shards_for_reader(urls, 0, ranks * workers)  # a shard for every reader
    empty = empty_reader(urls, ranks * workers)
    if empty:
        reader, shards = empty
        raise UsageError(
            f"reader {reader} of {ranks * workers} (rank {reader // workers}, DataLoader worker {reader % workers}) "
            f"would read only shards without samples ({', '.join(shards[:3])}{' ...' if len(shards) > 3 else ''}: "
            "0 samples in their sizes.json / *_stats.json): leave empty shards out of --train_shards, or use fewer "
            "ranks x --dataloader_num_workers"
        )


def _steps_and_samples(
    data_args: DataArguments, args: DiscoTrainingArguments, urls: list[str], hf: HFData | None = None
) -> tuple[int, int]:
    if hf is not None and not (data_args.train_num_samples or hf.num_rows):
        raise UsageError(f"{hf.description}: its number of rows is not known: pass --train_num_samples")
    num_samples = data_args.train_num_samples or (hf.num_rows if hf is not None else count_samples(urls))
    if num_samples <= 0:
        source = data_args.train_shards if hf is None else hf.description
        raise UsageError(f"no training samples in {source} (count {num_samples})")
    global_batch = args.per_device_train_batch_size * args.gradient_accumulation_steps * args.world_size
    if args.max_steps > 0:
        return args.max_steps, num_samples
    # The stream has no length, so the Trainer needs max_steps: epochs over the counted samples.
    return max(1, math.ceil(args.num_train_epochs * num_samples / global_batch)), num_samples


def check_deepspeed_batch(args: DiscoTrainingArguments) -> None:
    """Fail early, with what to change, when a DeepSpeed JSON's fixed batch sizes contradict the arguments.

    DeepSpeed would also refuse them, but only after the model is built, in an assertion on each rank.
    """
    path = args.deepspeed or os.environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE")  # the latter under accelerate launch
    if not isinstance(path, str):
        return
    try:
        config = json.loads(Path(path).read_text())
    except (OSError, ValueError) as error:
        raise UsageError(f"cannot read DeepSpeed config {path}: {error}") from error
    micro, accum, world = args.per_device_train_batch_size, args.gradient_accumulation_steps, args.world_size
    expected = {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": accum,
        "train_batch_size": micro * accum * world,
    }
    wrong = {k: v for k, v in config.items() if k in expected and v != "auto" and v != expected[k]}
    if wrong:
        raise UsageError(
            f"{path}: {wrong} contradicts --per_device_train_batch_size {micro} x --gradient_accumulation_steps "
            f'{accum} x {world} ranks (= {expected}); set those values to "auto" or change the arguments to match'
        )


def _check_numbers(args: DiscoTrainingArguments) -> None:
    """Values that would fail only once the model is built, or silently do something else."""
    if args.max_steps == 0:  # the Trainer would read 0 as "not set" and train --num_train_epochs
        raise UsageError(
            "--max_steps 0 trains nothing: give a positive number, or leave it out to train --num_train_epochs"
        )
    if args.per_device_train_batch_size < 1:
        raise UsageError(f"--per_device_train_batch_size {args.per_device_train_batch_size}: must be at least 1")
    if args.save_strategy == "steps" and args.save_steps <= 0:
        raise UsageError(f"--save_steps {args.save_steps:g}: give a positive number, or --save_strategy no")
    # A non-finite or absurd rate trains on to exit 0 with NaN weights; refuse it before any work.
    if not (math.isfinite(args.learning_rate) and 0 < args.learning_rate <= 1):
        raise UsageError(
            f"--learning_rate {args.learning_rate:g}: give a finite number in (0, 1]; CLIP trains at 1e-4 to 1e-3"
        )
    if not (math.isfinite(args.weight_decay) and 0 <= args.weight_decay * args.learning_rate < 1):
        raise UsageError(
            f"--weight_decay {args.weight_decay:g}: give a finite number of at least 0 and below 1 / --learning_rate "
            "(AdamW scales the weights by 1 - lr x wd every step); CLIP uses 0.1 to 0.2"
        )


def _check_model_source(model_args: ModelArguments) -> None:
    if not (model_args.tokenizer_name or model_args.model_name_or_path):
        raise UsageError(
            "training from --model_config needs --tokenizer_name (e.g. recipes/tokenizer or "
            "openai/clip-vit-base-patch32)"
        )
    if bool(model_args.model_name_or_path) == bool(model_args.model_config):
        raise UsageError(
            "give exactly one of --model_name_or_path (pretrained weights) or --model_config (a config JSON)"
        )
    if model_args.model_config:
        _read_json("--model_config", model_args.model_config)
    for flag, value in (
        ("--tokenizer_name", model_args.tokenizer_name),
        ("--model_name_or_path", model_args.model_name_or_path),
    ):
        if value and value.startswith(("/", "./", "../", "~")) and not Path(value).expanduser().exists():
            raise UsageError(f"{flag} {value}: no such folder")


def _check_hub_and_zeroshot(data_args: DataArguments, args: DiscoTrainingArguments) -> str | None:
    """The hub repo to push to at the end (None: no push), once a token is known to be there."""
    if (data_args.zeroshot_steps > 0) != bool(data_args.zeroshot_data):
        raise UsageError("zero-shot eval during training needs both --zeroshot_data DIR and --zeroshot_steps N")
    if not args.push_to_hub:
        return None
    if not args.hub_model_id:
        raise UsageError("--push_to_hub needs --hub_model_id USER/NAME")
    from disco_clip_ds.export.hub import require_hub_token

    try:
        require_hub_token()  # now, not after hours of training
    except ExportError as error:
        raise UsageError(str(error)) from error
    return args.hub_model_id


def _check_tokenizer_and_sizes(model_args: ModelArguments):
    """(tokenizer, image size, max text length), once they fit the model's config."""
    for flag, value in (
        ("--max_text_length", model_args.max_text_length),
        ("--image_size", model_args.image_size),
        ("--chunk_size", model_args.chunk_size),
    ):
        if value is not None and value < 1:  # 0 would silently mean "the default"
            raise UsageError(f"{flag} {value}: give a positive number, or leave it out for the default")
    tokenizer_name = model_args.tokenizer_name or model_args.model_name_or_path
    flag = "--tokenizer_name" if model_args.tokenizer_name else "--model_name_or_path"
    with _usage_error(f"{flag} {tokenizer_name}: "):
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_name)
    flag, source = (
        ("--model_config", model_args.model_config)
        if model_args.model_config
        else ("--model_name_or_path", model_args.model_name_or_path)
    )
    with _usage_error(f"{flag} {source}: "):
        config = load_config(model_args.model_name_or_path, model_args.model_config)
    if config.model_type not in MODEL_CLASSES:
        raise UsageError(
            f"{flag} {source}: a {config.model_type} model; train CLIP or SigLIP ({sorted(MODEL_CLASSES)})"
        )
    text, vision = config.text_config, config.vision_config
    image_size = model_args.image_size or vision.image_size
    if image_size != vision.image_size:
        raise UsageError(
            f"--image_size {image_size} differs from the model's {vision.image_size}: set image_size in the "
            "model config instead"
        )
    max_length = model_args.max_text_length or text.max_position_embeddings
    if max_length > text.max_position_embeddings:
        raise UsageError(
            f"--max_text_length {max_length} exceeds the model's max_position_embeddings {text.max_position_embeddings}"
        )
    # CLIP pools the text at the eos position: a mismatch trains on the wrong token without any error. (SigLIP pools
    # the last position of text padded to max_length, whatever its tokens.)
    clip_tokens = (text.eos_token_id, text.bos_token_id) == (tokenizer.eos_token_id, tokenizer.bos_token_id)
    if (config.model_type == "clip" and not clip_tokens) or len(tokenizer) > text.vocab_size:
        raise UsageError(
            f"tokenizer {tokenizer_name} (bos {tokenizer.bos_token_id}, eos {tokenizer.eos_token_id}, "
            f"{len(tokenizer)} tokens) does not "
            f"match the model's text config (bos {text.bos_token_id}, eos {text.eos_token_id}, vocab {text.vocab_size})"
        )
    return tokenizer, image_size, max_length


def _processor(tokenizer, image_size: int, model_name_or_path: str | None) -> CLIPProcessor:
    """The processor saved with the model: the pretrained model's own image processor when it has one (its
    normalisation is what its weights expect: SigLIP's is 0.5, not CLIP's), else CLIP's at `image_size`."""
    image_processor = None
    if model_name_or_path:
        try:
            image_processor = AutoImageProcessor.from_pretrained(model_name_or_path)
        except (OSError, ValueError):  # a folder of weights without a preprocessor_config.json
            image_processor = None
    if image_processor is None:
        image_processor = CLIPImageProcessor(
            size={"shortest_edge": image_size}, crop_size={"height": image_size, "width": image_size}
        )
    return CLIPProcessor(image_processor=image_processor, tokenizer=tokenizer)


def _lock_towers(model, model_args: ModelArguments) -> None:
    """Freeze a tower and its projection (CLIP has projection layers; SigLIP's towers end in their own heads)."""
    towers = []
    if model_args.lock_image_tower:
        towers += [model.vision_model, getattr(model, "visual_projection", None)]
    if model_args.lock_text_tower:
        towers += [model.text_model, getattr(model, "text_projection", None)]
    for module in filter(None, towers):
        module.requires_grad_(False)


def _resume_point(
    args: DiscoTrainingArguments, model_args: ModelArguments, data_args: DataArguments, checked: CheckedRun
) -> str | None:
    """The checkpoint to resume (None: a fresh start), once its run's fixed settings are found to match this
    command's (`resume.check_resume`: one line naming what differs), before the model is built; on another world
    size, its universal conversion (`resume.universal_checkpoint`)."""
    if args.resume_from_checkpoint is None:
        existing = checkpoint_folders(args.output_dir)
        if existing:  # a fresh run there would overwrite and rotate away the earlier run's checkpoints
            raise UsageError(
                f"{args.output_dir} holds checkpoints ({existing[0]}): pass --resume_from_checkpoint latest "
                "to continue that run, or choose a new --output_dir"
            )
        return None
    if args.resume_from_checkpoint != "latest":
        last = args.resume_from_checkpoint
        # verified on rank 0 against its manifest: a missing folder is bad usage (exit 2), one that does not verify a
        # failed run (exit 1) naming the newest checkpoint beside it that does
        verify_resumable(last)
    else:
        last = resolve_latest(args.output_dir)  # on rank 0, skipping incomplete checkpoints; every rank resumes it
        logger.info("resume: %s", last or f"no checkpoint in {args.output_dir}, starting fresh")
    if last is None:
        return None
    step = checkpoint_step(last)
    new = {
        **resume.launch_facts(args, data_args, checked.urls, checked.num_samples, checked.max_steps),
        "model": resume.model_architecture(model_args.model_name_or_path, model_args.model_config),
    }
    old = resume.check_resume(last, step, new, args.ignore_data_skip)
    if old.get("world_size", args.world_size) == args.world_size or step >= checked.max_steps:
        resume.drop_universal(args.output_dir)
        return last
    logger.info(
        "resume: %s, world size %d -> %d: through a universal checkpoint", last, old["world_size"], args.world_size
    )
    resume.load_universal(args)
    return str(resume.universal_checkpoint(last, args.output_dir))


def train(model_args: ModelArguments, data_args: DataArguments, args: DiscoTrainingArguments) -> dict:
    """Run training; returns the train metrics (with `skipped_samples`, `decoded_samples`). Saves the final model
    to output_dir. Validates every argument first; holds output_dir's run lock throughout; raises Preempted after
    a stop signal's checkpoint."""
    # every rank started alike, one --output_dir seen by all
    nodes.check_nodes(args, lambda: node_facts(model_args, data_args, args))
    checked = validate(model_args, data_args, args)
    _ = args.world_size  # sets up the process group: the lock and 'latest' are decided on rank 0, then broadcast
    check_space_at_start(args.output_dir)  # a full disk: one line, before the lock and run.json are written
    acquire_run_lock(args.output_dir, staging=STAGING)
    try:
        with peers.watching(args.ddp_timeout):
            return _train(model_args, data_args, args, checked)
    finally:
        release_run_lock()


def _train(
    model_args: ModelArguments, data_args: DataArguments, args: DiscoTrainingArguments, checked: CheckedRun
) -> dict:
    resume_from = _resume_point(args, model_args, data_args, checked)
    set_seed(args.seed)
    args.max_steps = checked.max_steps
    finished = finished_message(resume_from and checkpoint_step(resume_from), args.max_steps, resume_from)
    if finished:  # resuming would train one step past the end and change the final model
        repaired = keep_final_model(args.output_dir, resume_from)  # a final save cut short is written again
        if args.process_index == 0:
            print(repaired or finished)
        return {}
    args.push_to_hub = False  # never let the Trainer push raw DeepSpeed state: we export and push at the end
    compat.init_deepspeed_comm(args)
    model = build_model(
        model_args.model_name_or_path, model_args.model_config, model_args.loss_impl, model_args.chunk_size
    )
    _lock_towers(model, model_args)
    processor = _processor(checked.tokenizer, checked.image_size, model_args.model_name_or_path)

    reads_own_shards = not args.accelerator_config.dispatch_batches
    rank, world = (args.process_index, args.world_size) if reads_own_shards else (0, 1)
    source = ShardStream if checked.hf is None else HFStream
    stream = source(
        checked.urls if checked.hf is None else checked.hf,
        checked.image_size,
        rank=rank,
        world_size=world,
        seed=args.seed,
        shuffle_buffer=data_args.shuffle_buffer,
        num_workers=args.dataloader_num_workers,
        max_image_pixels=data_args.max_image_pixels,
    )
    # on a GPU the normalisation is ~free and the workers hand over 4x fewer bytes; on CPU ranks it would slow the
    # training loop, so by default the workers keep it there
    on_device = {"true": True, "false": False}.get(data_args.normalize_on_device, args.device.type == "cuda")
    if on_device:
        logger.info("the DataLoader hands over uint8 batches, normalised on %s", args.device)
    trainer = DiscoTrainer(
        model=model,
        args=args,
        train_dataset=stream,
        data_collator=ClipCollator(
            processor.tokenizer,
            checked.max_length,
            mean=processor.image_processor.image_mean,
            std=processor.image_processor.image_std,
            normalize=not on_device,
        ),
        processing_class=processor,
        reads_own_shards=reads_own_shards,
        stop_signals=checked.stop_signals,
    )
    if data_args.zeroshot_steps > 0:
        _attach_zeroshot(trainer, data_args, processor, checked.image_size)
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

    if trainer.is_world_process_zero():
        _write_run_file(args, model_args, data_args, checked, resume_from)
    result = trainer.train(resume_from_checkpoint=resume_from)
    if trainer.stopper.stopped:
        raise Preempted(resume_hint(args.output_dir, trainer.stopper.describe(), trainer.state.global_step))
    skipped, decoded = _stream_totals(trainer, stream)
    metrics = {**result.metrics, "skipped_samples": skipped, "decoded_samples": decoded}
    trainer.log_metrics("train", metrics)
    trainer.save_final(metrics)  # metrics, model, state, then the manifest that makes the final model verifiable
    if trainer.is_world_process_zero():
        _report(args, metrics)
        if checked.hub_model_id:
            _export_and_push(args, checked.hub_model_id)
    return metrics


def _stream_totals(trainer: DiscoTrainer, stream: ReaderStream) -> tuple[int, int]:
    """(skipped, decoded) samples over all ranks: decoded ~ steps x global batch, plus what was prefetched."""
    local = torch.tensor([[float(stream.skipped.value), float(stream.decoded.value)]], device=trainer.args.device)
    skipped, decoded = trainer.accelerator.gather(local).sum(dim=0).tolist()
    return int(skipped), int(decoded)


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
) -> None:
    """Every fact of the set-up that the exported model card states (export.py reads run.json, and nothing pickled).
    Written at a run's first launch; a resume adds a segment (`resume.with_resume`) and leaves the facts as they were,
    so that they stay true of every step."""
    facts = resume.launch_facts(args, data_args, checked.urls, checked.num_samples, checked.max_steps)
    path = Path(args.output_dir) / "run.json"
    if resume_from is None:
        run = {
            **facts,
            "loss_impl": model_args.loss_impl,
            "precision": "bf16" if args.bf16 else "fp16" if args.fp16 else "fp32",
            "versions": {
                name: _version(name) for name in ("disco-clip-ds", "torch", "transformers", "deepspeed", "accelerate")
            },
        }
    else:
        recorded = read_run_file(args.output_dir) or read_run_file(Path(resume_from).parent)
        universal = Path(resume_from).parent.name == resume.UNIVERSAL_DIR
        run = resume.with_resume(recorded, checkpoint_step(resume_from), facts, universal, args.ignore_data_skip)
    write_json(path, {k: v for k, v in run.items() if v is not None})


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


def main(argv: list[str] | None = None) -> int:
    """`disco-clip train`: parse the arguments, validate them, train. Errors are raised (`errors.run_main` turns
    them into a message and an exit code)."""
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s", level=logging.INFO)
    try:
        model_args, data_args, args = parse_args(argv)
        # as HF's run_clip: the main process logs at INFO, the others at --log_level_replica (WARNING by default)
        logging.getLogger().setLevel(logging.INFO if args.should_log else args.get_process_log_level())
        train(model_args, data_args, args)
        return 0
    finally:
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # a launched rank: the process ends after this
            compat.destroy_process_group()
            error = sys.exc_info()[1]
            exit_without_finalization(0 if error is None else getattr(error, "exit_code", 1))
