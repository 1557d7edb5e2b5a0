"""models/resolution.py: the schedule's form and its steps (hand-computed), the resize of a model's position
embeddings against transformers' own `interpolate_pos_encoding=True` at that side, and the saved model loading as the
plain transformers model at the new side; data/naflex.py's `rebudget` against the grid made at that budget."""

import copy
import functools
from fractions import Fraction

import pytest
import torch
import torch.nn.functional as F
from transformers import CLIPImageProcessor, CLIPModel, SiglipModel

from disco_clip_ds.data.naflex import naflex_size, pack_patches, patchify, rebudget
from disco_clip_ds.models.build import build_model
from disco_clip_ds.models.processor import at_image_size
from disco_clip_ds.models.resolution import (
    ResolutionSchedule,
    Stage,
    describe_schedule,
    parse_schedule,
    resize_images,
    resize_position_embeddings,
)
from disco_clip_ds.testing.launch import REPO

CONFIGS = {"clip": REPO / "recipes/models/tiny.json", "siglip": REPO / "recipes/models/siglip_tiny.json"}
PLAIN = {"clip": CLIPModel, "siglip": SiglipModel}


@functools.cache
def _tiny(kind: str):
    torch.manual_seed(0)
    return build_model(model_config=str(CONFIGS[kind])).to(torch.float64).eval()


def tiny(kind: str):
    return copy.deepcopy(_tiny(kind))


def test_perception_encoders_schedule_parses_and_its_stages_start_at_the_floor_of_fraction_x_steps():
    stages = parse_schedule("0:98, 0.35:154,0.7:224,0.95:336")
    assert stages == [Stage(Fraction(0), 98), Stage(Fraction(35, 100), 154), Stage(Fraction(7, 10), 224),
                      Stage(Fraction(95, 100), 336)]  # fmt: skip
    schedule = ResolutionSchedule(stages, 100)
    assert schedule.starts == [0, 35, 70, 95] and schedule.final == 336
    assert [schedule.size_at(s) for s in (0, 34, 35, 69, 70, 94, 95, 99)] == [98, 98, 154, 154, 224, 224, 336, 336]
    assert schedule.steps_per_stage() == [(98, 35), (154, 35), (224, 25), (336, 5)]
    # the fraction as written, not as a float: 0.29 x 100 is 28.999999999999996 in floats
    assert ResolutionSchedule(parse_schedule("0:1,0.29:2"), 100).starts == [0, 29]
    assert describe_schedule("0:32,0.5:64", 10) == "32 from step 1, 64 from step 6"
    assert describe_schedule(None, 10) is None


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("0:98,0.5:98", "must both increase"),
        ("0:154,0.5:98", "must both increase"),
        ("0:98,0.7:154,0.5:224", "must both increase"),
        ("0:98,1:154", "below 1"),
        ("0:98,-0.5:154", "at least 0"),
        ("0.1:98,0.5:154", "start it at 0"),
        ("0:98,0.5", "FRACTION:SIZE"),
        ("0:98,x:154", "FRACTION:SIZE"),
        ("0:0", "positive"),
    ],
)
def test_bad_schedules_are_one_line_saying_what_to_fix(text, says):
    with pytest.raises(ValueError, match=says) as error:
        parse_schedule(text)
    assert "\n" not in str(error.value)


@pytest.mark.slow  # builds and runs two tiny models (~0.3 s)
@pytest.mark.parametrize("kind", ["clip", "siglip"])
def test_resized_position_embeddings_run_as_transformers_interpolates_them_and_save_as_the_plain_model(kind, tmp_path):
    model = tiny(kind)
    pixels = torch.randn(2, 3, 80, 80, dtype=torch.float64)
    with torch.no_grad():  # transformers' own interpolation at 80 px, the model still at 64
        reference = model.get_image_features(pixel_values=pixels, interpolate_pos_encoding=True).pooler_output
    resize_position_embeddings(model, 80)
    assert model.config.vision_config.image_size == 80
    with torch.no_grad():
        resized = model.get_image_features(pixel_values=pixels).pooler_output  # no flag
    assert torch.equal(resized, reference)
    model.save_pretrained(tmp_path)
    plain = PLAIN[kind].from_pretrained(tmp_path, dtype=torch.float64).eval()
    assert plain.config.vision_config.image_size == 80
    with torch.no_grad():
        assert torch.equal(plain.get_image_features(pixel_values=pixels).pooler_output, reference)


def test_resizing_the_normalised_batch_is_normalising_the_resized_one():
    torch.manual_seed(0)
    raw = torch.rand(2, 3, 64, 64, dtype=torch.float64) * 255
    mean, std = torch.tensor([0.48, 0.46, 0.41]).view(3, 1, 1), torch.tensor([0.27, 0.26, 0.28]).view(3, 1, 1)
    normalise = lambda x: (x / 255 - mean) / std  # noqa: E731
    assert torch.allclose(resize_images(normalise(raw), 32), normalise(resize_images(raw, 32)), atol=1e-12)
    assert resize_images(raw, 64) is raw  # at its own side: untouched


def _packed(images, patch, budget):
    return pack_patches([patchify(image, patch) for image in images], budget)


def test_rebudget_packs_each_image_as_resized_to_its_naflex_size_at_the_new_budget():
    torch.manual_seed(0)
    patch = 4
    # each at its NaFlex size for 96 patches, as the stream makes them: 8 x 12 = 96 and 9 x 9 = 81 patches
    images = [torch.randn(3, 32, 48, dtype=torch.float64), torch.randn(3, 36, 36, dtype=torch.float64)]
    assert [naflex_size(*image.shape[1:], 4, 96) for image in images] == [(32, 48), (36, 36)]
    packed = _packed(images, patch, 96)
    same = rebudget(packed["pixel_values"], packed["spatial_shapes"], patch, 96)
    assert all(torch.equal(same[k], packed[k]) for k in packed)  # back to pixels and cut again: the same patches
    smaller = rebudget(packed["pixel_values"], packed["spatial_shapes"], patch, 24)
    targets = [naflex_size(32, 48, patch, 24), naflex_size(36, 36, patch, 24)]
    assert targets == [(16, 24), (16, 16)]  # hand-checked: 4 x 6 = 24 and 4 x 4 = 16 patches
    expected = [
        F.interpolate(image[None], size=size, mode="bicubic", antialias=True)[0] for image, size in zip(images, targets)
    ]
    reference = _packed(expected, patch, 24)
    assert smaller["spatial_shapes"].tolist() == [[4, 6], [4, 4]]
    assert torch.equal(smaller["pixel_attention_mask"], reference["pixel_attention_mask"])
    assert torch.allclose(smaller["pixel_values"], reference["pixel_values"], atol=1e-12)


def test_a_pretrained_image_processor_is_set_to_the_last_side():
    processor = at_image_size(CLIPImageProcessor(), 336)
    assert processor.size["shortest_edge"] == 336 and processor.crop_size["height"] == 336
    assert at_image_size(processor, None) is processor
