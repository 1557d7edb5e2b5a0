"""`disco-clip push` of an exported folder: exactly its files in one commit, the refusals, and a missing token. No
hub is ever contacted."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from disco_clip_ds.commands import push
from disco_clip_ds.errors import run_main
from disco_clip_ds.export import hub
from disco_clip_ds.testing.launch import REPO, TINY_CONFIG, TOKENIZER_DIR


def push_main(argv: list[str]) -> int:
    """`disco-clip push` in this process: its exit code, its messages on stderr."""
    return run_main(push.main, argv, "disco-clip push")


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """A folder written by `disco-clip export`, from a plain checkpoint of the tiny CLIP."""
    import torch
    from transformers import AutoTokenizer, CLIPConfig, CLIPImageProcessor, CLIPModel

    from disco_clip_ds.export.weights import export_checkpoint

    checkpoint = tmp_path_factory.mktemp("hub") / "checkpoint-3"
    torch.manual_seed(0)
    CLIPModel(CLIPConfig.from_json_file(str(TINY_CONFIG))).save_pretrained(checkpoint)
    AutoTokenizer.from_pretrained(TOKENIZER_DIR).save_pretrained(checkpoint)
    CLIPImageProcessor(size={"shortest_edge": 64}, crop_size={"height": 64, "width": 64}).save_pretrained(checkpoint)
    return export_checkpoint(checkpoint, checkpoint.parent / "model")


@pytest.fixture
def raw_checkpoint(exported, tmp_path):
    """A Trainer checkpoint under DeepSpeed: weights and config beside a `latest` file naming its state folder."""
    checkpoint = tmp_path / "checkpoint-3"
    shutil.copytree(exported, checkpoint)
    (checkpoint / "latest").write_text("global_step3")
    (checkpoint / "global_step3").mkdir()
    return checkpoint


def _push_cli(args, home: Path, **env):
    """`disco-clip push` in a fresh interpreter with an empty HF home: no cached token, offline."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    clean.update(HF_HOME=str(home), HF_HUB_OFFLINE="1", **env)
    return subprocess.run(
        [sys.executable, "-m", "disco_clip_ds.cli", "push", *args],
        capture_output=True,
        text=True,
        env=clean,
        cwd=REPO,
        timeout=120,
    )


@pytest.mark.slow  # a fresh interpreter
def test_push_dry_run_lists_exactly_the_exported_files(exported, tmp_path):
    result = _push_cli([str(exported), "--repo_id", "someone/tiny-clip", "--revision", "v1", "--dry_run"], tmp_path)
    assert result.returncode == 0, result.stderr
    listed = [line.split()[0] for line in result.stdout.splitlines() if line.startswith("  ")]
    assert listed == sorted(p.name for p in exported.iterdir())
    assert "https://huggingface.co/someone/tiny-clip/tree/v1" in result.stdout
    assert "no Hugging Face token" in result.stdout


@pytest.mark.slow  # a fresh interpreter
def test_push_without_token_fails_clearly(exported, tmp_path):
    result = _push_cli([str(exported), "--repo_id", "someone/tiny-clip"], tmp_path)
    assert result.returncode == 1
    assert "no Hugging Face token: set HF_TOKEN or run `hf auth login`" in result.stderr


@pytest.mark.slow  # beyond the fast tier's time budget
def test_push_refuses_raw_checkpoints(raw_checkpoint, capsys):
    assert push_main([str(raw_checkpoint), "--repo_id", "someone/x", "--dry_run"]) == 1
    assert "run `disco-clip export" in capsys.readouterr().err


def test_push_sends_the_planned_files_in_one_commit(exported, monkeypatch):
    """The upload path up to the network: the same file list as the dry run goes into one upload_folder commit."""
    import huggingface_hub

    calls = {}

    class RecordingApi:
        def __init__(self, token):
            calls["token"] = token

        def create_repo(self, repo_id, private, exist_ok):
            calls["repo"] = (repo_id, private, exist_ok)

        def create_branch(self, repo_id, branch, exist_ok):
            calls["branch"] = branch

        def upload_folder(self, folder_path, repo_id, revision, allow_patterns, commit_message):
            from huggingface_hub.utils import filter_repo_objects

            every = [p.relative_to(folder_path).as_posix() for p in Path(folder_path).rglob("*") if p.is_file()]
            calls["files"] = sorted(filter_repo_objects(every, allow_patterns=allow_patterns))  # as the hub selects
            calls["revision"] = revision
            return type("Commit", (), {"commit_url": f"https://huggingface.co/{repo_id}/commit/abc"})

    monkeypatch.setattr(huggingface_hub, "HfApi", RecordingApi)
    monkeypatch.setattr(huggingface_hub, "get_token", lambda: "hf_test")
    url = hub.push_folder(exported, "someone/tiny-clip", private=True, revision="v1")
    assert url.endswith("/commit/abc")
    assert (
        calls["files"] == [path for path, _ in hub.upload_plan(exported)] == sorted(p.name for p in exported.iterdir())
    )
    assert calls["repo"] == ("someone/tiny-clip", True, True) and calls["branch"] == "v1" and calls["revision"] == "v1"


@pytest.mark.parametrize("repo_id", ["someone/bad name", "a/b/c", "someone/x--y", ""])
def test_push_refuses_an_invalid_repo_id_even_in_a_dry_run(tmp_path, capsys, repo_id):
    assert push_main([str(tmp_path / "never-read"), "--repo_id", repo_id, "--dry_run"]) == 2
    assert f"--repo_id {repo_id!r} is not a valid hub id" in capsys.readouterr().err


HF_TOKEN = "hf_" + "aBcD3fGh1jKlMn0pQrStUvWxYz0123456"  # split so that no scanner flags this file
AWS_KEY = "AKIA" + "IOSFODNN7EXAMPLE"


@pytest.mark.parametrize(
    "name, planted, says",
    [
        ("README.md", f"| training data | pipe:curl -H 'Authorization: Bearer {HF_TOKEN}' https://x |", "line 3 holds"),
        ("config.json", f'  "note": "AWS_ACCESS_KEY_ID={AWS_KEY}",', "line 3 holds an AWS access key id"),
    ],
)
def test_push_refuses_a_folder_holding_a_secret_naming_file_and_line(exported, tmp_path, capsys, name, planted, says):
    """A card written by an older export (or edited by hand) with a credential: not even the dry run passes."""
    folder = tmp_path / "model"
    shutil.copytree(exported, folder)
    lines = (folder / name).read_text().splitlines()
    (folder / name).write_text("\n".join([*lines[:2], planted, *lines[2:]]) + "\n")
    assert push_main([str(folder), "--repo_id", "someone/x", "--dry_run"]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"disco-clip push: '{folder / name}' {says}"), err
    assert err.count("\n") == 1 and HF_TOKEN not in err and AWS_KEY not in err


def test_push_dry_run_passes_a_clean_export(exported, capsys):
    """The secret scan finds nothing in a real export (tokenizer vocabulary, weights header, card)."""
    assert push_main([str(exported), "--repo_id", "someone/x", "--dry_run"]) == 0
    assert "dry run: would upload" in capsys.readouterr().out


def test_push_of_a_missing_folder_or_a_file_is_bad_usage(exported, tmp_path, capsys):
    assert push_main([str(tmp_path / "nope"), "--repo_id", "someone/x", "--dry_run"]) == 2
    assert f"'{tmp_path / 'nope'}' does not exist" in capsys.readouterr().err
    assert push_main([str(exported / "config.json"), "--repo_id", "someone/x", "--dry_run"]) == 2
    assert "is a file, not a folder" in capsys.readouterr().err


def test_push_refuses_a_link_that_leaves_the_folder_and_keeps_one_inside(exported, tmp_path, capsys):
    """A symlink in the folder to a file outside it would upload that file (huggingface_hub lists files through
    links): refused, dry run included; a link to a file inside the folder is planned as that file."""
    outside = tmp_path / "id_rsa"
    outside.write_text("not for the hub\n")
    folder = tmp_path / "model"
    shutil.copytree(exported, folder)
    (folder / "notes.txt").symlink_to(outside)
    assert push_main([str(folder), "--repo_id", "someone/x", "--dry_run"]) == 1
    err = capsys.readouterr().err
    assert f"'{folder / 'notes.txt'}' is a link to '{outside}', outside the folder" in err and err.count("\n") == 1
    (folder / "notes.txt").unlink()
    (folder / "card.md").symlink_to(folder / "README.md")
    assert push_main([str(folder), "--repo_id", "someone/x", "--dry_run"]) == 0
    assert "  card.md  (" in capsys.readouterr().out


def test_every_exported_file_has_the_same_mode(exported):
    """model.safetensors is not left owner-only beside world-readable files: the folder is for others to read."""
    umask = os.umask(0)
    os.umask(umask)
    modes = {p.name: p.stat().st_mode & 0o777 for p in exported.iterdir()}
    assert set(modes.values()) == {0o666 & ~umask}, modes
    assert exported.stat().st_mode & 0o777 == 0o777 & ~umask
