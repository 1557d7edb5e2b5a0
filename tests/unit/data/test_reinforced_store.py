"""Reinforced sidecars (data/embeddings.py, data/prep/embed.py, data/transforms.py crop replay): a stored embedding
equals a fresh forward of the teacher (transformers' own model class) on its crop reproduced from the stored box;
two teachers side by side with their own image sizes and normalisations; caption keys, a missing one skipped and
counted; the stored dtype read back within its rounding; first-layout sidecars still read; a kill after a sidecar
resumes; every refusal in one line, exit 2, before any model is built."""

from __future__ import annotations

import json
import random
import subprocess
from dataclasses import replace

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from disco_clip_ds.commands.data import embed_main
from disco_clip_ds.data.decode import EncodedImage
from disco_clip_ds.data.embeddings import (
    EmbeddingStore,
    Reinforced,
    TeacherFacts,
    check_sidecars,
    read_metadata,
    read_reinforced,
    read_sidecar,
    shard_facts,
    sidecar_path,
    write_reinforced,
    write_sidecar,
)
from disco_clip_ds.data.streams.tar_samples import raw_samples
from disco_clip_ds.data.teacher_id import teacher_fingerprint
from disco_clip_ds.data.transforms import ImageTransform, augmentation_rng, crop_boxes, random_resized_crop_box
from disco_clip_ds.distributed.runlock import WRITER_LOCK
from disco_clip_ds.errors import DataError, UsageError, run_main
from disco_clip_ds.testing.images import noise_image_bytes, write_samples
from disco_clip_ds.testing.launch import REPO, TINY_CONFIG, TOKENIZER_DIR, VENV_BIN, train_env

SIGLIP_MEAN = (0.5, 0.5, 0.5)


def _embed(argv: list[str]) -> int:
    return run_main(embed_main, argv, "disco-clip data embed")


def _jpeg(rng, width: int, height: int) -> bytes:
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)).save(buf, format="JPEG")
    return buf.getvalue()


# --- crop replay ---


def test_a_given_box_is_the_drawn_crop_bit_for_bit_and_crop_boxes_are_the_training_draws():
    rng = np.random.default_rng(0)
    data = _jpeg(rng, 260, 220)  # large enough for a reduced (draft) decode at 64 px
    transform = ImageTransform(64)
    boxes = crop_boxes(data, 4, seed=7, key="s00003")
    assert len(set(boxes)) == 4 and boxes == crop_boxes((260, 220), 4, seed=7, key="s00003")
    for a, box in enumerate(boxes):
        # the documented seed string, drawn as training draws a crop (the box is the first draw)
        assert box == random_resized_crop_box(260, 220, random.Random(f"7/augmentation/{a}/s00003"))
        drawn = transform.from_bytes(data, augmentation_rng(7, "s00003", a))
        assert torch.equal(transform.from_bytes(data, None, box=box), drawn)
        assert torch.equal(ImageTransform(64, train=False).from_bytes(data, None, box=box), drawn)  # a box: a crop
    assert crop_boxes(data, 4, seed=8, key="s00003") != boxes
    decoded = {}  # one decode per draft scale, shared by two image sizes (two teachers)
    for size in (64, 48):
        crops = ImageTransform(size).box_crops(EncodedImage(data), boxes, decoded)
        assert all(torch.equal(c, ImageTransform(size).from_bytes(data, None, box=b)) for c, b in zip(crops, boxes))
    assert sorted(decoded) == [2, 4]  # 8 crops, 2 decodes
    with pytest.raises(ValueError, match="does not fit a 260 x 220 image"):
        transform.from_bytes(data, None, box=(0, 0, 261, 10))


# --- embed, then read back ---


def _teachers(tmp_path):
    """A CLIP teacher (64 px, CLIP's normalisation) and a SigLIP teacher (48 px, mean = std = 0.5), saved."""
    from transformers import SiglipImageProcessor

    from disco_clip_ds.models.build import build_model

    build_model(model_config=str(TINY_CONFIG), seed=0).save_pretrained(tmp_path / "clip")
    config = json.loads((REPO / "recipes/models/siglip_tiny.json").read_text())
    config["vision_config"]["image_size"] = 48
    (tmp_path / "siglip.json").write_text(json.dumps(config))
    build_model(model_config=str(tmp_path / "siglip.json"), seed=1).save_pretrained(tmp_path / "siglip")
    processor = SiglipImageProcessor(image_mean=list(SIGLIP_MEAN), image_std=list(SIGLIP_MEAN), size=48)
    processor.save_pretrained(tmp_path / "siglip")
    return tmp_path / "clip", tmp_path / "siglip"


def _shards(tmp_path, n: int = 6, per_shard: int = 3) -> str:
    rng = np.random.default_rng(1)
    samples = [
        {"jpg": _jpeg(rng, 160 + 8 * i, 130), "txt": f"a photo of {i}", "syn0.txt": f"a synthetic caption {i}"}
        for i in range(n)
    ]
    del samples[4]["syn0.txt"]  # skipped and counted
    write_samples(tmp_path / "data", samples, per_shard=per_shard)
    return str(tmp_path / "data" / f"{{00000..{(n - 1) // per_shard:05d}}}.tar")


def _reference(folder, kind: str, data: bytes, box, captions: list[str], mean, std):
    """transformers' own model class on the crop of `box` (ImageTransform), normalised here, and on the captions,
    tokenized as the command documents it (padded to the text positions): L2-normalised, float32."""
    from transformers import AutoTokenizer, CLIPModel, SiglipModel

    model = {"clip": CLIPModel, "siglip": SiglipModel}[kind].from_pretrained(folder).eval()
    size = model.config.vision_config.image_size
    crop = ImageTransform(size).from_bytes(data, None, box=box).float()
    pixels = ((crop / 255 - torch.tensor(mean).view(3, 1, 1)) / torch.tensor(std).view(3, 1, 1))[None]
    tokens = AutoTokenizer.from_pretrained(TOKENIZER_DIR)(
        captions,
        padding="max_length",
        truncation=True,
        max_length=model.config.text_config.max_position_embeddings,
        return_tensors="pt",
    )
    with torch.no_grad():
        image = model.get_image_features(pixel_values=pixels).pooler_output
        text = model.get_text_features(**tokens).pooler_output
    return F.normalize(image, dim=-1)[0], F.normalize(text, dim=-1)


@pytest.mark.slow  # two tiny teachers, 6 samples x 3 augmentations x 2 captions
def test_an_ensemble_with_augmentations_and_captions_equals_fresh_forwards_of_the_reproduced_crops(tmp_path, capsys):
    from transformers.image_utils import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD

    clip, siglip = _teachers(tmp_path)
    shards = _shards(tmp_path)
    argv = ["--teacher", str(clip), str(siglip), "--tokenizer_name", str(TOKENIZER_DIR), str(TOKENIZER_DIR)]
    argv += ["--shards", shards]  # a tokenizer per teacher
    argv += ["--output", str(tmp_path / "emb"), "--augmentations", "3", "--seed", "5"]
    argv += ["--caption_keys", "txt,syn0.txt", "--batch_size", "2"]
    assert _embed(argv) == 0
    assert "2 shard(s) embedded, 0 already done, 1 sample(s) without image or caption skipped (1 without syn0.txt)" in (
        capsys.readouterr().out
    )
    fingerprints = [teacher_fingerprint(str(clip)), teacher_fingerprint(str(siglip))]
    store = EmbeddingStore(tmp_path / "emb", fingerprints[::-1], shards=[str(tmp_path / "data" / "00000.tar")])
    assert store.augmentations == 3 and store.caption_keys == ["txt", "syn0.txt"] and store.seed == 5
    assert [t.model_type for t in store.teachers] == ["siglip", "clip"] and store.teachers[0].logit_bias is not None
    views = [(siglip, "siglip", SIGLIP_MEAN, SIGLIP_MEAN), (clip, "clip", OPENAI_CLIP_MEAN, OPENAI_CLIP_STD)]
    looked = 0
    for shard in sorted((tmp_path / "data").glob("*.tar")):
        for sample in raw_samples(str(shard)):
            if "syn0.txt" not in sample:
                with pytest.raises(DataError, match=f"no teacher embedding for sample {sample['__key__']}"):
                    store.lookup(str(shard), sample["__key__"])
                continue
            stored = store.lookup(str(shard), sample["__key__"])
            assert stored.boxes.dtype == torch.int32 and stored.boxes.shape == (3, 4)
            assert stored.boxes.tolist() == [list(b) for b in crop_boxes(sample["jpg"], 3, 5, sample["__key__"])]
            captions = [sample["txt"].decode(), sample["syn0.txt"].decode()]
            for t, (folder, kind, mean, std) in enumerate(views):
                assert stored.images[t].shape == (3, 64)
                for a, box in enumerate(stored.boxes.tolist()):
                    image, text = _reference(folder, kind, sample["jpg"], box, captions, mean, std)
                    torch.testing.assert_close(stored.images[t][a], image, atol=1e-6, rtol=0)
                torch.testing.assert_close(stored.texts[t]["txt"], text[0], atol=1e-6, rtol=0)
                torch.testing.assert_close(stored.texts[t]["syn0.txt"], text[1], atol=1e-6, rtol=0)
            looked += 1
    assert looked == 5
    # a teacher the sidecars lack: refused before training, and by the store
    with pytest.raises(UsageError, match="made by another teacher"):
        check_sidecars(tmp_path / "emb", [str(tmp_path / "data" / "00000.tar")], [*fingerprints, "f" * 16], "T")
    check_sidecars(tmp_path / "emb", [str(tmp_path / "data" / "00000.tar")], fingerprints, "T")
    with pytest.raises(DataError, match="made by another teacher"):
        EmbeddingStore(tmp_path / "emb", ["f" * 16]).lookup(str(tmp_path / "data" / "00000.tar"), "s00000")
    # the same command again: every sidecar kept; other settings: embedded again
    assert _embed(argv) == 0 and "0 shard(s) embedded, 2 already done" in capsys.readouterr().out
    assert _embed([*argv, "--embedding_dtype", "float16"]) == 0
    assert "2 shard(s) embedded, 0 already done" in capsys.readouterr().out


def test_a_centre_crop_sidecar_of_one_teacher_serves_todays_readers(tmp_path):
    """K = 0 is stored as K = 1 without boxes; read_sidecar and read_metadata (curation, stored_teacher) see the first
    layout's view."""
    shard = tmp_path / "00000.tar"
    shard.write_bytes(b"x" * 10)
    image, text = F.normalize(torch.randn(2, 1, 4), dim=-1), F.normalize(torch.randn(2, 4), dim=-1)
    teacher = TeacherFacts("t1", "T", "siglip", 10.0, -10.0)
    stored = Reinforced(["a", "b"], [teacher], [image], [{"txt": text}], None, ["txt"], meta=shard_facts(str(shard)))
    write_reinforced(sidecar_path(tmp_path, str(shard)), stored)
    rows, got_image, got_text, meta = read_sidecar(sidecar_path(tmp_path, str(shard)))
    assert rows == {"a": 0, "b": 1} and torch.equal(got_image, image[:, 0]) and torch.equal(got_text, text)
    facts = (meta["teacher"], meta["logit_scale"], meta["logit_bias"], meta["model_type"])
    assert facts == ("t1", "10.0", "-10.0", "siglip")
    store = EmbeddingStore(tmp_path, "t1")  # its settings before any lookup: from the folder's first sidecar
    assert store.augmentations == 0 and store.caption_keys == ["txt"] and store.teachers == [teacher]
    sample = store.lookup(str(shard), "b")
    assert sample.boxes is None and torch.equal(sample.images[0], image[1]) and sample.images[0].shape == (1, 4)
    with pytest.raises(DataError, match="no sidecar holds the teachers t1, t2"):
        EmbeddingStore(tmp_path, ["t1", "t2"]).caption_keys


def test_first_layout_sidecars_still_read(tmp_path):
    shard = tmp_path / "00000.tar"
    shard.write_bytes(b"x" * 10)
    image, text = F.normalize(torch.randn(2, 4), dim=1), F.normalize(torch.randn(2, 4), dim=1)
    meta = {"teacher": "t1", "model_type": "clip", "logit_scale": "100.0", "logit_bias": "", **shard_facts(str(shard))}
    write_sidecar(sidecar_path(tmp_path, str(shard)), ["a", "b"], image, text, meta)
    store = EmbeddingStore(tmp_path, ["t1"], shards=[str(shard)])
    assert store.augmentations == 0 and store.caption_keys == ["txt"] and store.seed is None
    assert store.teachers == [TeacherFacts("t1", "", "clip", 100.0, None)]
    sample = store.lookup(str(shard), "b")
    assert torch.equal(sample.images[0], image[1:2]) and torch.equal(sample.texts[0]["txt"], text[1])
    assert sample.boxes is None
    assert all(torch.equal(x, y) for x, y in zip(store.pair(str(shard), "a"), (image[0], text[0])))


@pytest.mark.parametrize("dtype, unit", [("float16", 2.0**-11), ("bfloat16", 2.0**-8), ("float32", 0.0)])
def test_the_stored_dtype_reads_back_as_float32_within_its_rounding(tmp_path, dtype, unit):
    """Each value rounded to nearest: off by at most half a unit in the last place, |x| * 2^-p (p: the mantissa
    bits, 10 or 7, plus the hidden one)."""
    shard = tmp_path / "00000.tar"
    shard.write_bytes(b"x")
    gen = torch.Generator().manual_seed(0)
    image, text = F.normalize(torch.randn(5, 2, 32, generator=gen), dim=-1), F.normalize(torch.randn(5, 32), dim=-1)
    boxes = torch.randint(0, 100, (5, 2, 4), generator=gen, dtype=torch.int32)
    stored = Reinforced(
        [f"k{i}" for i in range(5)],
        [TeacherFacts("t")],
        [image],
        [{"txt": text}],
        boxes,
        ["txt"],
        2,
        dtype,
        3,
        shard_facts(str(shard)),
    )
    path = sidecar_path(tmp_path, str(shard))
    write_reinforced(path, stored)
    back = read_reinforced(path)
    assert back.images[0].dtype == getattr(torch, dtype) and torch.equal(back.boxes, boxes)
    sample = EmbeddingStore(tmp_path, "t").lookup(str(shard), "k3")
    assert sample.images[0].dtype == torch.float32 and torch.equal(sample.boxes, boxes[3])
    assert (sample.images[0] - image[3]).abs().le(image[3].abs() * unit).all()
    assert (sample.texts[0]["txt"] - text[3]).abs().le(text[3].abs() * unit).all()
    data = bytearray(path.read_bytes())
    data[-1] ^= 1  # the last byte of the last tensor: the file still parses
    path.write_bytes(bytes(data))
    with pytest.raises(DataError, match="checksum does not match"):
        read_reinforced(path)


def test_a_folder_of_mixed_settings_is_refused_by_the_store(tmp_path):
    urls = []
    for i, k in enumerate((2, 3)):
        shard = tmp_path / f"0000{i}.tar"
        shard.write_bytes(b"x")
        urls.append(str(shard))
        boxes = torch.zeros(1, k, 4, dtype=torch.int32)
        stored = Reinforced(
            ["a"],
            [TeacherFacts("t")],
            [torch.full((1, k, 2), 0.5**0.5)],
            [{"txt": torch.full((1, 2), 0.5**0.5)}],
            boxes,
            ["txt"],
            k,
            "float32",
            0,
            shard_facts(str(shard)),
        )
        write_reinforced(sidecar_path(tmp_path, str(shard)), stored)
    store = EmbeddingStore(tmp_path, "t")
    store.lookup(urls[0], "a")
    with pytest.raises(DataError, match="made with augmentations 3, other sidecars .* with 2"):
        store.lookup(urls[1], "a")


# --- resume after a kill ---


@pytest.mark.slow  # two processes, each importing torch and building a tiny teacher
def test_a_kill_after_a_sidecar_resumes_from_the_next_shard(tmp_path):
    from disco_clip_ds.models.build import build_model

    build_model(model_config=str(TINY_CONFIG), seed=0).save_pretrained(tmp_path / "teacher")
    rng = np.random.default_rng(2)
    samples = [{"jpg": noise_image_bytes(rng, "JPEG", 48), "txt": f"c {i}"} for i in range(6)]
    write_samples(tmp_path / "data", samples, 2)
    args = ["--teacher", str(tmp_path / "teacher"), "--tokenizer_name", str(TOKENIZER_DIR), "--augmentations", "2"]
    args += ["--shards", str(tmp_path / "data" / "{00000..00002}.tar"), "--output", str(tmp_path / "emb")]
    cmd = [str(VENV_BIN / "python"), "-m", "disco_clip_ds.cli", "data", "embed", *args]
    killed = subprocess.run(
        cmd, env=train_env(DISCO_FAULT="kill_after_sidecar:shard=1"), capture_output=True, text=True, timeout=120
    )
    assert killed.returncode == -9, killed.stderr[-2000:]
    done = sorted(p.name for p in (tmp_path / "emb").iterdir() if p.name != WRITER_LOCK)  # the killed run's lock:
    assert len(done) == 2 and not any(name.endswith(".tmp") for name in done)  # taken over below; shards 0, 1 whole
    first = (tmp_path / "emb" / done[0]).read_bytes()
    again = subprocess.run(cmd, env=train_env(), capture_output=True, text=True, timeout=120)
    assert again.returncode == 0, again.stderr[-2000:]
    assert "1 shard(s) embedded, 2 already done" in again.stdout
    assert (tmp_path / "emb" / done[0]).read_bytes() == first
    assert all(int(read_metadata(p)["augmentations"]) == 2 for p in (tmp_path / "emb").glob("*.safetensors"))
    assert not (tmp_path / "emb" / WRITER_LOCK).exists()  # released at the end


# --- refusals ---


@pytest.mark.parametrize(
    "extra, said",
    [
        (["--teacher", "m", "./m"], "--teacher names m twice: give each teacher of the ensemble once"),
        (["--embedding_dtype", "float64"], "--embedding_dtype float64: give one of float16, bfloat16, float32"),
        (["--augmentations", "-1"], "--augmentations -1: give 0 (the centre crop) or more"),
        (["--caption_keys", ""], "--caption_keys '': give one or more keys, e.g. txt,syn0.txt"),
        (["--caption_keys", "txt,,syn0.txt"], "--caption_keys 'txt,,syn0.txt': give one or more keys"),
        (["--caption_keys", "txt,txt"], "--caption_keys txt,txt: a key named twice"),
        (["--tokenizer_name", "a", "b"], "--tokenizer_name: 2 names for 1 teachers: give one for all, or one per"),
    ],
)
def test_bad_settings_are_one_line_before_any_model(tmp_path, capsys, no_model, extra, said):
    argv = ["--teacher", "m", "--shards", str(tmp_path / "none.tar"), *extra]
    assert _embed(argv) == 2
    err = capsys.readouterr().err
    assert said in err and len(err.splitlines()) == 1, err


def test_one_model_under_two_names_is_one_line(tmp_path, capsys, no_model):
    from disco_clip_ds.models.build import load_config

    for name in ("a", "b"):
        load_config(model_config=str(TINY_CONFIG)).save_pretrained(tmp_path / name)
        (tmp_path / name / "model.safetensors").write_bytes(b"same")
    write_samples(tmp_path / "data", [{"jpg": b"x", "txt": "c"}], 1)
    argv = ["--teacher", str(tmp_path / "a"), str(tmp_path / "b"), "--shards", str(tmp_path / "data")]
    assert _embed(argv) == 2
    err = capsys.readouterr().err
    assert "are one model (fingerprint" in err and len(err.splitlines()) == 1, err


def test_check_sidecars_refuses_too_few_augmentations_or_a_missing_caption_key(tmp_path):
    shard = tmp_path / "00000.tar"
    shard.write_bytes(b"x")
    boxes = torch.zeros(1, 2, 4, dtype=torch.int32)
    texts = {"txt": torch.zeros(1, 2), "syn0.txt": torch.zeros(1, 2)}
    stored = Reinforced(
        ["a"], [TeacherFacts("t")], [torch.zeros(1, 2, 2)], [texts], boxes, ["txt", "syn0.txt"], 2, "float32", 0,
        shard_facts(str(shard)),
    )  # fmt: skip
    write_reinforced(sidecar_path(tmp_path, str(shard)), stored)
    check_sidecars(tmp_path, [str(shard)], ["t"], "T", augmentations=2, caption_keys=["txt", "syn0.txt"])
    with pytest.raises(UsageError, match="made with 2 augmentations per sample, fewer than the 3 needed"):
        check_sidecars(tmp_path, [str(shard)], ["t"], "T", augmentations=3)
    with pytest.raises(UsageError, match="made without the caption key syn1.txt \\(its keys: txt,syn0.txt"):
        check_sidecars(tmp_path, [str(shard)], "t", "T", caption_keys=["syn1.txt"])
    centre = tmp_path / "centre"
    meta = {"teacher": "t", **shard_facts(str(shard))}
    write_sidecar(sidecar_path(centre, str(shard)), ["a"], torch.zeros(1, 2), torch.zeros(1, 2), meta)
    with pytest.raises(UsageError, match="made with the centre crop alone, fewer than the 1 needed"):
        check_sidecars(centre, [str(shard)], "t", "T", augmentations=1)


def test_resharding_carries_every_teacher_augmentation_and_caption_of_the_kept_rows(tmp_path):
    """data filter's reshard (data/curate/reshard.py) copies the kept rows of reinforced sidecars; inputs embedded
    with other settings cannot share an output sidecar."""
    from disco_clip_ds.data.curate.reshard import write_output_shard

    rng = np.random.default_rng(3)
    write_samples(tmp_path / "in", [{"jpg": noise_image_bytes(rng, "JPEG"), "txt": f"c{i}"} for i in range(6)], 3)
    urls = [str(tmp_path / "in" / f"0000{i}.tar") for i in range(2)]
    gen = torch.Generator().manual_seed(0)
    inputs = []
    for i, url in enumerate(urls):
        keys = [f"s{j:05d}" for j in range(3 * i, 3 * i + 3)]
        stored = Reinforced(
            keys,
            [TeacherFacts("a", "A", "clip", 100.0), TeacherFacts("b", "B", "siglip", 10.0, -10.0)],
            [F.normalize(torch.randn(3, 2, d, generator=gen), dim=-1) for d in (4, 6)],
            [{k: F.normalize(torch.randn(3, d, generator=gen), dim=-1) for k in ("txt", "syn0.txt")} for d in (4, 6)],
            torch.randint(0, 40, (3, 2, 4), generator=gen, dtype=torch.int32),
            ["txt", "syn0.txt"],
            2,
            "bfloat16",
            7,
            shard_facts(url),
        )
        write_reinforced(sidecar_path(tmp_path / "in", url), stored)
        inputs.append(read_reinforced(sidecar_path(tmp_path / "in", url)))
    out = tmp_path / "out" / "00000.tar"
    out.parent.mkdir()
    pieces = [
        (urls[0], sidecar_path(tmp_path / "in", urls[0]), [1]),
        (urls[1], sidecar_path(tmp_path / "in", urls[1]), [0, 2]),
    ]
    assert write_output_shard(out, pieces) == 3
    got = read_reinforced(sidecar_path(out.parent, str(out)))
    assert got.keys == ["s00001", "s00003", "s00005"] and (got.augmentations, got.dtype, got.seed) == (2, "bfloat16", 7)
    assert [t.fingerprint for t in got.teachers] == ["a", "b"] and got.teachers[1].logit_bias == -10.0
    picks = [(inputs[0], 1), (inputs[1], 0), (inputs[1], 2)]
    for row, (source, at) in enumerate(picks):
        assert torch.equal(got.boxes[row], source.boxes[at])
        for t in range(2):
            assert torch.equal(got.images[t][row], source.images[t][at])
            assert all(torch.equal(got.texts[t][k][row], source.texts[t][k][at]) for k in ("txt", "syn0.txt"))
    other = replace(inputs[1], augmentations=3, boxes=torch.zeros(3, 3, 4, dtype=torch.int32))
    other.images = [F.normalize(torch.ones(3, 3, d), dim=-1) for d in (4, 6)]
    write_reinforced(sidecar_path(tmp_path / "in", urls[1]), other)
    with pytest.raises(DataError, match="input sidecars were embedded with other settings"):
        write_output_shard(out, pieces)
