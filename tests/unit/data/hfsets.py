"""What the 🤗 datasets tests share: small datasets of flat-colour images whose colour and caption name the row, and
readers of what a stream yields."""

from pathlib import Path
from types import SimpleNamespace

import pytest

from disco_clip_ds.data.streams.hf import HFStream
from disco_clip_ds.testing.images import image_bytes

SIZE = 16


def hf_colour(i: int) -> tuple[int, int, int]:
    return (i * 37 % 256, i * 91 % 256, 200 - i)


def hf_png(i: int) -> bytes:
    return image_bytes("PNG", "RGB", (20 + i % 7, 18 + i % 5), hf_colour(i))


def hf_rows(n: int, bad: dict | None = None) -> dict:
    """n rows 'sample i' with image i; bad = {i: 'corrupt' (truncated bytes) | 'none' (no image) | 'empty' (blank
    caption)}."""
    bad = bad or {}
    images, captions = [], []
    for i in range(n):
        data = hf_png(i)
        images.append(
            None
            if bad.get(i) == "none"
            else {"bytes": data[: len(data) // 3] if bad.get(i) == "corrupt" else data, "path": None}
        )
        captions.append(" \t" if bad.get(i) == "empty" else f"sample {i}")
    return {"image": images, "caption": captions, "id": list(range(n))}


def hf_dataset(rows: dict, captions=None):
    import datasets

    caption = captions or datasets.Value("string")
    features = datasets.Features({"image": datasets.Image(), "caption": caption, "id": datasets.Value("int64")})
    return datasets.Dataset.from_dict(rows, features=features)


def hf_args(**kw) -> SimpleNamespace:
    base = {
        "dataset_name": None,
        "dataset_config_name": None,
        "train_split": "train",
        "train_file": None,
        "image_column": "image",
        "caption_column": "caption",
        "streaming": False,
    }
    return SimpleNamespace(**{**base, **kw})


def hf_sample(item) -> tuple[str, tuple[int, ...]]:
    """(caption, colour) of a yielded item: a flat image stays flat under any crop and resize."""
    pixels, caption, _ = item  # a uint8 crop (ClipCollator normalises)
    colour = pixels.float().mean(dim=(1, 2)).round().int()
    return caption, tuple(colour.tolist())


def one_pass(stream: HFStream) -> list:
    """What a reader yields in its first pass (the pass field is position[3])."""
    out = []
    for item in stream:
        if item[2][3] > 0:
            return out
        out.append(item)
    return out


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """The same 23 rows as a save_to_disk folder, a parquet folder of 3 files, and a DatasetDict folder."""
    import datasets

    root = tmp_path_factory.mktemp("hfdata")
    ds = hf_dataset(hf_rows(23))
    ds.save_to_disk(str(root / "saved"))
    (root / "parquet").mkdir()
    for k, part in enumerate(((0, 8), (8, 16), (16, 23))):
        ds.select(range(*part)).to_parquet(str(root / "parquet" / f"part-{k}.parquet"))
    datasets.DatasetDict({"train": ds, "validation": ds.select(range(4))}).save_to_disk(str(root / "dict"))
    return root


def check_rows(data, n: int, captions=None):
    """Every row decodes to its own colour and caption (a list caption: one of the row's)."""
    items = one_pass(HFStream(data, SIZE, seed=1, shuffle_buffer=0))
    assert len(items) == n
    for item in items:
        caption, colour = hf_sample(item)
        i = int(caption.split()[-1])
        assert colour == hf_colour(i), (caption, colour)
        if captions:
            assert caption in captions(i)


def saved_dataset(tmp_path: Path, rows: dict) -> Path:
    hf_dataset(rows).save_to_disk(str(tmp_path / "ds"))
    return tmp_path / "ds"
