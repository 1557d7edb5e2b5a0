"""bench/gpu/train_figures.py: the figures a run logged, one schema row per training log plus the run's own."""

import csv
import importlib.util
import json

import pytest

from disco_clip_ds.testing.bench_record import schema_problems
from disco_clip_ds.testing.launch import REPO


def _script():
    spec = importlib.util.spec_from_file_location("train_figures", REPO / "bench/gpu/train_figures.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_each_training_log_and_the_run_become_a_row(tmp_path):
    history = [
        {"step": 10, "loss": 5.0, "samples_per_s": 800.0, "samples_per_s_per_rank": 100.0, "tflops_per_device": 52.0,
         "mfu": 0.0526, "step_time_s": 0.5},
        {"step": 10, "zeroshot_acc1": 0.5},  # an eval log: no row
    ]  # fmt: skip
    (tmp_path / "trainer_state.json").write_text(json.dumps({"log_history": history}))
    results = {"train_samples_per_second": 700.0, "train_samples_per_s_per_rank": 90.0, "train_tflops_per_device": 47.0}
    (tmp_path / "train_results.json").write_text(json.dumps(results))
    assert _script().main([str(tmp_path), "--out", str(tmp_path / "train.csv")]) == 0
    assert schema_problems(tmp_path / "train.csv") == []
    rows = list(csv.DictReader(open(tmp_path / "train.csv")))
    assert [(r["step"], r["tflops_per_device"], r["mfu"]) for r in rows] == [
        ("10", "52.0", "0.0526"),
        ("run", "47.0", ""),
    ]
    assert rows[1]["samples_per_s"] == "700.0" and rows[1]["samples_per_s_per_rank"] == "90.0"


def test_a_folder_without_a_finished_run_is_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        _script().main([str(tmp_path), "--out", str(tmp_path / "train.csv")])
    assert exit_.value.code == 2
    assert "no trainer_state.json or train_results.json: give the --output_dir" in capsys.readouterr().err
    assert not (tmp_path / "train.csv").exists()
