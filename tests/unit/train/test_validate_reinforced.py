"""The refusals of training from a reinforced set (train/validate/reinforced.py), each one line, exit 2, nothing
written: the flags without --teacher_embeddings, a ratio out of [0, 1], a pool size below 1 or above the K stored,
sidecars without augmentations or without synthetic captions, a pool for SigLIP 2's NaFlex grids."""

from types import SimpleNamespace

import pytest

from disco_clip_ds.errors import UsageError
from disco_clip_ds.testing.launch import REPO
from disco_clip_ds.train.validate.reinforced import check_reinforced_flags, check_store

MODEL = ["--model_config", str(REPO / "recipes/models/tiny.json")]
TOK = ["--tokenizer_name", str(REPO / "recipes/tokenizer")]

FLAG_CASES = {
    "pool without embeddings": (["--augmentation_pool"], "--augmentation_pool without --teacher_embeddings"),
    "ratio without embeddings": (
        ["--synthetic_caption_ratio", "0.5"],
        "--synthetic_caption_ratio without --teacher_embeddings",
    ),
    "live without embeddings": (["--live_teacher"], "--live_teacher without --teacher_embeddings"),
    "ratio above 1": (["{stored}", "--synthetic_caption_ratio", "1.5"], "--synthetic_caption_ratio 1.5: give a"),
    "ratio nan": (["{stored}", "--synthetic_caption_ratio", "nan"], "--synthetic_caption_ratio nan: give a"),
    "pool size without pool": (["{stored}", "--augmentation_pool_size", "2"], "add --augmentation_pool"),
    "pool size 0": (["{stored}", "--augmentation_pool", "--augmentation_pool_size", "0"], "give at least 1"),
}


@pytest.mark.parametrize("case", list(FLAG_CASES))
def test_reinforced_flags_that_cannot_work_are_refused_in_one_line(
    case, bad_arguments_setup, train_main, tmp_path, capsys
):
    (tmp_path / "teacher").mkdir()  # a teacher's folder: its config (its weights are not read for a stored run)
    (tmp_path / "teacher" / "config.json").write_text((REPO / MODEL[1]).read_text())
    (tmp_path / "emb").mkdir()
    stored = ["--teacher", str(tmp_path / "teacher"), "--teacher_embeddings", str(tmp_path / "emb")]
    argv, message = FLAG_CASES[case]
    argv = [a for arg in argv for a in (stored if arg == "{stored}" else [arg])]
    assert train_main("--train_shards", bad_arguments_setup["data"], *MODEL, *TOK, *argv) == 2
    said = [line for line in capsys.readouterr().err.splitlines() if line.startswith("disco-clip train: ")]
    assert len(said) == 1 and message in said[0], said
    assert not (tmp_path / "out").exists()


def _args(**given):
    base = dict(
        teacher_embeddings="emb",
        augmentation_pool=False,
        augmentation_pool_size=None,
        synthetic_caption_ratio=None,
        live_teacher=False,
    )
    return SimpleNamespace(**{**base, **given})


def test_what_the_sidecars_hold_is_checked_against_the_flags():
    store = SimpleNamespace(augmentations=4, caption_keys=("txt", "syn0.txt", "syn1.txt"))
    assert check_store(_args(augmentation_pool=True), store) == (4, ("syn0.txt", "syn1.txt"))
    assert check_store(_args(augmentation_pool=True, augmentation_pool_size=3), store)[0] == 3
    with pytest.raises(UsageError, match="store 4 augmentations per sample: add --augmentation_pool"):
        check_store(_args(), store)  # the stream's own crop would be taught the embedding of another crop
    with pytest.raises(UsageError, match=r"--augmentation_pool_size 5: .* store 4 augmentations .* --augmentations 5"):
        check_store(_args(augmentation_pool=True, augmentation_pool_size=5), store)
    centre = SimpleNamespace(augmentations=0, caption_keys=("txt",))
    with pytest.raises(UsageError, match="--augmentation_pool: the sidecars in emb store no augmentations"):
        check_store(_args(augmentation_pool=True), centre)
    with pytest.raises(UsageError, match="--synthetic_caption_ratio 0.3: the sidecars in emb store the real captions"):
        check_store(_args(synthetic_caption_ratio=0.3), centre)
    assert check_store(_args(synthetic_caption_ratio=0.0), centre) == (1, ())  # ratio 0: the real captions suffice
    assert check_store(_args(synthetic_caption_ratio=0.2), SimpleNamespace(augmentations=0, caption_keys=("txt", "s")))[
        1
    ] == ("s",)  # centre crops (no pool) with synthetic captions
    with pytest.raises(UsageError, match=r"no embeddings of the real captions \(txt\)"):
        check_store(_args(), SimpleNamespace(augmentations=0, caption_keys=("syn0.txt",)))
    with pytest.raises(UsageError, match="NaFlex"):
        check_reinforced_flags(_args(augmentation_pool=True), naflex=True)
    check_reinforced_flags(_args(augmentation_pool=True, synthetic_caption_ratio=1.0), naflex=False)


def test_a_teacher_of_the_ensemble_without_sidecars_is_refused(bad_arguments_setup, train_main, tmp_path, capsys):
    """--teacher A B against sidecars made by A alone: one line naming B's fingerprint and the command to run."""
    import torch

    from disco_clip_ds.data.embeddings import shard_facts, sidecar_path, write_sidecar
    from disco_clip_ds.data.shards import expand_shards
    from disco_clip_ds.data.teacher_id import teacher_fingerprint

    names = []
    for name, width in (("a", 64), ("b", 32)):  # two teacher folders (configs alone) of two fingerprints
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text((REPO / MODEL[1]).read_text().replace("\n", "\n" * (width // 32)))
        names.append(str(tmp_path / name))
    for url in expand_shards(bad_arguments_setup["data"]):
        meta = {"teacher": teacher_fingerprint(names[0]), **shard_facts(url)}
        write_sidecar(sidecar_path(tmp_path / "emb", url), ["k"], torch.zeros(1, 8), torch.zeros(1, 8), meta)
    argv = ["--teacher", *names, "--teacher_embeddings", str(tmp_path / "emb")]
    assert train_main("--train_shards", bad_arguments_setup["data"], *MODEL, *TOK, *argv) == 2
    said = [line for line in capsys.readouterr().err.splitlines() if line.startswith("disco-clip train: ")]
    assert len(said) == 1, said
    assert f"made by another teacher (fingerprint {teacher_fingerprint(names[0])}, not " in said[0]
    assert teacher_fingerprint(names[1]) in said[0] and "disco-clip data embed --teacher" in said[0]
