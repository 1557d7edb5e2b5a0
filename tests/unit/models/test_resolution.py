"""models/resolution.py: the schedule's form and its steps (hand-computed), the resize of a model's position
embeddings against transformers' own `interpolate_pos_encoding=True` at that side, and the saved model loading as the
plain transformers model at the new side; under ZeRO-3 (2 gloo ranks) the resize of a partitioned model, its image
tower called alone and a step at an earlier stage's side against the same unpartitioned; data/naflex.py's
`rebudget` against the grid made at that budget."""

import copy
import functools
import os
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
from disco_clip_ds.testing.ranks import run_ranks

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


LAST, EARLIER, LR = 96, 48, 0.5  # a schedule's last side (the build resizes to it from 64) and an earlier one's


def _batch() -> dict:
    """A global batch of 4 at an earlier stage's side, as the trainer passes it (models/resolution.py)."""
    generator = torch.Generator().manual_seed(1)
    return {
        "pixel_values": torch.randn(4, 3, EARLIER, EARLIER, generator=generator),
        "input_ids": torch.randint(2, 500, (4, 8), generator=generator),
        "interpolate_pos_encoding": True,
    }


def _zero3_steps(rank, world, folders: dict) -> dict:
    """On each of `world` gloo ranks, under ZeRO-3: each model of `folders` built partitioned (zero.Init) and resized
    to LAST, one SGD step of the global-batch loss on this rank's rows of `_batch()`; the gathered weights after it,
    and the image features of its rows before the step, by the tower called directly, outside the engine's forward."""
    import deepspeed
    from transformers.integrations import HfDeepSpeedConfig

    os.environ.update(LOCAL_RANK=str(rank), DS_ACCELERATOR="cpu")
    deepspeed.init_distributed(dist_backend="gloo")
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},  # every weight partitioned
        "zero_allow_untested_optimizer": True,
        "gradient_clipping": 0.0,
    }
    keep = HfDeepSpeedConfig(config)  # noqa: F841  (transformers' from_pretrained builds inside zero.Init)
    rows = {k: v[2 * rank : 2 * rank + 2] if torch.is_tensor(v) else v for k, v in _batch().items()}
    trained = {}
    for kind, folder in folders.items():
        model = build_model(str(folder), image_size=LAST)
        assert all(hasattr(p, "ds_id") for p in model.vision_model.encoder.parameters())  # partitioned
        optimizer = torch.optim.SGD(model.parameters(), lr=LR)
        engine = deepspeed.initialize(model=model, optimizer=optimizer, config=config)[0]
        features = None
        # before any forward of the engine, whose automatic discovery of external parameters would register the
        # weights read by a parent's forward (the position embedding; SigLIP's pooling attention's output
        # projection) with that parent from then on
        with torch.no_grad():
            features = model.get_image_features(pixel_values=rows["pixel_values"], interpolate_pos_encoding=True)
        features = features.pooler_output
        engine.backward(engine(**rows, return_loss=True).loss)
        engine.step()
        with deepspeed.zero.GatheredParameters(list(model.parameters())):
            trained[kind] = {n: p.detach().clone() for n, p in model.named_parameters()}, features
    return trained


@pytest.mark.slow  # 2 DeepSpeed ranks, two engines each
def test_under_zero3_a_resized_model_steps_at_an_earlier_side_as_without_it(tmp_path):
    """ZeRO-3 gathers a module's weights when its own forward runs; the position embedding's weight is read by its
    parent's (`interpolate_pos_encoding`), and by the resize at build time: the weights after a step on 2 ranks
    are those of the same step on one unpartitioned model, within fp32 reduction-order noise."""
    folders = {}
    for kind in CONFIGS:
        torch.manual_seed(0)
        folders[kind] = tmp_path / kind
        build_model(model_config=str(CONFIGS[kind])).save_pretrained(folders[kind])
    per_rank = run_ranks(_zero3_steps, 2, folders, timeout=300)
    key = "vision_model.embeddings.position_embedding.weight"
    for kind, folder in folders.items():
        model = build_model(str(folder), image_size=LAST)
        start = {n: p.detach().clone() for n, p in model.named_parameters()}
        with torch.no_grad():
            before = model.get_image_features(pixel_values=_batch()["pixel_values"], interpolate_pos_encoding=True)
        model(**_batch(), return_loss=True).loss.backward()
        with torch.no_grad():
            for p in model.parameters():
                if p.grad is not None:
                    p -= LR * p.grad
        plain = dict(model.named_parameters())
        assert plain[key].shape[0] == (LAST // 16) ** 2 + (kind == "clip")  # resized: 6 x 6 patches (+ CLIP's class)
        assert (plain[key] - start[key]).abs().max() > 0  # the interpolated position embeddings trained
        update = torch.cat([(plain[n] - start[n]).reshape(-1) for n in plain])
        for rank, trained in enumerate(per_rank):
            weights, features = trained[kind]
            assert weights.keys() == plain.keys()
            gap = torch.cat([(weights[n].reshape(plain[n].shape) - plain[n]).reshape(-1) for n in plain])
            assert gap.norm() <= 1e-4 * update.norm(), f"{kind}: updates differ by {gap.norm() / update.norm():.1e}"
            if features is not None:
                expected = before.pooler_output[2 * rank : 2 * rank + 2]
                torch.testing.assert_close(features, expected, rtol=1e-5, atol=1e-6)


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
