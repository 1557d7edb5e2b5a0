"""The embedded demo dataset: scikit-learn's 1,797 handwritten digits, captioned, served on loopback.

Offline and deterministic. Train shards go through exactly the LAION download path of `prep.download`
(parquet metadata with URL/TEXT columns -> img2dataset -> webdataset shards); the held-out eval split is
encoded with img2dataset's own Resizer (same size, same JPEG encoder) and written with webdataset's
TarWriter in the CLIP_benchmark layout.

    DIR/metadata/train.parquet      the URL list the download reads
    DIR/train/NNNNN.tar             key.jpg, key.txt (caption), key.json (img2dataset meta + label),
                                    key.syn0.txt, key.syn1.txt (synthetic captions, see below)
    DIR/train/sizes.json, summary.json
    DIR/eval/NNNNN.tar              key.jpg, key.txt (caption, for retrieval), key.cls (label), key.json
    DIR/eval/sizes.json, classnames.txt, zeroshot_classification_templates.txt
    DIR/suite/tasks.yml             three tasks for `disco-clip eval --tasks`, each set in CLIP_benchmark's wds layout
    DIR/suite/digits_zeroshot/      classnames.txt, zeroshot_classification_templates.txt, test/{nshards.txt,0.tar..}
    DIR/suite/digits_retrieval/     dataset_type.txt (retrieval), test/: key.jpg + key.txt (three captions per image)
    DIR/suite/digits_probe/         classnames.txt, train/ (the training split) and test/: key.jpg + key.cls

`--format hf` writes the same samples (same JPEG bytes, captions, labels, split and shard membership) as a
🤗 datasets parquet dataset, each file the rows of the shard of the same number, in source order:

    DIR/train/train-0000K-of-0000N.parquet   image (Image), caption, label (ClassLabel), source_index
    DIR/eval/test-0000K-of-0000M.parquet     the same columns; split "test" (datasets' name for eval files)
    DIR/eval/zeroshot_classification_templates.txt

`datasets.load_dataset("DIR/train")` or `load_dataset("parquet", data_dir="DIR/eval")` read them.

`--caption_noise P` captions a fraction P of the training samples as another digit (`mislabel`), for the
distillation demo; the eval split is the same as without it.

Every training sample of the shards also carries synthetic captions, extra members as DataCompDR ships a captioner's
captions beside the alt-text: `key.syn0.txt` and `key.syn1.txt`, each in a template of its own (`SYNTHETIC_TEMPLATES`,
none of the real captions' templates) and always naming the image's own digit, as a good captioner would, whatever
`--caption_noise` did to `key.txt`. Training reads `key.txt` unless told to draw synthetic captions.
"""

from __future__ import annotations

import contextlib
import copy
import io
import json
import math
import threading
import urllib.parse
import warnings
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np

from disco_clip_ds.atomic import staged
from disco_clip_ds.data.prep import download as prep
from disco_clip_ds.data.prep.fetch import environ
from disco_clip_ds.data.prep.outputs import canonicalize_tar, shard_name
from disco_clip_ds.data.shards import write_json
from disco_clip_ds.errors import DataError, UsageError

DIGITS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]  # class names in label order
CAPTION_TEMPLATES = [
    "a photo of the number {word}.",
    "handwritten digit {digit}",
    "the digit {word}, written by hand",
    "a scan of a handwritten {word}",
    "a small grey picture of the digit {digit}",
    "the number {digit}, drawn by hand",
    "a blurry handwritten {word}",
    "a low resolution image of a handwritten {digit}",
]
# The synthetic captions' templates, one per member (`syn0`, `syn1`): a captioner's wording, apart from the real
# captions' templates so that a run can tell which kind of caption it learnt from.
SYNTHETIC_TEMPLATES = [
    "a handwritten digit {digit}",
    "a black and white picture of the digit {word}",
]
ZEROSHOT_TEMPLATES = [
    "a photo of the number {c}.",
    "handwritten digit {c}",
    "the digit {c}, written by hand",
    "a scan of a handwritten {c}",
    "a blurry handwritten {c}",
]
# URLs name a fixed host, reached through the loopback server acting as an HTTP proxy: every sample's
# json records its URL, and a URL with the server's ephemeral port in it would make each run differ.
# The .invalid TLD never resolves (RFC 2606), so nothing can leave the machine by mistake.
DEMO_HOST = "digits.invalid"


def digit_images(size: int) -> tuple[list[bytes], np.ndarray]:
    """sklearn's digits (8x8, 17 grey levels) as `size` px RGB PNGs; returns (png bytes, labels)."""
    from PIL import Image
    from sklearn.datasets import load_digits

    digits = load_digits()
    pixels = np.rint(digits.images * (255 / 16)).astype(np.uint8)
    pngs = []
    for img in pixels:
        buf = io.BytesIO()
        Image.fromarray(img).resize((size, size), Image.Resampling.BILINEAR).convert("RGB").save(buf, "PNG")
        pngs.append(buf.getvalue())
    return pngs, digits.target.astype(int)


def captions_for(labels: np.ndarray, seed: int) -> list[str]:
    rng = np.random.default_rng(seed)
    picks = rng.integers(len(CAPTION_TEMPLATES), size=len(labels))
    return [CAPTION_TEMPLATES[t].format(word=DIGITS[y], digit=y) for t, y in zip(picks, labels)]


def noisy_count(fraction: float, train_samples: int) -> int:
    """How many of `train_samples` training captions `mislabel` makes name another digit."""
    return round(fraction * train_samples)


def mislabel(captions: list[str], labels: np.ndarray, indices: np.ndarray, fraction: float, seed: int) -> list[str]:
    """`captions` with a seeded `fraction` of the samples `indices` (the training split) captioned as another digit,
    in a template of their own: web alt-text often fails to describe its image, and a teacher that has learnt past
    such pairs is what distillation brings a student (docs/distillation.md). The labels stay the images' own."""
    rng = np.random.default_rng([seed, 1])  # apart from the templates' and the split's draws
    chosen = rng.choice(indices, size=noisy_count(fraction, len(indices)), replace=False)
    shifts, templates = rng.integers(1, 10, size=len(chosen)), rng.integers(len(CAPTION_TEMPLATES), size=len(chosen))
    noisy = list(captions)
    for i, shift, template in zip(chosen, shifts, templates):
        wrong = (int(labels[i]) + int(shift)) % 10
        noisy[i] = CAPTION_TEMPLATES[template].format(word=DIGITS[wrong], digit=wrong)
    return noisy


def synthetic_captions(label: int) -> dict[str, str]:
    """A sample's synthetic captions by member extension (`syn0.txt`, ...), each naming its true digit."""
    words = {"word": DIGITS[label], "digit": label}
    return {f"syn{k}.txt": template.format(**words) for k, template in enumerate(SYNTHETIC_TEMPLATES)}


def add_synthetic_captions(tar_path: Path) -> None:
    """Add `synthetic_captions` of its label (from key.json) to every sample of a finished training shard, each as an
    extra member of its sample; the members end sorted with the fixed mtime (`canonicalize_tar`), the shard written
    whole through a temporary file. A shard that already has them is left untouched (a resumed build)."""
    import tarfile

    with tarfile.open(tar_path) as tar:
        members = [(m, tar.extractfile(m).read()) for m in tar.getmembers() if m.isreg()]
    names = {m.name for m, _ in members}
    extra = []
    for member, data in members:
        key, _, ext = member.name.partition(".")
        if ext != "json":
            continue
        for syn, caption in synthetic_captions(int(json.loads(data)["label"])).items():
            if f"{key}.{syn}" not in names:
                extra.append((f"{key}.{syn}", caption.encode()))
    if not extra:
        return
    with staged(tar_path) as tmp:
        with tarfile.open(tmp, "w", format=tarfile.USTAR_FORMAT) as out:
            for member, data in members:
                out.addfile(member, io.BytesIO(data))
            for name, data in extra:
                info = copy.copy(members[0][0])  # the download's owner, mode and mtime, so that the shard stays uniform
                info.name, info.size = name, len(data)
                out.addfile(info, io.BytesIO(data))
        canonicalize_tar(tmp)


def split_indices(labels: np.ndarray, eval_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """A stratified, seeded train/eval split of sample indices (each part in ascending order)."""
    from sklearn.model_selection import train_test_split

    train, held = train_test_split(np.arange(len(labels)), test_size=eval_fraction, random_state=seed, stratify=labels)
    return np.sort(train), np.sort(held)


class _ImageProxyHandler(BaseHTTPRequestHandler):
    """Serves the in-memory images by URL path; proxy requests carry the absolute URL, both work."""

    def do_GET(self):
        body = self.server.files.get(urllib.parse.urlsplit(self.path).path)
        if body is None:
            self.send_error(404)
            return
        self.send_response(200)
        self.send_header("Content-Type", "image/png")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):  # one line per image would drown the download's own progress
        pass


class _ImageServer(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 256  # http.server's default backlog of 5 drops connections under 16+ threads


@contextlib.contextmanager
def serve_through_proxy(files: dict[str, bytes]):
    """Serve `files` ({url path: bytes}) on 127.0.0.1 as the HTTP proxy for http://DEMO_HOST/.

    Sets http_proxy for this process and the download workers it spawns, restores it on exit.
    """
    server = _ImageServer(("127.0.0.1", 0), _ImageProxyHandler)
    server.files = files
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    proxy, loopback = f"http://127.0.0.1:{server.server_address[1]}", "127.0.0.1,localhost"
    try:
        with environ(http_proxy=proxy, HTTP_PROXY=proxy, no_proxy=loopback, NO_PROXY=loopback):
            yield
    finally:
        server.shutdown()
        server.server_close()


def write_train_metadata(path: Path, indices, labels, captions) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path.parent.mkdir(parents=True, exist_ok=True)
    table = pa.table(
        {
            "URL": [f"http://{DEMO_HOST}/digits/{i:04d}.png" for i in indices],
            "TEXT": [captions[i] for i in indices],
            "label": [int(labels[i]) for i in indices],
            "source_index": [int(i) for i in indices],
        }
    )
    pq.write_table(table, path)


def jpeg_encoder(image_size: int):
    """PNG bytes -> JPEG bytes with img2dataset's own Resizer, set as the demo's download sets it."""
    from img2dataset.resizer import Resizer

    resizer = Resizer(image_size=image_size, resize_mode="border", resize_only_if_bigger=False)

    def encode(png: bytes) -> bytes:
        with warnings.catch_warnings():  # albumentations deprecations inside img2dataset, per image
            warnings.simplefilter("ignore", DeprecationWarning)
            jpg, *_, err = resizer(io.BytesIO(png))
        if err is not None:
            raise RuntimeError(f"img2dataset's resizer failed: {err}")
        return jpg

    return encode


def write_eval_shards(folder: Path, indices, pngs, labels, captions, image_size: int, per_shard: int) -> dict:
    """CLIP_benchmark-style eval shards, images encoded as the download path does; returns sizes."""
    import webdataset as wds

    encode = jpeg_encoder(image_size)
    folder.mkdir(parents=True, exist_ok=True)
    sizes = {}
    key_digits = max(1, math.ceil(math.log10(per_shard)))  # img2dataset's key layout: shard id, then position
    for shard, start in enumerate(range(0, len(indices), per_shard)):
        name = f"{shard_name(shard)}.tar"
        chunk = indices[start : start + per_shard]
        with staged(folder / name) as tmp, wds.TarWriter(str(tmp), mtime=0) as sink:
            for pos, i in enumerate(chunk):
                label = int(labels[i])
                sink.write(
                    {
                        "__key__": f"{shard_name(shard)}{pos:0{key_digits}d}",
                        "jpg": encode(pngs[i]),
                        "txt": captions[i],
                        "cls": label,
                        "json": {"label": label, "source_index": int(i)},
                    }
                )
        sizes[name] = len(chunk)
    (folder / "classnames.txt").write_text("\n".join(DIGITS) + "\n")
    write_templates(folder)
    write_json(folder / "sizes.json", sizes)
    return sizes


def write_templates(folder: Path) -> None:
    (folder / "zeroshot_classification_templates.txt").write_text("\n".join(ZEROSHOT_TEMPLATES) + "\n")


def write_parquet_split(folder: Path, split: str, indices, jpgs: dict, labels, captions, per_shard: int) -> list[int]:
    """`indices`' samples as `split-0000K-of-0000N.parquet` files of `per_shard` rows (the shards' membership), an
    Image column holding the JPEG bytes; each file written whole or not at all. Returns the rows per file."""
    from datasets import ClassLabel, Dataset, Features, Image, Value
    from datasets.utils.logging import disable_progress_bar, enable_progress_bar, is_progress_bar_enabled

    features = Features(
        {
            "image": Image(),
            "caption": Value("string"),
            "label": ClassLabel(names=DIGITS),
            "source_index": Value("int32"),
        }
    )
    folder.mkdir(parents=True, exist_ok=True)
    shown = is_progress_bar_enabled()
    disable_progress_bar()  # a bar per file, each of one batch: noise
    starts = range(0, len(indices), per_shard)
    for shard, start in enumerate(starts):
        chunk = [int(i) for i in indices[start : start + per_shard]]
        rows = {
            "image": [{"bytes": jpgs[i], "path": None} for i in chunk],
            "caption": [captions[i] for i in chunk],
            "label": [int(labels[i]) for i in chunk],
            "source_index": chunk,
        }
        path = folder / f"{split}-{shard:05d}-of-{len(starts):05d}.parquet"
        with staged(path) as tmp:
            Dataset.from_dict(rows, features=features).to_parquet(str(tmp))
    if shown:
        enable_progress_bar()
    return [len(indices[start : start + per_shard]) for start in starts]


def demo_samples(image_size: int, eval_fraction: float, seed: int, caption_noise: float):
    """Both builds' samples: (PNG images, labels, captions, train indices, eval indices), the training captions
    noised by `caption_noise` (`mislabel`)."""
    pngs, labels = digit_images(image_size)
    captions = captions_for(labels, seed)
    train_idx, eval_idx = split_indices(labels, eval_fraction, seed)
    return pngs, labels, mislabel(captions, labels, train_idx, caption_noise, seed), train_idx, eval_idx


def build_hf_demo(
    output: Path,
    image_size: int = 64,
    samples_per_shard: int = 180,
    eval_fraction: float = 0.2,
    seed: int = 0,
    caption_noise: float = 0.0,
) -> tuple[list[int], list[int]]:
    """The demo as a datasets parquet dataset under `output` (see the module docstring); returns the rows per
    file of train and eval. No download: the images are encoded as the download encodes them, and the split and
    files hold the samples of the shards demo built with the same arguments."""
    pngs, labels, captions, train_idx, eval_idx = demo_samples(image_size, eval_fraction, seed, caption_noise)
    encode = jpeg_encoder(image_size)
    jpgs = {int(i): encode(pngs[i]) for i in range(len(pngs))}
    train = write_parquet_split(output / "train", "train", train_idx, jpgs, labels, captions, samples_per_shard)
    evl = write_parquet_split(output / "eval", "test", eval_idx, jpgs, labels, captions, samples_per_shard)
    write_templates(output / "eval")  # last: the quickstart takes it as the sign of a finished build
    return train, evl


def build_demo(
    output: Path,
    image_size: int = 64,
    samples_per_shard: int = 180,
    eval_fraction: float = 0.2,
    processes: int = 2,
    threads: int = 16,
    seed: int = 0,
    caption_noise: float = 0.0,
) -> tuple[dict, dict]:
    """Build the demo dataset under `output`; return (train download summary, eval sizes). `caption_noise`: the
    fraction of training samples captioned as another digit (`mislabel`); the eval split's captions stay true."""
    pngs, labels, captions, train_idx, eval_idx = demo_samples(image_size, eval_fraction, seed, caption_noise)
    write_train_metadata(output / "metadata" / "train.parquet", train_idx, labels, captions)
    files = {f"/digits/{i:04d}.png": png for i, png in enumerate(pngs)}
    cfg = prep.DownloadConfig(
        url_list=str(output / "metadata" / "train.parquet"),
        output=str(output / "train"),
        preset="laion400m",
        save_additional_columns=["label", "source_index"],
        image_size=image_size,
        resize_mode="border",
        processes=processes,
        threads=threads,
        samples_per_shard=samples_per_shard,
        timeout=10,
        max_download_seconds=30,
    )
    with serve_through_proxy(files):
        summary = prep.download(cfg)
    if summary["successes"] != len(train_idx) or summary["shards_failed"]:
        raise DataError(f"demo download incomplete ({summary}); see {output / 'train' / 'summary.json'}")
    for tar in sorted((output / "train").glob("[0-9][0-9][0-9][0-9][0-9].tar")):
        add_synthetic_captions(tar)
    eval_sizes = write_eval_shards(output / "eval", eval_idx, pngs, labels, captions, image_size, samples_per_shard)
    write_suite_tasks(output / "suite", pngs, labels, train_idx, eval_idx, image_size, samples_per_shard, seed)
    return summary, eval_sizes


SUITE_TASKS = """\
# Three demo tasks in DataComp's tasklist.yml form over sets in CLIP_benchmark's wds layout:
#   disco-clip eval --model MODEL --tasks THIS_FILE --output OUT
digits_zeroshot:
  name: Digits zero-shot
  type: zeroshot_classification
  main_metric: acc1
  path: digits_zeroshot
  train: true
digits_retrieval:
  name: Digits retrieval
  type: zeroshot_retrieval
  main_metric: mean_recall@1
  path: digits_retrieval
  train: true
digits_probe:
  name: Digits linear probe
  type: linear_probe
  main_metric: acc1
  path: digits_probe
  val_proportion: 0.2
"""
CAPTIONS_PER_IMAGE = 3  # retrieval: several captions per image, as COCO's and Flickr's sets have


def write_suite_tasks(folder: Path, pngs, labels, train_idx, eval_idx, image_size: int, per_shard: int, seed: int):
    """The demo's three suite tasks (module docstring): zero-shot classification and retrieval of the eval split,
    a linear probe trained on the training split and tested on the eval split; tasks.yml written last."""
    encode = jpeg_encoder(image_size)
    jpgs = {int(i): encode(pngs[i]) for i in np.concatenate([train_idx, eval_idx])}
    classes = {int(i): str(int(labels[i])) for i in jpgs}
    rng = np.random.default_rng([seed, 2])  # apart from the other draws of the demo
    several = {
        int(i): "\n".join(
            CAPTION_TEMPLATES[t].format(word=DIGITS[labels[i]], digit=labels[i])
            for t in rng.choice(len(CAPTION_TEMPLATES), CAPTIONS_PER_IMAGE, replace=False)
        )
        for i in eval_idx
    }
    for name in ("digits_zeroshot", "digits_probe"):
        (folder / name).mkdir(parents=True, exist_ok=True)
        (folder / name / "classnames.txt").write_text("\n".join(DIGITS) + "\n")
        write_templates(folder / name)
    write_wds_split(folder / "digits_zeroshot" / "test", eval_idx, jpgs, "cls", classes, per_shard)
    write_wds_split(folder / "digits_probe" / "train", train_idx, jpgs, "cls", classes, per_shard)
    write_wds_split(folder / "digits_probe" / "test", eval_idx, jpgs, "cls", classes, per_shard)
    write_wds_split(folder / "digits_retrieval" / "test", eval_idx, jpgs, "txt", several, per_shard)
    (folder / "digits_retrieval" / "dataset_type.txt").write_text("retrieval\n")
    (folder / "tasks.yml").write_text(SUITE_TASKS)


def write_wds_split(folder: Path, indices, jpgs: dict, field: str, values: dict, per_shard: int) -> None:
    """A split in CLIP_benchmark's wds layout: `0.tar`, `1.tar`, ... of `per_shard` samples (key.jpg and key.`field`)
    and `nshards.txt`, each shard written whole or not at all."""
    import webdataset as wds

    folder.mkdir(parents=True, exist_ok=True)
    starts = range(0, len(indices), per_shard)
    for shard, start in enumerate(starts):
        with staged(folder / f"{shard}.tar") as tmp, wds.TarWriter(str(tmp), mtime=0) as sink:
            for i in indices[start : start + per_shard]:
                sink.write({"__key__": f"s{int(i):05d}", "jpg": jpgs[int(i)], field: values[int(i)]})
    (folder / "nshards.txt").write_text(f"{len(starts)}\n")


DEMO_ENTRIES = {"metadata", "train", "eval", "suite"}


FORMAT_FILES = {"shards": "*.tar", "hf": "*-of-*.parquet"}  # img2dataset writes NNNNN.parquet beside its tars


def check_output_folder(output: Path, fmt: str = "shards") -> None:
    """Refuse an --output that is a file, a non-empty folder of something else, or a demo build in the other
    format: the build writes and repairs files in place, so it may only resume its own earlier output."""
    if output.exists() and not output.is_dir():
        raise UsageError(f"--output {output} is a file: give a folder (new, empty, or an earlier demo build)")
    if output.is_dir():
        foreign = sorted(entry.name for entry in output.iterdir() if entry.name not in DEMO_ENTRIES)
        if foreign:
            raise UsageError(
                f"--output {output} holds {', '.join(foreign[:3])}, which is not a demo build: "
                "give a new or empty folder"
            )
        for other, pattern in FORMAT_FILES.items():
            if other != fmt and any(next((output / split).glob(pattern), None) for split in ("train", "eval")):
                raise UsageError(f"--output {output} holds a --format {other} demo: give another folder for {fmt}")
