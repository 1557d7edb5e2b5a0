"""The planner: config validation messages (the batch arithmetic shared with training), hand-computed memory and
traffic terms, the paper's two runs, contrastive accumulation's batch, SigLIP's terms. (Against measured peaks:
tests/launched/test_plan_measured.py.)"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

from disco_clip_ds import plan as P
from disco_clip_ds.commands import plan as plan_command
from disco_clip_ds.errors import run_main
from disco_clip_ds.testing.launch import REPO

VIT = REPO / "recipes/models/vit_b32.json"

CFG_32K = REPO / "ds_configs/vit_b32_32k_8gpu.json"

CFG_196K = REPO / "ds_configs/vit_b32_196k_64gpu.json"

CFG_196K_8GPU = REPO / "ds_configs/vit_b32_196k_8gpu.json"


def problems_of(config, world=4, **kwargs) -> str:
    with pytest.raises(P.PlanConfigError) as info:
        P.validate_config(config, world, **kwargs)
    return str(info.value)


def paper_plan(tmp_path, config: Path, gpus: int, *flags: str) -> tuple[int, dict]:
    """`plan` of ViT-B/32 with `config` on `gpus` 40 GB GPUs, activation checkpointing on (the paper's setting):
    its exit code and its --json record."""
    out = tmp_path / "plan.json"
    argv = ["--deepspeed", str(config), "--model", str(VIT), "--gpus", str(gpus), "--gpu_memory", "40GB"]
    code = plan_command.main([*argv, "--activation_checkpointing", *flags, "--json", str(out)])
    return code, json.loads(out.read_text())


def test_broken_batch_arithmetic_names_the_fix():
    config = {"train_batch_size": 32768, "train_micro_batch_size_per_gpu": 4096, "gradient_accumulation_steps": 1}
    msg = problems_of(config, world=4)
    assert "32768 != train_micro_batch_size_per_gpu 4096 x gradient_accumulation_steps 1 x world size 4 = 16384" in msg
    assert "set train_batch_size to 16384 or train_micro_batch_size_per_gpu to 8192 or --gpus to 8" in msg


def test_gradient_accumulation_enters_the_arithmetic():
    config = {"train_batch_size": 64, "train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 2}
    assert P.validate_config(config, 4).train_batch == 64
    assert "train_batch_size to 128" in problems_of(config, world=8)


def test_unknown_keys_are_caught_with_a_suggestion():
    config = {
        "train_micro_batch_size": 8,
        "train_batch_size": 32,
        "zero_optimization": {"stage": 2, "reduce_bucket": 5e7},
    }
    msg = problems_of(config)
    assert "unknown top-level key \"train_micro_batch_size\" (did you mean 'train_micro_batch_size_per_gpu'?)" in msg
    assert "unknown key zero_optimization.reduce_bucket (did you mean 'reduce_bucket_size'?)" in msg


def test_precision_and_zero_problems():
    both = {"train_micro_batch_size_per_gpu": 8, "bf16": {"enabled": True}, "fp16": {"enabled": True}}
    assert "enable one" in problems_of(both)
    bf16 = {"train_micro_batch_size_per_gpu": 8, "bf16": {"enabled": True}}
    assert "--precision fp16 but the config trains in bf16" in problems_of(bf16, precision="fp16")
    assert "stage must be 0, 1, 2 or 3, got 5" in problems_of(
        {"train_micro_batch_size_per_gpu": 8, "zero_optimization": {"stage": 5}}
    )
    bucket = {"train_micro_batch_size_per_gpu": 8, "zero_optimization": {"stage": 2, "reduce_bucket_size": -1}}
    assert "zero_optimization.reduce_bucket_size" in problems_of(bucket)
    assert "positive integer" in problems_of({"train_micro_batch_size_per_gpu": 0})


def test_flags_and_deepspeed_engine_checks():
    config = {"train_micro_batch_size_per_gpu": 8}
    assert "--per_device_batch 16 contradicts train_micro_batch_size_per_gpu 8" in problems_of(
        config, per_device_batch=16
    )
    odd = {"train_micro_batch_size_per_gpu": 8, "zero_optimization": {"stage": 2, "allgather_bucket_size": 25000001}}
    assert "allgather_bucket_size must be even" in problems_of(odd)
    offload = {
        "train_micro_batch_size_per_gpu": 8,
        "zero_optimization": {"stage": 1, "offload_param": {"device": "cpu"}},
    }
    assert "offload_param needs ZeRO stage 3" in problems_of(offload)


def test_cpu_config_plans_with_the_trainer_values_given(capsys):
    code = plan_command.main(
        [
            "--deepspeed",
            str(REPO / "ds_configs/cpu_zero2.json"),
            "--model",
            str(REPO / "recipes/models/tiny.json"),
            "--gpus",
            "2",
            "--gpu_memory",
            "8GB",
            "--per_device_batch",
            "64",
            "--precision",
            "fp32",
        ]
    )
    out = capsys.readouterr().out
    assert code == 0 and "needs the HF Trainer: gradient_clipping" in out and "micro batch 64 x grad accum 1 x 2" in out


def test_auto_values_need_the_trainer_or_a_flag():
    config = {
        "train_micro_batch_size_per_gpu": "auto",
        "train_batch_size": "auto",
        "zero_optimization": {"stage": 2, "reduce_bucket_size": "auto"},
    }
    assert "pass --per_device_batch" in problems_of(config)
    settings = P.validate_config(config, 4, per_device_batch=16)
    assert settings.train_batch == 64
    assert any("reduce_bucket_size" in a and "set it explicitly" in a for a in settings.trainer_auto)


def test_bad_files_are_reported(tmp_path):
    broken = tmp_path / "ds.json"
    broken.write_text('{"train_batch_size": 8,\n "bf16": {enabled: true}}')
    with pytest.raises(P.PlanConfigError, match="not valid JSON at line 2"):
        P.read_deepspeed_json(broken)
    with pytest.raises(P.PlanConfigError, match="no such file"):
        P.read_deepspeed_json(tmp_path / "missing.json")
    argv = ["--deepspeed", str(broken), "--model", str(VIT), "--gpus", "2"]
    assert run_main(plan_command.main, argv, "disco-clip plan") == 2


@pytest.mark.parametrize(
    "flag, value, message",
    [
        ("--gpu_memory", "0GB", "a GPU's memory is more than 0"),
        ("--model", "[1, 2]", "its top level is not a JSON object"),
        ("--patch_dropout", "1", "--patch_dropout 1: give a fraction at least 0 and below 1"),
        ("--overhead_gb", "nan", "--overhead_gb nan: give a finite number of GiB, 0 or more"),
        ("--overhead_gb", "-1", "--overhead_gb -1.0: give a finite number of GiB, 0 or more"),
        ("--node_memory_gb", "inf", "--node_memory_gb inf: give a node's memory in GiB, finite and more than 0"),
        ("--json", "DIR", "--json DIR: a folder; give the path of the JSON file to write"),
        ("--json", "DIR/no/plan.json", "--json DIR/no/plan.json: the folder DIR/no does not exist"),
    ],
)
def test_bad_planner_inputs_are_one_line_with_exit_2(flag, value, message, tmp_path, capsys):
    if flag == "--model":
        (tmp_path / "list.json").write_text(value)
        value = str(tmp_path / "list.json")
    value, message = value.replace("DIR", str(tmp_path)), message.replace("DIR", str(tmp_path))
    argv = ["--deepspeed", str(CFG_32K), "--model", str(VIT), "--gpus", "8", "--gpu_memory", "40GB", flag, value]
    assert run_main(plan_command.main, argv, "disco-clip plan") == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


@pytest.mark.slow  # starts the CLI in fresh interpreters
def test_cli_prints_one_clear_error_for_a_bad_config(tmp_path, capsys):
    config = tmp_path / "ds.json"
    config.write_text(json.dumps({"train_batch_size": 100, "train_micro_batch_size_per_gpu": 8}))
    argv = ["--deepspeed", str(config), "--model", str(VIT), "--gpus", "4"]
    assert run_main(plan_command.main, argv, "disco-clip plan") == 2
    err = capsys.readouterr().err
    assert "train_batch_size 100 != " in err and "Traceback" not in err
    # `python -m disco_clip_ds.plan` is the same command: one line, exit 2
    proc = subprocess.run([sys.executable, "-m", "disco_clip_ds.plan", *argv], capture_output=True, text=True)
    assert proc.returncode == 2 and proc.stderr.startswith("disco-clip plan: DeepSpeed config problems")
    assert "train_batch_size 100 != " in proc.stderr and "Traceback" not in proc.stderr


def test_model_states_match_deepspeed_and_hand_counts():
    p, n, largest = 151_277_313, 8, 25_296_896
    s2 = P.model_state_bytes(p, largest, 2, "bf16", n)
    assert sum(s2.values()) == pytest.approx(2 * p + int(18 * p / n))  # estimate_zero2_model_states_mem_needs
    s3 = P.model_state_bytes(p, largest, 3, "bf16", n)
    assert sum(s3.values()) == pytest.approx(4 * largest + int(18 * p / n))  # estimate_zero3_...
    assert sum(P.model_state_bytes(p, largest, 0, "fp32", n).values()) == 16 * p  # weights, grads, Adam m and v
    assert sum(P.model_state_bytes(p, largest, 1, "bf16", n).values()) == pytest.approx(4 * p + 16 * p / n)
    offloaded = P.model_state_bytes(p, largest, 2, "bf16", n, offload_optimizer=True)
    assert (
        sum(offloaded.values()) == pytest.approx(2 * p) and offloaded["optimizer"] == 0
    )  # DeepSpeed: 16-bit weights only


def test_traffic_hand_computed():
    shape = P.ModelShape.from_json(VIT)
    settings = P.validate_config(P.read_deepspeed_json(CFG_32K), 8)
    t = P.traffic_bytes(shape, settings, ("disco", "tiled"))
    features = 7 / 8 * 32768 * 2 * 512 * 2  # (N-1)/N x B x 2d x bf16
    assert t["disco loss: feature all-gather (forward)"] == pytest.approx(features)
    assert t["disco loss: feature reduce-scatter (backward)"] == pytest.approx(features)
    assert t["(paper: feature all-reduce in backward)"] == pytest.approx(2 * features)
    # the one-block tiled loss: the texts only, and two all-reduces (2 (N-1)/N each) of B fp32 column values
    assert t["tiled loss: text all-gather (forward)"] == pytest.approx(features / 2)
    assert t["tiled loss: text reduce-scatter (backward)"] == pytest.approx(features / 2)
    assert t["tiled loss: column lse all-reduces (forward)"] == pytest.approx(2 * 2 * 7 / 8 * 32768 * 4)
    # DeepSpeed all-reduces ZeRO-2's gradient buckets unless use_multi_rank_bucket_allreduce is off
    assert t["gradient all-reduce (multi-rank buckets)"] == pytest.approx(2 * 7 / 8 * shape.params * 4)  # fp32
    assert t["parameter all-gather"] == pytest.approx(7 / 8 * shape.params * 2)
    config = P.read_deepspeed_json(CFG_32K)
    config["zero_optimization"]["use_multi_rank_bucket_allreduce"] = False
    t = P.traffic_bytes(shape, P.validate_config(config, 8), ("tiled",))
    assert t["gradient reduce-scatter"] == pytest.approx(7 / 8 * shape.params * 4)
    assert "gradient all-reduce (multi-rank buckets)" not in t


def test_parameter_count_is_the_real_models():
    assert P.ModelShape.from_json(VIT).params == 151_277_313


def _vit_b16(tmp_path) -> Path:
    """A CLIPConfig JSON with ViT-B/16's image tower (224 px, 16 px patches, width 768, 12 layers, MLP 3072)."""
    config = json.loads(VIT.read_text())
    config["vision_config"] = {**config["vision_config"], "patch_size": 16, "image_size": 224}
    (tmp_path / "vit_b16.json").write_text(json.dumps(config))
    return tmp_path / "vit_b16.json"


def test_patch_dropout_counts_the_kept_tokens_in_compute_and_activations(tmp_path):
    """ViT-B/16's image tower: 17.6 G multiply-adds per image forward as timm reports it for vit_base_patch16_224
    (the published figure), by hand 12 layers x 197 tokens x (4 h^2 + 2 h m + 2 t h) + 196 patches x 768 x 768;
    at patch dropout 0.5 the layers see 1 + 98 tokens, the patch embedding still every patch."""
    shape = P.ModelShape.from_json(_vit_b16(tmp_path))
    h, m = 768, 3072
    by_hand = lambda t: 12 * t * (4 * h * h + 2 * h * m + 2 * t * h) + 196 * 3 * 16 * 16 * h
    assert shape.training_flops_per_sample()["vision"] == 3 * 2 * by_hand(197)
    assert by_hand(197) / 1e9 == pytest.approx(17.6, rel=0.01)
    masked = shape.with_patch_dropout(0.5)
    assert masked.layer_tokens(masked.towers["vision"]) == 99
    assert masked.training_flops_per_sample()["vision"] == 3 * 2 * by_hand(99)
    assert masked.training_flops_per_sample()["text"] == shape.training_flops_per_sample()["text"]
    full, kept = shape.features(), masked.features()
    assert full["layer_sh"] - kept["layer_sh"] == 12 * (197 - 99) * h
    assert full["layer_sm"] - kept["layer_sm"] == 12 * (197 - 99) * m
    assert full["embed_sh"] == kept["embed_sh"]  # the embeddings see every patch


def test_siglip2_counts_its_patch_budget_per_image(tmp_path):
    """The tiny SigLIP 2 (NaFlex; 2 layers, width 64, MLP 256, 4 px patches): the image tower sees the budget's
    patches, no class token (by hand, as above, for 256 and 64 tokens, the patch embedding over each patch); its
    input is budget x 3 x 4 x 4 pixels; the parameters are Siglip2Model's own; any budget of at least one patch is
    planned, above the 16 x 16 grid too (Siglip2 interpolates its positions), and 0 is refused as training refuses
    it. (recipes/models/siglip2_b16.json plans the same way, more slowly.)"""
    import torch
    from transformers import Siglip2Config, Siglip2Model

    path = REPO / "recipes/models/siglip2_tiny.json"
    h, m = 64, 256
    by_hand = lambda t: 2 * t * (4 * h * h + 2 * h * m + 2 * t * h) + t * 3 * 4 * 4 * h
    for budget in (256, 64, 1024, 5):
        shape = P.ModelShape.from_json(path, max_num_patches=budget)
        assert shape.patches == budget and shape.layer_tokens(shape.towers["vision"]) == budget
        assert shape.training_flops_per_sample()["vision"] == 3 * 2 * by_hand(budget)
        assert shape.input_bytes(2) == budget * 3 * 4 * 4 * 2 + 64 * 8
    with torch.device("meta"):
        plain = Siglip2Model(Siglip2Config.from_json_file(str(path)))
    default = P.ModelShape.from_json(path)
    assert default.params == sum(p.numel() for p in plain.parameters()) and default.patches == 256  # the whole grid
    for budget in (0, -3):
        with pytest.raises(P.PlanConfigError, match=f"--max_num_patches {budget}: give at least one patch"):
            P.ModelShape.from_json(path, max_num_patches=budget)
    with pytest.raises(P.PlanConfigError, match="--max_num_patches is SigLIP 2's"):
        P.ModelShape.from_json(VIT, max_num_patches=64)


def test_loss_terms_scale_as_the_paper_says():
    """local O(b^2) per rank, disco O(B^2/N), tiled O(B*d): the asymptotics the paper and disco_clip_ds.losses
    claim."""
    d, e, big = 512, 2, 1 << 17
    local = P.loss_bytes("local", 2 * big, 8, d, e) / P.loss_bytes("local", big, 8, d, e)
    disco = P.loss_bytes("disco", big, 64, d, e) / P.loss_bytes("disco", big, 8, d, e)
    tiled = P.loss_bytes("tiled", 2 * big, 8, d, e) / P.loss_bytes("tiled", big, 8, d, e)
    assert 3.9 < local <= 4.0 and 1 / 8 < disco < 1 / 4 and 1.9 < tiled < 2.2
    # the local loss depends on the local batch alone: the same b on 8 or 64 GPUs
    assert P.loss_bytes("local", 8 * big, 64, d, e) == P.loss_bytes("local", big, 8, d, e)


@pytest.mark.parametrize("config, gpus", [(CFG_32K, 8), (CFG_196K, 64)], ids=["32k_8gpu", "196k_64gpu"])
def test_paper_runs_fit_on_40gb_with_disco_and_tiled(config, gpus, tmp_path):
    code, result = paper_plan(tmp_path, config, gpus)
    memory = result["memory"]
    assert memory["disco"]["fits"] and memory["tiled"]["fits"]
    assert memory["tiled"]["total"] < memory["disco"]["total"]
    # The table shows what CLIP's per-device loss needs: its b x b logits at the micro batch, in fp32.
    b = result["settings"]["micro_batch"]
    assert memory["local"]["terms"]["loss (local)"] == pytest.approx(4 * b * b * 4 + 2 * b * 512 * 2)
    assert code == (0 if all(m["fits"] for m in memory.values()) else 1)


@pytest.mark.slow  # beyond the fast tier's time budget
def test_the_local_loss_is_planned_per_micro_batch_under_accumulation():
    """CLIP's per-device loss contrasts each micro-batch alone (the trainer refuses to accumulate it contrastively):
    with K = 8 its loss term is the micro-batch's own, without cached embeddings, and it has no largest K."""
    config = REPO / "ds_configs/vit_b32_196k_8gpu.json"
    result = P.plan(config, VIT, 8, "40GB", activation_checkpointing=True, loss_impls=("tiled", "local"))
    assert result["contrastive_steps"] == 8
    local, tiled = result["memory"]["local"]["terms"], result["memory"]["tiled"]["terms"]
    assert local["loss (local)"] == pytest.approx(4 * 3072 * 3072 * 4 + 2 * 3072 * 512 * 2)
    assert "cached embeddings" not in local and "cached embeddings" in tiled
    assert list(result["max_contrastive_steps"]) == ["tiled"]
    report = P.format_report(result, config, VIT)
    assert "planned as `--contrastive_accumulation false`" in report
    settings = P.validate_config(P.read_deepspeed_json(config), 8)
    with pytest.raises(P.PlanConfigError, match="local cannot be accumulated contrastively"):
        P.max_contrastive_steps(P.ModelShape.from_json(VIT), settings, P.load_fit(), "local", True, 40 * P.GiB, 0.0)


def test_without_checkpointing_the_paper_batch_does_not_fit_and_the_plan_says_what_would(capsys):
    result = P.plan(CFG_32K, VIT, 8, "40GB", loss_impls=("tiled",))
    assert not result["memory"]["tiled"]["fits"] and result["max_micro_batch"]["tiled"] < 4096
    # each change named is planned again and fits; the micro-batch named is the largest dividing 4096 that does
    changes = result["to_fit"]["tiled"]
    assert "activation checkpointing (train --activation_checkpointing)" in changes
    assert P.plan(CFG_32K, VIT, 8, "40GB", loss_impls=("tiled",), activation_checkpointing=True)["memory"]["tiled"][
        "fits"
    ]
    (micro,) = [c for c in changes if c.startswith("micro-batch")]
    m = int(micro.split()[1])
    k = 4096 // m
    assert micro.startswith(f"micro-batch {m} x {k} accumulation steps") and "same contrastive batch 32768" in micro
    config = json.loads(CFG_32K.read_text())
    smaller = P.validate_config({**config, "train_micro_batch_size_per_gpu": m, "gradient_accumulation_steps": k}, 8)
    fit, args = P.memory.load_fit(), (P.ModelShape.from_json(VIT),)
    assert P.memory_plan(*args, smaller, fit, "tiled", False, 40 * P.GiB).fits
    larger = [d for d in range(m + 1, 4096) if 4096 % d == 0]
    bigger = P.validate_config(
        {**config, "train_micro_batch_size_per_gpu": larger[0], "gradient_accumulation_steps": 4096 // larger[0]}, 8
    )
    assert not P.memory_plan(*args, bigger, fit, "tiled", False, 40 * P.GiB).fits
    print(P.format_report(result, CFG_32K, VIT))
    assert "tiled fits with any one of: " in capsys.readouterr().out


@pytest.mark.slow  # beyond the fast tier's time budget
def test_plan_puts_the_196k_batch_on_8_gpus_by_accumulation(tmp_path):
    config, vit = CFG_196K_8GPU, VIT
    code, result = paper_plan(tmp_path, config, 8, "--loss_impl", "tiled")
    assert code == 0 and result["global_batch"] == 3072 * 8 * 8 == 196608 and result["memory"]["tiled"]["fits"]
    terms = result["memory"]["tiled"]["terms"]
    # by hand: 8 micro-batches x 3072 rows x 512 dims, image and text, bf16 embeddings + their fp32 gradients
    assert terms["cached embeddings"] == 2 * 8 * 3072 * 512 * (2 + 4)
    # the loss spans all 196608 pairs (fp32 inputs), the activations one micro-batch: those of the 64-GPU run
    assert terms["loss (tiled)"] == P.loss_bytes("tiled", 196608, 8, 512, 4)
    paper = P.plan(
        CFG_196K,
        vit,
        64,
        "40GB",
        activation_checkpointing=True,
        loss_impls=("tiled",),
    )
    assert terms["activations"] == paper["memory"]["tiled"]["terms"]["activations"]
    # the largest K at this micro batch fits and K + 1 does not
    k = result["max_contrastive_steps"]["tiled"]
    settings = P.validate_config(P.read_deepspeed_json(config), 8)
    shape, fit = P.ModelShape.from_json(vit), P.load_fit()
    fits = lambda steps: (
        P.memory_plan(shape, dataclasses.replace(settings, grad_accum=steps), fit, "tiled", True, 40 * P.GiB).fits
    )
    assert k >= 8 and fits(k) and not fits(k + 1)
    # without contrastive accumulation the same config contrasts one micro-step's pairs only
    plain = P.plan(
        config, vit, 8, "40GB", activation_checkpointing=True, loss_impls=("tiled",), contrastive_accumulation=False
    )
    assert plain["global_batch"] == 3072 * 8 and "cached embeddings" not in plain["memory"]["tiled"]["terms"]


SIGLIP_B16 = REPO / "recipes/models/siglip_b16.json"

SIGLIP_32K = REPO / "ds_configs/siglip_b16_32k_8gpu.json"


def test_sigmoid_loss_terms_by_hand_and_flat_in_the_world_size():
    b, d = 1024, 768
    rows = 2048  # the sigmoid loss's default tile: 2M logits / 1024 columns, capped at b
    fp32 = P.loss_bytes("tiled", b * 8, 8, d, 4, loss="sigmoid")
    assert fp32 == 2 * b * d * 4 + 3 * b * d * 4 + 3 * min(rows, b) * b * 4 + 2 * b * d * 4
    bf16 = P.loss_bytes("tiled", b * 8, 8, d, 2, loss="sigmoid")
    assert bf16 == 2 * b * d * 2 + 2 * b * d * 4 + 3 * b * d * 4 + 3 * b * b * 4 + 2 * b * d * 2
    assert P.loss_bytes("tiled", b * 64, 64, d, 2, loss="sigmoid") == bf16  # same local batch, 8x the ranks
    assert P.loss_bytes("tiled", b * 64, 64, d, 2) > 8 * P.loss_bytes("tiled", b * 8, 8, d, 2) / 2  # CLIP's grows
    with pytest.raises(P.PlanConfigError, match="the sigmoid loss has tiled, local"):
        P.loss_bytes("disco", b * 8, 8, d, 2, loss="sigmoid")


def test_sigmoid_traffic_by_hand():
    shape = P.ModelShape.from_json(SIGLIP_B16)
    assert shape.loss == "sigmoid" and shape.projection_dim == 768
    settings = P.validate_config(P.read_deepspeed_json(SIGLIP_32K), 8)
    traffic = P.traffic_bytes(shape, settings, ("tiled",))
    block = 4096 * 768
    assert traffic["sigmoid loss: text ring (forward)"] == 7 * block * 2  # bf16 features, 7 hops
    assert traffic["sigmoid loss: text ring (backward)"] == 7 * block * 2
    assert traffic["sigmoid loss: fp32 gradient ring (backward)"] == 8 * block * 4  # 8 hops, the last one home


def test_siglip_b16_32k_plan_verdict(capsys):
    argv = ["--deepspeed", str(SIGLIP_32K), "--model", str(SIGLIP_B16), "--gpus", "8", "--activation_checkpointing"]
    assert plan_command.main([*argv, "--gpu_memory", "80GB"]) == 0
    out = capsys.readouterr().out
    assert "sigmoid loss" in out and "tiled" in out and "disco" not in out.split("per-GPU memory")[1].splitlines()[0]
    assert plan_command.main([*argv, "--gpu_memory", "40GB"]) == 1  # ds_configs/README.md: fits on 80 GB, not on 40 GB
    with pytest.raises(P.PlanConfigError, match="--loss_impl disco: the sigmoid loss has tiled, local"):
        plan_command.main([*argv, "--gpu_memory", "80GB", "--loss_impl", "disco"])


@pytest.mark.slow  # beyond the fast tier's time budget
def test_a_distillation_teacher_is_counted(tmp_path):
    """--teacher: its weights in the training dtype (1/N of them under ZeRO-3, its own inference engine), its no-grad
    forward where it exceeds the student's activations (which it precedes), and its fp32 embeddings (K micro-batches
    cached, every rank's texts gathered by the loss); a smaller student's largest batch shrinks."""
    config, world = REPO / "ds_configs/vit_b32_196k_8gpu.json", 8
    alone = P.plan(config, VIT, world, "40GB", activation_checkpointing=True, loss_impls=("tiled",))
    taught = P.plan(config, VIT, world, "40GB", activation_checkpointing=True, loss_impls=("tiled",), teacher_path=VIT)
    terms, settings = taught["memory"]["tiled"]["terms"], taught["settings"]
    teacher = P.ModelShape.from_json(VIT)
    elem = P.memory.PRECISION_BYTES[settings["precision"]]
    shards = world if settings["stage"] == 3 else 1
    assert terms["teacher weights"] == pytest.approx(teacher.params * elem / shards)
    micro, k = settings["micro_batch"], taught["contrastive_steps"]
    assert terms["teacher embeddings"] == pytest.approx(
        (2 * k * micro + micro * world * k) * teacher.projection_dim * 4
    )
    # ViT-B/32's no-grad forward peaks in a text MLP (77 tokens, width 512, MLP 2048): 2 s x h + 4 s x m elements,
    # beside a sample's 224 x 224 pixels and 77 int64 ids; under the student's checkpointed activations here
    per_sample = (77 * (2 * 512 + 4 * 2048) + 3 * 224 * 224) * elem + 77 * 8
    assert teacher.forward_bytes_per_sample(elem) == per_sample
    assert per_sample * micro < terms["activations"] and terms["teacher forward"] == 0
    tiny = P.plan(config, REPO / "recipes/models/tiny.json", world, "40GB", loss_impls=("tiled",), teacher_path=VIT)
    small_terms, small_micro = tiny["memory"]["tiled"]["terms"], tiny["settings"]["micro_batch"]
    above = per_sample * small_micro - small_terms["activations"] - small_terms["loss (tiled)"]
    assert above > 0 and small_terms["teacher forward"] == pytest.approx(above)
    assert taught["model"]["teacher_params"] == teacher.params
    assert taught["max_micro_batch"]["tiled"] < alone["max_micro_batch"]["tiled"]
    stage3 = json.loads(config.read_text())
    stage3["zero_optimization"] = {**stage3["zero_optimization"], "stage": 3}
    (tmp_path / "stage3.json").write_text(json.dumps(stage3))
    sharded = P.plan(tmp_path / "stage3.json", VIT, world, "40GB", activation_checkpointing=True, teacher_path=VIT)
    assert sharded["settings"]["stage"] == 3
    assert sharded["memory"]["tiled"]["terms"]["teacher weights"] == pytest.approx(teacher.params * elem / world)
    siglip = REPO / "recipes/models/siglip_tiny.json"
    with pytest.raises(P.PlanConfigError, match="cannot teach"):
        P.plan(config, VIT, world, "40GB", activation_checkpointing=True, teacher_path=siglip)
    with pytest.raises(P.PlanConfigError, match="distils the global batch"):
        P.plan(config, VIT, world, "40GB", loss_impls=("local",), teacher_path=VIT)
