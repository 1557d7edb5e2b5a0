"""data/curate/targets.py: the image-based filter's target set as embeddings, against an independent float64 forward
of the plain transformers CLIPModel (one image or prompt at a time, prompts unpadded), and every refusal in one
line."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image

from disco_clip_ds.data.curate.targets import CLASS_TEMPLATE, target_embeddings
from disco_clip_ds.data.prep.embed import embed_shards
from disco_clip_ds.data.streams.tar_samples import raw_samples
from disco_clip_ds.data.transforms import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD, ImageTransform
from disco_clip_ds.errors import UsageError
from disco_clip_ds.testing.images import write_samples
from disco_clip_ds.testing.launch import TINY_CONFIG, TOKENIZER_DIR

CLASSES = ["zero", "one", "seven"]


def _teacher(folder, seed: int) -> str:
    from disco_clip_ds.models.build import build_model

    build_model(model_config=str(TINY_CONFIG), seed=seed).save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module")
def teachers(tmp_path_factory):
    root = tmp_path_factory.mktemp("teachers")
    return _teacher(root / "a", 0), _teacher(root / "b", 1)


def _images(folder, n: int, fmt: str = "JPEG", key: str = "jpg", **extra) -> None:
    rng = np.random.default_rng(len(str(folder)))
    sizes = [(70, 50), (64, 64), (40, 90)]  # landscape, square, portrait: the center crop matters
    samples = []
    for i in range(n):
        pixels = rng.integers(0, 256, (*sizes[i % 3][::-1], 3), dtype=np.uint8)
        buf = io.BytesIO()
        Image.fromarray(pixels).save(buf, fmt)
        samples.append({key: buf.getvalue(), "txt": f"caption {i}", **extra})
    write_samples(folder, samples, per_shard=3)


def _reference_images(teacher: str, folder) -> torch.Tensor:
    """float64 CLIPModel, one image at a time, shards in name order, on data embed's center crop (ImageTransform's
    eval crop, tested against PIL in tests/unit/data/test_transforms.py), normalised here in float64 with CLIP's
    mean and std."""
    from transformers import CLIPModel

    model = CLIPModel.from_pretrained(teacher).double().eval()
    crop = ImageTransform(64, train=False).pixels
    mean, std = (torch.tensor(v, dtype=torch.float64).view(3, 1, 1) for v in (OPENAI_CLIP_MEAN, OPENAI_CLIP_STD))
    rows = []
    for shard in sorted(folder.glob("*.tar")):
        for sample in raw_samples(str(shard)):
            data = next(sample[k] for k in ("jpg", "png", "webp") if k in sample)
            pixels = ((crop(Image.open(io.BytesIO(data))).double() / 255 - mean) / std)[None]
            with torch.no_grad():
                rows.append(F.normalize(model.get_image_features(pixel_values=pixels).pooler_output[0], dim=0))
    return torch.stack(rows)


def _reference_texts(teacher: str, prompts: list[str]) -> torch.Tensor:
    from transformers import AutoTokenizer, CLIPModel

    model = CLIPModel.from_pretrained(teacher).double().eval()
    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER_DIR)
    rows = []
    with torch.no_grad():
        for prompt in prompts:
            tokens = tokenizer([prompt], return_tensors="pt")
            rows.append(F.normalize(model.get_text_features(**tokens).pooler_output[0], dim=0))
    return torch.stack(rows)


def _check(got: np.ndarray, reference: torch.Tensor) -> None:
    assert got.dtype == np.float32 and got.shape == tuple(reference.shape)
    assert np.allclose(np.linalg.norm(got, axis=1), 1, atol=1e-6)
    assert torch.allclose(torch.from_numpy(got).double(), reference, atol=2e-5)


@pytest.mark.slow  # two tiny teachers, a few dozen forwards
def test_eval_folder_and_plain_shards_are_embedded_as_the_teacher_sees_them(tmp_path, teachers):
    teacher, _ = teachers
    eval_folder = tmp_path / "eval"  # CLIP_benchmark's layout: classnames.txt beside test/*.tar, webp + cls
    _images(eval_folder / "test", 7, fmt="WEBP", key="webp", cls="1")
    (eval_folder / "classnames.txt").write_text("\n".join(CLASSES) + "\n")
    got = target_embeddings(str(eval_folder), teacher, str(TOKENIZER_DIR), batch_size=2)
    _check(got, _reference_images(teacher, eval_folder / "test"))
    _images(tmp_path / "plain", 5)
    _check(
        target_embeddings(str(tmp_path / "plain"), teacher, str(TOKENIZER_DIR)),
        _reference_images(teacher, tmp_path / "plain"),
    )


@pytest.mark.slow
def test_class_names_are_the_teachers_text_embeddings_of_the_template(tmp_path, teachers):
    teacher, _ = teachers
    names = tmp_path / "classnames.txt"
    names.write_text("zero\n\none\nseven\n")  # a blank line is no class
    got = target_embeddings(str(names), teacher, str(TOKENIZER_DIR), batch_size=2)
    _check(got, _reference_texts(teacher, [CLASS_TEMPLATE.format(name=n) for n in CLASSES]))


@pytest.mark.slow
def test_sidecars_are_read_and_another_teachers_are_refused(tmp_path, teachers):
    a, b = teachers
    _images(tmp_path / "shards", 6)
    urls = [str(p) for p in sorted((tmp_path / "shards").glob("*.tar"))]
    embed_shards(a, urls, None, tokenizer_name=str(TOKENIZER_DIR))
    reference = _reference_images(a, tmp_path / "shards")
    _check(target_embeddings(str(tmp_path / "shards"), a), reference)
    _check(target_embeddings(str(tmp_path / "shards"), None), reference)  # no teacher named: the sidecars' own
    with pytest.raises(UsageError, match=r"made by another teacher .*--teacher .*/b: embed the target") as error:
        target_embeddings(str(tmp_path / "shards"), b)
    assert len(str(error.value).splitlines()) == 1
    # one shard re-embedded by b: mixed teachers, refused also when no teacher is named
    embed_shards(b, urls[1:], str(tmp_path / "other"), tokenizer_name=str(TOKENIZER_DIR))
    mixed = next((tmp_path / "other").glob("*.teacher.safetensors"))
    mixed.replace(tmp_path / "shards" / mixed.name)
    with pytest.raises(UsageError, match="made by another teacher .*the other sidecars' teacher"):
        target_embeddings(str(tmp_path / "shards"), None)
    # a shard without its sidecar where the others have one
    (tmp_path / "shards" / mixed.name).unlink()
    with pytest.raises(UsageError, match=r"shard .*00001.tar has no sidecar .*: run `disco-clip data embed"):
        target_embeddings(str(tmp_path / "shards"), a)


def test_what_is_no_target_is_one_line(tmp_path):
    (tmp_path / "empty").mkdir()
    _images(tmp_path / "shards", 2)
    (tmp_path / "blank.txt").write_text("\n \n")
    cases = {
        str(tmp_path / "missing"): "no such file or folder",
        str(tmp_path / "empty"): "no *.tar shards in it",
        str(tmp_path / "shards"): "its images must be embedded: give the teacher",
        str(tmp_path / "shards" / "00000.tar"): "a .tar file, not a text file of class names",
        str(tmp_path / "blank.txt"): "no class names in it",
    }
    for target, said in cases.items():
        teacher = "unused" if target.endswith((".tar", ".txt")) else None
        with pytest.raises(UsageError, match=said.replace("*", r"\*")) as error:
            target_embeddings(target, teacher)
        assert len(str(error.value).splitlines()) == 1
    with pytest.raises(UsageError, match="its class names must be embedded"):
        target_embeddings(str(tmp_path / "blank.txt"), None)
