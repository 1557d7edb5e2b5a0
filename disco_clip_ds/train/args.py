"""The arguments of `disco-clip train`: the Trainer's own (TrainingArguments, with CLIP-pretraining defaults) plus
ModelArguments and DataArguments, and `parse_args`, which reads them with HfArgumentParser. Declarations and
parsing only: every refusal is in `disco_clip_ds.train.validate`."""

from __future__ import annotations

import contextlib
import json
import os
import sys
from dataclasses import dataclass, field

from transformers import HfArgumentParser, TrainingArguments
from transformers.training_args import OptimizerNames

from disco_clip_ds import LOSS_IMPLS, compat
from disco_clip_ds.cli import DefaultsOnce, suggest_on_error, unknown_option_problem
from disco_clip_ds.data.transforms import MAX_IMAGE_PIXELS
from disco_clip_ds.distributed import peers
from disco_clip_ds.errors import EXIT_PREEMPTED, DiscoClipError, UsageError
from disco_clip_ds.plan import checks
from disco_clip_ds.texts import read_text
from disco_clip_ds.train.help_groups import group_arguments


@dataclass
class ModelArguments:
    model_name_or_path: str | None = field(default=None, metadata={"help": "pretrained CLIP weights: hub id or folder"})
    model_config: str | None = field(
        default=None,
        metadata={
            "help": "CLIPConfig or SiglipConfig JSON to train from scratch, e.g. recipes/models/tiny.json, "
            "recipes/models/siglip_tiny.json"
        },
    )
    tokenizer_name: str | None = field(
        default=None,
        metadata={
            "help": "tokenizer hub id or folder (default: model_name_or_path), e.g. openai/clip-vit-base-patch32"
        },
    )
    loss_impl: str = field(
        default="tiled",
        metadata={
            "choices": list(LOSS_IMPLS),
            "help": "tiled / disco: global-batch loss; local: each device's own batch (HF's example)",
        },
    )
    chunk_size: int | None = field(
        default=None, metadata={"help": "rows per tile of the tiled loss (default: automatic)"}
    )
    image_size: int | None = field(default=None, metadata={"help": "training resolution (default: the model config's)"})
    max_num_patches: int | None = field(
        default=None,
        metadata={
            "help": "SigLIP 2 (NaFlex): the patch budget per image, each resized at its own aspect ratio to fit it "
            "(default 256; any number of patches: the position embeddings are interpolated to each image's grid)"
        },
    )
    max_text_length: int | None = field(
        default=None, metadata={"help": "tokens per caption (default: the model's max_position_embeddings)"}
    )
    # Distillation (train/distill.py, losses/distill.py): a frozen teacher's global-batch similarities taught.
    teacher: list[str] | None = field(
        default=None,
        metadata={
            "help": "a CLIPModel or SiglipModel (hub id or folder) of the model's family to distill from; frozen, "
            "never saved with the model. Several (--teacher A B): an ensemble, whose target is the mean of the "
            "teachers' softmaxes (sigmoids), each with its own inputs and logit scale, as MobileCLIP distils"
        },
    )
    distill_weight: float | None = field(
        default=None,
        metadata={"help": "with --teacher: loss = (1 - W) contrastive + W distillation (default 0.5)"},
    )
    distill_temperature: float | None = field(
        default=None,
        metadata={
            "help": "with --teacher: the teacher's similarities are divided by this instead of multiplied by its own "
            "logit scale (the student's logits are unchanged)"
        },
    )
    teacher_embeddings: str | None = field(
        default=None,
        metadata={
            "help": "with --teacher and --train_shards: the folder of its embeddings stored by `disco-clip data embed` "
            "(one sidecar per shard), read instead of running the teacher"
        },
    )
    # Training from a reinforced set (data/streams/reinforced.py): MobileCLIP's stored augmentations and captions.
    augmentation_pool: bool = field(
        default=False,
        metadata={
            "help": "with --teacher_embeddings stored with `data embed --augmentations K`: each sample is cropped with "
            "one of its K stored augmentations, chosen from (seed, sample, pass), and distilled towards the "
            "teachers' embeddings of that crop"
        },
    )
    augmentation_pool_size: int | None = field(
        default=None,
        metadata={
            "help": "with --augmentation_pool: draw from the first N stored augmentations of each sample only "
            "(default: all K stored)"
        },
    )
    synthetic_caption_ratio: float | None = field(
        default=None,
        metadata={
            "help": "with --teacher_embeddings stored with synthetic --caption_keys: each sample's caption is one of "
            "its synthetic captions with this probability (in [0, 1]), else its real one; the text target is the "
            "teachers' embedding of the caption chosen"
        },
    )
    live_teacher: bool = field(
        default=False,
        metadata={
            "help": "with --teacher_embeddings: the teachers run live on the crops and captions the stored run would "
            "train on (replayed from the sidecars) instead of their stored embeddings being read: a check that "
            "training from stored embeddings is training from the teachers"
        },
    )
    verify_teacher_weights: bool = field(
        default=False,
        metadata={
            "help": "with --teacher_embeddings: hash each teacher folder's weights (once, on rank 0) to check them "
            "against the sidecars' fingerprints, even when the fingerprint cache holds the fingerprint of its files "
            "as they are (then no weight is read)"
        },
    )
    lock_image_tower: bool = field(default=False, metadata={"help": "freeze the vision encoder and its projection"})
    lock_text_tower: bool = field(default=False, metadata={"help": "freeze the text encoder and its projection"})
    # Partial locking (open_clip's --lock-image-unlocked-groups, --lock-text-unlocked-layers): train/locking.py
    lock_image_tower_unlocked_layers: int | None = field(
        default=None,
        metadata={
            "help": "with --lock_image_tower: the last N vision encoder layers, the post-LayerNorm, SigLIP's head and "
            "CLIP's projection train; embeddings and pre-LayerNorm stay frozen (0, as unset: the whole tower frozen)"
        },
    )
    lock_image_tower_freeze_norm: bool = field(
        default=False,
        metadata={
            "help": "with --lock_image_tower_unlocked_layers N >= 1: the vision tower's LayerNorms stay frozen too, "
            "in the unlocked layers and the post-LayerNorm (a ViT's stand-in for open_clip's "
            "--lock-image-freeze-bn-stats)"
        },
    )
    lock_text_tower_unlocked_layers: int | None = field(
        default=None,
        metadata={
            "help": "with --lock_text_tower: the last N text encoder layers, the final LayerNorm, SigLIP's head and "
            "CLIP's projection train; embeddings stay frozen (0, as unset: the whole tower frozen)"
        },
    )

    def __post_init__(self):
        # A config file (or a caller) may name one teacher as a string, as --teacher took before it took a list.
        if isinstance(self.teacher, str):
            self.teacher = [self.teacher]


@dataclass
class DataArguments:
    train_shards: str | None = field(
        default=None,
        metadata={
            "help": "webdataset shards: 'dir/{00000..00099}.tar', a folder, or several joined by '::' (concatenated, "
            "or mixed by --train_data_weights) (or give --dataset_name / --train_file)"
        },
    )
    dataset_name: str | None = field(
        default=None,
        metadata={
            "help": "a 🤗 datasets dataset to train from: hub id, or a folder (save_to_disk, parquet files, "
            "imagefolder with metadata.jsonl)"
        },
    )
    dataset_config_name: str | None = field(default=None, metadata={"help": "the configuration of --dataset_name"})
    train_split: str = field(default="train", metadata={"help": "the split of --dataset_name to train on"})
    train_file: str | None = field(
        default=None, metadata={"help": "a csv, json(l) or parquet file of image paths (or bytes) and captions"}
    )
    image_column: str = field(
        default="image",
        metadata={"help": "column of --dataset_name/--train_file with the images: an Image feature, bytes or paths"},
    )
    caption_column: str = field(
        default="caption",
        metadata={"help": "column with the captions: a string, or a list of strings (one drawn per pass)"},
    )
    streaming: bool = field(
        default=False,
        metadata={"help": "stream --dataset_name/--train_file (an IterableDataset) instead of loading it"},
    )
    # Weighted mixtures (data/mix.py): each '::' source its own stream, each sample's source drawn by weight.
    train_data_weights: list[float] | None = field(
        default=None,
        metadata={
            "help": "one weight per '::'-joined --train_shards source: each sample comes from source i with "
            "probability w_i / sum(w) (without: the sources are concatenated)"
        },
    )
    train_data_upsampling_factors: list[str] | None = field(
        default=None,
        metadata={
            "help": "open_clip's form of the weights ('1::2' or 1 2): open_clip draws each shard with its source's "
            "factor, so source i's share is factor_i x its shards, normalised; give this or --train_data_weights"
        },
    )
    dataset_resampled: bool = field(
        default=False,
        metadata={
            "help": "draw shards with replacement (open_clip's --dataset-resampled): every reader draws its next shard "
            "at random from all of a source's shards, seeded, instead of passing over its own share"
        },
    )
    train_num_samples: int | None = field(
        default=None,
        metadata={
            "help": "samples per epoch (default: from sizes.json or img2dataset *_stats.json, or the dataset's "
            "number of rows)"
        },
    )
    shuffle_buffer: int = field(
        default=1000,
        metadata={
            "help": "samples in each reader's shuffle buffer (0: stream order; a map-style dataset is permuted "
            "whole each pass unless 0)"
        },
    )
    zeroshot_data: str | None = field(
        default=None, metadata={"help": "eval shards (CLIP_benchmark layout) for zero-shot accuracy during training"}
    )
    zeroshot_steps: int = field(default=0, metadata={"help": "run the zero-shot eval every N steps (0: never)"})
    eval_tasks: str | None = field(
        default=None,
        metadata={
            "help": "a task list (YAML, DataComp's tasklist.yml form; docs/evaluation.md) run during training: its "
            "tasks marked 'train: true' (or all) every --eval_steps (TrainingArguments' own: N steps, or a fraction "
            "of --max_steps; unset: none), all of them on the final model, written to OUTPUT_DIR/suite and the model "
            "card"
        },
    )
    max_image_pixels: int = field(
        default=MAX_IMAGE_PIXELS,
        metadata={"help": "skip (and count) training images of more pixels, read from the header before decoding"},
    )
    normalize_on_device: str = field(
        default="auto",
        metadata={
            "choices": ["auto", "true", "false"],
            "help": "hand the batch over as uint8 and normalise it on the device (bit-identical; auto: on a GPU), "
            "else in the DataLoader workers",
        },
    )


OWN_OPTIMIZERS = ("lamb",)  # --optim values that DiscoTrainer builds itself (TrainingArguments does not know them)


@dataclass
class DiscoTrainingArguments(TrainingArguments):
    """TrainingArguments with CLIP-pretraining defaults; CPU is chosen automatically when there is no GPU, and each
    rank reads its own shards unless --accelerator_config says dispatch_batches."""

    remove_unused_columns: bool = field(default=False, metadata={"help": "kept False: batches hold only model inputs"})
    report_to: None | str | list[str] = field(default="tensorboard", metadata={"help": "tensorboard, wandb, none, ..."})
    logging_steps: float = field(default=10)
    save_steps: float = field(default=500)
    save_total_limit: int | None = field(default=3)
    weight_decay: float = field(default=0.1)
    # The Trainer's optimizers plus ours (train/lamb.py), which DiscoTrainer builds; TrainingArguments itself would
    # refuse a name outside its enum, so __post_init__ shows it one of its own and then puts ours back.
    optim: str = field(
        default=TrainingArguments.__dataclass_fields__["optim"].default,
        metadata={
            "choices": [*(name.value for name in OptimizerNames), *OWN_OPTIMIZERS],
            "help": "the optimizer; lamb: LAMB (timm's rule) with its trust ratio per parameter under ZeRO-1/2/3 "
            "and FSDP (docs/training.md, LAMB)",
        },
    )
    warmup_steps: float = field(default=0)
    dataloader_num_workers: int = field(default=2)
    resume_from_checkpoint: str | None = field(
        default=None,
        metadata={
            "help": "a checkpoint folder, or 'latest' (the newest complete one in output_dir; fresh start if none)"
        },
    )
    contrastive_accumulation: bool = field(
        default=True,
        metadata={
            "help": "with --gradient_accumulation_steps K > 1, contrast all micro x world x K pairs of an optimizer "
            "step (gradient caching); false: independent micro-batch losses"
        },
    )
    # Per-tower optimizer settings (EVA-CLIP's recipe; open_clip's --image-layer-decay / --text-layer-decay): see
    # train/optim.py for the rule. Unset, the Trainer's two groups stay as they are.
    vision_lr: float | None = field(
        default=None, metadata={"help": "the vision tower's learning rate (default: --learning_rate)"}
    )
    text_lr: float | None = field(
        default=None, metadata={"help": "the text tower's learning rate (default: --learning_rate)"}
    )
    vision_weight_decay: float | None = field(
        default=None, metadata={"help": "the vision tower's weight decay (default: --weight_decay)"}
    )
    text_weight_decay: float | None = field(
        default=None, metadata={"help": "the text tower's weight decay (default: --weight_decay)"}
    )
    vision_layer_decay: float = field(
        default=1.0,
        metadata={
            "help": "layer-wise lr decay of the vision tower: encoder layer l of L at lr x decay^(L - l), the "
            "embeddings at decay^(L + 1), the head and projection at lr (EVA-CLIP: 0.85; 1: off)"
        },
    )
    text_layer_decay: float = field(
        default=1.0,
        metadata={"help": "layer-wise lr decay of the text tower, as --vision_layer_decay (EVA-CLIP: 0.75)"},
    )
    # FLIP's patch dropout (models/patch_dropout.py): a mask per sample, keyed by the sample, not by rank or pass.
    patch_dropout: float = field(
        default=0.0,
        metadata={
            "help": "fraction of each image's patch tokens dropped in training (FLIP: 0.5-0.75; 0: off); the class "
            "token is always kept; eval and the saved model see every patch"
        },
    )
    patch_dropout_until_step: int | None = field(
        default=None,
        metadata={
            "help": "the optimizer step from which training sees every patch again (FLIP's unmasked tuning at the "
            "end of the run, e.g. the last 5%% of --max_steps); default: masked to the end"
        },
    )
    resolution_schedule: str | None = field(
        default=None,
        metadata={
            "help": "progressive resolution (models/resolution.py): FRACTION:SIDE,... of the run's steps, e.g. "
            "0:98,0.35:154,0.7:224,0.95:336 (Perception Encoder); SigLIP 2: FRACTION:PATCH_BUDGET,...; the model "
            "trains and saves at the last size (default: one size throughout)"
        },
    )
    stage_micro_batch_sizes: str | None = field(
        default=None,
        metadata={
            "help": "each --resolution_schedule stage's micro-batch per rank, e.g. 256,128,64: larger where the "
            "images are smaller, each a multiple of --per_device_train_batch_size dividing its x "
            "--gradient_accumulation_steps, whose samples a step still contrasts (fewer accumulation steps; needs "
            "contrastive accumulation); default: --per_device_train_batch_size throughout"
        },
    )
    # An EMA of the weights (train/ema.py): timm ModelEmaV3's rule, sharded like the fp32 master weights.
    ema_decay: float | None = field(
        default=None,
        metadata={
            "help": "keep an EMA of the weights with this decay, in [0, 1) (e.g. 0.999; timm's default 0.9998); saved "
            "in every checkpoint, exported by `disco-clip export --ema` (default: no EMA)"
        },
    )
    ema_start_step: int = field(
        default=0,
        metadata={"help": "the EMA copies the weights up to this step, then averages (timm's update_after_step)"},
    )
    ema_warmup: bool = field(
        default=True,
        metadata={"help": "the decay ramps up as 1 - (1 + step)^(-2/3) to --ema_decay (timm's use_warmup)"},
    )
    drop_ema: bool = field(
        default=False,
        metadata={
            "help": "resume a checkpoint that keeps an EMA of the weights without --ema_decay: the EMA is dropped "
            "(without this flag such a resume is refused, so that no EMA is lost by a forgotten flag)"
        },
    )
    eval_ema: bool = field(
        default=False,
        metadata={"help": "the in-training zero-shot eval also evaluates the EMA (logged as zeroshot_ema_*)"},
    )
    # MFU in the training log (train/throughput.py): TFLOPs per device over this peak.
    peak_tflops: float | None = field(
        default=None,
        metadata={
            "help": "one device's dense peak TFLOPs at the run's precision, for the MFU in the training log "
            "(default: the table in docs/training.md for A100, H100 and H200; none on CPU)"
        },
    )
    # A lost peer (frozen, hung, cut off) ends its survivors after this many seconds instead of torch's 30 minutes.
    # 10 minutes (DeepSpeed's own default) is longer than the slowest collective a healthy run waits in: rank 0
    # writing a large model's checkpoint while the others wait at a barrier, the first step's ZeRO-3 gather and
    # setup at scale, a zero-shot eval (every rank runs it, so none waits long); short enough to free the nodes for
    # a restart well within a preemptible job's slot. Raise it for a very slow shared filesystem.
    ddp_timeout: int = field(
        default=600,
        metadata={"help": "seconds a rank waits for the others (joining, and every collective) before it stops"},
    )
    stop_signals: str = field(
        default="SIGTERM,SIGUSR1",
        metadata={
            "help": "signals that stop every rank at the next step with a checkpoint, "
            f"exit code {EXIT_PREEMPTED} ('none': off)"
        },
    )

    # The DeepSpeed JSON as `parse_args` read it (the one read of it in this package), for the argument checks; not
    # an argument (init=False: HfArgumentParser and to_dict leave it out).
    deepspeed_json: dict | None = field(default=None, init=False, repr=False)

    def __post_init__(self):
        # Not a side effect of ours: TrainingArguments.__post_init__ itself sets up the device ("# 8. Device Init":
        # `self.device`), which joins the process group in a launched rank. So the two settings that joining needs
        # are made before it (CPU ranks without a GPU; gloo's group with --ddp_timeout), and a master or peer that
        # never answers is a PeerError instead of torch's traceback. Nothing else happens here.
        compat.use_cpu_without_gpu(self)
        own_optim = self.optim if self.optim in OWN_OPTIMIZERS else None
        if own_optim:
            self.optim = OptimizerNames.ADAMW_TORCH  # what TrainingArguments checks; ours is put back below
        with peers.joining(self.ddp_timeout):
            compat.init_cpu_process_group(self)
            super().__post_init__()
        if own_optim:
            self.optim = own_optim  # a plain str: the Trainer reads it only where DiscoTrainer answers for it
        if self.accelerator_config.dispatch_batches is None:
            # Each rank reads its own shards (ShardStream); rank 0 reading for everyone does not scale.
            self.accelerator_config.dispatch_batches = False


def parse_args(argv: list[str] | None = None):
    """(ModelArguments, DataArguments, DiscoTrainingArguments) from argv, or from one .json/.yaml file. Values that
    TrainingArguments refuses while parsing are a UsageError. The DeepSpeed JSON (--deepspeed, or the one
    accelerate launch's config names) is read here, once, and kept as `deepspeed_json` for the checks."""
    parser = HfArgumentParser((ModelArguments, DataArguments, DiscoTrainingArguments), formatter_class=DefaultsOnce)
    group_arguments(suggest_on_error(parser))  # --help in groups; "did you mean" for a mistyped option
    argv = list(sys.argv[1:] if argv is None else argv)
    from_file = len(argv) == 1 and argv[0].endswith((".json", ".yaml", ".yml"))
    if not from_file:  # an unknown option, one line with the nearest known one (HfArgumentParser lists them all)
        known, unknown = parser.parse_known_args(argv)
        problem = unknown_option_problem(parser, unknown)
        if problem:
            raise UsageError(f"{problem} (`disco-clip train --help` lists the arguments)")
    values = _read_arguments_file(argv[0]) if from_file else vars(known)
    deepspeed_json = read_deepspeed_json(values.get("deepspeed"))  # before TrainingArguments, which would not name it
    # unknown names, and what TrainingArguments.__post_init__ refuses as not working together, are ValueErrors
    with usage_error(suffix=" (`disco-clip train --help` lists the arguments)"):
        parsed = parser.parse_dict(values) if from_file else parser.parse_args_into_dataclasses(args=argv)
    parsed[2].deepspeed_json = deepspeed_json
    _cap_max_steps(parsed[2])
    return parsed


MAX_STEPS_CAP_ENV = "DISCO_CLIP_MAX_STEPS"


def _cap_max_steps(args) -> None:
    """The docs test (tests/launched/test_docs.py) runs each documented training command exactly as a user types
    it; DISCO_CLIP_MAX_STEPS=N shortens such a run to at most N steps there. Not a user's setting."""
    cap = os.environ.get(MAX_STEPS_CAP_ENV)
    if cap and args.max_steps > int(cap):
        args.max_steps = int(cap)


def deepspeed_file(deepspeed) -> tuple[str, str] | None:
    """(the flag, the path) of a run's DeepSpeed JSON file: the one --deepspeed names (`deepspeed`), or else the one
    accelerate launch's config names; None without one (or for a config given inline)."""
    if isinstance(deepspeed, str) and not deepspeed.lstrip().startswith("{"):
        return "--deepspeed", deepspeed
    path = os.environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE")
    if deepspeed is None and path:  # under accelerate launch
        return "accelerate's deepspeed_config_file", path
    return None


def read_deepspeed_json(deepspeed) -> dict | None:
    """The DeepSpeed JSON of a run (`deepspeed_file`), through the planner's reader (plan.checks, the one reader of
    a DeepSpeed JSON: one kind of error for both commands); None without one."""
    found = deepspeed_file(deepspeed)
    if found is None:
        return None
    config = checks.read_deepspeed_json(found[1], flag=found[0])
    checks.check_sections(config, " ".join(found))
    return config


def _read_arguments_file(path: str) -> dict:
    import yaml

    text = read_text(path, "arguments file")  # a missing file or text that is not UTF-8: one line naming it
    try:
        values = json.loads(text) if path.endswith(".json") else yaml.safe_load(text)
    except (ValueError, yaml.YAMLError) as error:
        first = str(error).splitlines()[0] if str(error) else type(error).__name__  # YAML's run over several lines
        raise UsageError(f"{path} is not a readable arguments file: {first}") from error
    if not isinstance(values, dict):
        raise UsageError(f"{path} holds no argument names and values")
    return values


def read_json(flag: str, path: str) -> dict:
    """The JSON file a flag names, or a UsageError naming the flag and the file."""
    text = read_text(path, flag)
    try:
        return json.loads(text)
    except ValueError as error:
        raise UsageError(f"{flag} {path} is not a readable JSON file: {error}") from error


@contextlib.contextmanager
def usage_error(prefix: str = "", suffix: str = ""):
    """A plain ValueError or OSError raised inside (by a reader of the user's input) becomes a UsageError."""
    try:
        yield
    except (ValueError, OSError) as error:
        if isinstance(error, DiscoClipError):
            raise
        raise UsageError(f"{prefix}{error}{suffix}") from error
