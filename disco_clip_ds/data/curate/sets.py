"""The images of a folder of webdataset shards, as `--dedup_against` and `--target` name them: training shards
(`DIR/*.tar`, img2dataset's layout) or a CLIP_benchmark wds set (`DIR/test/*.tar`, samples with `webp`, `jpg` or
`png` and `cls`). Read through the one tar reader, `streams.tar_samples.raw_samples`."""

from __future__ import annotations

import tarfile
from collections.abc import Iterator
from pathlib import Path

from disco_clip_ds.data.streams.tar_samples import raw_samples
from disco_clip_ds.errors import DataError, UsageError

IMAGE_EXTENSIONS = ("jpg", "jpeg", "png", "webp")  # a sample's image is its first member of these, in this order


def set_shards(folder: str) -> list[str]:
    """The shards of `folder`, sorted: its own `*.tar`, else a CLIP_benchmark set's `test/*.tar`; a folder with
    neither is a one-line UsageError."""
    root = Path(folder)
    if not root.is_dir():
        raise UsageError(f"{folder}: no such folder (give a folder of webdataset shards or a CLIP_benchmark wds set)")
    for shards in (sorted(root.glob("*.tar")), sorted((root / "test").glob("*.tar"))):
        if shards:
            return [str(shard) for shard in shards]
    raise UsageError(
        f"{folder}: no *.tar shards in it nor in {folder}/test (give a folder of webdataset shards or a "
        f"CLIP_benchmark wds set)"
    )


def image_samples(folder: str) -> Iterator[tuple[str, bytes]]:
    """(key, encoded image bytes) of every sample of `folder`'s shards (`set_shards`), in shard order. A sample
    without an image member, or a shard that cannot be read, is a DataError naming it."""
    for shard in set_shards(folder):
        try:
            for sample in raw_samples(shard):
                image = next((sample[ext] for ext in IMAGE_EXTENSIONS if ext in sample), None)
                if image is None:
                    raise DataError(
                        f"{shard}: sample {sample['__key__']} has no image (one of {', '.join(IMAGE_EXTENSIONS)})"
                    )
                yield sample["__key__"], image
        except (tarfile.TarError, OSError, ValueError) as error:  # the reader's errors: unreadable, truncated, repeated
            raise DataError(f"{shard}: {error}") from None
