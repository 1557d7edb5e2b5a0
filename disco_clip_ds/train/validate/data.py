"""The training data: one source (--train_shards, or a `datasets` dataset loaded and checked), its shards there
and one for every reader (ranks x DataLoader workers), the samples per epoch and the steps they make,
--max_image_pixels, and the zero-shot eval's data."""

from __future__ import annotations

import logging
import math
from pathlib import Path

from disco_clip_ds.data.hf_io import HFData, load_training_dataset
from disco_clip_ds.data.redact import describe_source
from disco_clip_ds.data.shards import count_samples, empty_reader, is_url, shards_for_reader
from disco_clip_ds.errors import UsageError
from disco_clip_ds.train.args import DataArguments, DiscoTrainingArguments
from disco_clip_ds.train.validate.model import is_path

logger = logging.getLogger("disco_clip_ds.train")


def readers(args: DiscoTrainingArguments) -> int:
    """The data readers of a run: ranks x DataLoader workers (one rank reads for all under dispatch_batches)."""
    ranks = 1 if args.accelerator_config.dispatch_batches else args.world_size
    return ranks * max(1, args.dataloader_num_workers)


def check_source(data_args: DataArguments, args: DiscoTrainingArguments) -> HFData | None:
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
    return load_training_dataset(data_args, readers(args))


def check_shards_exist(spec: str, urls: list[str]) -> None:
    """Local shards that are missing: all of them is a mistake in the spec (one line); some of them is what an
    img2dataset run leaves where a shard failed to download, so, as webdataset's and open_clip's readers do, those are
    skipped and counted while training, and said once here."""
    missing = [url for url in urls if not is_url(url) and not Path(url).is_file()]
    if missing and len(missing) == len(urls):
        raise UsageError(
            f"--train_shards {spec}: no such file or folder"
            if len(urls) == 1
            else f"--train_shards {spec}: none of the {len(urls)} shards exists, e.g. '{missing[0]}': give a folder of "
            ".tar shards or a brace pattern"
        )
    if missing:
        logger.warning(
            "--train_shards: %d of %d shards not found, e.g. '%s': they are skipped and counted as bad samples",
            len(missing),
            len(urls),
            missing[0],
        )


def check_readers(args: DiscoTrainingArguments, urls: list[str]) -> None:
    """Every reader (rank x DataLoader worker) gets a shard, and, where the shards' counts are recorded, a sample:
    a reader with none would fail only once training has started."""
    num_readers, workers = readers(args), max(1, args.dataloader_num_workers)
    shards_for_reader(urls, 0, num_readers)  # a shard for every reader
    empty = empty_reader(urls, num_readers)
    if empty:
        reader, shards = empty
        raise UsageError(
            f"reader {reader} of {num_readers} (rank {reader // workers}, DataLoader worker {reader % workers}) "
            f"would read only shards without samples ({', '.join(shards[:3])}{' ...' if len(shards) > 3 else ''}: "
            "0 samples in their sizes.json / *_stats.json): leave empty shards out of --train_shards, or use fewer "
            "ranks x --dataloader_num_workers"
        )


def steps_and_samples(
    data_args: DataArguments, args: DiscoTrainingArguments, urls: list[str], hf: HFData | None = None
) -> tuple[int, int]:
    """(optimizer steps to train, samples per epoch): --max_steps, else the epochs over the counted samples."""
    if hf is not None and not (data_args.train_num_samples or hf.num_rows):
        raise UsageError(f"{hf.description}: its number of rows is not known: pass --train_num_samples")
    num_samples = data_args.train_num_samples or (hf.num_rows if hf is not None else count_samples(urls))
    if num_samples <= 0:
        source = describe_source(data_args.train_shards) if hf is None else hf.description
        raise UsageError(f"no training samples in {source} (count {num_samples})")
    global_batch = args.per_device_train_batch_size * args.gradient_accumulation_steps * args.world_size
    if args.max_steps > 0:
        return args.max_steps, num_samples
    # The stream has no length, so the Trainer needs max_steps: epochs over the counted samples.
    return max(1, math.ceil(args.num_train_epochs * num_samples / global_batch)), num_samples


def check_max_image_pixels(data_args: DataArguments) -> None:
    if data_args.max_image_pixels < 1:
        raise UsageError(f"--max_image_pixels {data_args.max_image_pixels}: give a positive number of pixels")


def check_zeroshot(data_args: DataArguments) -> None:
    if (data_args.zeroshot_steps > 0) != bool(data_args.zeroshot_data):
        raise UsageError("zero-shot eval during training needs both --zeroshot_data DIR and --zeroshot_steps N")
    data = data_args.zeroshot_data
    # a path (a hub id or brace pattern aside) must be there: the eval set is otherwise opened after the model is built
    if data and is_path(data) and "{" not in data and "::" not in data and not Path(data).expanduser().exists():
        raise UsageError(f"--zeroshot_data {data}: no such file or folder")
