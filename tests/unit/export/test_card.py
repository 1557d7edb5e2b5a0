"""export.card: the model card's facts from run.json (beside the checkpoint) and the checkpoint's trainer state, and
the card itself. (The card of real exports: launched/test_export_zero.py.)"""

from __future__ import annotations

import json
import re

import pytest

from disco_clip_ds.export.card import describe_run, eval_records, model_card


def test_the_card_states_the_run_the_checkpoint_and_the_evaluation(tmp_path):
    checkpoint = tmp_path / "run" / "checkpoint-6"
    checkpoint.mkdir(parents=True)
    log = [{"loss": 2.5, "step": 5}, {"eval_loss": 1.0}, {"loss": 2.123456, "step": 6}]
    (checkpoint / "trainer_state.json").write_text(json.dumps({"global_step": 6, "log_history": log}))
    run = {
        "world_size": 2,
        "gradient_accumulation_steps": 1,
        "zero_stage": 2,
        "tower_settings": "--vision_layer_decay 0.85",
        "patch_dropout": "0.5 of the patches dropped, every patch from step 5",
        "locked_towers": "--lock_image_tower --lock_image_tower_unlocked_layers 2",
        "versions": {"deepspeed": "0.19.8", "torch": "2.13.0"},
        "resumes": [{"from_step": 3, "world_size": 1, "gradient_accumulation_steps": 2}],
    }
    (checkpoint.parent / "run.json").write_text(json.dumps(run))
    facts = describe_run(checkpoint)
    assert facts == {
        "steps": 6,
        "final_train_loss": 2.1235,
        "world_size": 2,
        "gradient_accumulation_steps": 1,
        "zero_stage": 2,
        "tower_settings": "--vision_layer_decay 0.85",
        "patch_dropout": "0.5 of the patches dropped, every patch from step 5",
        "locked_towers": "--lock_image_tower --lock_image_tower_unlocked_layers 2",
        "resumes": "step 3 (1 rank x K 2)",
        "deepspeed": "0.19.8",
    }
    records = eval_records({"acc1": 0.5})
    assert records == [{"task": "evaluation", "metrics": {"acc1": 0.5}}]
    card = str(model_card(facts, records, "model.safetensors"))
    for line in (
        "| world size (data-parallel ranks) | 2 |",
        "| resumed at (ranks x K from there) | step 3 (1 rank x K 2) |",
        "| DeepSpeed ZeRO stage | 2 |",
        "| per-tower learning rates and layer decay | --vision_layer_decay 0.85 |",
        "| patch dropout (FLIP) | 0.5 of the patches dropped, every patch from step 5 |",
        "| locked towers | --lock_image_tower --lock_image_tower_unlocked_layers 2 |",
        "| last logged training loss | 2.1235 |",
        "| acc1 | 0.5000 |",
        "under DeepSpeed ZeRO.",
        "Weights exported in fp32 from model.safetensors.",
    ):
        assert line in card, line


HF_TOKEN = "hf_" + "aBcD3fGh1jKlMn0pQrStUvWxYz0123456"  # split so that no scanner flags this file
GATED = (
    f"pipe:curl -s -L -H 'Authorization: Bearer {HF_TOKEN}' "
    "https://huggingface.co/datasets/org/set/resolve/main/{00000..00007}.tar::/home/user/data/train"
)


@pytest.mark.slow  # beyond the fast tier's time budget
def test_an_export_publishes_no_credential_path_or_training_key(tmp_path):
    """A run that read gated shards through curl with a token, and a local folder: its export's card names the
    shards' host and path and the folder's name, nothing else of the sources; config.json is a plain model's."""
    import torch
    from transformers import AutoTokenizer, CLIPConfig, CLIPImageProcessor, CLIPModel

    from disco_clip_ds.export.weights import export_checkpoint
    from disco_clip_ds.testing.launch import TINY_CONFIG, TOKENIZER_DIR

    checkpoint = tmp_path / "run" / "checkpoint-3"
    config = CLIPConfig.from_json_file(str(TINY_CONFIG))
    config.loss_impl, config.chunk_size = "disco", 32  # what DiscoCLIPModel's config carries (models/base.py)
    torch.manual_seed(0)
    CLIPModel(config).save_pretrained(checkpoint)
    AutoTokenizer.from_pretrained(TOKENIZER_DIR).save_pretrained(checkpoint)
    CLIPImageProcessor(size={"shortest_edge": 64}, crop_size={"height": 64, "width": 64}).save_pretrained(checkpoint)
    # run.json as versions before the redaction recorded it: the spec verbatim
    (checkpoint.parent / "run.json").write_text(json.dumps({"data": GATED, "num_shards": 9, "world_size": 2}))

    out = export_checkpoint(checkpoint, tmp_path / "model")
    card = (out / "README.md").read_text()
    shown = (
        "pipe: https://huggingface.co/datasets/org/set/resolve/main/{00000..00007}.tar::data/train"  # the data named
    )
    assert f"| training data | {shown} |" in card
    for secret in (HF_TOKEN, "Bearer", "curl", "/home/user"):
        assert secret not in card, secret
    assert "| loss implementation | disco |" in card and "| loss tile size (chunk_size) | 32 |" in card
    exported = json.loads((out / "config.json").read_text())
    assert "loss_impl" not in exported and "chunk_size" not in exported
    assert exported["architectures"] == ["CLIPModel"]


HOSTILE = [
    "/home/alice/private/eval_set",
    "https://bob:hunter2secret@data.example.org/eval?token=abc123def456&x=1",
    f"s3 key AKIA{'ABCDEFGHIJKLMNOP'} and {HF_TOKEN}",
    "task|with|pipes\nand a newline",
    "<script>alert(1)</script><img src=x onerror=alert(2)>",
    "[click](javascript:alert(3))",
]


def _table_rows(card: str) -> list[str]:
    return [line for line in card.splitlines() if line.startswith("|")]


def test_a_card_holds_no_local_path_credential_or_markup_whatever_the_records_hold():
    """Every value a card shows passes one function (data/redact.public_text): eval records' datasets, task names and
    metric names, the suite's task keys and error texts, run.json's values. Nothing local, secret or active comes out,
    and each table row keeps its cells."""
    run = {"data": HOSTILE[0], "world_size": 2, "suite": []}
    run["suite"] = [
        {"task": HOSTILE[3], "type": HOSTILE[4], "main_metric": "acc1", "value": 0.5},
        {"task": "broken", "type": "zeroshot", "main_metric": "acc1", "value": None, "error": f"{HOSTILE[0]}: gone"},
    ]
    records = [{"task": text, "dataset": text, "metrics": {text: 0.25, "n": text}} for text in HOSTILE]
    card = str(model_card(run, records, "model.safetensors"))
    for leaked in ("/home/alice", "hunter2secret", "abc123def456", "AKIAABCDEFGHIJKLMNOP", HF_TOKEN, "<script", "<img"):
        assert leaked not in card, leaked
    assert "](javascript" not in card.replace("\\]", "")
    assert "eval_set" in card and "data.example.org" in card  # what names the data stays
    for row in _table_rows(card):
        assert len(re.findall(r"(?<!\\)\|", row)) in (3, 5), row  # 2 or 4 cells: no pipe from a value
