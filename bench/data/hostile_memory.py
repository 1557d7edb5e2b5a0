"""Peak memory of each reader's decode on hostile images, the base tree's readers against this one's, interleaved.

Each round runs every reader (training's crop, data embed's centre crop, NaFlex eval, evaluation, data filter's
fingerprint, the download's check with a short-side resize) on a 1 x 200,000 PNG, two decompression-bomb headers and
a real image just under the pixel cap, each in a forked child whose address space may grow by --limit_mib at most
(testing/memory.forked_peak_mib, loaded from this tree whichever tree's readers run), base and this tree in turn.

    python bench/data/hostile_memory.py --base /path/to/base/checkout --rounds 3
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import json
import os
import random
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
IMAGES = ("thin png 1 x 200000", "png bomb header", "jpeg bomb header", "near cap")


def _forked_peak_mib():
    """This tree's forked_peak_mib, loaded by path: the readers measured may be another tree's."""
    spec = importlib.util.spec_from_file_location("memory_here", REPO / "disco_clip_ds" / "testing" / "memory.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.forked_peak_mib


def _readers():
    from transformers import CLIPImageProcessor

    from disco_clip_ds.data.curate.copies import image_fingerprint
    from disco_clip_ds.data.naflex import NaflexTransform
    from disco_clip_ds.data.prep.fetch import check_image_pixels
    from disco_clip_ds.data.transforms import ImageTransform
    from disco_clip_ds.eval.sources import decode_batch

    processor = CLIPImageProcessor()  # shortest edge 224, then the centre crop
    aspect = {"max_aspect": 20} if "max_aspect" in inspect.signature(check_image_pixels).parameters else {}
    return {
        "train": lambda data: ImageTransform(224).from_bytes(data, random.Random(0)),
        "embed (centre crop)": lambda data: ImageTransform(224, train=False).from_bytes(data, None),
        "naflex eval": lambda data: NaflexTransform(16, 256, train=False).from_bytes(data, None),
        "eval": lambda data: decode_batch(processor, ([data], [0])),
        "filter (fingerprint)": image_fingerprint,
        "download (keep_ratio)": lambda data: check_image_pixels(data, **aspect),
    }


def worker(limit_mib: float) -> None:
    """Measure every reader on every image with the readers of the tree on PYTHONPATH; one JSON line each."""
    sys.path.insert(0, str(REPO))  # this tree's testing/images.py builds the same bytes for both trees
    spec = importlib.util.spec_from_file_location("images_here", REPO / "disco_clip_ds" / "testing" / "images.py")
    images_here = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(images_here)
    sys.path.pop(0)
    hostile = images_here.hostile_images()
    side = int(50_000_000**0.5)
    data = {name: hostile.get(name) for name in IMAGES[:3]}
    data["near cap"] = images_here.image_bytes("PNG", "L", (side, side), 90)
    measure = _forked_peak_mib()
    for reader, read in _readers().items():
        for name in IMAGES:
            outcome, extra = measure(lambda: read(data[name]), limit_mib)
            print(json.dumps({"reader": reader, "image": name, "outcome": outcome[:80], "peak_mib": extra}), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", required=True, help="a checkout of the base commit (its disco_clip_ds is measured)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--limit_mib", type=float, default=3072)
    parser.add_argument("--results", default=str(HERE / "results" / "hostile_memory.csv"))
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.limit_mib)
        return
    sys.path.insert(0, str(REPO))
    from disco_clip_ds.testing.bench_record import bench_row, write_rows

    trees = {"base": Path(args.base).resolve(), "this": REPO}
    samples: dict = {}
    for _ in range(args.rounds):
        for label, tree in trees.items():  # interleaved: base, this, base, this ...
            env = {**os.environ, "PYTHONPATH": str(tree)}
            command = [sys.executable, __file__, "--worker", "--base", args.base, "--limit_mib", str(args.limit_mib)]
            out = subprocess.run(command, env=env, capture_output=True, text=True, check=True, cwd=tree).stdout
            for line in out.splitlines():
                row = json.loads(line) if line.startswith("{") else None
                if row:
                    key = (row["reader"], row["image"], label)
                    samples.setdefault(key, {"outcome": row["outcome"], "peak_mib": []})["peak_mib"].append(
                        row["peak_mib"]
                    )
    rows = [
        bench_row({"reader": r, "image": i, "tree": t, "outcome": s["outcome"]}, {"peak_mib": s["peak_mib"]})
        for (r, i, t), s in samples.items()
    ]
    print(write_rows(args.results, rows, rounds=args.rounds))


if __name__ == "__main__":
    main()
