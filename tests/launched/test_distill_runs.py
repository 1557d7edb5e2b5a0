"""A live teacher end to end: distillation from a teacher of another width, image size and text length (its own
pixels and tokens made by the collator) trains exactly alike as one batch of 32, K = 2 micro-batches of 16, and 2
ranks x K = 2 x 8 under DeepSpeed ZeRO-2 and ZeRO-3 (the teacher sharded); a resumed run continues exactly; the
saved model, checkpoints and export are the student alone. (The loss: tests/unit/losses/
test_distill.py; the mixing and the inputs: tests/unit/train/test_distill.py.)"""

import json
import math
import re
import shutil

import pytest

from disco_clip_ds.commands import export as export_command
from disco_clip_ds.data.prep.embed import embed_shards
from disco_clip_ds.data.shards import expand_shards
from disco_clip_ds.testing.images import write_shards
from disco_clip_ds.testing.launch import QUICK, REPO, SGD, TINY_CONFIG, TOKENIZER_DIR, launch, launch_in_one_process
from disco_clip_ds.testing.runs import assert_same_training, same_weights, save_initial_model, step_losses, weights

STEPS = 2
SIGLIP_TINY = REPO / "recipes/models/siglip_tiny.json"
# dispatch_batches: every launch reads one stream, whatever its ranks, so that the runs see the same 64 samples
SAME_STREAM = ["--max_steps", str(STEPS), "--accelerator_config", '{"dispatch_batches": true}']


def save_teacher(folder, siglip=False):
    """A tiny CLIP (or SigLIP) narrower than the student (width and projection 48), at 32 px and 16 text positions:
    the collator must make its own pixels (resized, normalised) and tokens, and only similarities can be compared."""
    import torch

    from disco_clip_ds.models.build import build_model

    config = json.loads((SIGLIP_TINY if siglip else TINY_CONFIG).read_text())
    projection = {"projection_size": 48} if siglip else {"projection_dim": 48}
    if not siglip:
        config["projection_dim"] = 48
    config["text_config"].update(hidden_size=48, intermediate_size=96, max_position_embeddings=16, **projection)
    config["vision_config"].update(hidden_size=48, intermediate_size=96, image_size=32)
    if not siglip:
        config["vision_config"]["projection_dim"] = 48
    (folder.parent / "teacher.json").write_text(json.dumps(config))
    torch.manual_seed(21)
    build_model(model_config=str(folder.parent / "teacher.json")).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("distill")
    write_shards(root / "data", num_shards=2, per_shard=32, seed=3)
    initial, teacher = save_initial_model(root / "init", 11), save_teacher(root / "teacher")
    common = [
        "--model_name_or_path",
        str(initial),
        "--train_shards",
        f"{root}/data/{{00000..00001}}.tar",
        "--train_num_samples",
        "64",
        *SGD,
        *SAME_STREAM,
        "--teacher",
        str(teacher),
        "--distill_weight",
        "0.6",
        "--distill_temperature",
        "0.1",
    ]
    micro = lambda b, k: ["--per_device_train_batch_size", str(b), "--gradient_accumulation_steps", str(k)]
    # the teacher's embeddings stored once (`disco-clip data embed`) and read instead of running it
    embed_shards(
        str(teacher), expand_shards(f"{root}/data"), str(root / "embeddings"), tokenizer_name=str(TOKENIZER_DIR)
    )
    stored = [*common, "--teacher_embeddings", str(root / "embeddings"), "--patch_dropout", "0.5", *micro(16, 2)]
    # SigLIP: the sigmoid distillation (its teacher's bias too), K = 2 x 16 against 1 x 32
    siglip = [
        *common[: common.index("--teacher")],
        "--teacher",
        str(save_teacher(root / "siglip_teacher", siglip=True)),
        "--distill_weight",
        "0.6",
    ]
    siglip[1] = str(save_initial_model(root / "siglip_init", 11, SIGLIP_TINY))
    launch_in_one_process(
        [
            (root / "n1_k1", [*common, *micro(32, 1)]),
            (root / "n1_k2", [*common, *micro(16, 2)]),
            (root / "stored", stored),
            (root / "siglip_k1", [*siglip, *micro(32, 1)]),
            (root / "siglip_k2", [*siglip, *micro(16, 2)]),
        ]
    )
    launch(QUICK, 2, root / "n2_k2_zero2", *common, *micro(8, 2), "--save_steps", "1")
    # stopped after step 1 (its checkpoint) and resumed: the teacher is loaded again, nothing of it was saved
    shutil.copytree(root / "n2_k2_zero2" / "checkpoint-1", root / "resumed" / "checkpoint-1")
    launch(QUICK, 2, root / "resumed", *common, *micro(8, 2), "--resume_from_checkpoint", "latest")
    launch(QUICK, 2, root / "n2_k2_zero3", *common, *micro(8, 2), "--save_steps", "2", ds_config="cpu_zero3.json")
    return root, initial


@pytest.mark.timeout(900)
@pytest.mark.slow
def test_siglip_distilled_run_trains_like_one_batch_of_all_pairs(runs):
    root, _ = runs
    assert_same_training(root / "siglip_k2", root / "siglip_k1", weights(root / "siglip_init"), steps=STEPS)
    assert "with its own inputs" in (root / "siglip_k2.log").read_text()


@pytest.mark.timeout(900)
@pytest.mark.slow
@pytest.mark.parametrize("run", ["n1_k2", "n2_k2_zero2", "n2_k2_zero3"])
def test_distilled_run_trains_like_one_batch_of_all_pairs(runs, run):
    root, initial = runs
    assert_same_training(root / run, root / "n1_k1", weights(initial), steps=STEPS)  # keys: the student's alone
    assert not any("teacher" in key for key in weights(root / run))
    facts = json.loads((root / run / "run.json").read_text())
    assert facts["distillation"] == "from teacher, weight 0.6, temperature 0.1"  # no absolute path (D2)
    log = (root / f"{run}.log").read_text()
    assert "with its own inputs" in log
    if "zero3" in run:  # rank 0 (the rank that logs) holds half of the teacher (up to ZeRO's padding), not all of it
        held = [tuple(map(int, m)) for m in re.findall(r"teacher sharded by ZeRO-3: (\d+) of its (\d+) weights", log)]
        assert len(held) == 1 and all(part <= total // 2 + 64 for part, total in held), held


@pytest.mark.timeout(900)
@pytest.mark.slow
def test_a_resumed_distilled_run_continues_exactly(runs):
    root, _ = runs
    assert not any("teacher" in p.name for p in (root / "n2_k2_zero2" / "checkpoint-1").rglob("*"))
    assert (root / "resumed.log").read_text().count("{'loss': ") == 1  # step 2 was trained after the resume
    assert step_losses(root / "resumed") == pytest.approx(step_losses(root / "n2_k2_zero2"), rel=1e-6)
    assert same_weights(root / "resumed", root / "n2_k2_zero2") <= 1e-6


@pytest.mark.timeout(900)
@pytest.mark.slow
def test_a_run_reads_the_stored_embeddings(runs):
    """--teacher_embeddings: the run reads the sidecars (with K = 2 and patch dropout: the stream names each sample's
    shard and key beside its kept patches) and trains; its loss is not the live teacher's, whose embeddings are of
    the training crops, not the center crops stored (tests/unit/data/test_embeddings.py: equal on the same crops)."""
    root, initial = runs
    losses = step_losses(root / "stored")
    assert len(losses) == STEPS and all(math.isfinite(v) for v in losses)
    assert (
        not any("teacher" in key for key in weights(root / "stored"))
        and weights(root / "stored").keys() == weights(initial).keys()
    )
    facts = json.loads((root / "stored" / "run.json").read_text())
    assert facts["distillation"].endswith("its embeddings stored in embeddings")  # the folder's name alone (D2)


@pytest.mark.timeout(900)
@pytest.mark.slow
def test_an_exported_distilled_run_is_the_student_alone(runs, tmp_path):
    """`disco-clip export` of the ZeRO-3 run's DeepSpeed checkpoint (the teacher sharded beside the student): a plain
    CLIPModel with the student's keys and trained weights, its card naming the teacher."""
    from transformers import CLIPModel

    root, initial = runs
    assert export_command.main([str(root / "n2_k2_zero3" / "checkpoint-2"), str(tmp_path / "export")]) == 0
    exported = CLIPModel.from_pretrained(tmp_path / "export").state_dict()
    trained = weights(root / "n2_k2_zero3")
    assert exported.keys() >= trained.keys() == weights(initial).keys()  # + the buffers transformers does not save
    assert max((exported[k].float() - v).abs().max().item() for k, v in trained.items()) == 0
    card = (tmp_path / "export" / "README.md").read_text()
    assert (
        "| distilled (teacher, weight, temperature) | from " in card
        and "teacher, weight 0.6, temperature 0.1 |" in card
    )
    assert "Weights exported in fp32 from DeepSpeed ZeRO fp32 partitions (global_step2)." in card


@pytest.mark.timeout(600)
@pytest.mark.slow
def test_a_live_ensemble_trains_alike_on_two_ranks_and_one_rank_k2(tmp_path):
    """--teacher A B: a narrower teacher with its own pixels and tokens and a student-shaped one reading the
    student's inputs, distilled as one ensemble (losses/distill.py), trains alike on 2 ranks x 8 and on 1 rank x K = 2
    x 8; run.json names both teachers. (The ensemble's loss against float64: tests/unit/losses/
    test_distill_ensemble.py.)"""
    write_shards(tmp_path / "data", num_shards=1, per_shard=32, seed=5)
    initial = save_initial_model(tmp_path / "init", 11)
    narrow, same = save_teacher(tmp_path / "narrow"), save_initial_model(tmp_path / "same", 23)
    common = [
        "--model_name_or_path",
        str(initial),
        "--train_shards",
        f"{tmp_path}/data/00000.tar",
        "--train_num_samples",
        "32",
        *SGD,
        *SAME_STREAM,
        "--teacher",
        str(narrow),
        str(same),
        "--distill_weight",
        "1.0",
    ]
    launch_in_one_process(
        [(tmp_path / "n1_k2", [*common, "--per_device_train_batch_size", "8", "--gradient_accumulation_steps", "2"])]
    )
    launch(QUICK, 2, tmp_path / "n2", *common, "--per_device_train_batch_size", "8")
    assert_same_training(tmp_path / "n2", tmp_path / "n1_k2", weights(initial), steps=STEPS)
    facts = json.loads((tmp_path / "n2" / "run.json").read_text())
    assert facts["distillation"] == "from narrow + same, weight 1, the teacher's logit scale"
    assert "distilling from" in (log := (tmp_path / "n2.log").read_text()) and "with its own inputs" in log
