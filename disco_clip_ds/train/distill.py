"""A live teacher in training (`--teacher`, `--distill_weight`, `--distill_temperature`): the teacher's embeddings of
each batch and the student's loss (1 - W) contrastive + W distillation (`disco_clip_ds.losses.distill`).

The teacher is a plain transformers CLIPModel or SiglipModel held beside the student, not inside it: it is no
submodule of the model the Trainer wraps, so it has no optimizer state, the engine never sees it, and checkpoints,
exports and pushes hold the student alone. It runs in eval mode under no_grad. Its inputs are the student's unless
it tokenizes or preprocesses differently: the collator then adds its own under TEACHER_PREFIX keys
(`data.collate.ClipCollator`), which the student never sees (`split_inputs`).
"""

from __future__ import annotations

from pathlib import Path

import torch

from disco_clip_ds.data.collate import TEACHER_PREFIX, TeacherInputs
from disco_clip_ds.data.transforms import Normalize
from disco_clip_ds.losses.distill import sigmoid_distill_loss, softmax_distill_loss

# The files of which a saved tokenizer has at least one (fast, slow BPE, sentencepiece).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "spiece.model")


def split_inputs(inputs: dict) -> tuple[dict, dict]:
    """(the student's inputs, the teacher's): the teacher's are its own TEACHER_PREFIX keys where the collator made
    them, else the student's input_ids, attention_mask and pixel_values (never the student's kept patches)."""
    student = {k: v for k, v in inputs.items() if not k.startswith(TEACHER_PREFIX)}
    teacher = {k: student[k] for k in ("input_ids", "attention_mask", "pixel_values") if k in student}
    teacher.update({k[len(TEACHER_PREFIX) :]: v for k, v in inputs.items() if k.startswith(TEACHER_PREFIX)})
    return student, teacher


class Teacher:
    """A frozen CLIP or SigLIP teacher and the loss that mixes its distillation into the student's.

    `model`: a transformers CLIPModel or SiglipModel of the student's family; `weight` W: loss = (1 - W) contrastive +
    W distillation; `temperature`: when set, the teacher's similarities are multiplied by 1 / temperature instead of
    its own `logit_scale.exp()` (the student's logits and the teacher's SigLIP bias are unchanged)."""

    def __init__(self, model, weight: float, temperature: float | None = None):
        self.model = model.eval().requires_grad_(False)
        self.weight, self.temperature = weight, temperature
        self.sigmoid = model.config.model_type == "siglip"

    def to(self, device, dtype=None) -> Teacher:
        self.model.to(device=device, dtype=dtype)
        return self

    @torch.no_grad()
    def embed(self, inputs: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """The teacher's L2-normalised (image, text) embeddings of a batch's teacher inputs (`split_inputs`)."""
        self.model.eval()  # a Trainer's model.train() never reaches it, but nothing else may switch it either
        out = self.model(**inputs, return_loss=False)
        return out.image_embeds.float(), out.text_embeds.float()

    def scalars(self) -> tuple[torch.Tensor, ...]:
        """The teacher's similarity multiplier (and SigLIP bias) the distillation loss takes."""
        scale = self.model.logit_scale.detach().float().exp().reshape(())
        if self.temperature is not None:
            scale = torch.full_like(scale, 1.0 / self.temperature)
        return (scale, self.model.logit_bias.detach().float().reshape(())) if self.sigmoid else (scale,)

    def loss_fn(self, contrastive, teacher_images: torch.Tensor, teacher_texts: torch.Tensor):
        """loss(images, texts, *params) = (1 - W) contrastive(images, texts, *params) + W distillation against the
        teacher's embeddings of the same rows (`contrastive`: the student's `global_loss`)."""
        distill = sigmoid_distill_loss if self.sigmoid else softmax_distill_loss
        scalars = self.scalars()

        def loss(images, texts, *params):
            value = self.weight * distill(images, texts, *params, teacher_images, teacher_texts, *scalars)
            if self.weight < 1:  # W = 1 is pure distillation: no contrastive pass at all
                value = value + (1 - self.weight) * contrastive(images, texts, *params)
            return value

        return loss


def load_teacher(name_or_path: str, weight: float, temperature: float | None) -> Teacher:
    """The teacher's weights (a CLIPModel or SiglipModel hub id or folder; `train.validate` checked its type)."""
    from transformers import AutoModel

    return Teacher(AutoModel.from_pretrained(name_or_path), weight, temperature)


def teacher_inputs(teacher: Teacher, name_or_path: str, tokenizer, max_length: int, image_processor, image_size: int):
    """What the collator must make for the teacher beyond the student's batch (`TeacherInputs`), or None when the
    teacher reads the student's inputs as they are: its own tokenizer (found with its weights) when its vocabulary or
    special tokens differ, or when the student's texts do not fit its positions (or, for SigLIP, which pools the last
    position, are not padded to them); its own normalisation and size when its image processor's differ."""
    from transformers import AutoImageProcessor, AutoTokenizer

    config = teacher.model.config
    positions, size = config.text_config.max_position_embeddings, config.vision_config.image_size
    own_tokenizer = tokenizer  # weights saved without a tokenizer: taken to read the student's
    # (transformers builds an empty tokenizer from a folder without tokenizer files rather than failing)
    if not Path(name_or_path).is_dir() or any((Path(name_or_path) / f).is_file() for f in TOKENIZER_FILES):
        try:
            own_tokenizer = AutoTokenizer.from_pretrained(name_or_path)
        except (OSError, ValueError, TypeError):
            own_tokenizer = tokenizer
    same_tokens = type(own_tokenizer) is type(tokenizer) and own_tokenizer.get_vocab() == tokenizer.get_vocab()
    same_tokens = same_tokens and (
        own_tokenizer.bos_token_id,
        own_tokenizer.eos_token_id,
        own_tokenizer.pad_token_id,
    ) == (
        tokenizer.bos_token_id,
        tokenizer.eos_token_id,
        tokenizer.pad_token_id,
    )
    fits = max_length == positions if teacher.sigmoid else max_length <= positions
    try:
        own_processor = AutoImageProcessor.from_pretrained(name_or_path)
        mean, std = list(own_processor.image_mean), list(own_processor.image_std)
    except (OSError, ValueError, TypeError):  # none saved: the student's normalisation
        mean, std = list(image_processor.image_mean), list(image_processor.image_std)
    same_pixels = size == image_size and (mean, std) == (
        list(image_processor.image_mean),
        list(image_processor.image_std),
    )
    if same_tokens and fits and same_pixels:
        return None
    return TeacherInputs(
        tokenizer=None if same_tokens and fits else own_tokenizer,
        max_length=positions,
        normalize=None if same_pixels else Normalize(mean, std),
        image_size=None if same_pixels else size,
    )
