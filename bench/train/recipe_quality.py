"""Perception Encoder's levers on the demo against the quickstart's own recipe: zero-shot top-1 at the quickstart's
in-training evals (every 100 steps) and of the saved model, per seed, at the same steps.

Each run is `recipes/quickstart.sh` (2 CPU ranks x 128 pairs, ZeRO-2, fp32, cosine schedule with 30 warmup steps,
weight decay 0.1, beta2 0.98, eps 1e-6) for --steps steps (the quickstart's 300 by default), one arm each:
- adamw: the quickstart as it is (AdamW at 1e-3, 64 px throughout);
- lamb: LAMB (`OPTIM=lamb`) at Perception Encoder's 2e-3;
- progressive: AdamW at 1e-3 with a progressive resolution schedule in PE's shape on the demo's 64 px digits
  (`RESOLUTION_SCHEDULE=0:32,0.35:48,0.7:64`: 32 px for the first 35 % of the steps, 48 px to 70 %, then 64 px; the tiny
  CLIP's 16 px patches, so 4, 9 and 16 patches an image), evaluated and saved at 64 px.
The arms of a seed run side by side. Read from each run's trainer_state.json (`zeroshot_acc1`, `zeroshot_acc5`) and
its eval/zeroshot_classification.json (the saved model, `disco-clip eval`), into results/recipe_quality.csv. The
in-training evals run at the model's last side (64 px), which a progressive run reaches only in its last stage; so
the progressive arm's checkpoint-200 is also evaluated at the side it trained step 200 at (step "200 at N px"): its
position embeddings resized to N as the trainer resizes them (`resize_position_embeddings`), its processor at N.

    python bench/train/recipe_quality.py --seeds 0 1 2 [--arms adamw lamb progressive] [--steps 300] [--data data/demo]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import tempfile
from pathlib import Path

from disco_clip_ds.testing.bench_record import write_rows
from disco_clip_ds.testing.ranks import free_port

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
OUT = REPO / "outputs" / "bench_recipe"
RUNS = {
    "adamw": {"LR": "1e-3"},
    "lamb": {"OPTIM": "lamb", "LR": "2e-3"},
    "progressive": {"LR": "1e-3", "RESOLUTION_SCHEDULE": "0:32,0.35:48,0.7:64"},
}


def quickstart(out: Path, seed: int, run: str, steps: int, data: str | None) -> subprocess.Popen | None:
    """The quickstart with `run`'s settings into OUT, started; None when OUT already holds its finished run (a bench
    cut short goes on)."""
    if (out / "eval" / "zeroshot_both.json").is_file():  # the quickstart's last file
        return None
    shutil.rmtree(out, ignore_errors=True)
    env = {**os.environ, "OUT": str(out), "SEED": str(seed), "STEPS": str(steps), **RUNS[run]}
    env["MASTER_PORT"] = str(free_port())
    if data:
        env["DATA"] = data
    return subprocess.Popen(["bash", "recipes/quickstart.sh"], cwd=REPO, env=env, stdout=subprocess.DEVNULL)


def eval_rows(out: Path) -> list[dict]:
    """The run's in-training evals, and the saved model's (step "final")."""
    history = json.loads((out / "trainer_state.json").read_text())["log_history"]
    rows = [
        {"step": h["step"], "acc1": h["zeroshot_acc1"], "acc5": h["zeroshot_acc5"]}
        for h in history
        if "zeroshot_acc1" in h
    ]
    final = json.loads((out / "eval" / "zeroshot_classification.json").read_text())["metrics"]
    return [*rows, {"step": "final", "acc1": final["acc1"], "acc5": final.get("acc5")}]


def stage_rows(out: Path, steps: int, data: str | None) -> list[dict]:
    """checkpoint-200 of a progressive run evaluated (`disco-clip eval`) at the side its step 200 trained at."""
    from transformers import CLIPModel

    from disco_clip_ds.models.resolution import ResolutionSchedule, parse_schedule, resize_position_embeddings

    checkpoint = out / "checkpoint-200"
    side = ResolutionSchedule(parse_schedule(RUNS["progressive"]["RESOLUTION_SCHEDULE"]), steps).size_at(199)
    with tempfile.TemporaryDirectory() as folder:
        model = CLIPModel.from_pretrained(checkpoint)
        resize_position_embeddings(model, side)
        model.save_pretrained(folder)
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(checkpoint / name, Path(folder) / name)
        processor = json.loads((checkpoint / "processor_config.json").read_text())
        processor["image_processor"] |= {"crop_size": {"height": side, "width": side}, "size": {"shortest_edge": side}}
        (Path(folder) / "processor_config.json").write_text(json.dumps(processor))
        result = Path(folder) / "result.json"
        eval_data = str(Path(data or REPO / "data" / "demo") / "eval")
        command = ["disco-clip", "eval", "--model", folder, "--data", eval_data, "--output", str(result)]
        subprocess.run(command, check=True)
        metrics = json.loads(result.read_text())["metrics"]
    return [{"step": f"200 at {side} px", "acc1": metrics["acc1"], "acc5": metrics.get("acc5")}]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--arms", nargs="+", choices=list(RUNS), default=list(RUNS))
    parser.add_argument("--data", help="the demo dataset (default: the quickstart's data/demo, built if missing)")
    args = parser.parse_args()
    rows = []
    for seed in args.seeds:
        outs = {run: OUT / f"{run}_s{seed}_{args.steps}" for run in args.arms}
        started = [quickstart(out, seed, run, args.steps, args.data) for run, out in outs.items()]
        for process in filter(None, started):  # side by side: a machine slowing down meets both
            if process.wait():
                raise SystemExit(f"a quickstart run failed (exit {process.returncode}): {process.args}")
        for run, out in outs.items():
            got = eval_rows(out) + (stage_rows(out, args.steps, args.data) if run == "progressive" else [])
            rows += [
                {
                    "seed": seed,
                    "arm": run,
                    "optim": RUNS[run].get("OPTIM", "adamw"),
                    "learning_rate": RUNS[run]["LR"],
                    "resolution_schedule": RUNS[run].get("RESOLUTION_SCHEDULE", "64 throughout"),
                    "steps": args.steps,
                    **r,
                }
                for r in got
            ]
            print(run, seed, got, flush=True)
    write_rows(HERE / "results" / "recipe_quality.csv", rows, rounds=1)
    for step in [*range(100, args.steps + 1, 100), "final"]:
        means = {run: [r["acc1"] for r in rows if r["arm"] == run and r["step"] == step] for run in args.arms}
        print(step, {run: (round(statistics.mean(v), 4), min(v), max(v)) for run, v in means.items() if v})


if __name__ == "__main__":
    main()
