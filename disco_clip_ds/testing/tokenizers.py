"""Tokenizers for tests, written offline: each model family's own kind (CLIP's byte-level BPE, SigLIP 2's Gemma-style
Siglip2Tokenizer), small enough for the tiny recipes' text towers, and the training captions they are checked on."""

from __future__ import annotations

import string
from pathlib import Path

from disco_clip_ds.testing.launch import TOKENIZER_DIR

# the quickstart's captions and prompts (data/prep/demo.py, recipes/make_tokenizer.py): the ids a reload must keep
CAPTIONS = ("a photo of the number 5.", "a handwritten 7.", "the number 3, drawn by hand", "A Photo Of A Big 9!")
_SIGLIP2_SPECIAL = ("<pad>", "<eos>", "<bos>", "<unk>", "<mask>")  # Siglip2Tokenizer's defaults, ids 0..4
_SIGLIP2_WORDS = ("photo", "number", "the", "of", "digit", "drawn", "hand")


def siglip2_tokenizer(folder: Path) -> Path:
    """A Siglip2Tokenizer (SigLIP 2's own kind: Gemma's BPE rules, lowercased, '▁' for spaces) of the characters of
    lowercase English and the demo's words, saved in `folder`."""
    from transformers import Siglip2Tokenizer

    symbols = ["▁", *string.ascii_lowercase, *string.digits, *".,!?'-"]
    vocab = {token: i for i, token in enumerate(_SIGLIP2_SPECIAL)}
    merges = []
    for word in _SIGLIP2_WORDS:  # each word merged letter by letter, then with the space before it
        for end in range(2, len(word) + 1):
            merges.append((word[: end - 1], word[end - 1]))
        merges.append(("▁", word))
    for token in [*symbols, *(a + b for a, b in merges)]:
        vocab.setdefault(token, len(vocab))
    tokenizer = Siglip2Tokenizer(vocab=vocab, merges=merges)
    tokenizer.save_pretrained(folder)
    return folder


def family_tokenizer(model_type: str, folder: Path) -> Path | None:
    """A folder holding the tokenizer of `model_type`'s own family: CLIP's is the quickstart's (recipes/tokenizer, a
    CLIPTokenizer); SigLIP 2's a Siglip2Tokenizer written into `folder`; SigLIP's (SiglipTokenizer, SentencePiece)
    needs the sentencepiece package: None without it."""
    if model_type == "clip":
        return TOKENIZER_DIR
    if model_type == "siglip2":
        return siglip2_tokenizer(folder)
    try:
        import sentencepiece  # noqa: F401
    except ImportError:
        return None
    return _siglip_tokenizer(folder)


def _siglip_tokenizer(folder: Path) -> Path:
    """A SiglipTokenizer (SentencePiece unigram) trained on the captions, saved in `folder`."""
    import io

    import sentencepiece as spm
    from transformers import SiglipTokenizer

    model = io.BytesIO()
    corpus = [c.lower() for c in CAPTIONS] * 50 + list(string.ascii_lowercase + string.digits)
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(corpus), model_writer=model, vocab_size=48, hard_vocab_limit=False
    )
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "spiece.model").write_bytes(model.getvalue())
    SiglipTokenizer(vocab_file=str(folder / "spiece.model")).save_pretrained(folder)
    return folder
