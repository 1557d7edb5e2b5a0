"""Export of ZeRO-2/ZeRO-3 DeepSpeed checkpoints to a plain CLIPModel folder (reloaded in a fresh process with
transformers alone) and its refusals, launched: checkpoints of DeepSpeed engines on 2 spawned ranks, and a real
ZeRO-3 training run exported and evaluated. (Export of plain checkpoints and diverged weights:
unit/export/test_weights.py; `push` of an exported folder: unit/export/test_hub.py.)"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from disco_clip_ds.checkpoint.consolidate import load_state_dict
from disco_clip_ds.checkpoint.layout import save_problem
from disco_clip_ds.checkpoint.manifest import write_manifest
from disco_clip_ds.commands import export as export_command
from disco_clip_ds.data.prep.demo import DIGITS
from disco_clip_ds.errors import run_main
from disco_clip_ds.export import weights as ex
from disco_clip_ds.testing.images import noise_image_bytes, write_samples
from disco_clip_ds.testing.launch import TINY_CONFIG, TOKENIZER_DIR, run_training, train_command
from disco_clip_ds.testing.ranks import run_ranks
from disco_clip_ds.testing.zeroshot import assert_final_eval_is_the_last_zeroshot

pytestmark = pytest.mark.timeout(900)  # the module's deepspeed runs take minutes on a busy 2-core machine

REPO = Path(__file__).resolve().parents[2]
MODEL_CONFIG = TINY_CONFIG
PROMPTS = ["a photo of the number three.", "a dog", "seven"]


def fixed_pixels() -> torch.Tensor:
    return torch.randn(3, 3, 64, 64, generator=torch.Generator().manual_seed(7))


def _train_and_save(rank, world_size, stage, precision, checkpoint):
    """A few DeepSpeed steps of DiscoCLIPModel (ZeRO `stage`), then the checkpoint a Trainer would leave,
    and the trained model's embeddings of fixed inputs (under ZeRO-3 every rank must run the forward)."""
    os.environ.update(DS_ACCELERATOR="cpu", LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size))
    import deepspeed
    from transformers import AutoTokenizer, CLIPConfig, CLIPImageProcessor

    from disco_clip_ds.models.clip import DiscoCLIPModel

    torch.manual_seed(0)
    model = DiscoCLIPModel(CLIPConfig.from_json_file(str(MODEL_CONFIG)))
    ds_config = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 1_000_000},
        "bf16": {"enabled": precision == "bf16"},
    }
    engine, *_ = deepspeed.initialize(model=model, config=ds_config, model_parameters=model.parameters())
    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER_DIR)
    gen = torch.Generator().manual_seed(100 + rank)
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    for step in range(3):
        texts = [f"a photo of the number {w}." for w in ("one", "two", "three", "four")]
        tokens = tokenizer(texts, padding="max_length", max_length=16, return_tensors="pt")
        pixels = torch.randn(4, 3, 64, 64, generator=gen).to(dtype)
        loss = engine(
            input_ids=tokens["input_ids"],
            attention_mask=tokens["attention_mask"],
            pixel_values=pixels,
            return_loss=True,
        ).loss
        engine.backward(loss)
        engine.step()
    engine.save_checkpoint(str(checkpoint))
    torch.save({}, checkpoint / f"rng_state_{rank}.pth")  # the Trainer saves each rank's RNG state beside it
    if rank == 0:  # what the Trainer writes beside DeepSpeed's state
        model.config.save_pretrained(checkpoint)
        tokenizer.save_pretrained(checkpoint)
        CLIPImageProcessor(size={"shortest_edge": 64}, crop_size={"height": 64, "width": 64}).save_pretrained(
            checkpoint
        )
        (checkpoint / "trainer_state.json").write_text(
            json.dumps(
                {
                    "global_step": 3,
                    "max_steps": 3,
                    "train_batch_size": 4,
                    "log_history": [{"loss": float(loss), "step": 3}],
                }
            )
        )
        # what `disco-clip train` records for the model card beside the checkpoints
        (checkpoint.parent / "run.json").write_text(
            json.dumps(
                {
                    "world_size": world_size,
                    "micro_batch_per_rank": 4,
                    "global_contrastive_batch": 4 * world_size,
                    "loss_impl": "tiled",
                    "zero_stage": stage,
                    "precision": precision,
                    "versions": {"deepspeed": deepspeed.__version__},
                }
            )
        )
    torch.distributed.barrier()
    if rank == 0:  # every rank has written its part: the manifest, as `disco-clip train` publishes a checkpoint
        write_manifest(checkpoint)
    engine.eval()
    with torch.no_grad():
        # the exported weights are the fp32 masters; compare against an fp32 forward with them
        tokens = tokenizer(PROMPTS, padding=True, return_tensors="pt")
        text = engine.module.get_text_features(**tokens).pooler_output.float()
        image = engine.module.get_image_features(pixel_values=fixed_pixels().to(dtype)).pooler_output.float()
    torch.distributed.barrier()
    return {"text": text, "image": image, "loss": float(loss)}


def _train_and_save_stages(rank, world_size, stages, root):
    # one spawn for all stages: the ranks' imports cost more than the runs
    return {
        stage: _train_and_save(rank, world_size, stage, "fp32", root / f"zero{stage}" / "checkpoint-3")
        for stage in stages
    }


@pytest.fixture(scope="module")
def trained_checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("ds")
    for stage in (2, 3):
        (root / f"zero{stage}" / "checkpoint-3").mkdir(parents=True)
    return root, run_ranks(_train_and_save_stages, 2, (2, 3), root, timeout=600)[0]


@pytest.fixture(scope="module", params=[2, 3], ids=["zero2", "zero3"])
def checkpoint(request, trained_checkpoints):
    root, results = trained_checkpoints
    return root / f"zero{request.param}" / "checkpoint-3", request.param, results[request.param]


RELOAD = r"""
import json, sys, torch
from transformers import CLIPModel, CLIPProcessor
prompts, folders = json.loads(sys.argv[1]), sys.argv[2:]
for i, folder in enumerate(folders):
    model = CLIPModel.from_pretrained(folder).eval()
    processor = CLIPProcessor.from_pretrained(folder)
    assert type(processor.tokenizer).__name__.startswith("CLIPTokenizer"), type(processor.tokenizer)
    pixels = torch.randn(3, 3, 64, 64, generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        text = model.get_text_features(**processor.tokenizer(prompts, padding=True, return_tensors="pt")).pooler_output
        image = model.get_image_features(pixel_values=pixels).pooler_output
    torch.save({"text": text, "image": image, "logit_scale": model.logit_scale.detach()}, f"emb{i}.pt")
"""


def reload_in_fresh_process(tmp: Path, *folders: Path) -> list[dict]:
    """Load each folder with transformers alone (no disco_clip_ds import) in a new interpreter; its embeddings."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": ""}
    subprocess.run(
        [sys.executable, "-c", RELOAD, json.dumps(PROMPTS), *map(str, folders)],
        check=True,
        env=env,
        cwd=tmp,
        timeout=120,
    )
    return [torch.load(tmp / f"emb{i}.pt") for i in range(len(folders))]


EVAL_RECORD = {"dataset": "demo/eval", "task": "zeroshot_classification", "metrics": {"acc1": 0.875, "acc5": 1.0}}


@pytest.fixture(scope="module")
def exports(trained_checkpoints, tmp_path_factory):
    """{stage: (export of the run folder's newest checkpoint, its embeddings reloaded with transformers alone)}:
    both stages reloaded in one fresh interpreter (its imports cost more than the forwards)."""
    root, _ = trained_checkpoints
    tmp = tmp_path_factory.mktemp("exports")
    outs = {
        stage: ex.export_checkpoint(root / f"zero{stage}", tmp / f"zero{stage}", eval_metrics=EVAL_RECORD)
        for stage in (2, 3)
    }  # run folder -> newest checkpoint
    return dict(zip(outs, zip(outs.values(), reload_in_fresh_process(tmp, *outs.values()))))


@pytest.mark.slow
def test_export_reproduces_trained_embeddings(checkpoint, exports):
    _, stage, trained = checkpoint
    out, reloaded = exports[stage]
    assert sorted(p.name for p in out.iterdir()) == sorted(
        [
            "README.md",
            "config.json",
            "model.safetensors",
            "processor_config.json",
            "tokenizer.json",
            "tokenizer_config.json",
        ]
    )
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["CLIPModel"]
    assert "loss_impl" not in config and "chunk_size" not in config  # training settings: the card states them
    torch.testing.assert_close(reloaded["text"], trained["text"], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(reloaded["image"], trained["image"], rtol=1e-5, atol=1e-5)
    assert reloaded["logit_scale"].dim() == 0
    card = (out / "README.md").read_text()
    for fact in (
        f"| DeepSpeed ZeRO stage | {stage} |",
        "| world size (data-parallel ranks) | 2 |",
        "| global contrastive batch (pairs per loss) | 8 |",
        "| loss implementation | tiled |",
        "| precision | fp32 |",
        "| optimizer steps | 3 |",
        "| acc1 | 0.8750 |",
        "library_name: transformers",
    ):
        assert fact in card, fact


@pytest.mark.slow
def test_export_trained_weights_differ_from_init(checkpoint):
    # guards the embedding test: a checkpoint that silently exported the initial weights would also "match"
    # itself, but not a fresh DiscoCLIPModel with the same seed
    from transformers import CLIPConfig

    from disco_clip_ds.models.clip import DiscoCLIPModel

    folder, _, trained = checkpoint
    torch.manual_seed(0)
    fresh = DiscoCLIPModel(CLIPConfig.from_json_file(str(MODEL_CONFIG))).eval()
    with torch.no_grad():
        image = fresh.get_image_features(pixel_values=fixed_pixels()).pooler_output
    assert not torch.allclose(image, trained["image"], atol=1e-3)


@pytest.mark.slow
def test_partial_checkpoint_is_refused_and_nothing_is_written(checkpoint, tmp_path):
    folder, _, _ = checkpoint
    broken = tmp_path / "checkpoint-3"
    shutil.copytree(folder, broken)
    tag = (broken / "latest").read_text().strip()
    lost = next((broken / tag).glob("*optim_states.pt"))
    lost.unlink()  # one rank's partition lost
    missing = f"{tag}/{lost.name} is missing \\(the manifest lists it\\)"
    with pytest.raises(ex.ExportError, match=f"does not verify: {missing}"):
        ex.export_checkpoint(broken, tmp_path / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-3"]  # no output, no staging left
    assert save_problem(broken) == "1 DeepSpeed optimizer shards for 2 ranks"  # seen without the manifest too
    with pytest.raises(ex.ExportError, match="partial or corrupt DeepSpeed checkpoint"):
        load_state_dict(broken)  # what export would meet past the check

    shutil.rmtree(broken / tag)
    with pytest.raises(ex.ExportError, match="does not verify: .* is missing"):
        ex.export_checkpoint(broken, tmp_path / "out")
    assert save_problem(broken) == f"no DeepSpeed model states in {tag}"


def export_main(argv: list[str]) -> int:
    """`disco-clip export` in this process: its exit code, its messages on stderr."""
    return run_main(export_command.main, argv, "disco-clip export")


@pytest.mark.slow
def test_export_refusals(checkpoint, tmp_path, capsys):
    folder, _, _ = checkpoint
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "keep.txt").write_text("mine")
    assert export_main([str(folder), str(taken)]) == 1
    assert "is not empty" in capsys.readouterr().err
    assert [p.name for p in taken.iterdir()] == ["keep.txt"]
    assert export_main([str(tmp_path / "nope"), str(tmp_path / "out")]) == 2
    assert "does not exist" in capsys.readouterr().err
    no_processor = tmp_path / "run" / "checkpoint-3"
    shutil.copytree(folder, no_processor, ignore=shutil.ignore_patterns("tokenizer*", "preprocessor_config.json"))
    write_manifest(no_processor)  # a checkpoint published without them (the Trainer saves them only when given)
    assert export_main([str(no_processor), str(tmp_path / "out")]) == 1
    assert "--processor_from" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


class Planted:
    """What a forger puts in a checkpoint: unpickling it calls os.mkdir(marker)."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return os.mkdir, (self.marker,)


@pytest.mark.slow
def test_a_planted_pickle_is_refused_and_never_run(checkpoint, tmp_path, capsys):
    """An optimizer partition replaced by an object whose unpickling runs code, the manifest rebuilt to match (the
    manifest detects damage, not a forger): export refuses it in one line, naming it, and the code never runs."""
    folder, _, _ = checkpoint
    forged = tmp_path / "checkpoint-3"
    shutil.copytree(folder, forged)
    tag = (forged / "latest").read_text().strip()
    partition = sorted((forged / tag).glob("*optim_states.pt"))[-1]
    marker = tmp_path / "planted-code-ran"
    torch.save({"optimizer_state_dict": Planted(marker)}, partition)
    write_manifest(forged)
    assert export_main([str(forged), str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"disco-clip export: refused to read '{partition}': it holds a pickled posix.mkdir"), err
    assert err.count("\n") == 1
    assert not marker.exists() and not (tmp_path / "out").exists()


# ---------------------------------------------------------------- end to end: train.py -> export -> eval


def launch_training(output: Path, *args: str) -> None:
    """`torchrun --nproc_per_node 2 -m disco_clip_ds.train` with the tiny model on CPU; fails with its log. (torchrun
    starts sooner than the deepspeed launcher, which test_train and
    launched/test_faults_and_preemption.py cover.)"""
    cmd = [
        *train_command("torchrun", 2),
        "--model_config",
        MODEL_CONFIG,
        "--tokenizer_name",
        TOKENIZER_DIR,
        "--output_dir",
        output,
        "--report_to",
        "none",
        "--disable_tqdm",
        "true",
        "--dataloader_num_workers",
        "1",
        "--logging_steps",
        "1",
        *args,
    ]
    run_training(cmd, timeout=600)  # imports alone take minutes on a busy 2-core machine


@pytest.fixture(scope="module")
def zero3_run(tmp_path_factory):
    """A real `disco_clip_ds.train` run with DeepSpeed on 2 CPU ranks with ZeRO-3, checkpointing every 2
    steps and running the zero-shot callback every 2 steps."""
    import numpy as np

    root = tmp_path_factory.mktemp("run")
    rng = np.random.default_rng(5)
    write_samples(
        root / "train",
        [
            {"jpg": noise_image_bytes(rng, "JPEG", 64), "txt": f"a photo of the digit {DIGITS[i % 10]}"}
            for i in range(32)
        ],
        per_shard=16,
    )
    write_samples(
        root / "eval", [{"png": noise_image_bytes(rng, size=64), "cls": str(i % 10)} for i in range(20)], per_shard=10
    )
    (root / "eval" / "classnames.txt").write_text("\n".join(DIGITS) + "\n")
    (root / "eval" / "zeroshot_classification_templates.txt").write_text("a photo of the digit {c}\n{c}\n")
    launch_training(
        root / "out",
        "--deepspeed",
        REPO / "ds_configs" / "cpu_zero3.json",
        "--train_shards",
        root / "train",
        "--train_num_samples",
        "32",
        "--max_steps",
        "4",
        "--save_steps",
        "2",
        "--per_device_train_batch_size",
        "4",
        "--per_device_eval_batch_size",
        "8",
        "--zeroshot_data",
        root / "eval",
        "--zeroshot_steps",
        "2",
    )
    return root


@pytest.mark.slow
def test_trained_zero3_run_exports_and_evaluates_like_during_training(zero3_run, tmp_path):
    from disco_clip_ds.commands.eval import load_for_eval
    from disco_clip_ds.eval import tasks as ev

    out = zero3_run / "out"
    state = json.loads((out / "trainer_state.json").read_text())
    during = {e["step"]: e for e in state["log_history"] if "zeroshot_acc1" in e}
    assert sorted(during) == [2, 4]  # the callback ran on both ranks under ZeRO-3 (a one-rank forward would hang)
    # a step that evaluates logs its own loss too (the eval's log must not take the step's), each over its own step
    assert sorted(e["step"] for e in state["log_history"] if "loss" in e) == [1, 2, 3, 4]

    exported = ex.export_checkpoint(out / "checkpoint-4", tmp_path / "model")  # consolidated from ZeRO-3 partitions
    assert "| DeepSpeed ZeRO stage | 3 |" in (exported / "README.md").read_text()
    # against the Trainer's own final weights, gathered by DeepSpeed's other path (16-bit gather, fp32 here)
    from_export, from_trainer = reload_in_fresh_process(tmp_path, exported, out)
    torch.testing.assert_close(from_export["image"], from_trainer["image"], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(from_export["text"], from_trainer["text"], rtol=1e-5, atol=1e-5)

    data = str(zero3_run / "eval")
    model, tokenizer, processor = load_for_eval(str(exported))
    metrics = ev.zeroshot_classification(
        model,
        tokenizer,
        data,
        ev.find_classnames(data, None),
        ev.find_templates(data, None),
        image_processor=processor,
        progress=False,
    )
    assert {k: during[4][f"zeroshot_{k}"] for k in metrics} == pytest.approx(metrics)
    # `disco-clip eval` through the run folder (its final model) and through `disco-clip export` of the run folder
    assert_final_eval_is_the_last_zeroshot(out, zero3_run / "eval", tmp_path / "export")
