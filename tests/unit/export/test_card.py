"""export.card: the model card's facts from run.json (beside the checkpoint) and the checkpoint's trainer state, and
the card itself. (The card of real exports: launched/test_export_zero.py.)"""

from __future__ import annotations

import json

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
        "| last logged training loss | 2.1235 |",
        "| acc1 | 0.5000 |",
        "under DeepSpeed ZeRO.",
        "Weights exported in fp32 from model.safetensors.",
    ):
        assert line in card, line
