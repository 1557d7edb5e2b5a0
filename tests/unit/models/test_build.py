"""models/build.py: an unknown loss_impl, a missing config and a wrong number of sources are clear errors."""

import pytest

from disco_clip_ds.models.build import build_model
from disco_clip_ds.testing.launch import REPO

TINY = REPO / "recipes" / "models" / "tiny.json"


def test_unknown_loss_impl_and_missing_config_are_clear_errors(tmp_path):
    with pytest.raises(ValueError, match="loss_impl must be one of"):
        build_model(model_config=str(TINY), loss_impl="naive")
    with pytest.raises(FileNotFoundError, match="tiny.json"):
        build_model(model_config=str(tmp_path / "nope.json"))
    with pytest.raises(ValueError, match="exactly one"):
        build_model()
