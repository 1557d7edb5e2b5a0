"""plan/storage.py: the bytes a reinforced set stores per sample, by hand, and against a sidecar data embed's writer
makes."""

import json

import pytest
import torch

from disco_clip_ds.data.embeddings import Reinforced, TeacherFacts, write_reinforced
from disco_clip_ds.plan import format_storage, storage_plan


def test_a_datacompdr_style_set_by_hand():
    """K = 10, two 768-wide teachers, 6 captions, float16, 9-byte keys, 1B samples:
    images 10 x 1536 x 2 = 30720, texts 6 x 1536 x 2 = 18432, boxes 10 x 16 = 160, key 9 + 6 = 15: 49327 bytes."""
    plan = storage_plan(10**9, 10, [768, 768], 6, "float16")
    assert (plan.images, plan.texts, plan.boxes, plan.key) == (30720, 18432, 160, 15)
    assert plan.per_sample == 49327 and plan.total == 49327 * 10**9
    assert format_storage(plan).endswith("1000000000 samples: 49.327 TB")
    centre = storage_plan(1, 0, [512], 1, "float32")  # today's sidecar: one teacher, the centre crop, one caption
    assert (centre.images, centre.texts, centre.boxes, centre.per_sample) == (2048, 2048, 0, 2048 + 2048 + 15)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_the_per_sample_bytes_are_what_a_sidecar_holds(tmp_path, dtype):
    """The tensors' bytes of a written sidecar (from its safetensors header's offsets) and the keys' part of its
    header, for n samples, against n times the plan's terms."""
    n, k, dims, captions = 5, 3, [8, 16], ["txt", "syn0.txt"]
    keys = [f"{i:09d}" for i in range(n)]
    teachers = [TeacherFacts(f"t{i}") for i in range(len(dims))]
    stored = Reinforced(
        keys,
        teachers,
        [torch.zeros(n, k, d) for d in dims],
        [{c: torch.zeros(n, d) for c in captions} for d in dims],
        torch.zeros(n, k, 4, dtype=torch.int32),
        captions,
        k,
        dtype,
        0,
        {},
    )
    path = tmp_path / "x.teacher.safetensors"
    write_reinforced(path, stored)
    data = path.read_bytes()
    header = json.loads(data[8 : 8 + int.from_bytes(data[:8], "little")])
    offsets = [v["data_offsets"] for name, v in header.items() if name != "__metadata__"]
    tensor_bytes = sum(end - start for start, end in offsets)
    plan = storage_plan(n, k, dims, len(captions), dtype)
    assert tensor_bytes == n * (plan.images + plan.texts + plan.boxes)
    # as the header holds it: a JSON string (its outer quotes left out); "[" and "]" stand for the last ", "
    assert len(json.dumps(header["__metadata__"]["keys"])) - 2 == n * plan.key


def test_settings_data_embed_refuses_are_refused():
    with pytest.raises(ValueError, match="dtype 'float64'"):
        storage_plan(1, 1, [8], 1, "float64")
    with pytest.raises(ValueError, match="K >= 0"):
        storage_plan(1, -1, [8], 1)
