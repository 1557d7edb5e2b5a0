"""Contrastive accumulation end to end: K micro-batches of b train exactly like one batch of K x b on one rank, and
N ranks x K micro-batches like one rank with N x K x b, under plain PyTorch, DDP, DeepSpeed ZeRO-1/2/3 and FSDP,
with gradient checkpointing; a resumed run continues exactly; bad settings stop every rank with the reason. The
sharded runs also drop half of each image's patches (FLIP) and lock parts of both towers: frozen weights stay
bit-identical and get no optimizer state; two drop them at progressive resolution, each step's at its grid, one of
them with each stage's own micro-batch.
(The math: tests/unit/train/test_accumulation.py.)"""

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from disco_clip_ds.testing.images import write_shards
from disco_clip_ds.testing.launch import (
    QUICK,
    REPO,
    SGD,
    TINY_CONFIG,
    TOKENIZER_DIR,
    launch,
    launch_in_one_process,
    train_command,
    train_env,
)
from disco_clip_ds.testing.runs import (
    assert_same_training,
    assert_trained_under_fsdp,
    same_weights,
    save_initial_model,
    step_losses,
    weights,
)

STEPS, MICRO, SEED = 3, 4, 11

SAME_STREAM = ["--max_steps", str(STEPS), "--accelerator_config", '{"dispatch_batches": true}']
# Per-tower rates and layer decay (train/optim.py), on the sharded runs: each stage must apply every parameter
# group's rate as the Trainer's own optimizer does (their reference, n1_k1_towers). At SGD's lr 0.5 this is a
# relative rate (tower rate x decay^k / 0.5) per parameter of: vision 0.5 x (embeddings 1/8, layer 0 1/4, layer 1
# 1/2, after 1); text embeddings 1/64, layer 0 1/16, layer 1 1/4, after 1; logit_scale 1.
TOWERS = ["--vision_lr", "0.25", "--vision_layer_decay", "0.5", "--text_layer_decay", "0.25"]
# FLIP's patch dropout on the same sharded runs (and their reference): each sample's mask is its own, so K
# micro-batches (both passes of each) and N ranks see the masks one batch of all pairs sees.
PATCHES = ["--patch_dropout", "0.5"]
UNTIL_1, UNTIL_3 = (["--patch_dropout_until_step", str(step)] for step in (1, 3))
# and at progressive resolution (models/resolution.py): steps 1, 2, 3 at 32, 48, 64 px, each sample keeping half the
# patches of its step's grid (2 of 4, 4 of 9, 8 of 16), drawn per grid from the sample alone
SCHEDULE = ["--resolution_schedule", "0:32,0.34:48,0.67:64"]
# and each stage's micro-batch per rank (--stage_micro_batch_sizes) over a stream of micro-batches of 2, K = 4: step 1
# runs its 4 micro-batches as one forward of 8 at 32 px, step 2 as 2 of 4 at 48, step 3 as 4 of 2 at 64
STAGE_MICRO = ["--stage_micro_batch_sizes", "8,4,2"]
RELATIVE_RATES = {
    "vision_model.embeddings.patch_embedding.weight": 1 / 16,
    "vision_model.pre_layrnorm.weight": 1 / 16,
    "vision_model.encoder.layers.0.mlp.fc1.weight": 1 / 8,
    "vision_model.encoder.layers.1.self_attn.v_proj.weight": 1 / 4,
    "vision_model.post_layernorm.bias": 1 / 2,
    "visual_projection.weight": 1 / 2,
    "text_model.embeddings.token_embedding.weight": 1 / 64,
    "text_model.encoder.layers.0.self_attn.out_proj.weight": 1 / 16,
    "text_model.encoder.layers.1.mlp.fc2.weight": 1 / 4,
    "text_model.final_layer_norm.weight": 1.0,
    "text_projection.weight": 1.0,
    "logit_scale": 1.0,
}
# Partly locked towers (train/locking.py) on the same sharded runs and their reference: whatever the stage, only the
# parameters LOCK leaves unlocked may move, and only they may have optimizer state. Written out for the tiny CLIP (2
# layers a tower): vision layer 1's attention and MLP (its LayerNorms frozen too) and the projection train; the
# text tower trains but for its embeddings.
LOCK = [
    "--lock_image_tower",
    "--lock_image_tower_unlocked_layers",
    "1",
    "--lock_image_tower_freeze_norm",
    "--lock_text_tower",
    "--lock_text_tower_unlocked_layers",
    "2",
]


def locked(name: str) -> bool:
    """Whether LOCK freezes the parameter `name` of the tiny CLIP."""
    if name.startswith("vision_model."):
        return not name.startswith(("vision_model.encoder.layers.1.self_attn.", "vision_model.encoder.layers.1.mlp."))
    return name.startswith("text_model.embeddings.")


@pytest.mark.slow
def test_bad_settings_stop_every_rank_with_the_reason(tmp_path):
    """2 ranks under torchrun: each rank prints the reason and the launch ends (no rank waits in a collective)."""
    write_shards(tmp_path / "data", num_shards=2, per_shard=4)
    cmd = [
        *train_command("torchrun", 2),
        "--output_dir",
        str(tmp_path / "out"),
        "--report_to",
        "none",
        "--train_shards",
        str(tmp_path / "data"),
        "--model_config",
        str(TINY_CONFIG),
        "--tokenizer_name",
        str(TOKENIZER_DIR),
        "--loss_impl",
        "local",
        "--gradient_accumulation_steps",
        "2",
    ]
    proc = subprocess.run(cmd, cwd=REPO, env=train_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert (proc.stdout + proc.stderr).count("cannot be accumulated contrastively") == 2, (proc.stdout + proc.stderr)[
        -3000:
    ]
    assert not (tmp_path / "out" / "model.safetensors").exists()


@pytest.fixture(scope="module")
def initial_model(tmp_path_factory):
    return save_initial_model(tmp_path_factory.mktemp("init") / "tiny", SEED)


# The fixture's 19 runs (~15-25 s of imports per launch on a quiet 2-core machine, several times that on a loaded
# one) are charged to the first test that uses it.
E2E_TIMEOUT = pytest.mark.timeout(1800)

# AdamW with weight decay, clipping that bites, and a warmup + cosine schedule: all act on the accumulated gradient
# at the optimizer step, so K micro-batches must still train like one batch of all pairs. Adam divides by each
# gradient's own scale, which lifts fp32 summation-order noise in near-zero gradients: a looser update bound.
ADAMW = [
    "--optim",
    "adamw_torch",
    "--learning_rate",
    "1e-3",
    "--weight_decay",
    "0.1",
    "--max_grad_norm",
    "0.05",
    "--lr_scheduler_type",
    "cosine",
    "--warmup_steps",
    "1",
]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, initial_model):
    """The references (1 rank, K=1, micro 4b; SGD and AdamW) and the accumulating runs; ~3 min on 2 cores."""
    root = tmp_path_factory.mktemp("accum")
    write_shards(root / "data", num_shards=4, per_shard=24, seed=3)
    data = [
        "--model_name_or_path",
        str(initial_model),
        "--train_shards",
        f"{root}/data/{{00000..00003}}.tar",
        "--train_num_samples",
        "96",
    ]
    common, same = [*data, *SGD], [*data, *SGD, *SAME_STREAM]
    micro = lambda b, k: ["--per_device_train_batch_size", str(b), "--gradient_accumulation_steps", str(k)]
    gc = ["--gradient_checkpointing", "true"]
    zero1 = root / "zero1.json"
    zero1.write_text(
        json.dumps(
            {
                **json.loads((REPO / "ds_configs/cpu_zero2.json").read_text()),
                "zero_optimization": {"stage": 1, "reduce_bucket_size": 50000000, "allgather_bucket_size": 50000000},
            }
        )
    )
    # the one-rank runs share one interpreter (the reference first); each is what `python -m disco_clip_ds.train` runs
    launch_in_one_process(
        [
            (root / "n1_k1", [*same, *micro(4 * MICRO, 1)]),
            (root / "n1_k1_towers", [*same, *micro(4 * MICRO, 1), *TOWERS, *PATCHES, *LOCK]),
            (root / "n1_k1_scheduled", [*same, *micro(4 * MICRO, 1), *PATCHES, *SCHEDULE]),
            (root / "step1", [*same, *micro(4 * MICRO, 1), "--max_steps", "1"]),
            (root / "step1_towers", [*same, *micro(4 * MICRO, 1), "--max_steps", "1", *TOWERS]),
            (root / "step1_unmasked", [*same, *micro(4 * MICRO, 1), "--max_steps", "1", *TOWERS, *PATCHES, *UNTIL_1]),
            (root / "n1_k4", [*same, *micro(MICRO, 4)]),
            (root / "n1_k4_plain", [*same, *micro(MICRO, 4), "--contrastive_accumulation", "false"]),
            (root / "adamw_k1", [*data, *ADAMW, *SAME_STREAM, *micro(4 * MICRO, 1)]),
            (root / "adamw_k4", [*data, *ADAMW, *SAME_STREAM, *micro(MICRO, 4)]),
        ]
    )
    # the launchers themselves are test_train's subject: torchrun starts fastest, accelerate sets up FSDP
    sharded = [*same, *micro(MICRO, 2), *TOWERS, *PATCHES, *LOCK]
    launch(QUICK, 2, root / "n2_k2_zero1", *sharded, ds_config=str(zero1))
    launch(QUICK, 2, root / "n2_k2_zero2", *sharded)
    launch("accelerate", 2, root / "n2_k2_zero3_gc", *sharded, *gc, ds_config="cpu_zero3.json")
    launch("accelerate", 2, root / "n2_k2_fsdp", *sharded, ds_config=None)
    launch(QUICK, 2, root / "n2_k2_ddp_gc", *same, *micro(MICRO, 2), *gc, ds_config=None)
    launch(QUICK, 2, root / "n2_k2_zero2_scheduled", *same, *micro(MICRO, 2), *PATCHES, *SCHEDULE)
    launch(QUICK, 2, root / "n2_k4_zero2_staged", *same, *micro(MICRO // 2, 4), *PATCHES, *SCHEDULE, *STAGE_MICRO)
    # each rank reading its own shards (the default), uninterrupted, then resumed from the step-2 checkpoint
    # with patch dropout up to step 3, which the resumed part switches off as the uninterrupted run did
    own = [*common, *micro(MICRO, 2), "--max_steps", "4", "--save_steps", "2", *PATCHES, *UNTIL_3]
    launch(QUICK, 2, root / "full", *own)
    shutil.copytree(root / "full" / "checkpoint-2", root / "resumed" / "checkpoint-2")
    launch(QUICK, 2, root / "resumed", *own, "--resume_from_checkpoint", "latest")
    return root


@E2E_TIMEOUT
@pytest.mark.parametrize(
    "run",
    [
        "n1_k4",
        "n2_k2_zero1",
        "n2_k2_zero2",
        "n2_k2_zero3_gc",
        "n2_k2_fsdp",
        "n2_k2_ddp_gc",
        "n2_k2_zero2_scheduled",
        "n2_k4_zero2_staged",
    ],
)
@pytest.mark.slow
def test_accumulated_run_trains_like_one_batch_of_all_pairs(runs, initial_model, run):
    if "fsdp" in run:  # sharded by FSDP2, not fallen back to DDP
        assert_trained_under_fsdp(runs / run)
    history = json.loads((runs / run / "trainer_state.json").read_text())["log_history"]
    if "scheduled" in run or "staged" in run:  # each step at its stage's side, the masks of its grid
        assert [h["image_size"] for h in history if "loss" in h] == [32, 48, 64]
    if "staged" in run:  # and the rows of its forwards with grad
        assert [h["micro_batch_per_rank"] for h in history if "loss" in h] == [8, 4, 2]
    # the sharded runs: TOWERS, PATCHES and LOCK; the scheduled ones: PATCHES and SCHEDULE
    scheduled = "n1_k1_scheduled"
    reference = {"n1_k4": "n1_k1", "n2_k2_ddp_gc": "n1_k1", "n2_k2_zero2_scheduled": scheduled}.get(run, "n1_k1_towers")
    reference = scheduled if "staged" in run else reference
    assert_same_training(runs / run, runs / reference, weights(initial_model), steps=STEPS)


@E2E_TIMEOUT
@pytest.mark.slow
@pytest.mark.parametrize("run", ["n1_k1_towers", "n2_k2_zero1", "n2_k2_zero2", "n2_k2_zero3_gc", "n2_k2_fsdp"])
def test_locked_parameters_stay_bit_identical_and_get_no_optimizer_state(runs, initial_model, run):
    """Under the Trainer's optimizer, ZeRO-1/2/3 and FSDP: after 3 steps the parameters LOCK freezes are the initial
    ones bit for bit and every other one moved; the checkpoint's optimizer holds the trained parameters alone."""
    import torch

    w0, trained = weights(initial_model), weights(runs / run)
    unchanged = {name for name in w0 if torch.equal(trained[name], w0[name])}
    frozen = {name for name in w0 if locked(name)}
    assert frozen and unchanged == frozen
    assert json.loads((runs / run / "run.json").read_text())["locked_towers"] == " ".join(LOCK)  # a resume keeps it
    held = optimizer_parameters(runs / run / "checkpoint-3")
    if isinstance(held, int):  # the Trainer's optimizer.pt numbers its parameters instead of naming them
        assert held == len(w0) - len(frozen)
    else:
        assert held == set(w0) - frozen
    partitions = zero_fp32_partitions(runs / run / "checkpoint-3")
    if partitions:  # each group is padded to a multiple of the ranks at most
        size = sum(w0[name].numel() for name in set(w0) - frozen)
        assert size <= sum(map(sum, partitions)) < size + len(partitions) * len(partitions[0])


def optimizer_parameters(checkpoint: Path) -> set[str] | int:
    """The parameters a checkpoint's optimizer state holds: DeepSpeed's and FSDP's by name, the Trainer's by count."""
    import torch

    zero = sorted(checkpoint.glob("global_step*/*model_states.pt"))
    if zero:  # every rank's file lists the optimizer's parameters, group by group
        shapes = torch.load(zero[0], weights_only=False)["param_shapes"]
        return {name for group in shapes for name in group}
    if (checkpoint / "optimizer.bin").is_file():  # FSDP's full optimizer state dict
        groups = torch.load(checkpoint / "optimizer.bin", weights_only=False)["param_groups"]
        return {name for group in groups for name in group["params"]}
    groups = torch.load(checkpoint / "optimizer.pt", weights_only=False)["param_groups"]
    return sum(len(group["params"]) for group in groups)


def zero_fp32_partitions(checkpoint: Path) -> list[list[int]]:
    """The sizes of ZeRO's fp32 partitions (master weights; Adam's moments have the same), rank by rank, group by
    group; [] without DeepSpeed."""
    import torch

    ranks = []
    for path in sorted(checkpoint.glob("global_step*/*optim_states.pt")):
        state = torch.load(path, weights_only=False)["optimizer_state_dict"]
        flat = state["fp32_flat_groups"] if "fp32_flat_groups" in state else state["single_partition_of_fp32_groups"]
        ranks.append([t.numel() for t in flat])
    return ranks


@E2E_TIMEOUT
@pytest.mark.slow
def test_per_tower_rates_and_layer_decay_scale_each_parameters_first_update(runs, initial_model):
    """One SGD step from the same weights on the same batch, with and without TOWERS: each parameter's update is the
    plain one times its relative rate (the gradient is the same, so the ratio is the rate's, up to fp32 rounding)."""
    import torch

    w0, plain, towers = weights(initial_model), weights(runs / "step1"), weights(runs / "step1_towers")
    for name, rate in RELATIVE_RATES.items():
        reference, update = plain[name] - w0[name], towers[name] - w0[name]
        moved = reference.abs() > 1e-3 * reference.abs().max()
        assert moved.sum() > 0, name
        assert torch.median(update[moved] / reference[moved]).item() == pytest.approx(rate, rel=1e-3), name
    # and the towers' runs train on from there: n1_k1_towers moved differently from n1_k1
    assert (
        weights(runs / "n1_k1_towers")["visual_projection.weight"] - weights(runs / "n1_k1")["visual_projection.weight"]
    ).abs().max() > 1e-4


@E2E_TIMEOUT
@pytest.mark.slow
def test_patch_dropout_masks_until_its_step_and_then_every_patch_is_seen(runs):
    """Step 1 from the same weights on the same batch: with patch dropout the loss differs from the run without it
    (the masks were applied); with --patch_dropout_until_step 1 the run is the one without it, bit for bit."""
    masked, unmasked, plain = (step_losses(runs / r)[0] for r in ("n1_k1_towers", "step1_unmasked", "step1_towers"))
    assert abs(masked - plain) > 1e-3 and unmasked == plain
    assert same_weights(runs / "step1_unmasked", runs / "step1_towers") == 0
    facts = json.loads((runs / "full" / "run.json").read_text())
    assert facts["patch_dropout"] == "0.5 of the patches dropped, every patch from step 3"


@E2E_TIMEOUT
@pytest.mark.slow
def test_contrastive_accumulation_false_keeps_independent_micro_batch_losses(runs):
    """The flag off: the same K=4 run trains on 4 separate losses of b pairs, so the reference check above can fail."""
    plain, reference = step_losses(runs / "n1_k4_plain"), step_losses(runs / "n1_k1")
    # at the shared initial weights CLIP's loss is about ln(pairs): ln(4) per micro-batch against ln(16)
    assert reference[0] - plain[0] > 0.5
    logged = json.loads((runs / "n1_k4_plain" / "trainer_state.json").read_text())["log_history"][0]
    assert logged["global_contrastive_batch"] == MICRO


@E2E_TIMEOUT
@pytest.mark.slow
def test_logged_contrastive_batch_is_micro_x_world_x_k(runs):
    for run, expected in (("n1_k4", 4 * MICRO), ("n2_k2_zero2", 4 * MICRO), ("n1_k1", 4 * MICRO)):
        logged = json.loads((runs / run / "trainer_state.json").read_text())["log_history"][0]
        assert logged["global_contrastive_batch"] == expected, run
        assert json.loads((runs / run / "run.json").read_text())["global_contrastive_batch"] == expected


@E2E_TIMEOUT
@pytest.mark.slow
def test_resumed_run_continues_exactly(runs):
    full, resumed = step_losses(runs / "full"), step_losses(runs / "resumed")
    assert (runs / "resumed.log").read_text().count("{'loss': ") == 2  # steps 3 and 4 were trained after the resume
    assert len(full) == len(resumed) == 4
    assert resumed == pytest.approx(full, rel=1e-6)
    wa, wb = weights(runs / "full"), weights(runs / "resumed")
    assert max((wa[k] - wb[k]).abs().max().item() for k in wa) <= 1e-6


@E2E_TIMEOUT
@pytest.mark.slow
def test_weight_decay_clipping_and_schedule_act_on_the_accumulated_gradient(runs, initial_model):
    for run in ("adamw_k1", "adamw_k4"):
        history = json.loads((runs / run / "trainer_state.json").read_text())["log_history"]
        assert all(h["grad_norm"] > 0.05 for h in history if "grad_norm" in h), run  # clipping was active
        # one warmup step (at the full lr: warmup starts at lr / warmup), then cosine over the remaining two
        assert [h["learning_rate"] for h in history if "learning_rate" in h] == pytest.approx([1e-3, 1e-3, 5e-4])
        # the epoch logged is the passes over the data: 16 samples a step of 96 (the Trainer's own would be step / 3)
        assert [h["epoch"] for h in history if "loss" in h] == pytest.approx([1 / 6, 2 / 6, 3 / 6])
    assert_same_training(runs / "adamw_k4", runs / "adamw_k1", weights(initial_model), update_rtol=1e-3, steps=STEPS)
