"""A model named on the command line (models/source.py): a mistyped folder refused at once by its full path, a hub id
without a reachable hub refused at once saying so and how to work offline (a hub on 127.0.0.1:9, where nothing
listens: refused deterministically, where transformers retries for about 30 s, sleeping 23 s between its tries: a
limit of 10 s tells the two apart on a loaded machine)."""

from __future__ import annotations

import time

import pytest

from disco_clip_ds.errors import UsageError
from disco_clip_ds.models import source

from unit.data.test_teacher_id import hub_cache


@pytest.fixture
def no_hub(monkeypatch):
    """Online mode, with the hub at an address where nothing listens."""
    import huggingface_hub.constants

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", "http://127.0.0.1:9")
    source.hub_problem.cache_clear()
    yield
    source.hub_problem.cache_clear()


def test_what_is_spelled_as_a_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    paths = ["/abs", "./x", "../x", "~/x", ".hidden", "a/b/c", "a\\b", "folder/"]
    hub_ids = ["openai/clip-vit-base-patch32", "quickstart", "org/name"]
    assert [source.looks_like_path(v) for v in paths] == [True] * len(paths)
    assert [source.looks_like_path(v) for v in hub_ids] == [False] * len(hub_ids)
    (tmp_path / "outputs").mkdir()  # ORG/NAME whose ORG is a folder here: a path
    assert source.looks_like_path("outputs/quickstrt") and not source.looks_like_path("output/quickstrt")


def test_a_mistyped_folder_is_refused_by_its_full_path_with_the_nearest_names(tmp_path, monkeypatch, no_hub):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "outputs" / "quickstart").mkdir(parents=True)
    started = time.monotonic()
    with pytest.raises(UsageError) as refused:
        source.check_model_source("outputs/quickstrt", "--model")
    assert str(refused.value) == (
        f"--model outputs/quickstrt: no such folder: {tmp_path}/outputs/quickstrt; did you mean "
        f"{tmp_path}/outputs/quickstart?"
    )
    assert time.monotonic() - started < 1  # no hub asked
    source.check_model_source("outputs/quickstart", "--model")  # there: left to its loader


@pytest.mark.slow  # huggingface_hub's HTTP session and cache lookups: beyond the fast tier's budget
def test_a_hub_id_without_the_hub_is_refused_at_once_saying_how_to_work_offline(tmp_path, monkeypatch, no_hub):
    import huggingface_hub.constants

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    started = time.monotonic()
    with pytest.raises(UsageError) as refused:
        source.check_model_source("org/absent", "--teacher")
    said = str(refused.value)
    assert said.startswith(f"--teacher org/absent: a hub id (there is no folder {tmp_path}/org/absent), and the hub ")
    assert "http://127.0.0.1:9 cannot be reached" in said and "HF_HUB_OFFLINE=1" in said and "\n" not in said
    hub_cache(tmp_path / "hub", "org/cached", "c" * 40)
    with pytest.raises(UsageError, match="a copy is in the local cache: set HF_HUB_OFFLINE=1"):
        source.check_model_source("org/cached", "--teacher")
    assert time.monotonic() - started < 10  # one refused connection, no retries
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    source.check_model_source("org/cached", "--teacher")  # offline: the cache is transformers' to read


@pytest.mark.slow  # imports transformers' model classes
def test_eval_refuses_a_hub_id_without_the_hub_before_transformers_retries(tmp_path, monkeypatch, no_hub):
    from transformers import AutoImageProcessor, AutoModel  # noqa: F401  (imported before the clock starts)

    from disco_clip_ds.commands.eval import load_for_eval

    monkeypatch.chdir(tmp_path)
    started = time.monotonic()
    with pytest.raises(UsageError, match="--model openai/clip-vit-base-patch32: a hub id .* cannot be reached"):
        load_for_eval("openai/clip-vit-base-patch32")
    assert time.monotonic() - started < 10
