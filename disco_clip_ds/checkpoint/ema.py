"""The EMA of the weights in a checkpoint (train/ema.py keeps it): checkpoint-N/ema/rank-RRRRR.safetensors, one file
per rank, each holding that rank's fragments of the trainable parameters under their names, with each fragment's
offset in the flattened full parameter and the full shape in the file's metadata. Any world size reads it back
(`fill_fragments` copies the overlapping slices, reading lazily only those) and export assembles the full EMA
(`read_ema_state_dict`). The checkpoint's manifest covers these files like any other."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from disco_clip_ds.errors import CheckpointError

if TYPE_CHECKING:
    import torch

EMA_DIR = "ema"
FORMAT = "disco-clip-ema/1"


@dataclass
class Fragment:
    """One rank's piece of one parameter: elements [start, start + numel) of the flattened full parameter."""

    name: str
    start: int
    numel: int
    shape: tuple[int, ...]


def ema_files(checkpoint: str | Path) -> list[Path]:
    """The rank files of `checkpoint`'s EMA (none when the run kept no EMA)."""
    return sorted((Path(checkpoint) / EMA_DIR).glob("rank-*.safetensors"))


def write_fragments(
    checkpoint: Path, rank: int, fragments: list[Fragment], values: list[torch.Tensor], settings: dict
) -> None:
    """Rank `rank`'s EMA `values` (one fp32 tensor per fragment) into checkpoint/ema/rank-RRRRR.safetensors."""
    from safetensors.torch import save_file

    folder = checkpoint / EMA_DIR
    folder.mkdir(parents=True, exist_ok=True)
    layout = {f.name: [f.start, f.numel, list(f.shape)] for f in fragments}
    metadata = {"format": FORMAT, "fragments": json.dumps(layout), "settings": json.dumps(settings)}
    tensors = {f.name: v.contiguous() for f, v in zip(fragments, values, strict=True)}
    save_file(tensors, str(folder / f"rank-{rank:05d}.safetensors"), metadata=metadata)


def _saved(path: Path):
    from safetensors import safe_open

    return safe_open(str(path), framework="pt")


def fill_fragments(folder: Path, fragments: list[Fragment], values: list[torch.Tensor]) -> None:
    """Each fragment's values from the saved fragments that overlap it, whatever world size saved them."""
    wanted: dict[str, list[int]] = {}
    for i, fragment in enumerate(fragments):
        wanted.setdefault(fragment.name, []).append(i)
    filled = [0] * len(fragments)
    for path in sorted(folder.glob("rank-*.safetensors")):
        with _saved(path) as saved:
            for name, (start, numel, _) in json.loads(saved.metadata()["fragments"]).items():
                for i in wanted.get(name, ()):
                    lo, hi = max(start, fragments[i].start), min(start + numel, fragments[i].start + fragments[i].numel)
                    if lo < hi:  # a slice of the saved tensor: only those bytes are read
                        part = saved.get_slice(name)[lo - start : hi - start]
                        values[i][lo - fragments[i].start : hi - fragments[i].start].copy_(part)
                        filled[i] += hi - lo
    short = [f.name for f, n in zip(fragments, filled, strict=True) if n != f.numel]
    if short:
        raise CheckpointError(f"{folder} lacks the EMA of {', '.join(short[:3])}: the checkpoint is incomplete")


def saved_settings(checkpoint: str | Path) -> dict | None:
    """The settings `checkpoint`'s EMA was kept with (decay, start_step, warmup, begun_at: the optimizer step whose
    weights it started from), from its first rank file's header; None when the checkpoint holds no EMA."""
    files = ema_files(checkpoint)
    if not files:
        return None
    with _saved(files[0]) as saved:
        return json.loads(saved.metadata()["settings"])


def read_ema_state_dict(checkpoint: str | Path) -> tuple[dict[str, torch.Tensor], dict]:
    """The full EMA of `checkpoint`, assembled from every rank's file: ({name: fp32 tensor of the full shape}, the
    settings it was kept with). For export (one process, after training)."""
    import torch

    files = ema_files(checkpoint)
    if not files:
        raise CheckpointError(f"{checkpoint} holds no EMA ({EMA_DIR}/): train with --ema_decay to keep one")
    flats, shapes, filled, settings = {}, {}, {}, {}
    for path in files:
        with _saved(path) as saved:
            metadata = saved.metadata()
            settings = json.loads(metadata["settings"])
            for name, (start, numel, shape) in json.loads(metadata["fragments"]).items():
                shapes[name] = tuple(shape)
                flat = flats.setdefault(name, torch.zeros(math.prod(shape), dtype=torch.float32))
                flat[start : start + numel] = saved.get_tensor(name)
                filled[name] = filled.get(name, 0) + numel
    short = [name for name, shape in shapes.items() if filled[name] != math.prod(shape)]
    if short:
        raise CheckpointError(f"{checkpoint}: the EMA of {short[0]} is incomplete ({len(files)} rank files)")
    return {name: flats[name].view(shape) for name, shape in shapes.items()}, settings
