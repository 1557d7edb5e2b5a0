"""What the eval tests share: a tiny CLIP, a classification set of shards (and its 🤗 datasets forms), a saved model,
`disco-clip eval` in this process."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from disco_clip_ds.commands.eval import main as eval_command
from disco_clip_ds.errors import run_main
from disco_clip_ds.testing.images import noise_image_bytes, write_samples

IMAGE_SIZE = 32


def eval_main(argv: list[str]) -> int:
    """`disco-clip eval` in this process: its exit code, its messages on stderr."""
    return run_main(eval_command, argv, "disco-clip eval")


def tiny_tokenizer():
    """A real CLIPTokenizer over the 256 byte-level symbols (no merges), built offline."""
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers import CLIPTokenizer

    symbols = sorted(ByteLevel.alphabet())
    vocab = {s: i for i, s in enumerate(symbols + [s + "</w>" for s in symbols])}
    vocab["<|startoftext|>"], vocab["<|endoftext|>"] = len(vocab), len(vocab) + 1
    return CLIPTokenizer(vocab=vocab, merges=[])


def tiny_clip_config(tokenizer, image_size: int = IMAGE_SIZE):
    from transformers import CLIPConfig

    text = dict(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        max_position_embeddings=64,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    vision = dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        image_size=image_size,
        patch_size=8,
    )
    return CLIPConfig(text_config=text, vision_config=vision, projection_dim=16)


def tiny_image_processor(image_size: int = IMAGE_SIZE):
    from transformers import CLIPImageProcessor

    return CLIPImageProcessor(size={"shortest_edge": image_size}, crop_size={"height": image_size, "width": image_size})


def tiny_clip(seed: int = 0):
    from transformers import CLIPModel

    torch.manual_seed(seed)
    tokenizer = tiny_tokenizer()
    return CLIPModel(tiny_clip_config(tokenizer)).eval(), tokenizer, tiny_image_processor()


CLASSNAMES = ["zero", "one", "two", "three", "four", "five"]


TEMPLATES = ["a photo of the digit {c}.", "{c}", "a drawing of a {c}."]


@pytest.fixture(scope="module")
def cls_set(tmp_path_factory):
    """11 images over 6 classes in 3 shards (uneven), with classnames and templates beside them."""
    rng = np.random.default_rng(0)
    labels = [0, 1, 2, 3, 4, 5, 0, 2, 2, 5, 1]
    images = [noise_image_bytes(rng, "PNG" if i % 2 else "JPEG") for i in range(len(labels))]
    folder = tmp_path_factory.mktemp("cls")
    samples = [{("png" if i % 2 else "jpg"): img, "cls": str(y)} for i, (img, y) in enumerate(zip(images, labels))]
    write_samples(folder, samples, per_shard=4)
    (folder / "classnames.txt").write_text("\n".join(CLASSNAMES) + "\n")
    (folder / "zeroshot_classification_templates.txt").write_text("\n".join(TEMPLATES) + "\n")
    return folder, images, labels


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    model, tokenizer, processor = tiny_clip()
    folder = tmp_path_factory.mktemp("model")
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    processor.save_pretrained(folder)
    return folder


def rows_dataset(columns: dict, features: dict):
    from datasets import Dataset, Features

    return Dataset.from_dict(columns, features=Features(features))


def cls_dataset(images, labels, label_feature=None):
    from datasets import ClassLabel
    from datasets import Image as ImageFeature

    return rows_dataset(
        {"image": [{"bytes": b, "path": None} for b in images], "label": labels, "note": ["x"] * len(labels)},
        {"image": ImageFeature(), "label": label_feature or ClassLabel(names=CLASSNAMES), "note": string_feature()},
    )


def string_feature():
    from datasets import Value

    return Value("string")


@pytest.fixture(scope="module")
def hf_cls(cls_set, tmp_path_factory):
    """cls_set's 11 images and labels as a datasets dataset three ways, each with the same templates file beside
    it: a save_to_disk folder, a parquet folder (2 files, hub naming: split "test"), one parquet file."""
    _, images, labels = cls_set
    root = tmp_path_factory.mktemp("hf_cls")
    dataset = cls_dataset(images, labels)
    dataset.save_to_disk(str(root / "disk"))
    (root / "parquet").mkdir()
    for i in range(2):
        dataset.shard(2, i, contiguous=True).to_parquet(str(root / "parquet" / f"test-0000{i}-of-00002.parquet"))
    (root / "file").mkdir()
    dataset.to_parquet(str(root / "file" / "eval.parquet"))
    for folder in ("disk", "parquet", "file"):
        (root / folder / "zeroshot_classification_templates.txt").write_text("\n".join(TEMPLATES) + "\n")
    return {"disk": root / "disk", "parquet": root / "parquet", "file": root / "file" / "eval.parquet"}


def record(argv, capsys) -> dict:
    assert eval_main(argv) == 0, capsys.readouterr().err
    return json.loads(capsys.readouterr().out)


def tiny_trainer(model, tokenizer, processor, images: list[bytes], output_dir):
    """A Trainer of `model` for 3 steps of 2 pairs (the first two `images`, two short captions) on the CPU, without
    saving: what the in-training eval callbacks are attached to in the tests."""
    import io

    from PIL import Image
    from transformers import Trainer, TrainingArguments

    tokens = tokenizer(["a photo", "two cats playing"], padding="max_length", max_length=16, return_tensors="pt")
    pixels = processor(images=[Image.open(io.BytesIO(d)).convert("RGB") for d in images[:2]], return_tensors="pt")
    train = [
        {
            "input_ids": tokens["input_ids"][i],
            "attention_mask": tokens["attention_mask"][i],
            "pixel_values": pixels["pixel_values"][i],
        }
        for i in range(2)
    ] * 4

    def collate(rows):
        return {**{k: torch.stack([r[k] for r in rows]) for k in rows[0]}, "return_loss": True}

    args = TrainingArguments(
        output_dir=str(output_dir),
        max_steps=3,
        per_device_train_batch_size=2,
        learning_rate=1e-3,
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        use_cpu=True,
        disable_tqdm=True,
    )
    return Trainer(model=model, args=args, train_dataset=train, data_collator=collate)
