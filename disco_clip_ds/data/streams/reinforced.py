"""Training from a reinforced set (`--teacher_embeddings`, data/embeddings.py): which of a sample's stored
augmentations it is cropped with, which of its captions it is trained on, and the stored ensemble targets of that
pair, as MobileCLIP's reinforced training reads DataCompDR.

Every choice is a function of (seed, pass, sample key) alone, never of the rank, the DataLoader worker or the
micro-batch, so that a run is the same under accumulation, resume and another number of ranks:
- the augmentation (`--augmentation_pool`): one of the K stored crop boxes, uniformly (MobileCLIP draws
  `randint(0, K)` per sample); the crop is replayed from that box bit-identically and the image target is the
  teachers' embedding of that very crop;
- the caption (`--synthetic_caption_ratio R`): a synthetic caption with probability R, uniformly among the stored
  synthetic ones, else the real one: MobileCLIP's `mix_synthetic` mode, one caption per image, so that the contrastive
  and distillation losses keep one text per image row (its default mode, a second whole loss over the synthetic
  captions, doubles the text batch instead). The text target is the teachers' embedding of that caption.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from disco_clip_ds.data.reinforced import NotStored
from disco_clip_ds.errors import DataError

REAL_CAPTION = "txt"  # the caption key of the real caption: the sample's KEY.txt member


def augmentation_index(seed: int, epoch: int, key: str, count: int) -> int:
    """The stored augmentation (0 .. count - 1) that sample `key` is cropped with in pass `epoch`: uniform, from
    (seed, pass, key) alone."""
    return random.Random(f"{seed}/augmentation/{epoch}/{key}").randrange(count)


def caption_choice(seed: int, epoch: int, key: str, ratio: float, synthetic: tuple[str, ...]) -> str:
    """The caption key sample `key` is trained on in pass `epoch`: one of the `synthetic` keys (uniformly) with
    probability `ratio`, else the real caption; from (seed, pass, key) alone. Without synthetic keys, or at ratio 0,
    always the real one."""
    rng = random.Random(f"{seed}/caption/{epoch}/{key}")
    draw, pick = rng.random(), rng.randrange(max(1, len(synthetic)))
    return synthetic[pick] if synthetic and draw < ratio else REAL_CAPTION


class MissingCaption(NotStored):
    """A sample's chosen caption has no stored embedding: skipped and counted, as a sample without the caption."""


@dataclass
class Reinforcement:
    """How the stream reads a reinforced set: `store` (data/embeddings.py EmbeddingStore of the teachers, in the
    order of --teacher), `augmentations` K stored per sample, `pool`: crop each sample with one of them (else the
    stream's own random crop and the stored centre crop's targets, row 0), `ratio` and the `synthetic` caption keys
    to draw from, `targets`: carry the stored embeddings as the distillation targets (False: a live teacher runs on
    the replayed crops and chosen captions, the check that stored and live training agree)."""

    store: object
    augmentations: int
    pool: bool
    ratio: float = 0.0
    synthetic: tuple[str, ...] = ()
    targets: bool = True

    def choose(self, seed: int, epoch: int, key: str) -> tuple[int, str]:
        """(augmentation index, caption key) of sample `key` in pass `epoch`."""
        index = augmentation_index(seed, epoch, key, self.augmentations) if self.pool else 0
        return index, caption_choice(seed, epoch, key, self.ratio, self.synthetic)

    def lookup(self, shard: str, key: str, index: int, caption: str):
        """(crop box or None, targets or None) of the chosen augmentation and caption: the box when pooling, the
        teachers' stored (image, text) embeddings, one pair per teacher, when `targets`. A NotStored (the stream
        skips and counts the sample) when the sidecar has no row of the sample (`data embed` skipped it) or a teacher
        stored no embedding of the chosen caption (MissingCaption); the store's DataError (the run stops) when a
        sidecar is missing, torn, or holds rows that are not its shard's samples' teacher embeddings."""
        stored = self.store.lookup(shard, key)
        box = None
        if self.pool:
            if stored.boxes is None:
                raise DataError(f"sample {key}: its sidecar stores no augmentations")
            box = tuple(int(v) for v in stored.boxes[index].tolist())
        if not self.targets:
            return box, None
        if any(caption not in texts for texts in stored.texts):
            raise MissingCaption(f"sample {key}: no stored embedding of its caption {caption!r}")
        pairs = tuple((images[index], texts[caption]) for images, texts in zip(stored.images, stored.texts))
        return box, pairs


def stack_targets(targets: list[tuple[tuple[torch.Tensor, torch.Tensor], ...]]) -> tuple[list, list]:
    """A batch's per-sample targets (one (image, text) pair per teacher each) -> (images, texts): per teacher, the
    (n, d_t) float32 stack of its embeddings."""
    teachers = len(targets[0])
    images = [torch.stack([sample[t][0] for sample in targets]).float() for t in range(teachers)]
    texts = [torch.stack([sample[t][1] for sample in targets]).float() for t in range(teachers)]
    return images, texts
