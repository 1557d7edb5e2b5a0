"""Input pipeline speed per DataLoader worker: ours (ShardStream + ClipCollator) against open_clip 3.3.0's own
webdataset pipeline, on the same LAION-like shards, and what each step costs per sample.

Data, made here without a network: webdataset tars as img2dataset writes them (key.jpg / key.txt / key.json per
sample, 00000.tar ...), JPEGs resized to --short_side px on the short side (aspect ratios 3:4 to 16:9) at quality 95
(img2dataset's default), cut from the three photographs bundled with scikit-learn and matplotlib (random crops and
flips, so JPEG decode sees photographic texture, not flat colour), alt-text-like captions of about 40 CLIP tokens.

Speed: each side runs in its own process with one DataLoader worker (OMP_NUM_THREADS=1, torch threads 1), batch
--batch, 224 px training crops, 77-token captions; after --warmup batches (open_clip fills its 1,000-sample shuffle
buffer first) it times --batches batches. The rate is samples per CPU-second of that worker process (user + system,
from /proc): on a shared machine that is what a worker with a core of its own delivers, where wall-clock rates
(also written) swing with the load. The main process only waits on the worker. Sides interleave over --rounds;
the table takes each side's median, and the ratio's median over rounds.
- ours: disco_clip_ds.data.streams.shards.ShardStream + ClipCollator as train.py builds them on CPU ranks (the worker
  normalises the batch), with CLIP's own BPE as a fast transformers tokenizer (made offline from open_clip's
  vocabulary file; the same tokens as open_clip's); `ours_before` runs the same code of --before_commit (checked
  out with `git archive`).
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

    .venv/bin/python bench/data/input_pipeline.py --rounds 5 --before_commit aef1fb6 --draft_side 512
"""

from __future__ import annotations

import argparse
import csv
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
    """Samples, wall seconds and the DataLoader worker's CPU seconds over `batches` batches after `warmup`. On a
    shared machine the worker's CPU seconds are what a core of its own would take; wall time also counts the
    time it waited for a core."""
    import multiprocessing

    it = iter(loader)
    for _ in range(warmup):
        next(it)
    (worker,) = multiprocessing.active_children()  # the one DataLoader worker
    cpu, start = _cpu_seconds(worker.pid), time.perf_counter()
    for _ in range(batches):
        next(it)
    wall, cpu = time.perf_counter() - start, _cpu_seconds(worker.pid) - cpu
    return {"samples": batches * batch, "wall_s": round(wall, 3), "worker_cpu_s": round(cpu, 3)}


def ours_rate(args) -> dict:
    import torch
    from transformers import AutoTokenizer

    from disco_clip_ds.data.collate import ClipCollator
    from disco_clip_ds.data.streams.shards import ShardStream

    stream = ShardStream(args.urls, CROP, seed=0, shuffle_buffer=1000, num_workers=1)
    if args.no_draft:
        stream.transform.draft = False
    uint8 = {"normalize": False} if args.side == "ours_uint8" else {}  # (ours_before's collator has no such argument)
    collate = ClipCollator(AutoTokenizer.from_pretrained(args.tokenizer), CONTEXT, **uint8)
    loader = torch.utils.data.DataLoader(stream, batch_size=args.batch, num_workers=1, collate_fn=collate)
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
    stream = HFStream(load_training_dataset(data_args, 1), CROP, seed=0, shuffle_buffer=1000, num_workers=1)
    collate = ClipCollator(AutoTokenizer.from_pretrained(args.tokenizer), CONTEXT)
    loader = torch.utils.data.DataLoader(stream, batch_size=args.batch, num_workers=1, collate_fn=collate)
    return _timed(loader, args.warmup, args.batches, args.batch)


RATES = {
    "ours": ours_rate,
    "ours_uint8": ours_rate,
    "ours_before": ours_rate,
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


def ours_breakdown(args) -> list[dict]:
    """Ours now (uint8 crops, normalised straight into a shared-memory batch), ours_uint8 (the uint8 crops stacked
    into a shared-memory uint8 batch, normalised later on the device) and before (a float32 tensor per sample,
    stacked, then copied into shared memory when the DataLoader hands the batch over), step by step."""
    import numpy as np
    import torch
    from PIL import Image
    from transformers import AutoTokenizer

    from disco_clip_ds.data.collate import batch_tensor
    from disco_clip_ds.data.transforms import ImageTransform, random_resized_crop_box, to_rgb

    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    normalize = ImageTransform(CROP).normalize
    mean, std = normalize.mean, normalize.std
    now, stack, before = Steps(), Steps(), Steps()
    start = time.process_time()
    raw = _raw(args.urls, args.breakdown)
    now.total["read"] = time.process_time() - start
    for b in range(0, len(raw), args.batch):
        crops, floats, captions = [], [], []
        for sample in raw[b : b + args.batch]:
            rng = random.Random(f"0/0/{sample['__key__']}")
            captions.append(now.time("caption", lambda s: s["txt"].decode("utf-8").strip(), sample))
            image = now.time("decode", lambda d: Image.open(io.BytesIO(d)), sample["jpg"])
            now.time("decode", image.load)
            image = to_rgb(image)
            box = now.time(AUGMENT, random_resized_crop_box, *image.size, rng)
            crop = now.time(AUGMENT, image.resize, (CROP, CROP), Image.BICUBIC, box)
            crops.append(now.time("to uint8 tensor", lambda c: torch.from_numpy(np.array(c)).permute(2, 0, 1), crop))
            floats.append(
                before.time(
                    "to float tensor + normalise (per sample)",
                    lambda c: (torch.from_numpy(np.asarray(c, dtype=np.float32) / 255.0).permute(2, 0, 1) - mean) / std,
                    crop,
                )
            )
        kw = dict(padding="max_length", truncation=True, max_length=CONTEXT, return_tensors="pt")
        now.time("tokenize (batched, fast)", lambda: tokenizer(captions, **kw))
        shape = (len(crops), 3, CROP, CROP)
        now.time(
            "normalise into the shared-memory batch", lambda: normalize(crops, batch_tensor(shape, torch.float32, True))
        )
        stack.time(
            "stack into the shared-memory uint8 batch",
            lambda: torch.stack(crops, out=batch_tensor(shape, torch.uint8, True)),
        )
        stacked = before.time("collate (stack)", torch.stack, floats)
        before.time(SHARE, stacked.share_memory_)
    for step in ("read", "caption", "decode", AUGMENT, "tokenize (batched, fast)"):
        before.total[step] = now.total[step]
    uint8 = Steps()  # the same steps as ours, with the uint8 stack in place of the normalisation
    uint8.total = {**{k: v for k, v in now.total.items() if not k.startswith("normalise")}, **stack.total}
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
    rows = now.rows("ours", len(raw)) + uint8.rows("ours_uint8", len(raw)) + before.rows("ours_before", len(raw))
    return rows + whole.rows("ours", len(raw))


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


# ---------------------------------------------------------------- orchestration (project venv)


def _env(pythonpath: str) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    env.update(PYTHONPATH=pythonpath, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", NO_ALBUMENTATIONS_UPDATE="1")
    return env


def _side(python: str, pythonpath: str, task: str, side: str, urls: list[str], args, *extra: str):
    cmd = [python, __file__, "--task", task, "--side", side, "--urls", *urls]
    cmd += ["--batch", str(args.batch), "--batches", str(args.batches), "--warmup", str(args.warmup)]
    cmd += ["--breakdown", str(args.breakdown), "--tokenizer", args.tokenizer, *extra]
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
        sides = {"ours_before": (ours_python, _before_tree(args.before_commit, root)), **sides}
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
    _write(RESULTS / f"{args.name}.csv", rows)
    summarize(rows)
    if args.skip_breakdown:
        return
    steps = _side(ours_python, str(REPO), "breakdown", "ours", urls, args)
    steps += _side(oc_python, sides["open_clip"][1], "breakdown", "open_clip", urls, args)
    _write(RESULTS / f"{args.name}_steps.csv", steps)
    plot(rows, steps, RESULTS / f"{args.name}.png", args)


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
        for side in ("ours", "ours_uint8", "ours_before", "hf"):
            for shards in {s for s, _ in by}:
                ours, theirs = by.get((shards, side)), by.get((shards, "open_clip"))
                if ours and theirs:
                    ratio = statistics.median(ours[r] / theirs[r] for r in ours if r in theirs)
                    print(f"{shards} {side} / open_clip per {unit}: {ratio:.2f}x (median over rounds)")


def _write(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    print("wrote", path)


def plot(rows: list[dict], steps: list[dict], out: Path, args) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(15, 4.5), gridspec_kw={"width_ratios": [1, 1.6]})
    order = [s for s in ("ours_before", "ours", "ours_uint8", "open_clip") if any(r["side"] == s for r in rows)]
    shards = f"{args.short_side}px"
    medians = [
        statistics.median(r["samples_per_cpu_s"] for r in rows if (r["side"], r["shards"]) == (s, shards))
        for s in order
    ]
    colours = {"ours_before": "#bbbbbb", "ours": "#1f77b4", "ours_uint8": "#2ca02c", "open_clip": "#ff7f0e"}
    left.bar(order, medians, color=[colours[s] for s in order])
    for i, m in enumerate(medians):
        left.text(i, m, f"{m:.0f}", ha="center", va="bottom")
    left.set_ylabel("samples per CPU-second of the one DataLoader worker")
    left.set_title(f"{args.short_side} px JPEGs -> {CROP} px crops, batch {args.batch}")
    sides = [s for s in ("ours_before", "ours", "ours_uint8", "open_clip") if any(r["side"] == s for r in steps)]
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
    p.add_argument("--task", choices=["orchestrate", "rate", "breakdown", "draft"], default="orchestrate")
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
    p.add_argument("--skip_breakdown", action="store_true")
    p.add_argument("--name", default="input_pipeline")
    p.add_argument("--tokenizer", help="(made by the orchestrating run: CLIP's BPE as a fast tokenizer)")
    args = p.parse_args(argv)
    if args.task == "orchestrate":
        return orchestrate(args)
    import torch

    torch.set_num_threads(1)
    task = {"rate": RATES[args.side], "breakdown": ours_breakdown, "draft": draft_difference}[args.task]
    if args.task == "breakdown" and args.side == "open_clip":
        task = open_clip_breakdown
    print(json.dumps(task(args)))


if __name__ == "__main__":
    main()
