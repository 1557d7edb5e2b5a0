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


@pytest.fixture
def embedded(bad_arguments_setup, tmp_path, monkeypatch):
    """A teacher folder with a weight file, fingerprinted once (as `data embed` does, which fills the fingerprint
    cache), and a sidecar of it for every training shard."""
    import torch

    from disco_clip_ds.data.embeddings import shard_facts, sidecar_path, write_sidecar
    from disco_clip_ds.data.shards import expand_shards
    from disco_clip_ds.data.teacher_id import teacher_fingerprint

    monkeypatch.setenv("DISCO_CLIP_CACHE", str(tmp_path / "cache"))
    teacher = tmp_path / "teacher"
    teacher.mkdir()
    (teacher / "config.json").write_text((REPO / MODEL[1]).read_text())
    (teacher / "model.safetensors").write_bytes(b"\1" * 4096)  # never loaded by a stored run: any bytes do
    fingerprint = teacher_fingerprint(str(teacher))
    for url in expand_shards(bad_arguments_setup["data"]):
        meta = {"teacher": fingerprint, **shard_facts(url)}
        write_sidecar(sidecar_path(tmp_path / "emb", url), ["k"], torch.zeros(1, 64), torch.zeros(1, 64), meta)
    return teacher, fingerprint


def _validate(tmp_path, shards, teacher, *extra):
    from disco_clip_ds.train.args import parse_args
    from disco_clip_ds.train.validate import validate

    argv = ["--output_dir", str(tmp_path / "out"), "--train_shards", shards, "--report_to", "none", *MODEL, *TOK]
    argv += ["--teacher", str(teacher), "--teacher_embeddings", str(tmp_path / "emb"), *extra]
    return validate(*parse_args(argv))


def test_a_stored_run_reads_no_teacher_weight_unless_asked(embedded, bad_arguments_setup, tmp_path):
    """The sidecars' fingerprint is checked against the cached one: no teacher weight file opened; with
    --verify_teacher_weights it is read (and still matches)."""
    from disco_clip_ds.testing.file_opens import recorded_opens

    teacher, fingerprint = embedded
    weights = str(teacher / "model.safetensors")
    with recorded_opens() as opened:
        checked = _validate(tmp_path, bad_arguments_setup["data"], teacher)
    assert checked.teacher_store.fingerprints == [fingerprint]
    assert str(teacher / "config.json") in opened and weights not in opened  # the spy sees the teacher's files
    with recorded_opens() as opened:
        checked = _validate(tmp_path, bad_arguments_setup["data"], teacher, "--verify_teacher_weights")
    assert checked.teacher_store.fingerprints == [fingerprint] and opened.count(weights) == 1


def test_a_teacher_changed_since_its_sidecars_is_refused_though_its_fingerprint_was_cached(
    embedded, bad_arguments_setup, tmp_path
):
    """Weights rewritten in place after `data embed` (same size): the cache no longer holds them, so they are read
    and the sidecars refused as another teacher's."""
    from disco_clip_ds.data.teacher_id import teacher_fingerprint

    teacher, fingerprint = embedded
    (teacher / "model.safetensors").write_bytes(b"\2" * 4096)
    with pytest.raises(UsageError, match=f"made by another teacher \\(fingerprint {fingerprint}, not "):
        _validate(tmp_path, bad_arguments_setup["data"], teacher)
    assert teacher_fingerprint(str(teacher)) != fingerprint


def test_verify_teacher_weights_without_stored_embeddings_is_refused(bad_arguments_setup, train_main, tmp_path, capsys):
    (tmp_path / "teacher").mkdir()
    (tmp_path / "teacher" / "config.json").write_text((REPO / MODEL[1]).read_text())
    for argv, message in (
        (["--teacher", str(tmp_path / "teacher")], "--verify_teacher_weights checks the teachers against the"),
        ([], "--verify_teacher_weights without --teacher"),
    ):
        argv = ["--train_shards", bad_arguments_setup["data"], *MODEL, *TOK, *argv, "--verify_teacher_weights"]
        assert train_main(*argv) == 2
        said = [line for line in capsys.readouterr().err.splitlines() if line.startswith("disco-clip train: ")]
        assert len(said) == 1 and message in said[0], said


def _fingerprint_rank(rank, world, teacher):
    """This rank's (fingerprints or the error's text, weight files it opened) from `teacher_fingerprints`."""
    from disco_clip_ds.testing.file_opens import recorded_opens
    from disco_clip_ds.train.validate.teacher import teacher_fingerprints

    model_args = SimpleNamespace(teacher=[teacher], verify_teacher_weights=True)
    with recorded_opens() as opened:
        try:
            got = teacher_fingerprints(model_args)
        except UsageError as error:
            got = str(error)
    return got, [p for p in opened if p.endswith(".safetensors")]


@pytest.mark.slow
def test_one_rank_reads_the_teacher_and_every_rank_gets_its_fingerprint_or_its_error(tmp_path):
    """On 2 ranks, with the weights read (--verify_teacher_weights): rank 0 alone opens them, both get the
    fingerprint (the one computed by hand from the files); a folder without config.json fails on both, no hang."""
    import hashlib

    from disco_clip_ds.testing.ranks import run_ranks

    teacher = tmp_path / "teacher"
    teacher.mkdir()
    (teacher / "config.json").write_text("{}")
    (teacher / "model.safetensors").write_bytes(b"\3" * 100)
    expected = hashlib.sha256(b"config.json{}model.safetensors" + b"\3" * 100).hexdigest()[:16]
    env = {"DISCO_CLIP_CACHE": str(tmp_path / "cache")}
    (rank0, opened0), (rank1, opened1) = run_ranks(_fingerprint_rank, 2, str(teacher), env=env, timeout=90)
    assert rank0 == rank1 == [expected]
    assert opened0 == [str(teacher / "model.safetensors")] and opened1 == []
    (teacher / "config.json").unlink()
    said = [got for got, _ in run_ranks(_fingerprint_rank, 2, str(teacher), env=env, timeout=90)]
    assert said[0] == said[1] and "no config.json: not a model folder" in said[0]


def test_a_node_that_never_hashed_the_teacher_takes_the_sidecars_record_and_reads_no_weight(
    bad_arguments_setup, tmp_path, monkeypatch, caplog
):
    """A training node whose fingerprint cache never saw the folder (not the machine `data embed` ran on): the
    sidecar's record of the teacher given by that path is used, no weight file is opened, a warning says so;
    --verify_teacher_weights hashes them (and, other weights, refuses)."""
    import torch

    from disco_clip_ds.data.embeddings import shard_facts, sidecar_path, write_reinforced
    from disco_clip_ds.data.reinforced import Reinforced, TeacherFacts
    from disco_clip_ds.data.shards import expand_shards
    from disco_clip_ds.testing.file_opens import recorded_opens

    monkeypatch.setenv("DISCO_CLIP_CACHE", str(tmp_path / "fresh_cache"))
    teacher = tmp_path / "teacher"
    teacher.mkdir()
    (teacher / "config.json").write_text((REPO / MODEL[1]).read_text())
    (teacher / "model.safetensors").write_bytes(b"\1" * 4096)
    recorded = "0123456789abcdef"  # not these weights' hash: only --verify_teacher_weights can tell
    for url in expand_shards(bad_arguments_setup["data"]):
        stored = Reinforced(
            ["k"], [TeacherFacts(recorded, str(teacher), "clip", 100.0)], [torch.zeros(1, 1, 64)],
            [{"txt": torch.zeros(1, 64)}], None, ["txt"], 0, "float32", 0, shard_facts(url),
        )  # fmt: skip
        write_reinforced(sidecar_path(tmp_path / "emb", url), stored)
    with recorded_opens() as opened, caplog.at_level("WARNING", logger="disco_clip_ds.train"):
        checked = _validate(tmp_path, bad_arguments_setup["data"], teacher)
    assert checked.teacher_store.fingerprints == [recorded]
    assert str(teacher / "model.safetensors") not in opened
    assert "its weights were not hashed" in caplog.text and "--verify_teacher_weights" in caplog.text
    with pytest.raises(UsageError, match="made by another teacher"):
        _validate(tmp_path, bad_arguments_setup["data"], teacher, "--verify_teacher_weights")


def test_stored_embeddings_of_another_width_than_the_teachers_are_refused(bad_arguments_setup, tmp_path, monkeypatch):
    """32-wide rows under the fingerprint of a teacher whose embeddings are 64 wide (recipes/models/tiny.json): before,
    training distilled from them without a word."""
    import torch

    from disco_clip_ds.data.embeddings import shard_facts, sidecar_path, write_reinforced
    from disco_clip_ds.data.reinforced import Reinforced, TeacherFacts
    from disco_clip_ds.data.shards import expand_shards

    monkeypatch.setenv("DISCO_CLIP_CACHE", str(tmp_path / "fresh_cache"))
    teacher = tmp_path / "teacher"
    teacher.mkdir()
    (teacher / "config.json").write_text((REPO / MODEL[1]).read_text())
    (teacher / "model.safetensors").write_bytes(b"\1" * 4096)
    unit = torch.nn.functional.normalize(torch.ones(1, 32), dim=-1)
    image = unit[:, None].clone()  # a tensor of its own (safetensors stores no shared memory)
    for url in expand_shards(bad_arguments_setup["data"]):
        stored = Reinforced(
            ["k"], [TeacherFacts("0123456789abcdef", str(teacher), "clip", 100.0)], [image], [{"txt": unit}],
            None, ["txt"], 0, "float32", 0, shard_facts(url),
        )  # fmt: skip
        write_reinforced(sidecar_path(tmp_path / "emb", url), stored)
    said = f"--teacher_embeddings {tmp_path / 'emb'}: its embeddings of --teacher .* are 32 wide, the teacher's are 64"
    with pytest.raises(UsageError, match=said):
        _validate(tmp_path, bad_arguments_setup["data"], teacher)
