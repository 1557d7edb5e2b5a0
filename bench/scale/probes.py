"""The scale benchmark's measurements, one per process: scale_bench.py runs this file with PYTHONPATH set to the
tree it measures (the commit before, or the one after), so that `disco_clip_ds` is that tree's; each prints one JSON
line. Only interfaces both commits have are used: the CLI commands, the training stream's public classes
(ShardStream, MixtureStream, Reinforcement, EmbeddingStore), and `copies_within` of data/curate/copies.py.

    python bench/scale/probes.py imports
    python bench/scale/probes.py stream --data DIR --sidecars DIR --sources S --samples N --shuffle_buffer B
    python bench/scale/probes.py sidecars --data DIR --output DIR --tokenizer DIR
    python bench/scale/probes.py dedup --n N
    python bench/scale/probes.py cli -- data filter ...      (the command's own time, imports paid before)
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import resource
import sys
import threading
import time
from pathlib import Path

import numpy as np

MiB = 2**20


def io_counters() -> dict:
    """This process's /proc/self/io (rchar: bytes of read syscalls; read_bytes: bytes read from storage, page faults
    on mapped files included)."""
    with open("/proc/self/io") as f:
        return {k: int(v) for k, v in (line.split(": ") for line in f.read().splitlines() if line)}


def status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


class AnonPeak:
    """The peak RssAnon (private memory: what a worker's store and buffers hold, file pages aside), sampled every
    10 ms on a thread, with the last value read at the end."""

    def __init__(self):
        self.peak, self._stop = 0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.wait(0.01):
            self.peak = max(self.peak, status_kib("RssAnon"))

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, status_kib("RssAnon"))


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def emit(**values) -> None:
    import disco_clip_ds

    values["package"] = str(Path(disco_clip_ds.__file__).resolve().parents[1])
    print(json.dumps(values), flush=True)


def imports(_args) -> None:
    """A rank's interpreter with torch, transformers and deepspeed imported, and the training module."""
    import deepspeed  # noqa: F401
    import torch  # noqa: F401
    import transformers  # noqa: F401

    import disco_clip_ds.train.run  # noqa: F401

    emit(peak_rss=peak_rss_bytes())


def drop_from_page_cache(paths: list[Path]) -> None:
    """Evict the files' pages, so that read_bytes counts each page the run reads (flushed first: dirty pages stay)."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def fingerprints_of(teachers: list[str]) -> list[str]:
    """The teachers' fingerprints, where this tree computes them (data/embeddings.py, or data/teacher_id.py)."""
    try:
        from disco_clip_ds.data.teacher_id import teacher_fingerprint
    except ImportError:
        from disco_clip_ds.data.embeddings import teacher_fingerprint
    return [teacher_fingerprint(t) for t in teachers]


def make_store(folder: str, prints: list[str], urls: list[str], sources: int):
    """An EmbeddingStore as training makes one: sized by the mixture's sources where the class takes them."""
    from disco_clip_ds.data.embeddings import EmbeddingStore

    if "sources" in inspect.signature(EmbeddingStore).parameters:
        return EmbeddingStore(folder, prints, sources=sources)
    return EmbeddingStore(folder, prints)


def stream(args) -> None:
    """One DataLoader worker's work (this process is the one reader: rank 0 of 1, no workers): the training stream
    over `sources` mixed sources (uniform weights) with stored embeddings, augmentation pool and synthetic
    captions, read for `samples` samples."""
    import torch

    from disco_clip_ds.data.mix import Mixture, MixtureStream
    from disco_clip_ds.data.streams.reinforced import Reinforcement
    from disco_clip_ds.data.streams.shards import ShardStream

    sys.path.insert(0, str(Path(__file__).parent))
    from synthetic import CAPTION_KEYS, source_shards

    root = Path(args.data)
    sources = [source_shards(root, s) for s in range(args.sources)]
    urls = [u for shards in sources for u in shards]
    teachers = [str(root / "teachers" / t) for t in ("t0", "t1")]
    sidecars = sorted(Path(args.sidecars).glob("*.teacher.safetensors"))
    prints = fingerprints_of(teachers)
    store = make_store(args.sidecars, prints, urls, args.sources)
    reinforcement = Reinforcement(store, 30, True, 0.5, tuple(CAPTION_KEYS[1:]))
    options = {"seed": 0, "shuffle_buffer": args.shuffle_buffer, "reinforcement": reinforcement}
    if args.sources == 1:
        data = ShardStream(urls, args.image_size, **options)
    else:
        names = tuple(f"src{s}" for s in range(args.sources))
        mixture = Mixture(tuple(tuple(s) for s in sources), names, (1.0,) * args.sources)
        data = MixtureStream(mixture, args.image_size, **options)
    torch.set_num_threads(1)
    drop_from_page_cache(sidecars)
    before, rss_before, anon_before = io_counters(), status_kib("VmRSS") * 1024, status_kib("RssAnon") * 1024
    start = time.perf_counter()
    with AnonPeak() as anon:
        for n, _ in enumerate(data, 1):
            if n == args.samples:
                break
    seconds, after = time.perf_counter() - start, io_counters()
    emit(
        samples=args.samples,
        seconds=seconds,
        peak_rss=peak_rss_bytes(),
        rss_before=rss_before,
        anon_before=anon_before,
        peak_anon=anon.peak * 1024,
        planned=planned_worker_bytes(args, urls),
        read_bytes=after["read_bytes"] - before["read_bytes"],
        rchar=after["rchar"] - before["rchar"],
        sidecar_bytes=sum(p.stat().st_size for p in sidecars),
    )


def sidecars(args) -> None:
    """Every source shard's sidecar in this tree's format: `data embed` (this tree's) embeds the template shard, and
    each shard's sidecar copies its settings (teachers, K, captions, dtype, seed) and the crop boxes of its first
    sample (every image is 256 x 256), with random unit embeddings of DataCompDR's shapes: `data embed` itself runs
    a few samples a second here (what `data embed samples/s` measures), too slow for thousands of samples."""
    import tarfile
    from dataclasses import replace

    import torch

    from disco_clip_ds.cli import main as cli_main
    from disco_clip_ds.data.embeddings import read_reinforced, shard_facts, sidecar_path, write_reinforced

    sys.path.insert(0, str(Path(__file__).parent))
    from synthetic import CAPTION_KEYS, SOURCES, source_shards

    root, out = Path(args.data), Path(args.output)
    template_shard = root / "shards" / "template" / "00000.tar"
    teachers = [str(root / "teachers" / t) for t in ("t0", "t1")]
    argv = ["data", "embed", "--teacher", *teachers, "--shards", str(template_shard), "--output", str(out)]
    argv += ["--augmentations", "30", "--caption_keys", ",".join(CAPTION_KEYS), "--embedding_dtype", "float16"]
    if cli_main([*argv, "--tokenizer_name", args.tokenizer]) != 0:
        raise SystemExit("data embed of the template shard failed")
    template = read_reinforced(sidecar_path(out, str(template_shard)))
    g = torch.Generator().manual_seed(0)
    unit = lambda *shape: torch.nn.functional.normalize(torch.randn(*shape, generator=g), dim=-1)
    for shard in (u for s in range(SOURCES) for u in source_shards(root, s)):
        with tarfile.open(shard) as tar:
            keys = sorted({m.name.split(".", 1)[0] for m in tar.getmembers()})
        n, width = len(keys), template.images[0].shape[-1]
        stored = replace(
            template,
            keys=keys,
            images=[unit(n, 30, width) for _ in template.teachers],
            texts=[{c: unit(n, width) for c in template.caption_keys} for _ in template.teachers],
            boxes=template.boxes[:1].expand(n, -1, -1).clone(),
            meta=shard_facts(shard),
        )
        write_reinforced(sidecar_path(out, shard), stored)
    emit(sidecars=len(list(out.glob("*.teacher.safetensors"))))


def planned_worker_bytes(args, urls: list[str]) -> int | None:
    """What the planner counts for this worker (plan/host.py): the store's bound at these shards' samples, and the
    shuffle buffers (a block of raw samples per source); None where this tree has no bound."""
    try:
        from disco_clip_ds.data.embeddings import store_memory_bound, stored_row_bytes
    except ImportError:
        return None
    samples = args.shard_samples
    row = stored_row_bytes([768, 768], 30, 6, "float16")
    sample_bytes = sum(os.path.getsize(u) for u in urls) // (samples * len(urls))
    return store_memory_bound(args.sources, row, samples) + args.sources * args.shuffle_buffer * sample_bytes


def fingerprint_set(n: int, seed: int = 0) -> tuple[list[bytes], np.ndarray]:
    """`n` 64-bit fingerprints (image and mirror hash, (n, 2, 8) uint8) and 16-byte digests, as `data filter
    --dedup` makes them: random hashes, 1 % exact duplicates of an earlier sample and 2 % near copies (an earlier
    hash with 1 to 6 bits flipped)."""
    rng = np.random.default_rng(seed)
    hashes = rng.integers(0, 256, (n, 2, 8), dtype=np.uint8)
    digests = rng.integers(0, 256, (n, 16), dtype=np.uint8)  # blake2b-128, as image_fingerprint
    copies = rng.choice(np.arange(1, n), size=n // 33, replace=False)
    exact, near = copies[: n // 100], copies[n // 100 :]
    originals = (rng.random(len(copies)) * copies).astype(np.int64)
    hashes[copies] = hashes[originals]
    digests[exact] = digests[originals[: len(exact)]]
    for row, flips in zip(near, rng.integers(1, 7, len(near))):
        for bit in rng.choice(64, flips, replace=False):
            hashes[row, 0, bit // 8] ^= np.uint8(1 << (bit % 8))
    return [d.tobytes() for d in digests], hashes


def dedup(args) -> None:
    """`copies_within` (what `data filter --dedup` runs) over `n` synthetic fingerprints at the default threshold."""
    import hashlib

    from disco_clip_ds.data.curate.copies import DEFAULT_THRESHOLD, copies_within

    digests, hashes = fingerprint_set(args.n)
    start = time.perf_counter()
    dropped = copies_within(digests, hashes, DEFAULT_THRESHOLD)
    seconds = time.perf_counter() - start
    digest = hashlib.sha256(np.asarray(dropped, bool).tobytes()).hexdigest()[:16]
    emit(n=args.n, seconds=seconds, dropped=int(np.sum(dropped)), result=digest, peak_rss=peak_rss_bytes())


def cli(args) -> None:
    """A `disco-clip` command in this process, timed from after its imports (the interpreter's start aside)."""
    import torch  # noqa: F401
    import transformers  # noqa: F401

    from disco_clip_ds.cli import main

    start = time.perf_counter()
    code = main(args.argv)
    emit(code=code, seconds=time.perf_counter() - start, peak_rss=peak_rss_bytes())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="probe", required=True)
    sub.add_parser("imports")
    s = sub.add_parser("stream")
    s.add_argument("--data", required=True)
    s.add_argument("--sidecars", required=True)
    s.add_argument("--sources", type=int, required=True)
    s.add_argument("--samples", type=int, required=True)
    s.add_argument("--shuffle_buffer", type=int, required=True)
    s.add_argument("--image_size", type=int, default=64)
    s.add_argument("--shard_samples", type=int, required=True)
    d = sub.add_parser("dedup")
    d.add_argument("--n", type=int, required=True)
    w = sub.add_parser("sidecars")
    w.add_argument("--data", required=True)
    w.add_argument("--output", required=True)
    w.add_argument("--tokenizer", required=True)
    c = sub.add_parser("cli")
    c.add_argument("argv", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    if args.probe == "cli" and args.argv[:1] == ["--"]:
        args.argv = args.argv[1:]
    {"imports": imports, "stream": stream, "sidecars": sidecars, "dedup": dedup, "cli": cli}[args.probe](args)


if __name__ == "__main__":
    main()
