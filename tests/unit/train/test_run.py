"""The run's steps (`disco_clip_ds.train.run`): the resume point never overwrites an earlier run, locked towers."""

from disco_clip_ds.testing.launch import REPO

MODEL = ["--model_config", str(REPO / "recipes/models/tiny.json")]
TOK = ["--tokenizer_name", str(REPO / "recipes/tokenizer")]


def test_an_earlier_runs_checkpoints_are_never_silently_overwritten(bad_arguments_setup, train_main, tmp_path, capsys):
    (tmp_path / "out" / "checkpoint-7").mkdir(parents=True)
    assert train_main("--train_shards", bad_arguments_setup["data"], *MODEL, *TOK) == 2
    assert "--resume_from_checkpoint latest" in capsys.readouterr().err


def test_locked_towers_are_frozen_and_the_rest_trains():
    from disco_clip_ds.models.build import build_model
    from disco_clip_ds.train.args import ModelArguments
    from disco_clip_ds.train.run import _lock_towers

    model = build_model(model_config=str(REPO / "recipes/models/tiny.json"))
    _lock_towers(model, ModelArguments(lock_image_tower=True))
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert not any(n.startswith(("vision_model.", "visual_projection.")) for n in trainable)
    assert {"logit_scale", "text_projection.weight"} <= trainable and any(
        n.startswith("text_model.") for n in trainable
    )
    _lock_towers(model, ModelArguments(lock_text_tower=True))
    assert {n for n, p in model.named_parameters() if p.requires_grad} == {"logit_scale"}
