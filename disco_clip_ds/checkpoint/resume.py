"""Resuming a run under changed settings: what a run is fixed to, compared with the resuming command's settings
before any model is built (the conversion for another number of ranks: `checkpoint.universal`).

A run's facts are recorded once, at its first launch, in OUTPUT_DIR/run.json (`launch_facts`); each resume adds a
segment (`with_resume`) instead of rewriting them, so that the model card stays true for every step. The facts a
checkpoint was trained under are the first launch's, updated by the last segment that started before its step
(`facts_at`), with the model's architecture from the checkpoint's own config.json.

What may change, and why:
- world size, when the contrastive batch (micro x world x K) and the data readers (ranks x DataLoader workers) stay
  the same: contrastive accumulation is exact, so 2 ranks x K=1 and 1 rank x K=2 train the same steps. DeepSpeed's
  ZeRO-1/2/3 optimizer shards are re-partitioned through a universal checkpoint (`checkpoint.universal`), converted
  automatically: the resume is exact, so there is nothing to opt into, and a flag would only turn a working resume
  into an error. deepspeed's conversion of a ZeRO-3 checkpoint keeps every fp32 master weight and Adam moment, but
  its ZeRO-3 loader loses the step count and the per-group weight decay: `repair_zero3_universal_load` puts them
  back once the engine has loaded. Without DeepSpeed (DDP, FSDP) the world size is fixed, and the optimizer state
  of one stage does not load under another (a stage-2 conversion loaded under stage 3 fails);
- the data readers (ranks x DataLoader workers) on p x the ranks with 1/p of the micro-batch, the same workers and K
  (`ranks_per_reader`): ranks pk .. pk + p - 1 share rank k's readers, each keeping its share of every batch rank k
  read, so that every step contrasts the same pairs (the loss does not order them); run.json keeps counting the
  run's readers (data_readers) and records p (ranks_per_reader). Any other reader count with --ignore_data_skip:
  the stream restarts from the beginning (each reader's position is kept only when the readers are the run's);
- the data (shards, --train_num_samples), with --ignore_data_skip, as a deliberate change of data;
- max_steps, learning rate and the like: they are the user's to change.
Refused, each in one line naming old -> new and what to pass: the model's architecture, the ZeRO stage, the
contrastive batch and the samples per optimizer step, the per-tower optimizer settings and the locked towers (the
optimizer state's parameter groups).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path

from disco_clip_ds.checkpoint.data_identity import data_stat_digest, shards_digest  # noqa: F401 (resume.*)
from disco_clip_ds.checkpoint.ema import saved_settings
from disco_clip_ds.checkpoint.layout import is_zero3, saved_ranks
from disco_clip_ds.checkpoint.runfile import public_distillation, run_file_of
from disco_clip_ds.data.redact import describe_data
from disco_clip_ds.errors import UsageError
from disco_clip_ds.models.resolution import describe_schedule

logger = logging.getLogger("disco_clip_ds.checkpoint.resume")

# The architecture fields of a CLIPConfig: a change in any of them changes the weights' shapes or meaning.
ARCHITECTURE = {
    "": ("model_type", "projection_dim"),
    "text_config": (
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "max_position_embeddings",
        "hidden_act",
        "projection_dim",
        "projection_size",
    ),
    "vision_config": (
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "image_size",
        "num_patches",  # SigLIP 2's position-embedding grid
        "patch_size",
        "num_channels",
        "hidden_act",
        "projection_dim",
    ),
}
SEGMENT_KEYS = (  # what a resume may change and records
    "world_size",
    "micro_batch_per_rank",
    "gradient_accumulation_steps",
    "contrastive_accumulation",
    "global_contrastive_batch",
    "global_batch",
    "zero_stage",
    "data_readers",
    "ranks_per_reader",
    "dataloader_num_workers",
    "data",
    "num_shards",
    "shards_sha256",
    "data_stat_sha256",
    "train_num_samples",
    "max_steps",
    "resolution_schedule",  # its stages are steps of the run: recorded per segment
)


# --- the facts ---


def architecture(config: dict, image_size: int | None = None) -> dict:
    """The architecture fields (ARCHITECTURE) of a CLIPConfig or SiglipConfig dict, as 'text_config.hidden_size' ->
    value (a field the family lacks is None); `image_size`: the side the model is built at, where it differs
    (--resolution_schedule's last, models/resolution.py)."""
    found = {}
    for part, keys in ARCHITECTURE.items():
        section = config.get(part, {}) if part else config
        for key in keys:
            found[f"{part}.{key}" if part else key] = section.get(key)
    if image_size is not None:
        found["vision_config.image_size"] = image_size
    return found


# The per-tower optimizer flags (train/optim.py) and their defaults: the optimizer state holds one group per tower
# layer they set, so a resume must keep them (the state also keeps each group's rate: a new value would be ignored).
TOWER_FLAGS = {
    "vision_lr": None,
    "text_lr": None,
    "vision_weight_decay": None,
    "text_weight_decay": None,
    "vision_layer_decay": 1.0,
    "text_layer_decay": 1.0,
}


def tower_settings(args) -> str:
    """The per-tower optimizer flags a run sets, as one would pass them; 'none' when it sets none (a fact run.json
    keeps, where a None is dropped: a run started without them must refuse a resume with them)."""
    given = [
        f"--{flag} {getattr(args, flag):g}"
        for flag, default in TOWER_FLAGS.items()
        if getattr(args, flag, default) != default
    ]
    return " ".join(given) or "none"


def patch_dropout_setting(args) -> str | None:
    """The run's patch dropout as the card and run.json show it (None: off). Not a resume fact: a resume may change
    it (the mask draws are keyed by sample and pass, and the optimizer state does not depend on it)."""
    rate, until = getattr(args, "patch_dropout", 0.0), getattr(args, "patch_dropout_until_step", None)
    if not rate:
        return None
    return f"{rate:g} of the patches dropped" + (f", every patch from step {until}" if until is not None else "")


def distillation_setting(model_args) -> str | None:
    """The run's distillation as the card and run.json show it (None: none). Not a resume fact, as patch dropout:
    the teacher is never saved and the optimizer state does not depend on it."""
    teacher = getattr(model_args, "teacher", None)
    if not teacher:
        return None
    teacher = teacher if isinstance(teacher, str) else " + ".join(teacher)  # an ensemble: every member, in order
    temperature = getattr(model_args, "distill_temperature", None)
    scale = f"temperature {temperature:g}" if temperature is not None else "the teacher's logit scale"
    stored = getattr(model_args, "teacher_embeddings", None)
    how = "crops replayed from" if getattr(model_args, "live_teacher", False) else "its embeddings stored in"
    # public, as the card shows it: the teacher and its embeddings by `--train_shards`' rule (no absolute path)
    return public_distillation(
        f"from {teacher}, weight {model_args.distill_weight:g}, {scale}"
        + (f", {how} {stored}" if stored else "")
        + "".join(f"; {part}" for part in _reinforcement(model_args))
    )


def _reinforcement(model_args) -> list[str]:
    """How a run reads a reinforced set (data/streams/reinforced.py), as the card shows it."""
    parts = []
    if getattr(model_args, "augmentation_pool", False):
        size = getattr(model_args, "augmentation_pool_size", None)
        parts.append(f"one of {'the first ' + str(size) if size else 'all'} stored crops per sample")
    ratio = getattr(model_args, "synthetic_caption_ratio", None)
    if ratio:
        parts.append(f"synthetic captions at ratio {ratio:g}")
    return parts


# The locking flags (train/locking.py), with their unlocked layers and norms: a frozen parameter has no optimizer
# state, so a run's optimizer state holds its trainable parameters only and loads only where the same ones train.
LOCK_FLAGS = {
    "lock_image_tower": ("lock_image_tower_unlocked_layers", "lock_image_tower_freeze_norm"),
    "lock_text_tower": ("lock_text_tower_unlocked_layers",),
}


def lock_settings(model_args) -> str:
    """The towers a run locks, as the flags that lock them ('none': no tower is locked; an unlocked-layer count of 0,
    the whole tower, is left out)."""
    given = []
    for flag, details in LOCK_FLAGS.items():
        if not getattr(model_args, flag, False):
            continue
        given.append(f"--{flag}")
        for detail in details:
            value = getattr(model_args, detail, None)
            if value is True:
                given.append(f"--{detail}")
            elif value:
                given.append(f"--{detail} {value}")
    return " ".join(given) or "none"


def launch_facts(
    args, data_args, urls: list[str], num_samples: int, max_steps: int, split: int = 1, model_args=None
) -> dict:
    """This launch's facts, as run.json records them (`args`: DiscoTrainingArguments; the contrastive batch as
    ContrastiveAccumulationMixin.contrastive_batch_size counts it; `split`: the ranks that share each of the run's
    readers, `ranks_per_reader`: data_readers counts the run's readers, which fix the data order; `model_args`:
    ModelArguments, for the locked towers, left out when None)."""
    plugin = args.deepspeed_plugin
    ranks = 1 if args.accelerator_config.dispatch_batches else args.world_size
    accumulate = bool(args.contrastive_accumulation) and args.gradient_accumulation_steps > 1
    # "data" is public (the model card shows it): secrets and shell commands are left out (data/redact.py); the
    # digest, of everything the arguments name, is what a resume compares
    if data_args.train_shards:
        data, num_shards, digest = data_args.train_shards, len(urls), shards_digest(urls)
    else:  # a `datasets` dataset: what the arguments name (source, split, columns, streaming) is its fingerprint
        from disco_clip_ds.data.hf_io import describe_source

        data, num_shards = describe_source(data_args), None
        digest = hashlib.sha256(data.encode()).hexdigest()[:16]
    return {
        "data": describe_data(data),
        "num_shards": num_shards,
        "shards_sha256": digest,
        "train_num_samples": num_samples,
        "world_size": args.world_size,
        "micro_batch_per_rank": args.per_device_train_batch_size,
        "gradient_accumulation_steps": args.gradient_accumulation_steps,
        "contrastive_accumulation": accumulate,
        "global_contrastive_batch": args.per_device_train_batch_size
        * args.world_size
        * (args.gradient_accumulation_steps if accumulate else 1),
        "global_batch": args.per_device_train_batch_size * args.gradient_accumulation_steps * args.world_size,
        "zero_stage": plugin.zero_stage if plugin is not None else None,
        "dataloader_num_workers": args.dataloader_num_workers,
        "data_readers": ranks // split * max(1, args.dataloader_num_workers),
        "ranks_per_reader": split,
        "max_steps": max_steps,
        "tower_settings": tower_settings(args),
        "patch_dropout": patch_dropout_setting(args),
        "resolution_schedule": describe_schedule(
            getattr(args, "resolution_schedule", None),
            max_steps,
            getattr(args, "stage_micro_batch_sizes", None),
            args.per_device_train_batch_size,
            args.gradient_accumulation_steps,
        ),
        "max_num_patches": None if model_args is None else getattr(model_args, "max_num_patches", None),
        "locked_towers": None if model_args is None else lock_settings(model_args),
        "distillation": None if model_args is None else distillation_setting(model_args),
    }


def facts_at(run: dict, step: int) -> dict:
    """The facts the steps up to `step` were trained under: the first launch's, updated by the last resume that
    started before `step` (a resume from step s saves its first checkpoint after s)."""
    facts = {k: v for k, v in run.items() if k != "resumes"}
    for segment in run.get("resumes", []):
        if segment["from_step"] < step:
            facts.update({k: segment[k] for k in SEGMENT_KEYS if k in segment})
    return facts


def checkpoint_facts(checkpoint: Path) -> dict:
    """What the checkpoint itself says, from its small files: world size (one RNG file per rank), ZeRO-3 (per-rank
    model states), the architecture (config.json)."""
    facts: dict = {}
    ranks = saved_ranks(checkpoint)
    if ranks:
        facts["world_size"] = ranks
    if is_zero3(checkpoint):
        facts["zero_stage"] = 3
    ema = saved_settings(checkpoint)
    if ema is not None:
        facts["ema_decay"] = ema["decay"]
    try:
        facts["model"] = architecture(json.loads((checkpoint / "config.json").read_text()))
    except (OSError, ValueError):
        pass
    return facts


def recorded_facts(checkpoint: Path, step: int) -> dict:
    """The facts `checkpoint` (at `step`) was trained under: its run.json, then the checkpoint's own files."""
    run = run_file_of(checkpoint) or {}
    facts = facts_at(run, step)
    if run:
        facts.setdefault("zero_stage", None)  # run.json leaves it out for a run without DeepSpeed
    own = checkpoint_facts(checkpoint)
    if "zero_stage" in own and facts.get("zero_stage") not in (None, 3):
        own.pop("zero_stage")  # run.json's stage 3 or not agrees; its exact stage (1 or 2) is the finer fact
    return {**facts, **own}


# --- the comparison ---


def describe_ranks(n: int) -> str:
    return f"{n} rank{'s' if n != 1 else ''}"


def _stage(stage: int | None) -> str:
    return "none (no DeepSpeed)" if stage is None else str(stage)


def _batch(facts: dict) -> str:
    k = facts["gradient_accumulation_steps"]
    mode = " contrastive" if facts.get("contrastive_accumulation") and k > 1 else ""
    return f"{facts['micro_batch_per_rank']} per rank x {describe_ranks(facts['world_size'])} x K {k}{mode}"


def _batch_advice(old: dict, new: dict) -> str:
    """The flags that give the old contrastive batch on the new number of ranks."""
    target, world, micro = old["global_contrastive_batch"], new["world_size"], new["micro_batch_per_rank"]
    if old["global_batch"] != target:  # the old run did not accumulate contrastively: keep its K and micro
        per_rank = old["global_batch"] // world
        if (
            old["global_batch"] % world == 0
            and per_rank == old["micro_batch_per_rank"] * (old["gradient_accumulation_steps"])
        ):
            return (
                f"pass --per_device_train_batch_size {old['micro_batch_per_rank']} --gradient_accumulation_steps "
                + (f"{old['gradient_accumulation_steps']} --contrastive_accumulation false")
            )
        return f"resume on {describe_ranks(old['world_size'])} with the run's batch flags"
    if target % (micro * world) == 0:
        k = target // (micro * world)
        return f"pass --gradient_accumulation_steps {k}" + (" --contrastive_accumulation true" if k > 1 else "")
    if target % world == 0:
        return f"pass --per_device_train_batch_size {target // world} --gradient_accumulation_steps 1"
    return f"resume on a number of ranks that divides {target}"


def _reader_advice(old: dict, new: dict) -> str:
    readers, ranks = old["data_readers"], new["data_readers"] // max(1, new["dataloader_num_workers"])
    restart = "--ignore_data_skip to restart the data stream (samples seen before are seen again)"
    if not readers % ranks:
        return (
            f"pass --dataloader_num_workers {readers // ranks} to continue each reader's stream exactly, or {restart}"
        )
    run = _reading_ranks(old) if old.get("num_shards") is not None else None
    split = ranks // run[0] if run and not ranks % run[0] else 0
    if split > 1 and not run[1] % split:
        workers = old["dataloader_num_workers"]
        return (
            f"pass --per_device_train_batch_size {run[1] // split} --dataloader_num_workers {workers} to share each "
            f"reader's batches between {split} ranks exactly, or {restart}"
        )
    return "pass " + restart


def resume_problems(old: dict, new: dict, ignore_data_skip: bool = False) -> list[str]:
    """What keeps a run trained under `old` facts from resuming under `new` ones: one clause per difference, each
    naming old -> new and what to pass. Facts absent on either side (older run.json files) are not compared."""

    def known(*keys):
        return all(old.get(k) is not None and new.get(k) is not None for k in keys)

    problems = []
    if known("model") and old["model"] != new["model"]:
        changed = ", ".join(
            f"{k} {old['model'][k]} -> {new['model'][k]}"
            for k in old["model"]
            if old["model"][k] != new["model"].get(k)
        )
        problems.append(
            f"model {changed}: resume with the run's own model (its config.json is in the checkpoint), or choose a new "
            "--output_dir"
        )
    stage_changed = "zero_stage" in old and old.get("zero_stage") != new.get("zero_stage")
    if stage_changed:
        stage = old.get("zero_stage")
        problems.append(
            f"ZeRO stage {_stage(stage)} -> {_stage(new.get('zero_stage'))}: "
            + (f"pass a --deepspeed config with stage {stage}" if stage is not None else "drop --deepspeed")
            + " (optimizer state does not move between stages), or export the checkpoint and start a new --output_dir"
        )
    batch_changed = known("global_contrastive_batch", "global_batch") and (
        (old["global_contrastive_batch"], old["global_batch"]) != (new["global_contrastive_batch"], new["global_batch"])
    )
    if batch_changed:
        problems.append(
            f"contrastive batch {old['global_contrastive_batch']} ({_batch(old)}) -> "
            f"{new['global_contrastive_batch']} ({_batch(new)}): {_batch_advice(old, new)}"
        )
    if "tower_settings" in old and old["tower_settings"] != new.get("tower_settings"):
        problems.append(
            f"per-tower optimizer settings '{old['tower_settings']}' -> '{new.get('tower_settings')}': pass the run's "
            "(its optimizer state holds their parameter groups and rates), or export the checkpoint and start a new "
            "--output_dir"
        )
    if known("locked_towers") and old["locked_towers"] != new["locked_towers"]:
        problems.append(
            f"locked towers '{old['locked_towers']}' -> '{new['locked_towers']}': pass the run's (its optimizer state "
            "holds the parameters that train, and only those), or export the checkpoint and start a new --output_dir"
        )
    if known("max_num_patches") and old["max_num_patches"] != new["max_num_patches"]:
        problems.append(
            f"--max_num_patches {old['max_num_patches']} -> {new['max_num_patches']}: pass "
            f"--max_num_patches {old['max_num_patches']} (each image's tokens, so the training, depend on it)"
        )
    if known("world_size") and old["world_size"] != new["world_size"] and not (batch_changed or stage_changed):
        if not converts_world_size(old, new):
            problems.append(
                f"world size {old['world_size']} -> {new['world_size']}: only DeepSpeed ZeRO checkpoints move to "
                f"another number of ranks; resume on {describe_ranks(old['world_size'])}"
            )
    if old.get("ema_decay") is not None and new.get("ema_decay") is None and not new.get("drop_ema"):
        problems.append(
            f"the checkpoint keeps an EMA of the weights (decay {old['ema_decay']:g}) and this command none: pass "
            f"--ema_decay {old['ema_decay']:g} to keep it, or --drop_ema true to go on without it"
        )
    if ignore_data_skip:
        return problems
    if known("data_readers") and old["data_readers"] != new["data_readers"] and ranks_per_reader(old, new) == 1:
        problems.append(
            f"data readers (ranks x DataLoader workers) {old['data_readers']} -> {new['data_readers']}: "
            + _reader_advice(old, new)
        )
    if known("shards_sha256") and old["shards_sha256"] != new["shards_sha256"]:
        problems.append(
            f"training data {_data(old)} -> {_data(new)}: pass the run's "
            + (
                "--train_shards"
                if old.get("num_shards") is not None
                else "--dataset_name/--train_file, split and columns"
            )
            + ", or --ignore_data_skip to train on the new data from its start"
        )
    same_names = old.get("shards_sha256") == new.get("shards_sha256")
    if same_names and known("data_stat_sha256") and old["data_stat_sha256"] != new["data_stat_sha256"]:
        problems.append(
            f"training data {_data(new)} changed since the run read it (its files' sizes or modification times "
            "differ; the run would not continue the data it trained on): restore the data the run read, or pass "
            "--ignore_data_skip to train on it as it is now from its start"
        )
    elif known("train_num_samples") and old["train_num_samples"] != new["train_num_samples"]:
        problems.append(
            f"--train_num_samples {old['train_num_samples']} -> {new['train_num_samples']}: pass "
            f"--train_num_samples {old['train_num_samples']}, or --ignore_data_skip to restart the data stream"
        )
    return problems


def _data(facts: dict) -> str:
    shards = facts.get("num_shards")
    return f"{facts.get('data')}" + (f" ({shards} shards)" if shards is not None else "")


def _reading_ranks(facts: dict) -> tuple[int, int] | None:
    """(ranks whose readers fix the run's data order, the micro-batch each of them read) from a run's facts; None
    when one rank read for all (dispatch_batches) or the facts are too old to tell."""
    if any(facts.get(k) is None for k in ("world_size", "micro_batch_per_rank", "dataloader_num_workers")):
        return None
    split = facts.get("ranks_per_reader") or 1  # run.json files from before the split never split
    reading, rest = divmod(facts["world_size"], split)
    if rest or facts.get("data_readers") != reading * max(1, facts["dataloader_num_workers"]):
        return None
    return reading, facts["micro_batch_per_rank"] * split


def ranks_per_reader(old: dict, new: dict) -> int:
    """How many of the new ranks share each rank's readers of the run (`old`: its facts; `new`: this launch's,
    counted without a split): p > 1 when it resumes on p x the ranks that read for it, with 1/p of their
    micro-batch, the same DataLoader workers and K, from shards (a `datasets` dataset is cut by the reader count)
    that each rank reads itself; else 1. Each new rank then keeps its share of every batch of the old rank's readers
    (`ReaderStream`): each step trains on the same pairs, the global batch kept."""
    run, launch = _reading_ranks(old), _reading_ranks(new)
    if run is None or launch is None or old.get("num_shards") is None or new.get("num_shards") is None:
        return 1
    (reading, batch), same = run, (old.get("gradient_accumulation_steps"), old["dataloader_num_workers"])
    split, rest = divmod(new["world_size"], reading)
    if rest or split < 2 or new["micro_batch_per_rank"] * split != batch:
        return 1
    return split if same == (new.get("gradient_accumulation_steps"), new["dataloader_num_workers"]) else 1


def converts_world_size(old: dict, new: dict) -> bool:
    """Whether a checkpoint trained under `old` resumes on `new`'s world size through a universal checkpoint:
    DeepSpeed ZeRO-1/2/3 on both sides, same stage."""
    return old.get("zero_stage") in (1, 2, 3) and new.get("zero_stage") == old.get("zero_stage")


def check_resume(checkpoint: str | os.PathLike, step: int, new: dict, ignore_data_skip: bool = False) -> dict:
    """Raise a one-line UsageError when the run of `checkpoint` cannot resume under `new` facts (`launch_facts`
    plus "model": `architecture` of the checked config); return the recorded facts otherwise. Reads small files only."""
    checkpoint = Path(checkpoint)
    old = recorded_facts(checkpoint, step)
    problems = resume_problems(old, new, ignore_data_skip)
    if problems:
        raise UsageError(f"cannot resume {checkpoint.name} under changed settings: " + "; ".join(problems))
    return old


def with_resume(run: dict | None, step: int, new: dict, universal: bool, ignore_data_skip: bool) -> dict:
    """run.json's content after a resume from `step` under `new` facts: the first launch's facts stay, and a
    segment is added (replacing any from a later step, whose checkpoints no longer exist or are being redone)."""
    run = dict(run or {k: v for k, v in new.items() if k != "model"})
    segment = {"from_step": step, **{k: new[k] for k in SEGMENT_KEYS if new.get(k) is not None}}
    if universal:
        segment["universal_checkpoint"] = True
    if ignore_data_skip:
        segment["data_restarted"] = True
    run["resumes"] = [s for s in run.get("resumes", []) if s["from_step"] < step] + [segment]
    return run
