"""The scale benchmark's synthetic data, built once into one folder and read by both sides (scale_bench.py):

- `shards/srcI/NNNNN.tar`: SOURCES sources x SHARDS_PER_SOURCE shards of `samples` samples each (DataCompDR: 10,000
  a shard; scaled), each sample a 256 x 256 JPEG (quality 90, smooth colour fields with a few boxes: what
  img2dataset's 256 px resize writes, in size), its caption `txt` and 5 synthetic ones `syn0.txt` .. `syn4.txt`
  (DataCompDR's real caption and 5 CoCa captions), and sizes.json;
- `shards/template/00000.tar` (2 samples): what each side's `data embed` embeds for a sidecar to copy the settings
  of (probes.py `sidecars`); `shards/embed/00000.tar` (`embed_samples` samples): what `data embed` is timed on;
- `teachers/t0`, `teachers/t1`: two CLIP teachers whose embeddings are 768 wide (DataCompDR's ViT-L/14 ensemble
  width) on the tiny model's towers (recipes/models/tiny.json: 64 px, 32 tokens), so that embedding stays cheap;
- `student`: the tiny CLIP every training start-up starts from;
- `eval/`: a task list (`tasks.yml`) of two zero-shot classification sets and one retrieval set, `eval_images`
  64 px images each, and `eval/model`: recipes/models/small.json's CLIP (96 px, 4 layers of 256 a tower) saved with
  its tokenizer and image processor.

Every file is a function of the sizes alone (seeded): `built.json` records them, and a folder built with other
sizes is built again.
"""

from __future__ import annotations

import io
import json
import shutil
from pathlib import Path

import numpy as np

from disco_clip_ds.testing.images import write_samples
from disco_clip_ds.testing.launch import TINY_CONFIG, TOKENIZER_DIR
from disco_clip_ds.testing.runs import save_initial_model

SOURCES, SHARDS_PER_SOURCE = 8, 2
CAPTION_KEYS = ["txt"] + [f"syn{i}.txt" for i in range(5)]
TEACHER_WIDTH, IMAGE_PIXELS = 768, 256
SMALL_CONFIG = Path(TINY_CONFIG).with_name("small.json")
WORDS = "a photo of the red blue green dog cat car tree house on in with near small large old new".split()


def jpeg(rng: np.random.Generator, size: int = IMAGE_PIXELS) -> bytes:
    """A smooth colour field with three boxes, as a JPEG of quality 90 (tens of KB, as web photos at 256 px)."""
    from PIL import Image

    ramp = np.linspace(0, 1, size)
    base = rng.uniform(0, 255, 3)[None, None] * np.add.outer(ramp, ramp)[..., None] / 2
    pixels = base + rng.normal(0, 12, (size, size, 3))
    for _ in range(3):
        x, y, w = (int(v) for v in rng.integers(0, size // 2, 3))
        pixels[y : y + w, x : x + w] = rng.uniform(0, 255, 3)
    buf = io.BytesIO()
    Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8)).save(buf, "JPEG", quality=90)
    return buf.getvalue()


def caption(rng: np.random.Generator) -> bytes:
    return " ".join(rng.choice(WORDS, int(rng.integers(5, 15)))).encode()


def source_shards(root: Path, source: int) -> list[str]:
    return [str(root / "shards" / f"src{source}" / f"{s:05d}.tar") for s in range(SHARDS_PER_SOURCE)]


def write_source(folder: Path, source: int, samples: int, shards: int = SHARDS_PER_SOURCE) -> None:
    import webdataset as wds

    rng = np.random.default_rng(1000 + source)
    folder.mkdir(parents=True, exist_ok=True)
    for s in range(shards):
        with wds.TarWriter(str(folder / f"{s:05d}.tar")) as sink:
            for i in range(samples):
                key = f"{source:02d}{s:03d}{i:05d}"
                sample = {"__key__": key, "jpg": jpeg(rng), "json": json.dumps({"key": key}).encode()}
                sample.update({name: caption(rng) for name in CAPTION_KEYS})
                sink.write(sample)
    (folder / "sizes.json").write_text(json.dumps({f"{s:05d}.tar": samples for s in range(shards)}))


def save_teacher(folder: Path, seed: int) -> None:
    """The tiny CLIP with 768-wide embeddings (its projections), drawn with `seed`."""
    config = json.loads(Path(TINY_CONFIG).read_text())
    config["projection_dim"] = TEACHER_WIDTH
    for tower in ("text_config", "vision_config"):
        config[tower]["projection_dim"] = TEACHER_WIDTH
    spec = folder.with_suffix(".json")
    spec.parent.mkdir(parents=True, exist_ok=True)
    spec.write_text(json.dumps(config))
    save_initial_model(folder, seed, spec)


def write_eval(root: Path, images: int) -> Path:
    """Two classification sets and a retrieval set of `images` images each, their task list, and the eval model."""
    from transformers import AutoTokenizer, CLIPImageProcessor, CLIPProcessor

    rng = np.random.default_rng(7)
    classes = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]
    for name in ("cls_a", "cls_b"):
        samples = [{"jpg": jpeg(rng, 64), "cls": str(i % len(classes))} for i in range(images)]
        write_samples(root / name, samples, per_shard=max(1, images // 4))
        (root / name / "classnames.txt").write_text("\n".join(classes) + "\n")
        (root / name / "zeroshot_classification_templates.txt").write_text("a photo of {c}.\na {c}.\n")
    samples = [{"jpg": jpeg(rng, 64), "txt": caption(rng) + b"\n" + caption(rng)} for _ in range(images)]
    write_samples(root / "ret", samples, per_shard=max(1, images // 4))
    tasks = {
        "cls_a": {"path": "cls_a"},
        "cls_b": {"path": "cls_b"},
        "ret": {"type": "zeroshot_retrieval", "path": "ret"},
    }
    import yaml

    (root / "tasks.yml").write_text(yaml.safe_dump(tasks))
    model = save_initial_model(root / "model", 3, SMALL_CONFIG)
    tokenizer = AutoTokenizer.from_pretrained(str(TOKENIZER_DIR))
    processor = CLIPImageProcessor(size={"shortest_edge": 96}, crop_size={"height": 96, "width": 96})
    CLIPProcessor(image_processor=processor, tokenizer=tokenizer).save_pretrained(str(model))
    return root / "tasks.yml"


def build(root: Path, samples: int, eval_images: int, embed_samples: int) -> dict:
    """Build (or keep, when built with these sizes) the data under ROOT; returns its record."""
    record = {"samples_per_shard": samples, "eval_images": eval_images, "embed_samples": embed_samples, "format": 3}
    done = root / "built.json"
    if done.is_file() and json.loads(done.read_text()) == record:
        return record
    if root.exists():
        shutil.rmtree(root)
    for source in range(SOURCES):
        write_source(root / "shards" / f"src{source}", source, samples)
    write_source(root / "shards" / "template", 98, 2, shards=1)
    write_source(root / "shards" / "embed", 99, embed_samples, shards=1)
    for seed in (0, 1):
        save_teacher(root / "teachers" / f"t{seed}", 21 + seed)
    save_initial_model(root / "student", 11)
    write_eval(root / "eval", eval_images)
    done.write_text(json.dumps(record))
    return record
