"""Property tests of the configs `train` and `plan` read (Hypothesis, a fixed seed): whatever values a DeepSpeed JSON's
sections or a model config's sizes hold, the only outcomes are a result or the project's one-line error (a
PlanConfigError, a ValueError naming the field for the model config), never another exception."""

import json
import math

from hypothesis import given, settings
from hypothesis import strategies as st

from disco_clip_ds.errors import PlanConfigError
from disco_clip_ds.plan.checks import check_sections
from disco_clip_ds.testing.launch import TINY_CONFIG

HOSTILE = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=8),
    st.lists(st.integers(), max_size=2),
    st.dictionaries(st.text(max_size=4), st.integers(), max_size=2),
)
KEYS = st.sampled_from(["zero_optimization", "fp16", "bf16", "amp", "optimizer", "train_micro_batch_size", "bogus"])
ZERO_KEYS = st.sampled_from(["stage", "reduce_bucket_size", "offload_param", "overlap_comm", "stage3_x", "nonsense"])


@settings(max_examples=80, derandomize=True, deadline=None)
@given(st.dictionaries(KEYS, HOSTILE, max_size=3), st.dictionaries(ZERO_KEYS, HOSTILE, max_size=3))
def test_any_deepspeed_sections_pass_or_are_one_planner_error(top, zero):
    config = {**top, "zero_optimization": zero} if zero else top
    try:
        check_sections(config, "--deepspeed ds.json")
    except PlanConfigError as error:
        assert str(error).startswith("--deepspeed ds.json: DeepSpeed config problems:")


SIZES = st.sampled_from(
    [
        ("vision_config", "hidden_size"),
        ("vision_config", "num_attention_heads"),
        ("vision_config", "patch_size"),
        ("vision_config", "image_size"),
        ("text_config", "intermediate_size"),
        ("text_config", "vocab_size"),
        (None, "projection_dim"),
        (None, "logit_scale_init_value"),
    ]
)


@settings(max_examples=60, derandomize=True, deadline=None)
@given(SIZES, st.one_of(st.integers(min_value=-(2**40), max_value=2**12), st.floats(allow_nan=True), st.none()))
def test_any_model_size_loads_or_is_one_line_naming_the_field(tmp_path_factory, field, value):
    from disco_clip_ds.models.configs import load_config

    section, key = field
    config = json.loads(TINY_CONFIG.read_text())
    (config[section] if section else config)[key] = value
    path = tmp_path_factory.mktemp("cfg") / "model.json"
    path.write_text(json.dumps(config))
    try:
        loaded = load_config(model_config=str(path))
    except ValueError as error:
        assert "\n" not in str(error)
        return
    tower = loaded.vision_config
    assert tower.hidden_size > 0 and tower.hidden_size % tower.num_attention_heads == 0
    assert 0 < tower.patch_size <= tower.image_size and loaded.projection_dim > 0
    assert math.isfinite(loaded.logit_scale_init_value)
