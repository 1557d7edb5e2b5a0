"""Train the small CLIP-format tokenizer in recipes/tokenizer/ (for the tiny model; no hub access needed).

Same normaliser, pre-tokeniser and BPE format as openai/clip-vit-base-patch32 (byte-level BPE, words end in
'</w>', <|startoftext|>/<|endoftext|>), trained by the `tokenizers` library on a small caption corpus, then
wrapped in transformers' CLIPTokenizer so that `AutoTokenizer.from_pretrained("recipes/tokenizer")` loads it.

    python recipes/make_tokenizer.py [--output recipes/tokenizer] [--vocab_size 1024]
"""

import argparse
import itertools

from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from transformers import CLIPTokenizer

from disco_clip_ds.data.prep.demo import DIGITS

# CLIP's zero-shot templates and caption words: the demo data's captions and prompts stay in a few tokens.
TEMPLATES = [
    "a photo of the number {}.",
    "a photo of the digit {}.",
    "a blurry photo of the number {}.",
    "a handwritten {}.",
    "a drawing of the digit {}.",
    "an image of the number {}.",
    "a close-up photo of a {}.",
    "a black and white photo of the number {}.",
    "a bright photo of a {}.",
    "a photo of a small {}.",
    "a photo of a big {}.",
    "a low resolution photo of the {}.",
    "a cropped photo of the {}.",
    "itap of a {}.",
    "handwritten digit {}",
    "the digit {}, written by hand",
    "a scan of a handwritten {}",
    "a blurry handwritten {}",
    "a small grey picture of the digit {}",
    "the number {}, drawn by hand",
    "a low resolution image of a handwritten {}",
    "a good photo of the {}.",
    "a rendering of a {}.",
    "a sketch of a {}.",
    "a pixelated photo of the {}.",
]
WORDS = (
    "the a an of in on with and is are this that photo picture image drawing digit number handwritten white "
    "black dark bright blurry small large big red green blue gray grey color colour background dog cat car man "
    "woman person people street city tree house water sky sea beach mountain flower food plate table room "
    "bird horse train bus boat plane road field snow grass sign text written style scanned pixel centered"
).split()


def corpus():
    for template, name in itertools.product(TEMPLATES, DIGITS + [str(i) for i in range(10)]):
        yield template.format(name)
    for a, b in itertools.product(WORDS, repeat=2):
        yield f"{a} {b}"


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output", default="recipes/tokenizer")
    parser.add_argument("--vocab_size", type=int, default=1024)
    args = parser.parse_args()

    template = CLIPTokenizer()  # an empty CLIP tokenizer: its normaliser and pre-tokeniser are CLIP's
    bpe = Tokenizer(models.BPE(end_of_word_suffix="</w>", continuing_subword_prefix="", unk_token="<|endoftext|>"))
    bpe.normalizer = template.backend_tokenizer.normalizer
    bpe.pre_tokenizer = template.backend_tokenizer.pre_tokenizer
    trainer = trainers.BpeTrainer(
        vocab_size=args.vocab_size,
        special_tokens=["<|startoftext|>", "<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        end_of_word_suffix="</w>",
        show_progress=False,
    )
    bpe.train_from_iterator(corpus(), trainer=trainer)
    vocab = bpe.get_vocab()
    merges = _merges(bpe)
    tokenizer = CLIPTokenizer(vocab=vocab, merges=merges, model_max_length=77)
    tokenizer.save_pretrained(args.output)
    print(
        f"saved {len(vocab)}-token CLIP tokenizer to {args.output}: "
        f"bos={tokenizer.bos_token_id} eos={tokenizer.eos_token_id} pad={tokenizer.pad_token_id}"
    )


def _merges(bpe: Tokenizer):
    import json

    return [
        tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in json.loads(bpe.to_str())["model"]["merges"]
    ]


if __name__ == "__main__":
    main()
