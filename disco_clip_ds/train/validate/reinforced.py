"""Training from a reinforced set: --augmentation_pool, --augmentation_pool_size, --synthetic_caption_ratio and
--live_teacher against what the sidecars of --teacher_embeddings hold (data/streams/reinforced.py)."""

from __future__ import annotations

import math

from disco_clip_ds.data.streams.reinforced import REAL_CAPTION
from disco_clip_ds.errors import UsageError
from disco_clip_ds.train.args import ModelArguments


def check_reinforced_flags(model_args: ModelArguments, naflex: bool) -> None:
    """The reinforced-set flags make sense together, before any sidecar is read: each needs --teacher_embeddings, a
    ratio in [0, 1], a pool size of at least 1, square crops to replay (not SigLIP 2's NaFlex grids)."""
    args = model_args
    given = [
        flag
        for flag, value in (
            ("--augmentation_pool", args.augmentation_pool),
            ("--augmentation_pool_size", args.augmentation_pool_size is not None),
            ("--synthetic_caption_ratio", args.synthetic_caption_ratio is not None),
            ("--live_teacher", args.live_teacher),
        )
        if value
    ]
    if given and args.teacher_embeddings is None:
        raise UsageError(
            f"{' and '.join(given)} without --teacher_embeddings: give the folder `disco-clip data embed` wrote"
        )
    ratio = args.synthetic_caption_ratio
    if ratio is not None and not (math.isfinite(ratio) and 0 <= ratio <= 1):
        raise UsageError(f"--synthetic_caption_ratio {ratio:g}: give a probability in [0, 1]")
    if args.augmentation_pool_size is not None and not args.augmentation_pool:
        raise UsageError("--augmentation_pool_size without --augmentation_pool: add --augmentation_pool")
    if args.augmentation_pool_size is not None and args.augmentation_pool_size < 1:
        raise UsageError(f"--augmentation_pool_size {args.augmentation_pool_size}: give at least 1")
    if args.augmentation_pool and naflex:
        raise UsageError(
            "--augmentation_pool replays square crops: a SigLIP 2 NaFlex model keeps each image's aspect ratio; "
            "train it without the pool"
        )


def check_store(model_args: ModelArguments, store) -> tuple[int, tuple[str, ...]]:
    """(augmentations to draw from, synthetic caption keys to draw from) once the sidecars' `store` holds what the
    flags ask: stored augmentations for a pool (and a pool for stored augmentations), at least
    --augmentation_pool_size of them, the real caption, and a synthetic caption for a ratio above 0."""
    folder, stored = model_args.teacher_embeddings, int(store.augmentations or 0)
    embed = f"run `disco-clip data embed --teacher ... --output {folder}` with"
    if model_args.augmentation_pool and stored == 0:
        raise UsageError(
            f"--augmentation_pool: the sidecars in {folder} store no augmentations (centre crops only): {embed} "
            "--augmentations K"
        )
    if stored and not model_args.augmentation_pool:
        raise UsageError(
            f"--teacher_embeddings {folder}: its sidecars store {stored} augmentations per sample: add "
            "--augmentation_pool (without it each sample's own random crop would be taught the embedding of another "
            "crop)"
        )
    size = model_args.augmentation_pool_size or stored
    if model_args.augmentation_pool and size > stored:
        raise UsageError(
            f"--augmentation_pool_size {size}: the sidecars in {folder} store {stored} augmentations per sample: "
            f"give at most {stored}, or {embed} --augmentations {size}"
        )
    keys = tuple(store.caption_keys)
    if REAL_CAPTION not in keys:
        raise UsageError(f"--teacher_embeddings {folder}: no embeddings of the real captions ({REAL_CAPTION}): {embed} "
                         f"--caption_keys {','.join((REAL_CAPTION, *keys))}")
    synthetic = tuple(k for k in keys if k != REAL_CAPTION)
    if (model_args.synthetic_caption_ratio or 0) > 0 and not synthetic:
        raise UsageError(
            f"--synthetic_caption_ratio {model_args.synthetic_caption_ratio:g}: the sidecars in {folder} store the "
            f"real captions only: {embed} --caption_keys txt,syn0.txt,... (or leave the ratio out)"
        )
    return (size if model_args.augmentation_pool else 1), synthetic
