"""Which copy detector `disco-clip data filter --dedup_against` should use, and at which threshold: planted copies
of eval images found, other training images spared.

Two image sets, each an eval split and a training split:
- `demo`: the demo's held-out digits (`DIR/eval`, built by `disco-clip data demo --output DIR` when missing) and
  its training shards (`DIR/train`). Different images of one digit are drawn alike: the false-positive risk of a
  detector that matches by content.
- `photos`: 256 x 256 px JPEGs (quality 95) of square boxes of 120 to 240 px at random places of the three
  photographs bundled with scikit-learn and matplotlib: --photo_eval boxes of china.jpg are the eval split,
  --photo_train boxes of flower.jpg and grace_hopper.jpg the training split (distinct photographs, so no training
  image is a copy of an eval image but the planted ones; both have smooth backgrounds, which look alike to any
  global hash).

--planted eval images (the first of a seeded permutation) are planted into the training split under each kind of
copy: `jpeg` (re-encoded at quality 60), `smaller` / `larger` (resized by -10 % / +10 %), `crop` (8 % of the width
and of the height cut off, split between the two sides at random), `flip` (mirrored), and `all` (re-encoded at 60,
10 % smaller, cropped and flipped at once); every copy is re-encoded as a JPEG (quality 95 where not 60). For each
detector and threshold, one row per set: the fraction of planted copies found (`found`, and per kind
`found_<kind>`; `found_issue` over jpeg, smaller, larger and flip) and the fraction of the other training images
wrongly taken for copies (`false`), with counts.

Detectors:
- `phash8_windows`: what the filter runs (copies.reference_fingerprints' hashes, 64 bits, of each eval image, its
  mirror and 9 windows cut 6 % smaller and their mirrors; copies.copies_of_reference); threshold: the Hamming
  distance in bits.
- `phash8` / `phash16`: the same without the windows (the image and its mirror only), 64 / 256-bit hashes.
- `clip`: cosine similarity of a CLIP model's image embeddings (--clip_model, a saved CLIPModel folder such as the
  quickstart's `OUT/export`); threshold: the least cosine that counts as a copy. Also matched against the
  mirrored eval image, as the hashes are.
- `phash8_windows<=B+clip`: a copy for both (phash8_windows within --both_bits B and clip at or above the
  threshold).

    python bench/data/dedup_bench.py --demo outputs/bench_dedup/demo --clip_model outputs/quickstart/export
"""

from __future__ import annotations

import argparse
import io
import sys
from pathlib import Path

import numpy as np

from disco_clip_ds.testing.bench_record import write_rows  # first: the commit is read when the bench starts

REPO = Path(__file__).resolve().parents[2]
KINDS = ("jpeg", "smaller", "larger", "crop", "flip", "all")
ISSUE_KINDS = ("jpeg", "smaller", "larger", "flip")  # the kinds issue 42's measurement names: `found_issue`
# (hash_size, windows, thresholds): phash's bits are balanced (as many set as not), so its distances are even
HASHES = {
    "phash8_windows": (8, True, range(0, 17, 2)),
    "phash8": (8, False, range(0, 17, 2)),
    "phash16": (16, False, range(0, 81, 8)),
}
CROP = 0.08  # of the width and of the height, cut by the `crop` copies
CLIP_THRESHOLDS = [0.9, 0.95, 0.97, 0.98, 0.99, 0.995]


def copy_of(data: bytes, kind: str, rng: np.random.Generator) -> bytes:
    """A copy of the encoded image `data`, of `kind`, encoded as a JPEG; `rng` places the crop."""
    from PIL import Image, ImageOps

    image = Image.open(io.BytesIO(data)).convert("RGB")
    w, h = image.size
    if kind in ("crop", "all"):
        left, top = rng.uniform(0, CROP), rng.uniform(0, CROP)
        image = image.crop((round(left * w), round(top * h), round((1 - CROP + left) * w), round((1 - CROP + top) * h)))
    if kind in ("smaller", "larger", "all"):
        scale = 1.1 if kind == "larger" else 0.9
        image = image.resize((round(image.width * scale), round(image.height * scale)), Image.Resampling.BICUBIC)
    if kind in ("flip", "all"):
        image = ImageOps.mirror(image)
    buf = io.BytesIO()
    image.save(buf, "JPEG", quality=60 if kind in ("jpeg", "all") else 95)
    return buf.getvalue()


def demo_set(folder: Path) -> tuple[list[bytes], list[bytes]]:
    """(eval images, training images) of the demo."""
    from disco_clip_ds.data.curate.sets import image_samples

    if not (folder / "train" / "sizes.json").is_file():
        from disco_clip_ds.data.prep.demo import build_demo

        build_demo(folder)
    evals = [data for _, data in image_samples(str(folder / "eval"))]
    train = [data for _, data in image_samples(str(folder / "train"))]
    return evals, train


def photo_set(n_eval: int, n_train: int, seed: int) -> tuple[list[bytes], list[bytes]]:
    """(eval images (china.jpg), training images (the other two photographs))."""
    sys.path.insert(0, str(REPO / "bench" / "data"))
    from input_pipeline import photographs
    from PIL import Image

    photos, rng = photographs(), np.random.default_rng(seed)
    boxes = []
    for i in range(n_eval + n_train):
        p = 0 if i < n_eval else int(rng.integers(1, len(photos)))
        side = int(rng.integers(120, 241))
        x, y = int(rng.integers(photos[p].width - side)), int(rng.integers(photos[p].height - side))
        boxes.append((p, x, y, side))
    images = []
    for p, x, y, side in boxes:
        buf = io.BytesIO()
        crop = photos[p].crop((x, y, x + side, y + side))
        crop.resize((256, 256), Image.Resampling.LANCZOS).save(buf, "JPEG", quality=95)
        images.append(buf.getvalue())
    return images[:n_eval], images[n_eval:]


def hash_scores(evals, train, hash_size: int, windows: bool):
    from disco_clip_ds.data.curate.copies import fingerprints

    reference = fingerprints(evals, windows=windows, hash_size=hash_size)[1]
    return reference, fingerprints(train, hash_size=hash_size)[1]


def clip_embed(model_dir: str, images: list[bytes]) -> np.ndarray:
    """L2-normalised image embeddings of `images` by the CLIPModel in `model_dir`, its own processor's input."""
    import torch
    from PIL import Image
    from transformers import AutoProcessor, CLIPModel

    model, processor = CLIPModel.from_pretrained(model_dir).eval(), AutoProcessor.from_pretrained(model_dir)
    out = []
    with torch.no_grad():
        for start in range(0, len(images), 256):
            batch = [Image.open(io.BytesIO(d)).convert("RGB") for d in images[start : start + 256]]
            pixels = processor(images=batch, return_tensors="pt")["pixel_values"]
            features = model.get_image_features(pixel_values=pixels)
            features = getattr(features, "pooler_output", features)
            out.append(torch.nn.functional.normalize(features, dim=-1).double().numpy())
    return np.concatenate(out)


def mirrored(images: list[bytes]) -> list[bytes]:
    from PIL import Image, ImageOps

    out = []
    for data in images:
        buf = io.BytesIO()
        ImageOps.mirror(Image.open(io.BytesIO(data)).convert("RGB")).save(buf, "PNG")
        out.append(buf.getvalue())
    return out


def rows_for(name: str, detector: str, found_by: dict, kinds: np.ndarray, n_other: int, n_planted: int) -> list[dict]:
    """One row per threshold: `found_by[threshold]` is the bool per training sample (planted copies after the
    others) of the detector at that threshold."""
    rows = []
    for threshold, hit in found_by.items():
        other, planted = hit[:n_other], hit[n_other:]
        row = {
            "set": name,
            "detector": detector,
            "threshold": threshold,
            "planted": len(planted),
            "eval_images": n_planted,
            "others": n_other,
            "found": round(float(planted.mean()), 4),
            "found_count": int(planted.sum()),
            "false": round(float(other.mean()), 5),
            "false_count": int(other.sum()),
        }
        row["found_issue"] = round(float(planted[np.isin(kinds, ISSUE_KINDS)].mean()), 4)
        row.update({f"found_{k}": round(float(planted[kinds == k].mean()), 4) for k in KINDS})
        rows.append(row)
    return rows


def measure(name: str, evals: list[bytes], train: list[bytes], args) -> list[dict]:
    from disco_clip_ds.data.curate.copies import copies_of_reference

    rng = np.random.default_rng(args.seed)
    order = rng.permutation(len(evals))[: args.planted]
    planted = [copy_of(evals[i], kind, rng) for kind in KINDS for i in order]
    kinds = np.repeat(KINDS, len(order))
    train_all = train + planted
    rows = []
    for detector, (size, windows, thresholds) in HASHES.items():
        reference, hashes = hash_scores(evals, train_all, size, windows)
        found = {t: copies_of_reference(hashes, reference, t) for t in thresholds}
        rows += rows_for(name, detector, found, kinds, len(train), len(order))
        if detector == "phash8_windows":
            by_hash = copies_of_reference(hashes, reference, args.both_bits)
    if args.clip_model:
        ref = np.concatenate([clip_embed(args.clip_model, evals), clip_embed(args.clip_model, mirrored(evals))])
        best = (clip_embed(args.clip_model, train_all) @ ref.T).max(axis=1)
        found = {c: best >= c for c in CLIP_THRESHOLDS}
        rows += rows_for(name, "clip", found, kinds, len(train), len(order))
        both = {c: (best >= c) & by_hash for c in CLIP_THRESHOLDS}
        both_name = f"phash8_windows<={args.both_bits}+clip"
        rows += rows_for(name, both_name, both, kinds, len(train), len(order))
    return rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--demo", default="outputs/bench_dedup/demo", help="the demo's folder (built if missing)")
    parser.add_argument("--clip_model", help="a saved CLIPModel folder for the `clip` detector (skipped without)")
    parser.add_argument("--planted", type=int, default=100, help="eval images planted, each under every kind")
    parser.add_argument("--photo_eval", type=int, default=100)
    parser.add_argument("--photo_train", type=int, default=2000)
    parser.add_argument("--both_bits", type=int, default=14, help="phash8_windows' bits in the +clip detector")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--csv", default=str(REPO / "bench/data/results/dedup.csv"))
    args = parser.parse_args(argv)
    rows = measure("demo", *demo_set(Path(args.demo)), args)
    rows += measure("photos", *photo_set(args.photo_eval, args.photo_train, args.seed), args)
    for row in rows:
        kinds = " ".join(f"{k} {row[f'found_{k}']:.2f}" for k in KINDS)
        print(
            f"{row['set']:6s} {row['detector']:14s} {row['threshold']:>6} found {row['found']:.3f} "
            f"({row['found_issue']:.3f} of the issue's kinds) "
            f"false {row['false']:.4f} ({row['false_count']}/{row['others']})  {kinds}"
        )
    print(write_rows(args.csv, rows, rounds=1))


if __name__ == "__main__":
    main()
