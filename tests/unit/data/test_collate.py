"""data/collate.py: the collator tokenizes to max_length and hands over tensors only."""

import torch
from transformers import AutoTokenizer

from disco_clip_ds.data.collate import ClipCollator
from disco_clip_ds.testing.launch import TOKENIZER_DIR


def test_collator_pads_to_max_length_with_eos_and_no_labels():
    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER_DIR)
    batch = ClipCollator(tokenizer, max_length=12)(
        [(torch.zeros(3, 8, 8), "a photo of the digit seven"), (torch.ones(3, 8, 8), "seven")]
    )
    assert set(batch) == {"pixel_values", "input_ids", "attention_mask"}
    assert batch["input_ids"].shape == (2, 12) and batch["pixel_values"].shape == (2, 3, 8, 8)
    ids = batch["input_ids"][1].tolist()
    assert ids[0] == tokenizer.bos_token_id and ids[2] == tokenizer.eos_token_id
    assert batch["attention_mask"][1].tolist() == [1, 1, 1] + [0] * 9
    long = ClipCollator(tokenizer, max_length=5)([(torch.zeros(3, 8, 8), "a photo of the digit seven eight nine")])
    assert long["input_ids"][0, -1] == tokenizer.eos_token_id  # truncation keeps the end token CLIP pools at


def test_kept_patches_ride_in_the_batch_beside_the_positions():
    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER_DIR)
    samples = [
        (torch.zeros(3, 8, 8, dtype=torch.uint8), "seven", torch.tensor([0, 2]), torch.tensor([0, 1, 5])),
        (torch.ones(3, 8, 8, dtype=torch.uint8), "eight", torch.tensor([1, 3]), torch.tensor([0, 2, 5])),
    ]
    batch = ClipCollator(tokenizer, max_length=12, patch_dropout=True)(samples)
    assert batch["patch_keep"].tolist() == [[0, 2], [1, 3]]
    assert batch["stream_position"].tolist() == [[0, 1, 5], [0, 2, 5]]
    plain = ClipCollator(tokenizer, max_length=12)([(s[0], s[1], s[3]) for s in samples])
    assert "patch_keep" not in plain and torch.equal(plain["pixel_values"], batch["pixel_values"])


def test_under_a_schedule_each_grids_kept_patches_ride_under_their_own_key():
    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER_DIR)
    samples = [
        (torch.zeros(3, 8, 8), "seven", {"patch_keep": torch.tensor([0, 2]), "patch_keep@1": torch.tensor([0])}),
        (torch.ones(3, 8, 8), "eight", {"patch_keep": torch.tensor([1, 3]), "patch_keep@1": torch.tensor([0])}),
    ]
    batch = ClipCollator(tokenizer, max_length=12, patch_dropout=True)(samples)
    assert batch["patch_keep"].tolist() == [[0, 2], [1, 3]] and batch["patch_keep@1"].tolist() == [[0], [0]]
