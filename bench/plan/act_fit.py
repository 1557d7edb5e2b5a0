"""Fit the planner's activation-memory coefficients from measured CPU peaks of real CLIPModels.

    python bench/plan/act_fit.py       # writes disco_clip_ds/plan/activation_fit.json

Every (model, batch, checkpointing) point runs disco_clip_ds.testing.step_memory in a fresh process (forward+backward,
fp32, sdpa attention). Two batch sizes per model give the per-sample slope, free of fixed costs. The slope is
modelled per encoder tower t (L layers, s tokens, width h, MLP width m) in activation elements per sample:

    no checkpointing:  alpha * sum_t L*s*h + beta * sum_t L*s*m + eps * sum_t s*h
    checkpointing:     delta * sum_t L*s*h + eps * sum_t s*h + max_t (alpha*s*h + beta*s*m)   (one layer live)

plus the input tensors (pixels, token ids) counted exactly. alpha, beta, eps are fitted by least squares over
ViT-B/32 and three probe models that vary depth, width, MLP ratio and image tokens; delta likewise on the
checkpointed runs. The planner (disco_clip_ds/plan/) scales elements by the training precision's bytes.
No s^2 attention term: sdpa (flash / memory-efficient kernels) stores no attention matrix.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from disco_clip_ds.plan import FIT_FILE, ModelShape

ROOT = Path(__file__).resolve().parents[2]

VIT_B32 = ROOT / "recipes/models/vit_b32.json"
# (name, overrides for both towers, vision overrides, batches without / with checkpointing)
PROBES = [
    ("vit_b32", {}, {}, (4, 12), (16, 48)),
    (
        "probe_l4_h256_m1024",
        {"num_hidden_layers": 4, "hidden_size": 256, "intermediate_size": 1024, "num_attention_heads": 4},
        {},
        (16, 48),
        (128, 384),
    ),
    (
        "probe_l2_h256_m2048_s101",
        {"num_hidden_layers": 2, "hidden_size": 256, "intermediate_size": 2048, "num_attention_heads": 4},
        {"image_size": 160, "patch_size": 16},
        (16, 48),
        (128, 384),
    ),
    (
        "probe_l6_h384_m384",
        {"num_hidden_layers": 6, "hidden_size": 384, "intermediate_size": 384, "num_attention_heads": 6},
        {},
        (16, 48),
        (128, 384),
    ),
]


def _write_config(name: str, both: dict, vision: dict, folder: Path) -> Path:
    config = json.loads(VIT_B32.read_text())
    for tower in ("text_config", "vision_config"):
        config[tower].update(both)
    config["vision_config"].update(vision)
    path = folder / f"{name}.json"
    path.write_text(json.dumps(config))
    return path


def _measure(path: Path, batch: int, checkpointing: bool) -> float:
    cmd = [sys.executable, "-m", "disco_clip_ds.testing.step_memory", "--model", str(path), "--batch", str(batch)]
    cmd += ["--activation_checkpointing"] if checkpointing else []
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])["delta_mib"] * 2**20


def main() -> None:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, both, vision, batches, ckpt_batches in PROBES:
            path = _write_config(name, both, vision, Path(tmp))
            shape = ModelShape.from_json(path)
            for ckpt, (b1, b2) in ((False, batches), (True, ckpt_batches)):
                m1, m2 = _measure(path, b1, ckpt), _measure(path, b2, ckpt)
                slope = (m2 - m1) / (b2 - b1)
                rows.append(
                    {
                        "model": name,
                        "checkpointing": ckpt,
                        "batches": [b1, b2],
                        "delta_bytes": [m1, m2],
                        "slope_bytes": slope,
                        "input_bytes": shape.input_bytes(4),
                        "shape": shape.features(),
                    }
                )
                print(f"{name:28s} ckpt={ckpt!s:5s} slope {slope / 2**20:8.3f} MiB/sample", flush=True)
    plain = [r for r in rows if not r["checkpointing"]]
    a = np.array([[r["shape"]["layer_sh"], r["shape"]["layer_sm"], r["shape"]["embed_sh"]] for r in plain], float)
    y = np.array([(r["slope_bytes"] - r["input_bytes"]) / 4 for r in plain])
    alpha, beta, eps = np.linalg.lstsq(a, y, rcond=None)[0]
    ckpt = [r for r in rows if r["checkpointing"]]
    rest = np.array(
        [
            (r["slope_bytes"] - r["input_bytes"]) / 4
            - eps * r["shape"]["embed_sh"]
            - max(alpha * sh + beta * sm for sh, sm in r["shape"]["tower_layer_sh_sm"])
            for r in ckpt
        ]
    )
    x = np.array([r["shape"]["layer_sh"] for r in ckpt], float)
    delta = float(x @ rest / (x @ x))
    fit = {"alpha": float(alpha), "beta": float(beta), "eps": float(eps), "delta": delta}
    for r in rows:
        shape = r["shape"]
        predicted = ModelShape.activation_elements_from(shape, fit, r["checkpointing"]) * 4 + r["input_bytes"]
        r["predicted_slope_bytes"] = predicted
        r["error"] = predicted / r["slope_bytes"] - 1
        print(
            f"{r['model']:28s} ckpt={r['checkpointing']!s:5s} measured {r['slope_bytes'] / 2**20:8.3f} "
            f"predicted {predicted / 2**20:8.3f} MiB/sample ({r['error']:+.1%})"
        )
    FIT_FILE.write_text(
        json.dumps(
            {
                "command": "python bench/plan/act_fit.py",
                "what": "activation elements per sample = alpha*sum L*s*h + beta*sum L*s*m + eps*sum s*h "
                "(no checkpointing); "
                "delta*sum L*s*h + eps*sum s*h + max_tower(alpha*s*h + beta*s*m) (checkpointing); "
                "see bench/plan/act_fit.py",
                "measured_on": "CPU, fp32, torch %s, transformers %s, sdpa attention" % _versions(),
                "coefficients": fit,
                "points": rows,
            },
            indent=1,
        )
        + "\n"
    )
    print("wrote", FIT_FILE.relative_to(ROOT), fit)


def _versions() -> tuple[str, str]:
    import torch
    import transformers

    return torch.__version__, transformers.__version__


if __name__ == "__main__":
    main()
