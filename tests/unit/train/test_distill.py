"""The live teacher (`disco_clip_ds.train.distill`): its inputs beside the student's, the mixed loss against a
float64 formula, and when the collator must make the teacher's own tokens and pixels."""

import math

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoTokenizer, CLIPImageProcessor

from disco_clip_ds.data.collate import ClipCollator, TeacherInputs
from disco_clip_ds.data.transforms import Normalize
from disco_clip_ds.testing.launch import TINY_CONFIG, TOKENIZER_DIR
from disco_clip_ds.train.distill import Teacher, load_teacher, split_inputs, teacher_inputs


@pytest.fixture(scope="module")
def tiny_teacher(tmp_path_factory):
    """A saved tiny CLIP (weights only, no tokenizer or image processor), loaded as a teacher."""
    from disco_clip_ds.models.build import build_model

    folder = tmp_path_factory.mktemp("teacher") / "tiny"
    torch.manual_seed(3)
    build_model(model_config=str(TINY_CONFIG)).save_pretrained(folder)
    return folder, load_teacher(str(folder), 0.5, None)


def test_split_inputs_gives_the_teacher_its_own_keys_or_the_students():
    batch = {"input_ids": 1, "attention_mask": 2, "pixel_values": 3, "patch_keep": 4, "teacher_pixel_values": 5}
    student, teacher = split_inputs(batch)
    assert student == {"input_ids": 1, "attention_mask": 2, "pixel_values": 3, "patch_keep": 4}
    assert teacher == {"input_ids": 1, "attention_mask": 2, "pixel_values": 5}  # never the student's kept patches


def test_teacher_reads_the_students_inputs_when_they_fit(tiny_teacher):
    folder, teacher = tiny_teacher
    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER_DIR)
    config = teacher.model.config
    size, positions = config.vision_config.image_size, config.text_config.max_position_embeddings
    processor = CLIPImageProcessor(size={"shortest_edge": size}, crop_size={"height": size, "width": size})
    # saved without a tokenizer or image processor: it reads the student's (transformers would build an empty one)
    assert teacher_inputs(teacher, str(folder), tokenizer, positions, processor, size) is None
    # a student of another image size: the teacher gets its own pixels, at its size
    extra = teacher_inputs(teacher, str(folder), tokenizer, positions, processor, size // 2)
    assert extra.tokenizer is None and extra.image_size == size and extra.normalize is not None
    # a student's text longer than the teacher's positions: its own tokens
    extra = teacher_inputs(teacher, str(folder), tokenizer, positions + 8, processor, size)
    assert extra.tokenizer is not None and extra.max_length == positions and extra.normalize is None


def test_collator_makes_the_teachers_inputs():
    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER_DIR)
    normalize = Normalize([0.5] * 3, [0.5] * 3)
    teacher = TeacherInputs(tokenizer=tokenizer, max_length=6, normalize=normalize, image_size=16)
    crops = [torch.randint(0, 256, (3, 32, 32), dtype=torch.uint8) for _ in range(3)]
    batch = ClipCollator(tokenizer, 10, normalize=False, teacher=teacher)([(c, "a photo") for c in crops])
    assert batch["pixel_values"].dtype == torch.uint8 and batch["input_ids"].shape == (3, 10)
    assert batch["teacher_input_ids"].shape == (3, 6) and batch["teacher_attention_mask"].shape == (3, 6)
    assert (
        batch["teacher_pixel_values"].shape == (3, 3, 16, 16) and batch["teacher_pixel_values"].dtype == torch.float32
    )
    assert batch["teacher_pixel_values"].abs().max() <= 1.0  # (x / 255 - 0.5) / 0.5 of the resized crops
    plain = ClipCollator(tokenizer, 10)([(c, "a photo") for c in crops])
    assert not any(k.startswith("teacher_") for k in plain)


@pytest.mark.parametrize("weight, temperature", [(0.3, None), (1.0, 0.05)])
def test_mixed_loss_matches_float64_formula(tiny_teacher, weight, temperature):
    """loss = (1 - W) CLIP + W KL distillation, the teacher's similarities times its logit scale or / temperature,
    written out in float64 from the full B x B matrices."""
    _, loaded = tiny_teacher
    teacher = Teacher(loaded.model, weight, temperature)
    g = torch.Generator().manual_seed(0)
    x, y = (F.normalize(torch.randn(6, 8, generator=g, dtype=torch.float64), dim=1) for _ in "xy")
    xt, yt = (F.normalize(torch.randn(6, 12, generator=g, dtype=torch.float64), dim=1) for _ in "xy")
    t_scale = 1 / temperature if temperature else teacher.model.logit_params()[0].item()
    xi = x.float().requires_grad_()
    _, _, params = teacher.embed({"input_ids": torch.randint(0, 40, (2, 8)), "pixel_values": torch.randn(2, 3, 64, 64)})
    assert params[0].item() == pytest.approx(t_scale)  # the multiplier the distillation takes
    got = teacher.loss_fn(xt.float(), yt.float(), params)(xi, y.float(), torch.tensor(20.0))
    got.backward()

    xr = x.clone().requires_grad_()
    student, target = 20.0 * xr @ y.T, t_scale * xt @ yt.T
    labels = torch.arange(6)
    clip = (F.cross_entropy(student, labels) + F.cross_entropy(student.T, labels)) / 2
    kl = lambda d: (target.softmax(d) * (target.log_softmax(d) - student.log_softmax(d))).sum() / 6
    ref = (1 - weight) * clip + weight * (kl(1) + kl(0)) / 2
    ref.backward()
    assert got.item() == pytest.approx(ref.item(), rel=1e-5)
    torch.testing.assert_close(xi.grad.double(), xr.grad, rtol=1e-4, atol=1e-6)
    assert math.isfinite(got.item())


def test_teacher_is_frozen_and_in_eval_mode(tiny_teacher):
    _, teacher = tiny_teacher
    teacher.model.train()
    ids = torch.randint(0, 40, (2, 8))
    images, texts, _ = teacher.embed({"input_ids": ids, "pixel_values": torch.randn(2, 3, 64, 64)})
    assert not teacher.model.training and not any(p.requires_grad for p in teacher.model.parameters())
    assert images.shape[0] == texts.shape[0] == 2 and not images.requires_grad
    torch.testing.assert_close(images.norm(dim=1), torch.ones(2))
