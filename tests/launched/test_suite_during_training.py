"""The suite during training (`--eval_tasks FILE --eval_steps N`), 2 CPU ranks under ZeRO-3 (torchrun): every rank
runs it together, each encoding its share of every set's batches (a forward is a collective: a rank left without a
batch in a set's last round encodes one again; a suite on one rank would hang the other), and the probe's
weight-decay candidates split between them; the tasks marked `train: true` at step 1, all of them at the last step;
the final suite lands in the run folder, equals `disco-clip eval --tasks` of the saved model on 1 rank to the last
printed digit, and shows in the exported model card."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from disco_clip_ds.data.prep.demo import DIGITS
from disco_clip_ds.testing.images import noise_image_bytes, write_samples, write_shards
from disco_clip_ds.testing.launch import LAUNCH_COMMON, QUICK, REPO, SGD, launch
from disco_clip_ds.testing.zeroshot import write_eval_shards

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

TASKS = """
digits:
  path: zeroshot
  train: true
captions:
  type: retrieval
  path: retrieval
probe:
  type: linear_probe
  path: probe
  val_proportion: 0.25
"""


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("suite_run")
    write_shards(root / "train", num_shards=2, per_shard=16, seed=2)
    write_eval_shards(root / "tasks" / "zeroshot")
    rng = np.random.default_rng(6)
    captioned = [{"png": noise_image_bytes(rng), "txt": f"a {DIGITS[i]}\nthe digit {i}"} for i in range(10)]
    write_samples(root / "tasks" / "retrieval", captioned, per_shard=5)
    for split, n in (("train", 20), ("test", 10)):
        labelled = [{"png": noise_image_bytes(rng), "cls": str(i % 5)} for i in range(n)]
        write_samples(root / "tasks" / "probe" / split, labelled, per_shard=10)
    (root / "tasks" / "tasks.yml").write_text(TASKS)
    common = ["--model_config", str(REPO / "recipes/models/tiny.json"), *SGD, "--max_steps", "2"]
    common += ["--train_shards", str(root / "train"), "--train_num_samples", "32", "--per_device_train_batch_size", "4"]
    suite = [
        "--eval_tasks",
        str(root / "tasks" / "tasks.yml"),
        "--eval_steps",
        "1",
        "--per_device_eval_batch_size",
        "8",
    ]
    launch(QUICK, 2, root / "out", *common, *suite, ds_config="cpu_zero3.json")
    assert "--save_steps" in LAUNCH_COMMON  # (the final model is saved whole: the card reads the run folder)
    return root


def test_every_rank_runs_the_suite_and_the_final_one_is_in_the_run_folder(run):
    state = json.loads((run / "out" / "trainer_state.json").read_text())
    logged = {e["step"]: e for e in state["log_history"] if any(k.startswith("suite/") for k in e)}
    assert sorted(logged) == [1, 2]
    assert {k for k in logged[1] if k.startswith("suite/")} == {"suite/digits", "suite/average"}
    assert {k for k in logged[2] if k.startswith("suite/")} == {
        "suite/digits",
        "suite/captions",
        "suite/probe",
        "suite/average",
    }
    table = json.loads((run / "out" / "suite" / "suite.json").read_text())
    assert [row["task"] for row in table["rows"]] == ["digits", "captions", "probe", "average"]
    assert all(row["error"] == "" for row in table["rows"])
    for row in table["rows"][:3]:
        assert row["value"] == pytest.approx(logged[2][f"suite/{row['task']}"])


def test_the_saved_model_scores_the_same_and_its_card_shows_the_suite(run, tmp_path):
    from disco_clip_ds.commands.eval import EvalArguments, run_tasks
    from disco_clip_ds.export.weights import export_checkpoint

    results, rows = run_tasks(
        EvalArguments(model=str(run / "out"), tasks=str(run / "tasks" / "tasks.yml"), batch_size=8)
    )
    during = json.loads((run / "out" / "suite" / "suite.json").read_text())["rows"]
    # 2 ZeRO-3 ranks, each with its share of the batches (the probe's 20 training images are 3 batches of 8: rank 1
    # repeats one) against 1 rank: the same numbers to the last digit the table prints
    assert [f"{row['value']:.4f}" for row in rows] == [f"{row['value']:.4f}" for row in during]
    assert [row["value"] for row in rows] == pytest.approx([row["value"] for row in during], abs=1e-6)
    exported = export_checkpoint(run / "out", tmp_path / "model")
    card = (exported / "README.md").read_text()
    assert (
        "## Benchmark suite" in card and f"| digits | zeroshot_classification | acc1 | {rows[0]['value']:.4f} |" in card
    )
