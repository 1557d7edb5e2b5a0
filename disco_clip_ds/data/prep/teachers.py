"""The teachers of `disco-clip data embed` (and of curation's targets): each checked before any model is built (a name
that is neither a folder nor a model on the hub, or a model type whose embeddings cannot be stored here, is one line,
exit 2), fingerprinted, and built with its own view of a sample (its tokenizer, image size and normalisation)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from disco_clip_ds.data.decode import EncodedImage
from disco_clip_ds.data.teacher_id import teacher_fingerprint
from disco_clip_ds.data.transforms import ImageTransform, Normalize
from disco_clip_ds.errors import UsageError

MODEL_TYPES = ("clip", "siglip")  # teachers with one image size, whose crops data embed stores


def teacher_config(teacher: str):
    """The teacher's config, read before any model is built; a UsageError in one line for a folder that is not there,
    a name that is neither a model folder nor a model on the hub (or, offline, in its cache), and a model type whose
    embeddings this command cannot store."""
    from disco_clip_ds.models.build import load_config

    folder = Path(teacher).expanduser()
    if not folder.exists() and teacher.startswith(("/", "./", "../", "~")):
        raise UsageError(f"--teacher {teacher}: no such folder")
    try:
        config = load_config(str(folder) if folder.exists() else teacher)
    except (OSError, ValueError) as error:  # transformers' messages run over several lines
        what = "not a model folder" if folder.exists() else "no such folder, nor a model on the hub or in its cache"
        raise UsageError(f"--teacher {teacher}: {what} ({str(error).splitlines()[0]})") from error
    if config.model_type == "siglip2":
        raise UsageError(
            f"--teacher {teacher}: a SigLIP 2 model, whose NaFlex image input has no one image size to crop to; "
            f"data embed stores the embeddings of {' and '.join(MODEL_TYPES)} teachers"
        )
    if config.model_type not in MODEL_TYPES:
        raise UsageError(f"--teacher {teacher}: a {config.model_type} model; give a CLIPModel or SiglipModel")
    return config


def teacher_preprocessing(name_or_path: str, tokenizer_name: str | None, config):
    """(tokenizer, text length, ImageTransform, Normalize) of the teacher's own view of a sample: its tokenizer (or
    `tokenizer_name`), padded to its text positions, and a center crop at its image size with its normalisation
    (its image processor's, else CLIP's)."""
    from transformers import AutoImageProcessor, AutoTokenizer

    from disco_clip_ds.compat import image_processor_class

    source = tokenizer_name or name_or_path
    try:
        tokenizer = AutoTokenizer.from_pretrained(source)
    except (OSError, ValueError, TypeError) as error:
        raise UsageError(f"{source}: no tokenizer ({error}); pass --tokenizer_name") from error
    if len(tokenizer) < 3:  # transformers builds an empty tokenizer from a folder without tokenizer files
        raise UsageError(f"{source}: no tokenizer files; pass --tokenizer_name")
    try:
        processor = AutoImageProcessor.from_pretrained(name_or_path)
    except (OSError, ValueError, TypeError):
        processor = image_processor_class("CLIPImageProcessor")()
    size = config.vision_config.image_size
    return (
        tokenizer,
        config.text_config.max_position_embeddings,
        ImageTransform(size, train=False),
        Normalize(processor.image_mean, processor.image_std),
    )


@dataclass
class Teacher:
    """A teacher as data embed runs it: the model (eval mode, no gradients), its fingerprint, and its own view of a
    sample (`teacher_preprocessing`)."""

    name: str
    model: torch.nn.Module
    fingerprint: str
    tokenizer: object
    text_length: int
    transform: ImageTransform
    normalize: Normalize

    def crops(self, data: bytes, boxes: list, decoded: dict) -> list[torch.Tensor]:
        """The teacher's uint8 views (3, size, size) of an encoded image: the centre crop (its image processor's
        steps) when `boxes` is empty, else each box resized to its image size as the training crop makes it
        (`ImageTransform.box_crops`: as `from_bytes` with that box, bit for bit; the image decoded once per draft
        scale, `decoded` shared with the other teachers)."""
        if not boxes:
            return [self.transform.from_bytes(data, None)]
        if self._box_transform is None:
            self._box_transform = ImageTransform(self.transform.image_size, train=True)
        encoded = EncodedImage(data)  # the pixel cap checked, as every reader's
        return self._box_transform.box_crops(encoded, boxes, decoded)

    _box_transform: ImageTransform | None = field(default=None, init=False, repr=False)


def checked_fingerprint(teacher: str) -> str:
    """`teacher`'s fingerprint once its config is checked (`teacher_config`; `data.teacher_id`: a folder's weights
    hashed, or taken from the fingerprint cache while its files are unchanged; a hub id's resolved commit, no weights
    fetched); a UsageError in one line when its weights cannot be read."""
    teacher_config(teacher)
    try:
        return teacher_fingerprint(teacher)
    except (OSError, ValueError) as error:  # a weight file that cannot be read
        raise UsageError(f"--teacher {teacher}: its weights cannot be read ({str(error).splitlines()[0]})") from error


def load_teacher(teacher: str, tokenizer_name: str | None = None, device: str | torch.device = "cpu") -> Teacher:
    """`teacher` (a CLIPModel or SiglipModel folder or hub id) checked, fingerprinted (`checked_fingerprint`) and
    built on `device`; a UsageError in one line when it cannot be."""
    from disco_clip_ds.models.build import build_model

    fingerprint = checked_fingerprint(teacher)
    model = build_model(teacher).eval().requires_grad_(False).to(device)
    tokenizer, length, transform, normalize = teacher_preprocessing(teacher, tokenizer_name, model.config)
    return Teacher(teacher, model, fingerprint, tokenizer, length, transform, normalize)
