"""What a reinforced set costs: bytes per sample of the sidecars `disco-clip data embed` writes, against the
planner's count (`disco_clip_ds.plan.storage_plan`), and embed throughput (samples/s per process), for K = 1, 4, 8
augmentations x T = 1, 2 teachers; and what a 1B-sample DataCompDR-style set takes.

The data: the demo's first two training shards (360 samples, `disco-clip data demo`, built into data/demo when
missing), each sample with three captions (`txt`, the demo's synthetic `syn0.txt` and `syn1.txt`: C = 3), stored in
float16 as MobileCLIP's DataCompDR stores them. The teachers: the quickstart's CLIP (`recipes/models/tiny.json`,
random weights: the bytes and the cost do not depend on them; the second drawn from another seed), saved with the
demo's tokenizer. One process, 1 thread, `embed_shards` in-process (the `data embed` command without its start-up):
the time covers loading the teachers (milliseconds for these), decoding, the K crops, the teachers' forwards and
writing the sidecars. Settings run in turn (reversed every other round) for --rounds rounds, each round into a fresh
folder; the bytes are the sidecars' file sizes (headers included) over the samples.

The 1B-sample row is the planner's count for K = 10 augmentations, T = 2 teachers of width 768 (DataCompDR's two
ViT-L/14 teachers), C = 6 captions (the real one and 5 synthetic), float16, 9-character keys.

    python bench/data/reinforced_storage.py --rounds 3     # writes results/reinforced_storage.csv
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from pathlib import Path

from disco_clip_ds.testing.bench_record import bench_row, write_rows
from disco_clip_ds.testing.launch import REPO, TINY_CONFIG, TOKENIZER_DIR

HERE = Path(__file__).resolve().parent
DEMO = REPO / "data" / "demo"
CAPTION_KEYS = ["txt", "syn0.txt", "syn1.txt"]
SETTINGS = [(k, t) for t in (1, 2) for k in (1, 4, 8)]  # (K, T)
DATACOMPDR = {"samples": 10**9, "augmentations": 10, "teacher_dims": [768, 768], "caption_keys": 6}


def teachers(folder: Path) -> list[str]:
    """Two tiny CLIP teachers (random weights, seeds 0 and 1) saved with the demo's tokenizer."""
    from transformers import AutoTokenizer

    from disco_clip_ds.models.build import build_model

    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER_DIR)
    names = []
    for seed in (0, 1):
        out = folder / f"teacher_{seed}"
        build_model(model_config=str(TINY_CONFIG), seed=seed).save_pretrained(out)
        tokenizer.save_pretrained(out)
        names.append(str(out))
    return names


def embed_once(names: list[str], shards: list[str], out: Path, k: int, dtype: str) -> float:
    """Seconds to embed `shards` into OUT with the teachers `names`."""
    from disco_clip_ds.data.prep.embed import Settings, embed_shards

    settings = Settings(names, augmentations=k, caption_keys=CAPTION_KEYS, dtype=dtype)
    shutil.rmtree(out, ignore_errors=True)
    start = time.perf_counter()
    summary = embed_shards(names, shards, str(out), settings=settings)
    seconds = time.perf_counter() - start
    if summary["skipped"] or len(summary["embedded"]) != len(shards):
        raise RuntimeError(f"embedding was incomplete: {summary}")
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--shards", type=int, default=2, help="the demo's first N training shards (180 samples each)")
    parser.add_argument("--dtype", default="float16")
    parser.add_argument("--results", type=Path, default=HERE / "results" / "reinforced_storage.csv")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch

    from disco_clip_ds.data.prep.demo import build_demo
    from disco_clip_ds.plan import storage_plan

    torch.set_num_threads(1)
    if not (DEMO / "train" / "sizes.json").is_file():
        build_demo(DEMO)
    shards = [str(DEMO / "train" / f"{i:05d}.tar") for i in range(args.shards)]
    from disco_clip_ds.data.streams.tar_samples import raw_samples

    samples = sum(1 for shard in shards for _ in raw_samples(shard, read=False))
    with tempfile.TemporaryDirectory(prefix="reinforced_storage_") as tmp:
        names = teachers(Path(tmp))
        seconds = {setting: [] for setting in SETTINGS}
        sizes = {}
        for round_ in range(args.rounds + 1):  # round 0 warms up
            for k, t in SETTINGS if round_ % 2 else SETTINGS[::-1]:
                out = Path(tmp) / f"k{k}_t{t}"
                took = embed_once(names[:t], shards, out, k, args.dtype)
                if round_:
                    seconds[(k, t)].append(took)
                sizes[(k, t)] = sum(p.stat().st_size for p in out.glob("*.safetensors"))
    rows = []
    dims = [64]  # the tiny teachers' projection width
    for k, t in SETTINGS:
        plan = storage_plan(samples, k, dims * t, len(CAPTION_KEYS), args.dtype)
        measured = sizes[(k, t)] / samples
        rows.append(
            bench_row(
                {
                    "set": "demo",
                    "augmentations": k,
                    "teachers": t,
                    "caption_keys": len(CAPTION_KEYS),
                    "dtype": args.dtype,
                    "samples": samples,
                    "bytes_per_sample": round(measured, 1),
                    "planned_bytes_per_sample": plan.per_sample,
                    "measured_vs_planned": round(measured / plan.per_sample, 4),
                },
                {"samples_per_s": [samples / s for s in seconds[(k, t)]]},
            )
        )
    big = storage_plan(**DATACOMPDR, dtype="float16")
    rows.append(
        {
            "set": "DataCompDR-style 1B (planned)",
            "augmentations": DATACOMPDR["augmentations"],
            "teachers": len(DATACOMPDR["teacher_dims"]),
            "caption_keys": DATACOMPDR["caption_keys"],
            "dtype": "float16",
            "samples": big.samples,
            "planned_bytes_per_sample": big.per_sample,
            "planned_total_tb": round(big.total / 1e12, 3),
            "rounds": 1,
        }
    )
    write_rows(args.results, rows)
    for row in rows:
        print({k: v for k, v in row.items() if k not in ("command", "commit", "machine")})


if __name__ == "__main__":
    main()
