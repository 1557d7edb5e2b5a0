"""Property test of `disco-clip train`'s numeric arguments (rates, decays, factors, sizes, steps): whatever value one
of them is given (non-finite, huge, negative, zero, not a number at all), the only outcomes are a run that validates
with a finite value, argparse's refusal of a value that is not a number (exit 2), or the project's one-line error.
Hypothesis, a bounded number of examples and a fixed seed, in the fast tier."""

import math
import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from disco_clip_ds.errors import DiscoClipError
from disco_clip_ds.testing.images import write_shards
from disco_clip_ds.testing.launch import REPO
from disco_clip_ds.train.args import parse_args
from disco_clip_ds.train.validate import validate

FLAGS = [
    "learning_rate",
    "weight_decay",
    "warmup_ratio",
    "vision_lr",
    "text_lr",
    "vision_layer_decay",
    "text_layer_decay",
    "patch_dropout",
    "ema_decay",
    "peak_tflops",
    "distill_temperature",
    "synthetic_caption_ratio",
    "chunk_size",
    "max_text_length",
    "shuffle_buffer",
    "max_image_pixels",
    "train_num_samples",
    "per_device_train_batch_size",
    "gradient_accumulation_steps",
    "max_steps",
    "save_steps",
    "zeroshot_steps",
]
HOSTILE = st.one_of(
    st.sampled_from(["nan", "-nan", "inf", "-inf", "1e308", "-1e308", "1e999", "0", "-0", "-1", "1e-320", ""]),
    st.sampled_from(["abc", "0x10", "1_000", " 3", "3.", "10" * 20, "-" + "9" * 25]),
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
    st.integers(min_value=-(10**30), max_value=10**30).map(str),
)


@pytest.fixture(scope="module")
def base_argv(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("numeric")
    write_shards(tmp / "data", num_shards=2, per_shard=4)
    return ["--output_dir", str(tmp / "out"), "--report_to", "none", "--train_shards", str(tmp / "data")] + [
        "--model_config",
        str(REPO / "recipes/models/tiny.json"),
        "--tokenizer_name",
        str(REPO / "recipes/tokenizer"),
        "--per_device_train_batch_size",
        "2",
        "--max_steps",
        "2",
    ]


@settings(
    max_examples=int(os.environ.get("NUMERIC_EXAMPLES", 15)),
    derandomize=True,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(flag=st.sampled_from(FLAGS), value=HOSTILE)
def test_any_number_is_a_valid_run_or_one_line(base_argv, capsys, flag, value):
    try:
        model_args, data_args, args = parse_args([*base_argv, f"--{flag}", value])
    except SystemExit as refused:  # argparse: not a number of the flag's type
        assert refused.code == 2 and f"--{flag}" in capsys.readouterr().err.splitlines()[-1]
        return
    except DiscoClipError as error:
        assert "\n" not in str(error) and "Traceback" not in str(error)
        return
    given_value = next(getattr(a, flag) for a in (model_args, data_args, args) if hasattr(a, flag))
    try:
        validate(model_args, data_args, args)
    except DiscoClipError as error:
        assert "\n" not in str(error), error
        return
    if isinstance(given_value, float):
        assert math.isfinite(given_value), f"--{flag} {value} was accepted"
