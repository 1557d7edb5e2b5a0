"""The run's steps (`disco_clip_ds.train.run`): the resume point never overwrites an earlier run. (Locked towers:
test_locking.py.)"""

from disco_clip_ds.testing.launch import REPO

MODEL = ["--model_config", str(REPO / "recipes/models/tiny.json")]
TOK = ["--tokenizer_name", str(REPO / "recipes/tokenizer")]


def test_an_earlier_runs_checkpoints_are_never_silently_overwritten(bad_arguments_setup, train_main, tmp_path, capsys):
    (tmp_path / "out" / "checkpoint-7").mkdir(parents=True)
    assert train_main("--train_shards", bad_arguments_setup["data"], *MODEL, *TOK) == 2
    assert "--resume_from_checkpoint latest" in capsys.readouterr().err
