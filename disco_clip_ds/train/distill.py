"""A live teacher in training (`--teacher`, `--distill_weight`, `--distill_temperature`): the teacher's embeddings of
each batch and the student's loss (1 - W) contrastive + W distillation (`disco_clip_ds.losses.distill`).

The teacher (a CLIPModel or SiglipModel's weights, loaded as this package's model of its family) is held beside the
student, not inside it: it is no submodule of the model the Trainer wraps, so it has no optimizer state, the
student's engine never sees it, and checkpoints, exports and pushes hold the student alone. It runs in eval mode
under no_grad (under ZeRO-3 partitioned, in an inference engine of its own: `load_teacher`). Its inputs are the
student's unless it tokenizes or preprocesses differently: the collator then adds its own under TEACHER_PREFIX keys
(`data.collate.ClipCollator`), which the student never sees (`split_inputs`). With `--teacher_embeddings` no model
runs: `StoredTeacher` takes the embeddings stored per shard (data/embeddings.py) that the collator looked up.

Several teachers (`--teacher A B`) are an `Ensemble`: each runs on its own inputs (the collator's TEACHER_PREFIX keys
then carry the member's index, "teacher_0_input_ids"), and the loss distils the mean of their distributions
(losses/distill.py, as MobileCLIP's ensemble). Its embeddings travel as one tensor, the members' side by side, so
that contrastive accumulation concatenates micro-batches of an ensemble as it does one teacher's.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from disco_clip_ds.data.collate import TEACHER_PREFIX, TeacherInputs
from disco_clip_ds.data.transforms import Normalize
from disco_clip_ds.losses.distill import sigmoid_distill_loss, softmax_distill_loss

logger = logging.getLogger("disco_clip_ds.train")

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

    `model`: a DiscoCLIPModel or DiscoSiglipModel of the student's family (its output carries its logit parameters as
    its forward used them, gathered there under ZeRO-3), or the ZeRO-3 inference engine wrapping one; `weight` W:
    loss = (1 - W) contrastive + W distillation; `temperature`: when set, the teacher's similarities are multiplied by
    1 / temperature instead of its own logit multiplier (the student's logits and the teacher's SigLIP bias are
    unchanged)."""

    def __init__(self, model, weight: float, temperature: float | None = None):
        model.eval()  # (a DeepSpeed engine's eval returns None)
        model.requires_grad_(False)
        self.model, self.config = model, getattr(model, "module", model).config  # an engine's config is DeepSpeed's
        self.weight, self.temperature = weight, temperature
        self.sigmoid = self.config.model_type == "siglip"

    @torch.no_grad()
    def embed(self, inputs: dict) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, ...]]:
        """The teacher's L2-normalised (image, text) embeddings of a batch's teacher inputs (`split_inputs`), and the
        similarity multiplier (and SigLIP bias) the distillation loss takes."""
        self.model.eval()  # a Trainer's model.train() never reaches it, but nothing else may switch it either
        out = self.model(**inputs, return_loss=False, return_logits=False)
        scale = out.logit_scale.detach().float().reshape(())
        if self.temperature is not None:
            scale = torch.full_like(scale, 1.0 / self.temperature)
        params = (scale, out.logit_bias.detach().float().reshape(())) if self.sigmoid else (scale,)
        return out.image_embeds.float(), out.text_embeds.float(), params

    def loss_fn(self, teacher_images: torch.Tensor, teacher_texts: torch.Tensor, teacher_params):
        """loss(images, texts, *params) = (1 - W) contrastive + W distillation against the teacher's embeddings of the
        same rows: the student's CLIP (SigLIP) loss and the distillation from the same tiles, in one pass
        (`disco_clip_ds.losses.distill`), whichever --loss_impl computes the loss without a teacher."""
        distill = sigmoid_distill_loss if self.sigmoid else softmax_distill_loss

        def loss(images, texts, *params):
            return distill(
                images, texts, *params, teacher_images, teacher_texts, *teacher_params, distill_weight=self.weight
            )

        return loss


class Ensemble:
    """Several frozen teachers distilled as one (losses/distill.py's ensemble: the mean of the members' softmaxes or
    sigmoids, each member with its own multiplier and bias). The interface of `Teacher`: `embed` returns the members'
    embeddings side by side, (b, sum of their widths), and their multipliers (and biases) as tensors of shape (M,);
    `loss_fn` splits them again. `members`: Teachers of one family, sharing the weight and the temperature."""

    def __init__(self, members: list[Teacher]):
        self.members, self.dims = members, None
        self.weight, self.sigmoid = members[0].weight, members[0].sigmoid
        self.config = members[0].config  # the family's, for what asks which family teaches

    @torch.no_grad()
    def embed(self, inputs: dict) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, ...]]:
        """Every member's embeddings of its own inputs (`member_inputs`), side by side, and its parameters."""
        images, texts, params = zip(*(m.embed(member_inputs(inputs, k)) for k, m in enumerate(self.members)))
        self.dims = [x.shape[1] for x in images]
        return torch.cat(images, 1), torch.cat(texts, 1), tuple(torch.stack(p) for p in zip(*params))

    def loss_fn(self, teacher_images: torch.Tensor, teacher_texts: torch.Tensor, teacher_params):
        """As Teacher.loss_fn, against the ensemble: the side-by-side embeddings split into the members' again."""
        distill = sigmoid_distill_loss if self.sigmoid else softmax_distill_loss
        images, texts = teacher_images.split(self.dims, 1), teacher_texts.split(self.dims, 1)
        params = [list(p.unbind()) for p in teacher_params]

        def loss(student_images, student_texts, *student_params):
            return distill(
                student_images, student_texts, *student_params, images, texts, *params, distill_weight=self.weight
            )

        return loss


def member_inputs(inputs: dict, index: int) -> dict:
    """Ensemble member `index`'s inputs from a batch's teacher inputs (`split_inputs`): the student's, with those the
    collator made for this member ("INDEX_"-prefixed) in their place."""
    prefix = f"{index}_"
    own = {k: v for k, v in inputs.items() if k in ("input_ids", "attention_mask", "pixel_values")}
    own.update({k[len(prefix) :]: v for k, v in inputs.items() if k.startswith(prefix)})
    return own


class StoredTeacher(Teacher):
    """An ensemble of T teachers read from their stored embeddings (`--teacher_embeddings`, data/embeddings.py): each
    sample's, of its chosen augmentation and caption, ride in the batch under TEACHER_PREFIX keys (image_embeds.t,
    text_embeds.t for teacher t, in the order of --teacher); each teacher's multiplier and bias are its sidecars'. No
    model is loaded or run."""

    def __init__(self, config, weight: float, temperature: float | None, scales: list[float], biases: list):
        self.model, self.config = None, config
        self.weight, self.temperature = weight, temperature
        self.sigmoid = config.model_type == "siglip"
        self.stored = list(zip(scales, biases))

    def embed(self, inputs: dict) -> tuple[list[torch.Tensor], list[torch.Tensor], tuple[list[torch.Tensor], ...]]:
        """The teachers' stored (image, text) embeddings of the batch, a list of each, and (multipliers[, biases]):
        a list per parameter, teachers in the same order, as the distillation losses take an ensemble."""
        images = [inputs[f"image_embeds.{t}"].float() for t in range(len(self.stored))]
        texts = [inputs[f"text_embeds.{t}"].float() for t in range(len(self.stored))]
        device = images[0].device
        scales = [
            torch.tensor(1.0 / self.temperature if self.temperature is not None else scale, device=device)
            for scale, _ in self.stored
        ]
        if not self.sigmoid:
            return images, texts, (scales,)
        return images, texts, (scales, [torch.tensor(bias, device=device) for _, bias in self.stored])


def stored_teacher(names: list[str], store, weight: float, temperature: float | None, config=None):
    """(StoredTeacher, its TeacherInputs for the collator) of the teachers `names` (in --teacher's order) whose
    embeddings `store` (data/embeddings.py EmbeddingStore, train.validate checked each teacher there) holds; the
    multiplier and bias of each are the sidecars'. `config`: the first teacher's, as the checks resolved it."""
    from disco_clip_ds.models.configs import load_config

    config = load_config(names[0]) if config is None else config
    scales = [float(t.logit_scale) for t in store.teachers]
    biases = [None if t.logit_bias is None else float(t.logit_bias) for t in store.teachers]
    return StoredTeacher(config, weight, temperature, scales, biases), TeacherInputs(stored=True)


def load_teacher(
    name_or_path: str | list[str],
    weight: float,
    temperature: float | None,
    args=None,
    config=None,
    deepspeed: dict | None = None,
) -> Teacher | Ensemble:
    """The teacher (a CLIPModel or SiglipModel hub id or folder; `train.validate` checked its family) on the run's
    device. Under ZeRO-3 it is built partitioned like the student (transformers' zero.Init in from_pretrained) and
    run by a DeepSpeed inference engine of its own (no optimizer), which gathers each layer's weights for its forward
    as the student's engine does: each rank holds 1/N of it. That engine, not a submodule of the student, keeps it out
    of the student's optimizer, checkpoints and exports. Otherwise it is replicated, in the engine's 16-bit dtype
    under DeepSpeed (the batch arrives in it; no autocast there) and fp32 elsewhere (the Trainer's autocast).
    `config`: the teacher's config as the checks loaded it (None: loaded here); `deepspeed`: the run's DeepSpeed
    JSON, whose ZeRO settings the teacher's engine takes. Several names (and `config` a list of their configs, or
    None): an Ensemble of them, each loaded so; one name in a list: that teacher alone."""
    from disco_clip_ds.models.build import build_model

    if isinstance(name_or_path, (list, tuple)):
        configs = config if config is not None else [None] * len(name_or_path)
        members = [load_teacher(n, weight, temperature, args, c, deepspeed) for n, c in zip(name_or_path, configs)]
        return members[0] if len(members) == 1 else Ensemble(members)

    model = build_model(name_or_path, config=config).requires_grad_(False).eval()
    if args is None:
        return Teacher(model, weight, temperature)
    from transformers.integrations import is_deepspeed_zero3_enabled

    if is_deepspeed_zero3_enabled():
        return Teacher(_zero3_inference_engine(model, args, deepspeed), weight, temperature)
    dtype = (torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else None) if args.deepspeed else None
    return Teacher(model.to(device=args.device, dtype=dtype), weight, temperature)


def _zero3_inference_engine(model, args, written: dict | None):
    """A DeepSpeed ZeRO-3 engine without optimizer around the partitioned teacher (as transformers' own
    `deepspeed_init(inference=True)` evaluates a ZeRO-3 model): the run's ZeRO-3 settings and precision, concrete
    batch numbers in place of the student's "auto" ones (the engine checks them, and the teacher never steps)."""
    import deepspeed

    zero = {k: v for k, v in ((written or {}).get("zero_optimization") or {}).items() if v != "auto"}
    zero.pop("offload_optimizer", None)  # no optimizer
    config = {
        "train_micro_batch_size_per_gpu": args.per_device_train_batch_size,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {**zero, "stage": 3},
        "bf16": {"enabled": bool(args.bf16)},
        "fp16": {"enabled": bool(args.fp16)},
        "steps_per_print": 1 << 30,
    }
    engine, *_ = deepspeed.initialize(model=model, config=config)
    held = sum(p.ds_tensor.numel() for p in model.parameters())
    logger.info(
        "teacher sharded by ZeRO-3: %d of its %d weights on this rank",
        held,
        sum(p.ds_numel for p in model.parameters()),
    )
    return engine


def teacher_inputs(teacher, name_or_path, tokenizer, max_length: int, image_processor, image_size: int):
    """What the collator must make for the teacher beyond the student's batch (`TeacherInputs`), or None when the
    teacher reads the student's inputs as they are: its own tokenizer (found with its weights) when its vocabulary or
    special tokens differ, or when the student's texts do not fit its positions (or, for SigLIP, which pools the last
    position, are not padded to them); its own normalisation and size when its image processor's differ. For an
    Ensemble (`name_or_path` the list of its names): a list with each member's (None where a member needs nothing),
    or None when none needs anything."""
    if isinstance(teacher, Ensemble):
        extra = [
            teacher_inputs(m, n, tokenizer, max_length, image_processor, image_size)
            for m, n in zip(teacher.members, name_or_path)
        ]
        return extra if any(e is not None for e in extra) else None
    if isinstance(name_or_path, (list, tuple)):
        (name_or_path,) = name_or_path
    from transformers import AutoImageProcessor, AutoTokenizer

    config = teacher.config
    positions, size = config.text_config.max_position_embeddings, config.vision_config.image_size
    own_tokenizer = tokenizer  # weights saved without a tokenizer: taken to read the student's
    # (transformers builds an empty tokenizer from a folder without tokenizer files rather than failing)
    if not Path(name_or_path).is_dir() or any((Path(name_or_path) / f).is_file() for f in TOKENIZER_FILES):
        try:
            own_tokenizer = AutoTokenizer.from_pretrained(name_or_path, config=config)  # not loaded again
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
        own_processor = AutoImageProcessor.from_pretrained(name_or_path, config=config)
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
