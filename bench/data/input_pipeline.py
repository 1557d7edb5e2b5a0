"""Input pipeline speed per DataLoader worker: ours (ShardStream + ClipCollator) against open_clip 3.3.0's own
webdataset pipeline, on the same LAION-like shards, and what each step costs per sample.

Data, made here without a network: webdataset tars as img2dataset writes them (key.jpg / key.txt / key.json per
sample, 00000.tar ...), JPEGs resized to --short_side px on the short side (aspect ratios 3:4 to 16:9) at quality 95
(img2dataset's default), cut from the three photographs bundled with scikit-learn and matplotlib (random crops and
flips, so JPEG decode sees photographic texture, not flat colour), alt-text-like captions of about 40 CLIP tokens.

Speed: each side runs in its own process with one DataLoader worker (--workers N: N of them, their CPU time summed;
OMP_NUM_THREADS=1, torch threads 1), batch
--batch, 224 px training crops, 77-token captions; after --warmup batches (open_clip fills its 1,000-sample shuffle
buffer first) it times --batches batches. The rate is samples per CPU-second of that worker process (user + system,
from /proc): on a shared machine that is what a worker with a core of its own delivers, where wall-clock rates
(also written) swing with the load. The main process only waits on the worker. Sides interleave over --rounds;
the table takes each side's median, and the ratio's median over rounds.
- ours: disco_clip_ds.data.streams.shards.ShardStream + ClipCollator as train.py builds them on CPU ranks (the worker
  normalises the batch), with CLIP's own BPE as a fast transformers tokenizer (made offline from open_clip's
  vocabulary file; the same tokens as open_clip's); `ours_before` and `ours_uint8_before` run the same code of
  --before_commit (checked out with `git archive`).
- ours_uint8: the same with ClipCollator(normalize=False), as train.py builds it on a GPU: the worker hands over
  the uint8 batch and the trainer normalises it on the device (not measured here).
- open_clip: open_clip_train.data.get_wds_dataset with open_clip.image_transform(224, is_train=True) (ViT-B-32's
  train preprocess) and open_clip.get_tokenizer("ViT-B-32"), in bench/vs_open_clip's virtualenv (made by
  vs_open_clip.ensure_openclip_venv; open_clip is never a dependency of the package).
- hf (with --parquet DIR): our `datasets` path, disco_clip_ds.data.streams.hf.HFStream (map-style, as train.py builds it
  for --dataset_name DIR) + ClipCollator, over the same samples written once as a parquet dataset (an `image`
  column of JPEG bytes, a `caption` column).
Breakdown (--breakdown): each step timed alone in one process over the first --breakdown samples, in CPU
microseconds per sample; batch-wide steps (tokenize, collate, normalise) are timed per batch and divided by its size.
Draft decoding (only when the crop spans >= 2 x 224 px, so never on 256 px images): --draft_side S makes a second
shard set S px on the short side and measures ours with draft decoding on and off, and the difference it makes on
the normalised tensors (max and mean absolute).
--kernels: the decoders (PIL, simplejpeg) and resizers (PIL, OpenCV, torch's uint8 kernel) alone, one thread, on
the --breakdown samples of each shard set, CPU time and difference from PIL's pixels; and the fidelity of the new
training crop against the old PIL crop of the same box. --threads K: decode + crop of those samples by one process,
by one process with K threads, and by K processes, on the same cores.

    .venv/bin/python bench/data/input_pipeline.py --rounds 5 --before_commit edb33e2 --draft_side 512 --kernels \
        --threads 2
"""

from __future__ import annotations

import argparse
import io
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
RESULTS = Path(__file__).resolve().parent / "results"
sys.path.insert(0, str(REPO / "bench" / "vs_open_clip"))
import vs_open_clip  # noqa: E402  (the open_clip virtualenv and its CPU import workarounds)

CROP, CONTEXT = 224, 77
WORDS = (
    "vintage wooden table chair modern kitchen design interior living room white black red blue green gold "
    "silver leather dress women men fashion summer beach sunset mountain lake forest river city street night "
    "photo stock image illustration vector art print poster canvas wall decor home garden flower rose tree "
    "dog cat puppy kitten bird horse car truck bike wedding party birthday cake food recipe chicken salad "
    "pasta coffee tea cup mug glass bottle wine beer shirt shoes bag jacket ring necklace earrings watch "
    "phone laptop computer desk office book cover map logo icon pattern seamless texture background abstract "
    "hand drawn watercolor painting portrait family kids baby christmas holiday winter snow travel hotel"
).split()


# ---------------------------------------------------------------- data


def photographs():
    """The bundled photographs (RGB PIL images): scikit-learn's china.jpg and flower.jpg, matplotlib's
    grace_hopper.jpg."""
    import matplotlib.cbook
    import sklearn.datasets
    from PIL import Image

    folder = Path(sklearn.datasets.__file__).parent / "images"
    paths = [folder / "china.jpg", folder / "flower.jpg", matplotlib.cbook.get_sample_data("grace_hopper.jpg")]
    return [Image.open(p).convert("RGB") for p in paths]


def caption(rng: random.Random) -> str:
    words = [rng.choice(WORDS) for _ in range(rng.randint(29, 41))]
    if rng.random() < 0.5:
        words.insert(rng.randint(0, len(words)), str(rng.randint(1990, 2024)))
    text = " ".join(words)
    return text[0].upper() + text[1:] + rng.choice([".", "", " | Stock Photo", " - Free Download"])


def make_shards(folder: Path, shards: int, per_shard: int, short_side: int, seed: int = 0) -> list[str]:
    """img2dataset-layout shards of photographic JPEGs (quality 95) `short_side` px on the short side."""
    import webdataset as wds
    from PIL import Image

    urls = [str(folder / f"{s:05d}.tar") for s in range(shards)]
    if all(Path(u).exists() for u in urls):
        return urls
    folder.mkdir(parents=True, exist_ok=True)
    rng, photos = random.Random(seed), photographs()
    for s, url in enumerate(urls):
        with wds.TarWriter(url + ".tmp") as sink:
            for i in range(per_shard):
                photo = rng.choice(photos)
                aspect = rng.uniform(3 / 4, 16 / 9)
                w = rng.randint(min(photo.width, 260), photo.width)
                h = min(photo.height, round(w / aspect))
                w = min(w, round(h * aspect))
                left, top = rng.randint(0, photo.width - w), rng.randint(0, photo.height - h)
                image = photo.crop((left, top, left + w, top + h))
                if rng.random() < 0.5:
                    image = image.transpose(Image.FLIP_LEFT_RIGHT)
                scale = short_side / min(w, h)
                image = image.resize((round(w * scale), round(h * scale)), Image.LANCZOS)
                buf = io.BytesIO()
                image.save(buf, "JPEG", quality=95)
                key = f"{s:05d}{i:04d}"
                text = caption(rng)
                meta = {"key": key, "caption": text, "status": "success", "width": image.width}
                meta["height"] = image.height
                sink.write({"__key__": key, "jpg": buf.getvalue(), "txt": text.encode(), "json": json.dumps(meta)})
        os.replace(url + ".tmp", url)
    return urls


def clip_tokenizer(out: Path, venv: Path) -> str:
    """CLIP's own BPE (49,408 tokens, as openai/clip-vit-base-patch32's tokenizer) as a fast transformers
    tokenizer folder, made offline from the vocabulary file open_clip ships: the tokenizer a real run loads, where
    recipes/tokenizer is the demo's 539-token one (whose captions would be three times as many tokens)."""
    import gzip

    from transformers import AutoTokenizer, CLIPTokenizer

    if not (out / "tokenizer.json").exists():
        bpe = next(venv.glob("lib/python*/site-packages/open_clip/bpe_simple_vocab_16e6.txt.gz"))
        merges = gzip.open(bpe).read().decode("utf-8").split("\n")[1 : 49152 - 256 - 2 + 1]
        printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
        byte_chars = [chr(b) for b in printable] + [chr(256 + i) for i in range(256 - len(printable))]
        vocab = byte_chars + [c + "</w>" for c in byte_chars] + ["".join(m.split()) for m in merges]
        vocab += ["<|startoftext|>", "<|endoftext|>"]
        out.mkdir(parents=True, exist_ok=True)
        (out / "vocab.json").write_text(json.dumps({v: i for i, v in enumerate(vocab)}))
        (out / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n")
        CLIPTokenizer(vocab=str(out / "vocab.json"), merges=str(out / "merges.txt")).save_pretrained(out)
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert tokenizer.is_fast and len(tokenizer) == 49408
    assert tokenizer("a photo of a cat").input_ids == [49406, 320, 1125, 539, 320, 2368, 49407]  # as open_clip's
    return str(out)


def write_parquet(urls: list[str], out: Path) -> None:
    """The same samples as a parquet dataset (image bytes, caption), for the `datasets` side."""
    import datasets

    from disco_clip_ds.data.streams.tar_samples import raw_samples

    rows = [s for u in urls for s in raw_samples(u, 0)]
    features = datasets.Features({"image": datasets.Image(), "caption": datasets.Value("string")})
    data = {"image": [{"bytes": s["jpg"], "path": None} for s in rows], "caption": [s["txt"].decode() for s in rows]}
    datasets.Dataset.from_dict(data, features=features).to_parquet(str(out / "train.parquet"))


# ---------------------------------------------------------------- timing (each side in its own process)


def _cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process `pid` so far (/proc/PID/stat)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _timed(loader, warmup: int, batches: int, batch: int) -> dict:
    """Samples, wall seconds and the DataLoader workers' CPU seconds (summed) over `batches` batches after `warmup`.
    On a shared machine the workers' CPU seconds are what cores of their own would take; wall time also counts the
    time they waited for a core."""
    import multiprocessing

    it = iter(loader)
    for _ in range(warmup):
        next(it)
    workers = multiprocessing.active_children()  # the DataLoader workers
    cpu_of = lambda: sum(_cpu_seconds(w.pid) for w in workers)
    cpu, start = cpu_of(), time.perf_counter()
    for _ in range(batches):
        next(it)
    wall, cpu = time.perf_counter() - start, cpu_of() - cpu
    measured = {"samples": batches * batch, "wall_s": round(wall, 3), "worker_cpu_s": round(cpu, 3)}
    return {**measured, "workers": len(workers)}


def ours_rate(args) -> dict:
    import torch
    from transformers import AutoTokenizer

    from disco_clip_ds.data.collate import ClipCollator
    from disco_clip_ds.data.streams.shards import ShardStream

    stream = ShardStream(args.urls, CROP, seed=0, shuffle_buffer=1000, num_workers=args.workers)
    if args.no_draft:
        stream.transform.draft = False
    uint8 = {"normalize": False} if args.side.startswith("ours_uint8") else {}
    collate = ClipCollator(AutoTokenizer.from_pretrained(args.tokenizer), CONTEXT, **uint8)
    loader = torch.utils.data.DataLoader(stream, batch_size=args.batch, num_workers=args.workers, collate_fn=collate)
    return _timed(loader, args.warmup, args.batches, args.batch)


def _open_clip_pipeline(args):
    open_clip = vs_open_clip._import_open_clip()
    from open_clip_train.data import get_wds_dataset

    preprocess = open_clip.image_transform(CROP, is_train=True)
    tokenizer = open_clip.get_tokenizer("ViT-B-32")
    return open_clip, preprocess, tokenizer, get_wds_dataset


def open_clip_rate(args) -> dict:
    _, preprocess, tokenizer, get_wds_dataset = _open_clip_pipeline(args)
    oc_args = argparse.Namespace(
        train_data="::".join(args.urls),
        train_num_samples=10**9,
        dataset_resampled=False,
        train_data_upsampling_factors=None,
        seed=0,
        batch_size=args.batch,
        workers=1,
        world_size=1,
    )
    loader = get_wds_dataset(oc_args, preprocess, is_train=True, tokenizer=tokenizer).dataloader
    return _timed(loader, args.warmup, args.batches, args.batch)


def hf_rate(args) -> dict:
    """Our `datasets` path: HFStream (as train.py builds it for --dataset_name) over the parquet copy of the same
    samples (--parquet), map-style, with ClipCollator."""
    from types import SimpleNamespace

    import torch
    from transformers import AutoTokenizer

    from disco_clip_ds.data.collate import ClipCollator
    from disco_clip_ds.data.hf_io import load_training_dataset
    from disco_clip_ds.data.streams.hf import HFStream

    names = {"dataset_config_name": None, "train_split": "train", "train_file": None, "streaming": False}
    data_args = SimpleNamespace(dataset_name=args.parquet, image_column="image", caption_column="caption", **names)
    stream = HFStream(
        load_training_dataset(data_args, args.workers), CROP, seed=0, shuffle_buffer=1000, num_workers=args.workers
    )
    collate = ClipCollator(AutoTokenizer.from_pretrained(args.tokenizer), CONTEXT)
    loader = torch.utils.data.DataLoader(stream, batch_size=args.batch, num_workers=args.workers, collate_fn=collate)
    return _timed(loader, args.warmup, args.batches, args.batch)


RATES = {
    "ours": ours_rate,
    "ours_uint8": ours_rate,
    "ours_before": ours_rate,
    "ours_uint8_before": ours_rate,
    "open_clip": open_clip_rate,
    "hf": hf_rate,
}


# ---------------------------------------------------------------- per-step costs


class Steps:
    """CPU microseconds per sample (this process's user + system time, so that other load on the machine does not
    count), summed per step."""

    def __init__(self):
        self.total: dict[str, float] = {}

    def time(self, step: str, fn, *a):
        start = time.process_time()
        out = fn(*a)
        self.total[step] = self.total.get(step, 0.0) + time.process_time() - start
        return out

    def rows(self, side: str, n: int) -> list[dict]:
        return [{"side": side, "step": k, "us_per_sample": round(v / n * 1e6, 1)} for k, v in self.total.items()]


def _raw(urls: list[str], n: int) -> list[dict]:
    from disco_clip_ds.data.streams.tar_samples import raw_samples

    out = []
    for url in urls:
        out += list(raw_samples(url, 0))
        if len(out) >= n:
            return out[:n]
    return out


AUGMENT, SHARE = "augment (crop box + bicubic resize)", "copy into shared memory (worker -> main)"
NORMALISE, STACK = "normalise into the shared-memory batch", "stack into the shared-memory uint8 batch"


def ours_breakdown(args) -> list[dict]:
    """Ours now (libjpeg-turbo decode, torch's uint8 resize, straight to a tensor) and before (edb33e2: PIL's decode
    and resize, then the crop to a tensor), each with the worker normalising into a shared-memory float32 batch
    (ours, ours_before) or stacking the uint8 crops into a shared-memory batch (ours_uint8, ours_uint8_before),
    step by step. Reading, captions, tokenizing and collating are the same code before and after: timed once."""
    import numpy as np
    import torch
    from PIL import Image
    from transformers import AutoTokenizer

    from disco_clip_ds.data.collate import batch_tensor
    from disco_clip_ds.data.decode import EncodedImage
    from disco_clip_ds.data.resize import resized_crop
    from disco_clip_ds.data.transforms import ImageTransform, random_resized_crop_box, to_rgb

    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    normalize = ImageTransform(CROP).normalize
    shared, now, before = Steps(), Steps(), Steps()
    start = time.process_time()
    raw = _raw(args.urls, args.breakdown)
    shared.total["read"] = time.process_time() - start
    for b in range(0, len(raw), args.batch):
        crops, captions = [], []
        for sample in raw[b : b + args.batch]:
            key = sample["__key__"]
            captions.append(shared.time("caption", lambda s: s["txt"].decode("utf-8").strip(), sample))
            # now (no reduced decode on these shards: a 256 px image never has twice 224 px to spare)
            encoded = now.time("decode", EncodedImage, sample["jpg"])
            pixels = now.time("decode", encoded.decode)
            box = now.time(AUGMENT, random_resized_crop_box, *encoded.size, random.Random(f"0/0/{key}"))
            crops.append(now.time(AUGMENT, resized_crop, pixels, box, encoded.size, CROP))
            # before
            image = before.time("decode", lambda d: Image.open(io.BytesIO(d)), sample["jpg"])
            before.time("decode", image.load)
            image = to_rgb(image)
            box = before.time(AUGMENT, random_resized_crop_box, *image.size, random.Random(f"0/0/{key}"))
            crop = before.time(AUGMENT, image.resize, (CROP, CROP), Image.BICUBIC, box)
            before.time("to uint8 tensor", lambda c: torch.from_numpy(np.array(c)).permute(2, 0, 1), crop)
        kw = dict(padding="max_length", truncation=True, max_length=CONTEXT, return_tensors="pt")
        shared.time("tokenize (batched, fast)", lambda: tokenizer(captions, **kw))
        shape = (len(crops), 3, CROP, CROP)
        shared.time(NORMALISE, lambda: normalize(crops, batch_tensor(shape, torch.float32, True)))
        shared.time(STACK, lambda: torch.stack(crops, out=batch_tensor(shape, torch.uint8, True)))
    rows = []
    for side, steps in (("ours", now), ("ours_before", before)):
        for variant, collate_step, dropped in (("", NORMALISE, STACK), ("_uint8", STACK, NORMALISE)):
            name = side.replace("ours", "ours" + variant)
            merged = Steps()
            merged.total = {**{k: v for k, v in shared.total.items() if k != dropped}, **steps.total}
            merged.total = {k: merged.total[k] for k in _STEP_ORDER if k in merged.total}
            rows += merged.rows(name, len(raw))
    # the whole stream and collator in this process, no DataLoader: what the steps add up to
    from disco_clip_ds.data.collate import ClipCollator
    from disco_clip_ds.data.streams.shards import ShardStream

    stream = iter(ShardStream(args.urls, CROP, seed=0, shuffle_buffer=1000))
    collate = ClipCollator(tokenizer, CONTEXT)
    start = time.process_time()
    for b in range(0, len(raw), args.batch):
        collate([next(stream) for _ in range(min(args.batch, len(raw) - b))])
    whole = Steps()
    whole.total["whole stream + collate, in process"] = time.process_time() - start
    return rows + whole.rows("ours", len(raw))


_STEP_ORDER = ("read", "caption", "decode", AUGMENT, "to uint8 tensor", "tokenize (batched, fast)", NORMALISE, STACK)


def open_clip_breakdown(args) -> list[dict]:
    """open_clip's pipeline stages on the same samples: webdataset's tar reader and 'pilrgb' decoder, each of
    image_transform's steps, its tokenizer (one call per sample, as get_wds_dataset maps it), wds collation and the
    DataLoader's copy of the batch into shared memory."""
    import webdataset as wds

    _, preprocess, tokenizer, _ = _open_clip_pipeline(args)
    steps = Steps()
    start = time.process_time()
    src = wds.tarfile_to_samples()([{"url": u} for u in args.urls])
    raw = [s for s, _ in zip(src, range(args.breakdown))]
    steps.total["read"] = time.process_time() - start
    decode = wds.autodecode.Decoder([wds.autodecode.imagehandler("pilrgb")])
    names = {0: AUGMENT, 1: "to RGB", 2: "to float tensor", 3: "normalise"}
    for b in range(0, len(raw), args.batch):
        rows = []
        for sample in raw[b : b + args.batch]:
            sample = steps.time("decode", decode, sample)
            image = sample["jpg"]
            for i, t in enumerate(preprocess.transforms):
                image = steps.time(names.get(i, type(t).__name__), t, image)
            tokens = steps.time("tokenize (per sample)", lambda s: tokenizer(s)[0], sample["txt"])
            rows.append((image, tokens))
        images, _ = steps.time("collate (stack)", wds.filters.default_collation_fn, rows)
        steps.time(SHARE, images.share_memory_)
    return steps.rows("open_clip", len(raw))


def draft_difference(args) -> list[dict]:
    """Ours with draft decoding against without, on the --draft_side shards: how often it fires, and max / mean
    absolute difference of the normalised tensors."""
    from disco_clip_ds.data.transforms import ImageTransform, Normalize, draft_scale, random_resized_crop_box

    raw, norm = _raw(args.urls, args.breakdown), Normalize()
    on, off = ImageTransform(CROP), ImageTransform(CROP, draft=False)
    diffs, fired = [], 0
    from PIL import Image

    for sample in raw:
        key = sample["__key__"]
        with Image.open(io.BytesIO(sample["jpg"])) as image:
            fired += draft_scale(random_resized_crop_box(*image.size, random.Random(key)), CROP) > 1
        a = norm(on.from_bytes(sample["jpg"], random.Random(key)))
        b = norm(off.from_bytes(sample["jpg"], random.Random(key)))
        diffs.append((a - b).abs())
    import torch

    diff = torch.stack(diffs)
    return [
        {"samples": len(raw), "drafted": fired, "max_abs": float(diff.max()), "mean_abs": float(diff.mean())},
    ]


def _old_crop(data: bytes, rng: random.Random):
    """The training crop as edb33e2 made it: PIL's header, box, draft decode, PIL's bicubic resize of the box."""
    import numpy as np
    import torch
    from PIL import Image

    from disco_clip_ds.data.transforms import draft_scale, random_resized_crop_box, to_rgb

    with Image.open(io.BytesIO(data)) as image:
        full = image.size
        box = random_resized_crop_box(*full, rng)
        scale = draft_scale(box, CROP)
        if scale > 1:
            image.draft(None, (full[0] // scale, full[1] // scale))
        image.load()
        image = to_rgb(image)
        sx, sy = image.width / full[0], image.height / full[1]
        box = (box[0] * sx, box[1] * sy, box[2] * sx, box[3] * sy)
        return torch.from_numpy(np.array(image.resize((CROP, CROP), Image.BICUBIC, box=box))).permute(2, 0, 1)


def fidelity(args) -> list[dict]:
    """The new training crop (draft decoding on) against edb33e2's PIL crop of the same box (its draft decoding on
    too), and against PIL's crop-then-resize of the full-size decode (torchvision's RandomResizedCrop of a PIL image,
    open_clip's): mean and max absolute difference in uint8 levels, over --breakdown samples."""
    import numpy as np
    import torch
    from PIL import Image

    from disco_clip_ds.data.transforms import ImageTransform, random_resized_crop_box, to_rgb

    new, old, first = ImageTransform(CROP), [], []
    for sample in _raw(args.urls, args.breakdown):
        key, data = sample["__key__"], sample["jpg"]
        crop = new.from_bytes(data, random.Random(key)).to(torch.int16)
        old.append((crop - _old_crop(data, random.Random(key))).abs())
        image = to_rgb(Image.open(io.BytesIO(data)))
        box = random_resized_crop_box(*image.size, random.Random(key))
        pil = torch.from_numpy(np.array(image.crop(box).resize((CROP, CROP), Image.BICUBIC))).permute(2, 0, 1)
        first.append((crop - pil).abs())
    rows = []
    for against, diffs in (("edb33e2 PIL crop (resize of the box)", old), ("PIL crop, then resize", first)):
        diff = torch.stack(diffs).float()
        row = {"against": against, "samples": len(diffs), "mean_abs": round(float(diff.mean()), 4)}
        rows.append({**row, "max_abs": int(diff.max()), "share_over_2": round(float((diff > 2).float().mean()), 6)})
    return rows


def kernels(args) -> list[dict]:
    """Decoders and resizers alone, one thread, on --breakdown samples: CPU microseconds per sample and mean / max
    absolute difference (uint8 levels) from PIL's (decode; resize of the box, and crop then resize)."""
    import cv2
    import numpy as np
    import simplejpeg
    import torch
    import torch.nn.functional as F
    from PIL import Image

    from disco_clip_ds.data.transforms import random_resized_crop_box

    cv2.setNumThreads(1)
    raw = [s["jpg"] for s in _raw(args.urls, args.breakdown)]
    pil_decode = lambda d: np.asarray(Image.open(io.BytesIO(d)).convert("RGB"))
    decoders = {
        "PIL": pil_decode,
        "simplejpeg": lambda d: simplejpeg.decode_jpeg(d, "RGB"),
        "simplejpeg fastdct+fastupsample": lambda d: simplejpeg.decode_jpeg(d, "RGB", fastdct=True, fastupsample=True),
    }
    rows, images = [], [pil_decode(d) for d in raw]
    for name, fn in decoders.items():
        start = time.process_time()
        out = [fn(d) for d in raw]
        cpu = time.process_time() - start
        diff = np.concatenate([np.abs(a.astype(np.int16) - b).ravel() for a, b in zip(out, images)])
        rows.append(_kernel_row("decode", name, cpu, len(raw), diff, diff))
    boxes = [random_resized_crop_box(a.shape[1], a.shape[0], random.Random(i)) for i, a in enumerate(images)]
    pil_images = [Image.fromarray(a) for a in images]  # what PIL's decoder hands its resize
    crop = lambda a, b: a[b[1] : b[3], b[0] : b[2]]

    def torch_aa(im, a, b):
        t = torch.from_numpy(crop(a, b)).permute(2, 0, 1).unsqueeze(0)
        return F.interpolate(t, size=(CROP, CROP), mode="bicubic", antialias=True)[0].permute(1, 2, 0).numpy()

    def cv2_auto(im, a, b):
        c = crop(a, b)
        area = max(c.shape[:2]) >= 2 * CROP  # a strong downscale: area averaging, else bicubic
        return cv2.resize(c, (CROP, CROP), interpolation=cv2.INTER_AREA if area else cv2.INTER_CUBIC)

    resizers = {
        "PIL resize of the box (edb33e2)": lambda im, a, b: im.resize((CROP, CROP), Image.BICUBIC, box=b),
        "PIL crop, then resize": lambda im, a, b: im.crop(b).resize((CROP, CROP), Image.BICUBIC),
        "cv2 INTER_CUBIC": lambda im, a, b: cv2.resize(crop(a, b), (CROP, CROP), interpolation=cv2.INTER_CUBIC),
        "cv2 INTER_AREA": lambda im, a, b: cv2.resize(crop(a, b), (CROP, CROP), interpolation=cv2.INTER_AREA),
        "cv2 INTER_AREA if >= 2x down, else INTER_CUBIC": cv2_auto,
        "torch uint8 bicubic antialias (torchvision v2's)": torch_aa,
    }
    outputs, cpu = {}, {}
    for name, fn in resizers.items():
        start = time.process_time()
        out = [fn(im, a, b) for im, a, b in zip(pil_images, images, boxes)]
        cpu[name] = time.process_time() - start
        outputs[name] = np.stack([np.asarray(o) for o in out]).astype(np.int16)
    old, first = outputs["PIL resize of the box (edb33e2)"], outputs["PIL crop, then resize"]
    for name, out in outputs.items():
        rows.append(_kernel_row("resize", name, cpu[name], len(raw), np.abs(out - old), np.abs(out - first)))
    return rows


def _kernel_row(step: str, name: str, cpu: float, n: int, old, first) -> dict:
    return {
        "step": step,
        "kernel": name,
        "us_per_sample": round(cpu / n * 1e6, 1),
        "mean_abs_vs_pil": round(float(old.mean()), 4),
        "max_abs_vs_pil": int(old.max()),
        "mean_abs_vs_pil_crop_first": round(float(first.mean()), 4),
        "max_abs_vs_pil_crop_first": int(first.max()),
    }


def _decode_chunk(chunk: list[tuple[str, bytes]]) -> int:
    from disco_clip_ds.data.transforms import ImageTransform

    transform = ImageTransform(CROP)
    return len([transform.from_bytes(data, random.Random(key)) for key, data in chunk])


def threads(args) -> list[dict]:
    """Decode + crop of --breakdown samples, on the same cores, three ways: one process alone; one process with a
    pool of --pool threads (decoding and resizing release the GIL); --pool processes (as DataLoader workers are).
    Samples per CPU-second of all of them together, and per wall second."""
    import multiprocessing
    from concurrent.futures import ThreadPoolExecutor

    import psutil

    raw = [(s["__key__"], s["jpg"]) for s in _raw(args.urls, args.breakdown)]
    chunks = [raw[i : i + 32] for i in range(0, len(raw), 32)]
    me = psutil.Process()
    cpu_of = lambda procs: sum(sum(p.cpu_times()[:2]) for p in procs)
    rows = []
    for way in ("1 process", f"1 process, {args.pool} threads", f"{args.pool} processes"):
        if way.endswith("processes"):
            pool = multiprocessing.get_context("fork").Pool(args.pool)
            pool.map(_decode_chunk, chunks[: args.pool])  # started and warm
            procs = [psutil.Process(p.pid) for p in pool._pool]
            run = lambda: sum(pool.map(_decode_chunk, chunks, chunksize=1))
        elif "threads" in way:
            executor = ThreadPoolExecutor(args.pool)
            procs, run = [me], lambda: sum(executor.map(_decode_chunk, chunks))
        else:
            procs, run = [me], lambda: sum(map(_decode_chunk, chunks))
        run()  # warm
        cpu, start = cpu_of(procs), time.perf_counter()
        done = run()
        wall, cpu = time.perf_counter() - start, cpu_of(procs) - cpu
        if way.endswith("processes"):
            pool.close()
        rows.append(
            {
                "way": way,
                "samples": done,
                "cpu_s": round(cpu, 3),
                "wall_s": round(wall, 3),
                "samples_per_cpu_s": round(done / cpu, 1),
                "samples_per_wall_s": round(done / wall, 1),
            }
        )
    return rows


# ---------------------------------------------------------------- orchestration (project venv)


def _env(pythonpath: str) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    env.update(PYTHONPATH=pythonpath, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", NO_ALBUMENTATIONS_UPDATE="1")
    return env


def _side(python: str, pythonpath: str, task: str, side: str, urls: list[str], args, *extra: str):
    cmd = [python, __file__, "--task", task, "--side", side, "--urls", *urls]
    cmd += ["--batch", str(args.batch), "--batches", str(args.batches), "--warmup", str(args.warmup)]
    cmd += ["--breakdown", str(args.breakdown), "--tokenizer", args.tokenizer, "--workers", str(args.workers)]
    cmd += ["--pool", str(args.pool), *extra]
    cmd += ["--parquet", args.parquet] if args.parquet else []
    result = subprocess.run(cmd, capture_output=True, text=True, env=_env(pythonpath), cwd=REPO)
    if result.returncode != 0:
        raise SystemExit(f"{side} {task} failed:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def _before_tree(commit: str, root: Path) -> str:
    tree = root / f"before-{commit}"
    if not (tree / "disco_clip_ds").exists():
        tree.mkdir(parents=True, exist_ok=True)
        archive = subprocess.run(["git", "archive", commit, "disco_clip_ds"], cwd=REPO, capture_output=True, check=True)
        subprocess.run(["tar", "-x", "-C", str(tree)], input=archive.stdout, check=True)
    return str(tree)


def orchestrate(args) -> None:
    root = Path(args.data)
    urls = make_shards(root / f"shards_{args.short_side}", args.shards, args.per_shard, args.short_side)
    if args.parquet and not (Path(args.parquet) / "train.parquet").exists():
        Path(args.parquet).mkdir(parents=True, exist_ok=True)
        write_parquet(urls, Path(args.parquet))
    ours_python = sys.executable
    oc_python = str(vs_open_clip.ensure_openclip_venv(vs_open_clip.OPENCLIP_VENV))
    args.tokenizer = clip_tokenizer(root / "clip_tokenizer", vs_open_clip.OPENCLIP_VENV)
    sides = {
        "ours": (ours_python, str(REPO)),
        "ours_uint8": (ours_python, str(REPO)),
        "open_clip": (oc_python, str(REPO / "bench" / "vs_open_clip")),
    }
    if args.before_commit:
        before = (ours_python, _before_tree(args.before_commit, root))
        sides = {"ours_before": before, "ours_uint8_before": before, **sides}
    if args.parquet:
        sides["hf"] = (ours_python, str(REPO))
    sides = {side: where for side, where in sides.items() if not args.sides or side in args.sides}
    rows = []
    for r in range(args.rounds):
        for side, (python, path) in sides.items():
            rows.append(_rate_row(r, side, f"{args.short_side}px", _side(python, path, "rate", side, urls, args)))
    if args.draft_side:
        big = make_shards(root / f"shards_{args.draft_side}", 2, args.per_shard, args.draft_side, seed=1)
        for r in range(args.rounds):
            for side, extra in (("ours", ()), ("ours_no_draft", ("--no_draft",))):
                measured = _side(ours_python, str(REPO), "rate", "ours", big, args, *extra)
                rows.append(_rate_row(r, side, f"{args.draft_side}px", measured))
        draft = _side(ours_python, str(REPO), "draft", "ours", big, args)
        print(draft, flush=True)
        _write(RESULTS / f"{args.name}_draft.csv", [{"shards": f"{args.draft_side}px", **d} for d in draft])
    if args.kernels:
        shard_sets = {f"{args.short_side}px": urls, f"{args.draft_side}px": big if args.draft_side else None}
        _extras(args, ours_python, shard_sets)
    if args.threads:
        args.pool = args.threads
        threaded = _side(ours_python, str(REPO), "threads", "ours", urls, args)
        _write(RESULTS / f"{args.name}_threads.csv", [{"shards": f"{args.short_side}px", **t} for t in threaded])
    if not rows:
        return
    _write(RESULTS / f"{args.name}.csv", rows)
    summarize(rows)
    if args.skip_breakdown:
        return
    steps = _side(ours_python, str(REPO), "breakdown", "ours", urls, args)
    steps += _side(oc_python, sides["open_clip"][1], "breakdown", "open_clip", urls, args)
    _write(RESULTS / f"{args.name}_steps.csv", steps)
    plot(rows, steps, RESULTS / f"{args.name}.png", args)


def _extras(args, python: str, shard_sets: dict) -> None:
    """The decoders and resizers alone, and the new crop's fidelity, on each shard set."""
    kernel_rows, fidelity_rows = [], []
    for shards, urls in shard_sets.items():
        if urls:
            kernel_rows += [{"shards": shards, **k} for k in _side(python, str(REPO), "kernels", "ours", urls, args)]
            fidelity_rows += [{"shards": shards, **f} for f in _side(python, str(REPO), "fidelity", "ours", urls, args)]
    _write(RESULTS / f"{args.name}_kernels.csv", kernel_rows)
    _write(RESULTS / f"{args.name}_fidelity.csv", fidelity_rows)


def _rate_row(round_: int, side: str, shards: str, measured: dict) -> dict:
    row = {"round": round_, "side": side, "shards": shards, **measured}
    row["samples_per_cpu_s"] = round(measured["samples"] / measured["worker_cpu_s"], 1)
    row["samples_per_wall_s"] = round(measured["samples"] / measured["wall_s"], 1)
    print(row, flush=True)
    return row


def summarize(rows: list[dict]) -> None:
    """Each side's median samples per worker CPU-second and per wall second, and the medians over rounds of
    ours / open_clip."""
    for unit, column in (("worker CPU-second", "samples_per_cpu_s"), ("wall second", "samples_per_wall_s")):
        by: dict[tuple[str, str], dict[int, float]] = {}
        for r in rows:
            by.setdefault((r["shards"], r["side"]), {})[int(r["round"])] = float(r[column])
        for (shards, side), rates in by.items():
            print(f"{shards} {side}: {statistics.median(rates.values()):.1f} samples per {unit}")
        for side in ("ours", "ours_uint8", "ours_before", "ours_uint8_before", "hf"):
            for shards in {s for s, _ in by}:
                ours, theirs = by.get((shards, side)), by.get((shards, "open_clip"))
                if ours and theirs:
                    ratio = statistics.median(ours[r] / theirs[r] for r in ours if r in theirs)
                    print(f"{shards} {side} / open_clip per {unit}: {ratio:.2f}x (median over rounds)")


def _write(path: Path, rows: list[dict]) -> None:
    # here, not at the top: this script runs again inside open_clip's venv (the open_clip side), without the package
    from disco_clip_ds.testing.bench_record import write_rows

    path.parent.mkdir(parents=True, exist_ok=True)
    write_rows(path, rows, rounds=1)
    print("wrote", path)


SIDE_ORDER = ("ours_before", "ours_uint8_before", "ours", "ours_uint8", "open_clip")


def plot(rows: list[dict], steps: list[dict], out: Path, args) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(15, 4.5), gridspec_kw={"width_ratios": [1, 1.6]})
    order = [s for s in SIDE_ORDER if any(r["side"] == s for r in rows)]
    shards = f"{args.short_side}px"
    medians = [
        statistics.median(r["samples_per_cpu_s"] for r in rows if (r["side"], r["shards"]) == (s, shards))
        for s in order
    ]
    colours = {"ours_before": "#bbbbbb", "ours_uint8_before": "#999999", "ours": "#1f77b4", "ours_uint8": "#2ca02c"}
    colours["open_clip"] = "#ff7f0e"
    left.bar(order, medians, color=[colours[s] for s in order])
    for i, m in enumerate(medians):
        left.text(i, m, f"{m:.0f}", ha="center", va="bottom")
    left.set_ylabel("samples per CPU-second of the one DataLoader worker")
    left.set_title(f"{args.short_side} px JPEGs -> {CROP} px crops, batch {args.batch}")
    sides = [s for s in SIDE_ORDER if any(r["side"] == s for r in steps)]
    step_names = list(dict.fromkeys(r["step"] for r in steps if not r["step"].startswith("whole")))
    bottom = [0.0] * len(sides)
    cmap = plt.get_cmap("tab20")
    for k, step in enumerate(step_names):
        vals = [sum(r["us_per_sample"] for r in steps if r["side"] == s and r["step"] == step) for s in sides]
        right.barh(sides, vals, left=bottom, color=cmap(k), label=step)
        bottom = [b + v for b, v in zip(bottom, vals)]
    right.set_xlabel("CPU microseconds per sample, one thread")
    right.set_title("per-step cost")
    right.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print("wrote", out)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    tasks = ["orchestrate", "rate", "breakdown", "draft", "fidelity", "kernels", "threads"]
    p.add_argument("--task", choices=tasks, default="orchestrate")
    p.add_argument("--side", choices=list(RATES) + ["ours_no_draft"], default="ours")
    p.add_argument("--urls", nargs="*", default=[])
    p.add_argument("--data", default=str(REPO / "outputs" / "bench_input_pipeline"), help="shards are made here")
    p.add_argument("--shards", type=int, default=8)
    p.add_argument("--per_shard", type=int, default=400)
    p.add_argument("--short_side", type=int, default=256)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--batches", type=int, default=8, help="timed batches per measurement")
    p.add_argument("--warmup", type=int, default=2, help="untimed batches first")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--breakdown", type=int, default=1024, help="samples for the per-step breakdown")
    p.add_argument("--before_commit", help="also measure ours at this commit (e.g. main before the change)")
    p.add_argument("--draft_side", type=int, help="also measure draft decoding on shards this many px short side")
    p.add_argument("--no_draft", action="store_true")
    p.add_argument(
        "--parquet", help="a parquet copy of the same samples here (written once): measure our datasets path"
    )
    p.add_argument("--sides", nargs="*", help="only these sides (default: all)")
    p.add_argument("--workers", type=int, default=1, help="DataLoader workers per side (rates per CPU-second of all)")
    p.add_argument("--kernels", action="store_true", help="also time decoders and resizers alone, and the fidelity")
    p.add_argument("--threads", type=int, default=0, help="also compare a pool of this many threads with processes")
    p.add_argument("--pool", type=int, default=2, help="(the pool size of --task threads)")
    p.add_argument("--skip_breakdown", action="store_true")
    p.add_argument("--name", default="input_pipeline")
    p.add_argument("--tokenizer", help="(made by the orchestrating run: CLIP's BPE as a fast tokenizer)")
    args = p.parse_args(argv)
    if args.task == "orchestrate":
        return orchestrate(args)
    import torch

    torch.set_num_threads(1)
    task = {"rate": RATES[args.side], "breakdown": ours_breakdown, "draft": draft_difference, "fidelity": fidelity}
    task = {**task, "kernels": kernels, "threads": threads}[args.task]
    if args.task == "breakdown" and args.side == "open_clip":
        task = open_clip_breakdown
    print(json.dumps(task(args)))


if __name__ == "__main__":
    main()
