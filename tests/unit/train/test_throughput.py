"""Throughput in the training log (`train/throughput.py`): the dense peak looked up from the device's name and the
run's precision, --peak_tflops over it, TFLOPs per device and MFU from samples/s, no MFU on CPU said once."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch

from disco_clip_ds.errors import UsageError
from disco_clip_ds.train import throughput as tp


@pytest.mark.parametrize(
    "name, model",
    [
        ("NVIDIA A100-SXM4-80GB", "A100"),
        ("NVIDIA A100-PCIE-40GB", "A100"),
        ("NVIDIA A100 80GB PCIe", "A100"),
        ("NVIDIA H100 80GB HBM3", "H100 SXM"),
        ("NVIDIA H100 PCIe", "H100 PCIe"),
        ("NVIDIA H100 NVL", "H100 NVL"),
        ("NVIDIA H200", "H200 SXM"),
        ("NVIDIA H200 NVL", "H200 NVL"),
        ("NVIDIA GeForce RTX 4090", None),
        ("Tesla V100-SXM2-32GB", None),
    ],
)
def test_the_device_name_picks_its_row(name, model):
    assert tp.device_model(name) == model


def _args(**kw):
    return SimpleNamespace(**{"peak_tflops": None, "bf16": False, "fp16": False, "tf32": None, **kw})


@pytest.mark.parametrize(
    "flags, precision, peak",
    [({"bf16": True}, "bf16", 989.4), ({"fp16": True}, "bf16", 989.4), ({"tf32": True}, "tf32", 494.7),
     ({"tf32": False}, "fp32", 66.9)],
)  # fmt: skip
def test_the_runs_precision_picks_the_column(monkeypatch, flags, precision, peak):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    args = _args(**flags)
    assert tp.run_precision(args) == precision
    assert tp.peak_tflops(args, torch.device("cuda", 0)) == (peak, f"H100 SXM dense {precision}")


def test_no_peak_on_cpu_or_an_unknown_gpu_unless_given(monkeypatch):
    assert tp.peak_tflops(_args(), torch.device("cpu")) == (
        None,
        "no dense peak is known for a cpu device (pass --peak_tflops to set one)",
    )
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA GeForce RTX 4090")
    peak, why = tp.peak_tflops(_args(bf16=True), torch.device("cuda", 0))
    assert peak is None and why.startswith("NVIDIA GeForce RTX 4090 is not in the peak table") and "bf16" in why
    assert tp.peak_tflops(_args(peak_tflops=82.6), torch.device("cuda", 0)) == (82.6, "--peak_tflops")
    assert tp.peak_tflops(_args(peak_tflops=50.0), torch.device("cpu")) == (50.0, "--peak_tflops")


def test_the_flag_is_parsed_and_a_peak_not_above_zero_refused(tmp_path):
    from transformers import HfArgumentParser

    from disco_clip_ds.train.args import DiscoTrainingArguments
    from disco_clip_ds.train.validate.training import check_peak_tflops

    (args,) = HfArgumentParser(DiscoTrainingArguments).parse_args_into_dataclasses(
        ["--output_dir", str(tmp_path), "--peak_tflops", "312", "--report_to", "none"]
    )
    assert tp.peak_tflops(args, torch.device("cpu")) == (312.0, "--peak_tflops")
    refusal = r"^--peak_tflops 0.0: give one device's dense peak in TFLOPs, finite and above 0$"
    with pytest.raises(UsageError, match=refusal):
        check_peak_tflops(_args(peak_tflops=0.0))


def test_tflops_and_mfu_from_samples_per_second():
    # 2 devices, 8 samples per step over both, 1e12 FLOPs per sample: 3 steps in 6 s = 2 samples/s per device
    meter = tp.Throughput(lambda step: 1e12, 10.0)
    meter.started(100.0, 0)
    figures = meter.figures(106.0, 3, samples_per_step=8, world=2)
    assert figures == {
        "samples_per_s": 4.0,
        "samples_per_s_per_rank": 2.0,
        "step_time_s": 2.0,
        "tflops_per_device": 2.0,
        "mfu": 0.2,
    }
    # the next log counts from this one; the run's figures from the first batch
    assert meter.figures(110.0, 5, 8, 2)["tflops_per_device"] == 2.0
    run = meter.run_figures(8, 2)
    assert run == {"train_samples_per_s_per_rank": 2.0, "train_tflops_per_device": 2.0, "train_mfu": 0.2}


def test_without_a_peak_tflops_are_logged_and_the_reason_for_no_mfu_once(caplog):
    meter = tp.Throughput(lambda step: 2e12, None, "no dense peak is known for a cpu device")
    meter.started(0.0, 0)
    with caplog.at_level(logging.WARNING, logger="disco_clip_ds.train"):
        first = meter.figures(1.0, 1, 1, 1)
        second = meter.figures(2.0, 2, 1, 1)
    assert first["tflops_per_device"] == second["tflops_per_device"] == 2.0 and "mfu" not in first
    assert [r.getMessage() for r in caplog.records] == ["MFU is not logged: no dense peak is known for a cpu device"]


def test_the_flops_follow_patch_dropout_until_its_last_step():
    from transformers import CLIPConfig

    from disco_clip_ds.testing.launch import TINY_CONFIG

    config = CLIPConfig.from_json_file(str(TINY_CONFIG))
    args = SimpleNamespace(patch_dropout=0.5, patch_dropout_until_step=3)
    per_sample = tp.flops_per_sample(config, args)
    assert per_sample(2) < per_sample(3) == tp.flops_per_sample(config, SimpleNamespace(
        patch_dropout=0.0, patch_dropout_until_step=None))(2)  # fmt: skip
    stored = SimpleNamespace(model=None, config=config)  # stored embeddings: no teacher forward
    live = SimpleNamespace(model=object(), config=config)
    assert tp.flops_per_sample(config, args, teacher=stored)(1) == per_sample(1)
    assert tp.flops_per_sample(config, args, teacher=live)(1) == per_sample(1) + per_sample(3) / 3
    # an ensemble: each live member's forward (per_sample(3) / 3: one forward of the tiny model, teacher and student)
    ensemble = SimpleNamespace(members=[live, live, stored], config=config)
    assert tp.flops_per_sample(config, args, teacher=ensemble)(1) == per_sample(1) + 2 * per_sample(3) / 3
