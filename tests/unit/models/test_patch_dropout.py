"""models/patch_dropout.py: the kept-patch count, the per-sample draw (under a resolution schedule one per stage's
grid, the step keeping its own), and the towers with kept patches, at their own side and interpolated to an earlier
stage's, against each image run alone through the plain tower's modules with its kept tokens picked by Python
indexing (CLIP keeps its class token; SigLIP has none and its attention-pooling head sees the kept tokens)."""

import functools
import random

import pytest
import torch
from torch import nn

from disco_clip_ds.models.build import build_model
from disco_clip_ds.models.patch_dropout import (
    PATCHES_KEY,
    at_grid,
    draw_kept_patches,
    draw_sample_patches,
    kept_patches,
    patch_counts,
    stage_key,
    stage_patch_counts,
)
from disco_clip_ds.models.resolution import resize_images
from disco_clip_ds.testing.launch import REPO

from unit.models.batches import batch

CONFIGS = {"clip": REPO / "recipes/models/tiny.json", "siglip": REPO / "recipes/models/siglip_tiny.json"}
PATCHES = 16  # both tiny configs: 64 px images of 16 px patches


@functools.cache
def tiny(kind: str):
    torch.manual_seed(0)
    return build_model(model_config=str(CONFIGS[kind])).to(torch.float64).eval()


@pytest.mark.parametrize(
    ("patches", "dropout", "kept"), [(196, 0.5, 98), (196, 0.75, 49), (49, 0.75, 12), (50, 0.5, 25), (16, 0.99, 1)]
)
def test_kept_patches_is_open_clips_count(patches, dropout, kept):
    assert kept_patches(patches, dropout) == kept


def test_patch_counts_read_the_vision_config_and_zero_is_off():
    config = tiny("clip").config.vision_config
    assert patch_counts(config, 0.5) == (PATCHES, 8)
    assert patch_counts(config, 0.0) is None


def test_a_draw_is_sorted_distinct_and_a_function_of_its_rng_alone():
    first = draw_kept_patches(196, 98, random.Random("7/patches/0/sample-3"))
    assert first.dtype == torch.int64 and len(first) == 98 == len(set(first.tolist()))
    assert first.tolist() == sorted(first.tolist()) and 0 <= first.min() and first.max() < 196
    assert torch.equal(first, draw_kept_patches(196, 98, random.Random("7/patches/0/sample-3")))
    assert not torch.equal(first, draw_kept_patches(196, 98, random.Random("7/patches/1/sample-3")))


def test_under_a_schedule_a_sample_has_masks_for_every_grid_and_the_step_keeps_its_own():
    config = tiny("clip").config.vision_config  # 64 px, 16 px patches: the schedule 32, 48, 64 has 4, 9, 16 patches
    assert stage_patch_counts(config, 0.5, [32, 48, 64]) == ((4, 2), (9, 4))
    assert stage_patch_counts(config, 0.5, [64]) == () == stage_patch_counts(config, 0.0, [32, 64])
    drawn = draw_sample_patches((16, 8), ((4, 2), (9, 4)), random.Random("7/patches/0/sample-3"))
    assert set(drawn) == {PATCHES_KEY, stage_key(4), stage_key(9)}
    # the last grid's mask is the one a run without a schedule draws (the RNG's first draw)
    assert torch.equal(drawn[PATCHES_KEY], draw_kept_patches(16, 8, random.Random("7/patches/0/sample-3")))
    assert torch.equal(draw_sample_patches((16, 8), (), random.Random("7/patches/0/sample-3")), drawn[PATCHES_KEY])
    for key, (n, kept) in ((stage_key(4), (4, 2)), (stage_key(9), (9, 4))):
        assert len(drawn[key]) == kept == len(set(drawn[key].tolist())) and drawn[key].max() < n
    again = draw_sample_patches((16, 8), ((4, 2), (9, 4)), random.Random("7/patches/0/sample-3"))
    assert all(torch.equal(drawn[k], again[k]) for k in drawn)  # a function of the sample's RNG alone
    batch = {"pixel_values": torch.zeros(1), **{k: v[None] for k, v in drawn.items()}}
    for grid, expected in ((4, stage_key(4)), (9, stage_key(9)), (16, PATCHES_KEY)):
        step = dict(batch)
        at_grid(step, grid)
        assert set(step) == {"pixel_values", PATCHES_KEY} and torch.equal(step[PATCHES_KEY], batch[expected])
    at_grid(batch, None)  # FLIP's unmasked tuning: no mask of any grid
    assert set(batch) == {"pixel_values"}


def reference_image_embeds(model, pixels: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """Each image alone through the tower's modules, its kept tokens (class token first for CLIP) picked by index
    (the position embeddings interpolated for images of another side than the model's)."""
    vision, out = model.vision_model, []
    interpolate = pixels.shape[-1] != model.config.vision_config.image_size
    for image, kept in zip(pixels, keep):
        tokens = vision.embeddings(image[None], interpolate_pos_encoding=interpolate)[0]
        rows = list(range(model.CLASS_TOKENS)) + [model.CLASS_TOKENS + int(i) for i in kept]
        hidden = tokens[rows][None]
        if model.CLASS_TOKENS:  # CLIP: pre-norm, encoder, post-norm of the class token, projection
            hidden = vision.encoder(inputs_embeds=vision.pre_layrnorm(hidden)).last_hidden_state
            out.append(model.visual_projection(vision.post_layernorm(hidden[:, 0])))
        else:  # SigLIP: encoder, post-norm, attention-pooling head over the kept tokens
            hidden = vision.encoder(inputs_embeds=hidden).last_hidden_state
            out.append(vision.head(vision.post_layernorm(hidden)))
    return nn.functional.normalize(torch.cat(out), dim=-1)


@pytest.mark.slow  # beyond the fast tier's time budget
@pytest.mark.parametrize("kind", ["clip", "siglip"])
@pytest.mark.parametrize("side", [64, 32])  # the model's own; an earlier stage of a resolution schedule (4 patches)
def test_the_tower_sees_the_kept_tokens_only(kind, side):
    model, inputs = tiny(kind), batch()
    grid = (side // 16) ** 2
    kept = kept_patches(grid, 0.5)
    if side != 64:  # as the trainer passes an earlier stage's batch (train/resolution.py)
        inputs = {
            **inputs,
            "pixel_values": resize_images(inputs["pixel_values"], side),
            "interpolate_pos_encoding": True,
        }
    rng = random.Random(5)
    keep = torch.stack([draw_kept_patches(grid, kept, rng) for _ in inputs["input_ids"]])
    with torch.no_grad():
        out = model(**inputs, patch_keep=keep)
        expected = reference_image_embeds(model, inputs["pixel_values"], keep)
        plain = model(**inputs)
    assert out.vision_model_output.last_hidden_state.shape[1] == model.CLASS_TOKENS + kept
    assert plain.vision_model_output.last_hidden_state.shape[1] == model.CLASS_TOKENS + grid
    torch.testing.assert_close(out.image_embeds, expected, rtol=1e-10, atol=1e-12)
    assert (out.image_embeds - plain.image_embeds).abs().max() > 1e-3  # the mask mattered
    torch.testing.assert_close(out.text_embeds, plain.text_embeds, rtol=0, atol=0)  # the text tower is untouched


@pytest.mark.parametrize("kind", ["clip", "siglip"])
def test_keeping_every_patch_is_the_plain_tower_bit_for_bit(kind):
    model, inputs = tiny(kind), batch()
    every = torch.arange(PATCHES).expand(len(inputs["input_ids"]), -1)
    with torch.no_grad():
        assert torch.equal(model(**inputs, patch_keep=every).image_embeds, model(**inputs).image_embeds)


def test_the_mask_holds_only_inside_its_forward_and_a_wrong_row_count_is_refused():
    model, inputs = tiny("clip"), batch()
    with torch.no_grad():
        plain = model(**inputs).image_embeds
        model(**inputs, patch_keep=torch.arange(8).expand(len(inputs["input_ids"]), -1))
        assert torch.equal(model(**inputs).image_embeds, plain)  # nothing of the last mask is left behind
        with pytest.raises(ValueError, match="patch_keep holds 2 rows for a batch of 6 images"):
            model(**inputs, patch_keep=torch.arange(8).expand(2, -1))


def test_a_saved_model_has_no_trace_of_patch_dropout(tmp_path):
    model = tiny("clip")
    model(**batch(), patch_keep=torch.arange(8).expand(6, -1))
    model.save_pretrained(tmp_path)
    assert "patch" not in (tmp_path / "config.json").read_text().replace("patch_size", "")
    assert "patch_dropout" not in str(list(model.state_dict()))
