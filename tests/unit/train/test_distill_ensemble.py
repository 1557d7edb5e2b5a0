"""A live ensemble (`--teacher A B`, `disco_clip_ds.train.distill.Ensemble`): each member on its own inputs, the loss
against the mean of the members' softmaxes written out in float64 from each member's own forward, micro-batches
concatenated as contrastive accumulation does, the collator's per-member keys, and run.json's naming of every
teacher."""

import json

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoTokenizer, CLIPImageProcessor

from disco_clip_ds.data.collate import ClipCollator, TeacherInputs
from disco_clip_ds.data.transforms import Normalize
from disco_clip_ds.testing.launch import TINY_CONFIG, TOKENIZER_DIR
from disco_clip_ds.train.distill import Ensemble, Teacher, load_teacher, member_inputs, split_inputs, teacher_inputs


@pytest.fixture(scope="module")
def two_teachers(tmp_path_factory):
    """Two saved tiny CLIPs, one of tiny.json's shape, one narrower (projection 40) at 32 px: --teacher A B."""
    from disco_clip_ds.models.build import build_model

    root = tmp_path_factory.mktemp("ensemble")
    config = json.loads(TINY_CONFIG.read_text())
    config["projection_dim"] = config["vision_config"]["projection_dim"] = 40
    config["text_config"]["projection_dim"] = 40
    config["vision_config"]["image_size"] = 32
    (root / "narrow.json").write_text(json.dumps(config))
    folders = [root / "same", root / "narrow"]
    for seed, folder, recipe in zip((3, 4), folders, (TINY_CONFIG, root / "narrow.json")):
        torch.manual_seed(seed)
        build_model(model_config=str(recipe)).save_pretrained(folder)
    names = [str(f) for f in folders]
    return names, load_teacher(names, 0.5, None)


def batch(seed=0, rows=6):
    """A batch as split_inputs gives it to the ensemble: the student's 64 px pixels and tokens, and member 1's own
    32 px pixels (collator key teacher_1_pixel_values)."""
    g = torch.Generator().manual_seed(seed)
    inputs = {
        "input_ids": torch.randint(2, 500, (rows, 8), generator=g),
        "attention_mask": torch.ones(rows, 8, dtype=torch.long),
        "pixel_values": torch.randn(rows, 3, 64, 64, generator=g),
        "teacher_1_pixel_values": torch.randn(rows, 3, 32, 32, generator=g),
    }
    return split_inputs(inputs)[1]


@pytest.mark.slow  # beyond the fast tier's time budget
def test_load_teacher_of_a_list(two_teachers):
    names, ensemble = two_teachers
    assert isinstance(ensemble, Ensemble) and [type(m) for m in ensemble.members] == [Teacher, Teacher]
    assert isinstance(load_teacher(names[:1], 0.5, None), Teacher)  # `--teacher A`: the one teacher, as before


def test_each_member_reads_its_own_inputs():
    inputs = {"input_ids": 1, "attention_mask": 2, "pixel_values": 3, "1_pixel_values": 4, "0_input_ids": 5}
    assert member_inputs(inputs, 0) == {"input_ids": 5, "attention_mask": 2, "pixel_values": 3}
    assert member_inputs(inputs, 1) == {"input_ids": 1, "attention_mask": 2, "pixel_values": 4}
    assert member_inputs(inputs, 2) == {"input_ids": 1, "attention_mask": 2, "pixel_values": 3}


@pytest.mark.slow  # beyond the fast tier's time budget
@pytest.mark.parametrize("weight", [1.0, 0.3])
def test_ensemble_loss_matches_float64_formula_of_each_members_forward(two_teachers, weight):
    """Each member's forward on its own inputs, in float64 by hand: target per direction = the mean of the members'
    softmaxes (each at its own logit scale); loss = (1 - W) CLIP + W KL(target || student)."""
    _, loaded = two_teachers
    ensemble = Ensemble([Teacher(m.model, weight) for m in loaded.members])
    inputs = batch()
    images, texts, params = ensemble.embed(inputs)
    assert images.shape == texts.shape == (6, 64 + 40) and params[0].shape == (2,)
    g = torch.Generator().manual_seed(1)
    x, y = (F.normalize(torch.randn(6, 16, generator=g, dtype=torch.float64), dim=1) for _ in "xy")
    xi = x.float().requires_grad_()
    got = ensemble.loss_fn(images, texts, params)(xi, y.float(), torch.tensor(20.0))
    got.backward()

    xr = x.clone().requires_grad_()
    student, targets = 20.0 * xr @ y.T, []
    with torch.no_grad():
        for k, member in enumerate(loaded.members):
            out = member.model(**member_inputs(inputs, k), return_loss=False, return_logits=False)
            xt, yt = out.image_embeds.double(), out.text_embeds.double()
            targets.append(out.logit_scale.double().reshape(()) * xt @ yt.T)
    assert targets[1].shape == (6, 6) and not torch.allclose(targets[0], targets[1])
    labels = torch.arange(6)
    clip = (F.cross_entropy(student, labels) + F.cross_entropy(student.T, labels)) / 2
    kl = 0
    for d in (1, 0):
        mean = sum(t.softmax(d) for t in targets) / 2
        kl = kl + (mean * (mean.log() - student.log_softmax(d))).sum() / 6
    ref = (1 - weight) * clip + weight * kl / 2
    ref.backward()
    assert got.item() == pytest.approx(ref.item(), rel=1e-5)
    torch.testing.assert_close(xi.grad.double(), xr.grad, rtol=1e-4, atol=1e-6)


@pytest.mark.slow  # beyond the fast tier's time budget
def test_micro_batches_concatenated_are_the_whole_batch(two_teachers):
    """Contrastive accumulation concatenates each micro-batch's teacher embeddings (train/accumulation.py): an
    ensemble's side-by-side embeddings of K = 2 micro-batches give the loss of the whole batch."""
    _, ensemble = two_teachers
    whole = batch(seed=2, rows=8)
    halves = [{k: v[rows] for k, v in whole.items()} for rows in (slice(0, 4), slice(4, 8))]
    images, texts, params = zip(*(ensemble.embed(h) for h in halves))
    student = [F.normalize(torch.randn(8, 16, generator=torch.Generator().manual_seed(5)), dim=1) for _ in "xy"]
    split = ensemble.loss_fn(torch.cat(images), torch.cat(texts), params[0])(*student, torch.tensor(20.0))
    one = ensemble.loss_fn(*ensemble.embed(whole))(*student, torch.tensor(20.0))
    assert split.item() == pytest.approx(one.item(), rel=1e-5)


def test_teacher_inputs_and_the_collator_per_member(two_teachers):
    """The narrow member needs its own 32 px pixels, the other reads the student's: a list with None for it, and the
    collator's keys carry the member's index."""
    names, ensemble = two_teachers
    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER_DIR)
    processor = CLIPImageProcessor(size={"shortest_edge": 64}, crop_size={"height": 64, "width": 64})
    extra = teacher_inputs(ensemble, names, tokenizer, 32, processor, 64)
    assert extra[0] is None and extra[1].image_size == 32 and extra[1].tokenizer is None
    crops = [torch.randint(0, 256, (3, 64, 64), dtype=torch.uint8) for _ in range(3)]
    made = ClipCollator(tokenizer, 32, normalize=False, teacher=extra)([(c, "a photo") for c in crops])
    assert sorted(k for k in made if k.startswith("teacher_")) == ["teacher_1_pixel_values"]
    assert made["teacher_1_pixel_values"].shape == (3, 3, 32, 32)
    own = TeacherInputs(tokenizer=tokenizer, max_length=6, normalize=Normalize([0.5] * 3, [0.5] * 3), image_size=16)
    made = ClipCollator(tokenizer, 32, teacher=[own, extra[1]])([(c, "a photo") for c in crops])
    keys = ["teacher_0_attention_mask", "teacher_0_input_ids", "teacher_0_pixel_values", "teacher_1_pixel_values"]
    assert sorted(k for k in made if k.startswith("teacher_")) == keys and made["teacher_0_input_ids"].shape == (3, 6)


def test_run_json_names_every_teacher_without_its_path(tmp_path):
    from types import SimpleNamespace

    from disco_clip_ds.checkpoint.resume import distillation_setting
    from disco_clip_ds.checkpoint.runfile import public_distillation

    args = SimpleNamespace(
        teacher=[str(tmp_path / "home" / "teacher_a"), "org/clip-b"],
        teacher_embeddings=None,
        distill_weight=1.0,
        distill_temperature=None,
    )
    shown = distillation_setting(args)
    assert shown == "from teacher_a + org/clip-b, weight 1, the teacher's logit scale"
    assert public_distillation(f"from {tmp_path}/a + {tmp_path}/b, weight 1, x") == "from a + b, weight 1, x"


@pytest.mark.slow  # beyond the fast tier's time budget
def test_siglip_ensemble_matches_float64_mean_of_sigmoids(tmp_path):
    """Two SigLIP teachers (each its own scale and bias, set apart): the target of each pair is the mean of their
    sigmoids, in the per-pair cross-entropy of the student's sigmoid, / B."""
    from disco_clip_ds.models.build import build_model
    from disco_clip_ds.testing.launch import REPO

    members = []
    for seed, (scale, bias) in zip((5, 6), ((2.0, -3.0), (3.0, -1.0))):
        torch.manual_seed(seed)
        model = build_model(model_config=str(REPO / "recipes/models/siglip_tiny.json"))
        with torch.no_grad():
            model.logit_scale.fill_(scale), model.logit_bias.fill_(bias)
        members.append(Teacher(model, 1.0))
    ensemble = Ensemble(members)
    inputs = {k: v for k, v in batch(seed=3).items() if k != "1_pixel_values"}
    images, texts, params = ensemble.embed(inputs)
    assert [p.shape for p in params] == [(2,), (2,)]
    g = torch.Generator().manual_seed(1)
    x, y = (F.normalize(torch.randn(6, 16, generator=g, dtype=torch.float64), dim=1) for _ in "xy")
    xi = x.float().requires_grad_()
    got = ensemble.loss_fn(images, texts, params)(xi, y.float(), torch.tensor(10.0), torch.tensor(-5.0))
    got.backward()

    xr = x.clone().requires_grad_()
    student = 10.0 * xr @ y.T - 5.0
    with torch.no_grad():
        outs = [m.model(**inputs, return_loss=False, return_logits=False) for m in members]
        logits = [
            o.logit_scale.double().reshape(()) * o.image_embeds.double() @ o.text_embeds.double().T
            + o.logit_bias.double().reshape(())
            for o in outs
        ]
    target = sum(t.sigmoid() for t in logits) / 2
    ref = -(target * F.logsigmoid(student) + (1 - target) * F.logsigmoid(-student)).sum() / 6
    ref.backward()
    assert got.item() == pytest.approx(ref.item(), rel=1e-5)
    torch.testing.assert_close(xi.grad.double(), xr.grad, rtol=1e-4, atol=1e-6)
