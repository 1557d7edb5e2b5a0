"""The data tests' shared fixtures (`folders` defined in hfsets.py, beside the helpers it uses)."""

import pytest

from unit.data.hfsets import folders  # noqa: F401


@pytest.fixture
def no_model(monkeypatch):
    """Building a model fails the test: a refusal must come before any model is built."""

    def refuse(*args, **kwargs):
        raise AssertionError("a model was built")

    monkeypatch.setattr("disco_clip_ds.models.build.build_model", refuse)
