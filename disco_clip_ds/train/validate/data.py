"""The training data: one source (--train_shards, or a `datasets` dataset loaded and checked), its shards there
and one for every reader (ranks x DataLoader workers), a weighted mixture of its '::' sources, the samples per epoch
and the steps they make, --max_image_pixels, and the zero-shot eval's data."""

from __future__ import annotations

import logging
import math
from pathlib import Path

from disco_clip_ds.data.hf_io import HFData, load_training_dataset
from disco_clip_ds.data.mix import Mixture, normalised, upsampling_weights
from disco_clip_ds.data.redact import describe_source
from disco_clip_ds.data.shards import (
    count_samples,
    empty_reader,
    expand_sources,
    is_url,
    repeated_shard,
    shards_for_reader,
    source_specs,
    twice_text,
)
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


def checked_shards(spec: str) -> list[str]:
    """The shards of --train_shards SPEC, each '::' source checked on its own (at every start, a resume included):
    a source none of whose shards exists is a mistake in the spec (one line naming it), as is a shard named twice
    (`a::a` would read it twice over, in silence); some shards of a source missing is what an img2dataset run leaves
    where a shard failed to download, so, as webdataset's and open_clip's readers do, those are skipped and counted
    while training, and said once here."""
    specs, sources = source_specs(spec), expand_sources(spec)
    for i, (written, urls) in enumerate(zip(specs, sources)):
        missing = [url for url in urls if not is_url(url) and not Path(url).is_file()]
        if not missing or len(missing) < len(urls):
            continue
        where = f"--train_shards {spec}" if len(sources) == 1 else f"--train_shards source {i} ({written})"
        raise UsageError(
            f"{where}: no such file or folder"
            if len(urls) == 1
            else f"{where}: none of the {len(urls)} shards exists, e.g. '{missing[0]}': give a folder of .tar shards "
            "or a brace pattern"
        )
    urls = [url for source in sources for url in source]
    _refuse_twice(urls)
    missing = [url for url in urls if not is_url(url) and not Path(url).is_file()]
    if missing:
        logger.warning(
            "--train_shards: %d of %d shards not found, e.g. '%s': they are skipped and counted as bad samples",
            len(missing),
            len(urls),
            missing[0],
        )
    return urls


def _refuse_twice(urls: list[str]) -> None:
    """A shard named twice (`a::a`, overlapping brace patterns, one file by two paths): `data embed` refuses it too.
    A source meant to count more is weighted (--train_data_weights), not repeated."""
    repeated = repeated_shard(urls)
    if repeated:
        raise UsageError(
            f"--train_shards names {twice_text(*repeated)}: name each shard once; to read a source more often, weight "
            "it with --train_data_weights"
        )


def check_readers(args: DiscoTrainingArguments, urls: list[str], resampled: bool = False) -> None:
    """Every reader (rank x DataLoader worker) gets a shard, and, where the shards' counts are recorded, a sample:
    a reader with none would fail only once training has started. (`resampled`: every reader draws from all the
    shards, so there is nothing to check.)"""
    if resampled:
        return
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


def check_mixture(data_args: DataArguments, args: DiscoTrainingArguments) -> Mixture | None:
    """The weighted mixture of --train_shards' '::' sources that --train_data_weights (or open_clip's
    --train_data_upsampling_factors) ask for, each source checked for its readers as a source alone is; None without
    weights (the sources are then concatenated). --dataset_resampled is refused with a `datasets` source."""
    weights = _given_weights(data_args)
    if data_args.dataset_resampled and not data_args.train_shards:
        raise UsageError(
            "--dataset_resampled draws webdataset shards with replacement: it needs --train_shards (a `datasets` "
            "source is read in its own order; see docs/data.md, Mixtures)"
        )
    if weights is None:
        return None
    flag = "--train_data_upsampling_factors" if data_args.train_data_upsampling_factors else "--train_data_weights"
    if not data_args.train_shards:
        raise UsageError(
            f"{flag} mix '::'-joined --train_shards sources, each read as its own stream with its own "
            "position; a `datasets` source is one dataset: write it as shards, or mix the datasets beforehand "
            "(see docs/data.md, Mixtures)"
        )
    specs, sources = source_specs(data_args.train_shards), expand_sources(data_args.train_shards)
    if len(sources) < 2:
        raise UsageError(
            f"{flag}: --train_shards {describe_source(data_args.train_shards)} is one source: join "
            "the sources to mix with '::' ('a/{00000..00009}.tar::b/{0000..0003}.tar')"
        )
    if len(weights) != len(sources):
        raise UsageError(
            f"{len(weights)} data weight(s) for {len(sources)} '::'-joined --train_shards sources: give one each"
        )
    try:  # the given numbers, then their normalised shares (huge ones overflow a sum; tiny ones underflow to 0)
        weights = list(
            upsampling_weights(weights, [len(urls) for urls in sources])
            if data_args.train_data_upsampling_factors
            else normalised(weights)
        )
    except ValueError as error:
        raise UsageError(f"{flag}: {error}") from None
    for i, (spec, urls) in enumerate(zip(specs, sources)):
        try:
            check_readers(args, urls, data_args.dataset_resampled)
        except (UsageError, ValueError) as error:
            raise UsageError(f"--train_shards source {i} ({describe_source(spec)}): {error}") from error
    return Mixture(tuple(map(tuple, sources)), tuple(map(describe_source, specs)), tuple(weights))


def _given_weights(data_args: DataArguments) -> list[float] | None:
    """--train_data_weights, or --train_data_upsampling_factors as numbers ('1::2' or 1 2), or None."""
    if data_args.train_data_weights and data_args.train_data_upsampling_factors:
        raise UsageError("give --train_data_weights or --train_data_upsampling_factors (open_clip's form), not both")
    if not data_args.train_data_upsampling_factors:
        return list(data_args.train_data_weights) if data_args.train_data_weights else None
    words = [w for given in data_args.train_data_upsampling_factors for w in given.split("::") if w.strip()]
    try:
        return [float(w) for w in words]
    except ValueError:
        raise UsageError(
            f"--train_data_upsampling_factors {' '.join(data_args.train_data_upsampling_factors)}: give numbers, "
            "one per source ('1::2' or 1 2)"
        ) from None


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
