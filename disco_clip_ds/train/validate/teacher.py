"""The teacher(s): --teacher (a model of the student's family with weights to load, or several: an ensemble, each
listed once), --distill_weight, --distill_temperature, and --teacher_embeddings stored for every training shard by
that teacher."""

from __future__ import annotations

import logging
import math
from pathlib import Path

from disco_clip_ds.checkpoint.layout import verify_model_folder
from disco_clip_ds.distributed.ranks import decided_on_rank0
from disco_clip_ds.errors import DataError, DiscoClipError, UsageError
from disco_clip_ds.models.configs import load_config
from disco_clip_ds.models.source import check_model_source
from disco_clip_ds.train.args import ModelArguments, usage_error
from disco_clip_ds.train.validate.model import is_path

logger = logging.getLogger("disco_clip_ds.train")

# W without --distill_weight: loss = (1 - W) contrastive + W distillation
DEFAULT_DISTILL_WEIGHT = 0.5


def check_teacher(model_args: ModelArguments, student) -> tuple[float | None, list | None]:
    """(the distillation weight, its default filled in; each teacher's config, in --teacher's order), or (None, None)
    without --teacher: teachers of the `student` config's family (CLIP for CLIP, SigLIP for SigLIP: the loss compares
    the same kind of similarities), each listed once, whose weights are there to load, a weight in (0, 1], a positive
    temperature, a global-batch loss."""
    teachers, weight, temperature = model_args.teacher, model_args.distill_weight, model_args.distill_temperature
    if not teachers:
        given = [
            f
            for f, v in (
                ("--distill_weight", weight),
                ("--distill_temperature", temperature),
                ("--teacher_embeddings", model_args.teacher_embeddings),
                ("--verify_teacher_weights", model_args.verify_teacher_weights or None),
            )
            if v is not None
        ]
        if given:
            raise UsageError(f"{' and '.join(given)} without --teacher: name the model to distill from")
        return None, None
    weight = DEFAULT_DISTILL_WEIGHT if weight is None else weight
    if not (math.isfinite(weight) and 0 < weight <= 1):
        raise UsageError(f"--distill_weight {weight:g}: give a number in (0, 1] (1: distillation only)")
    if temperature is not None and not (math.isfinite(temperature) and temperature > 0):
        raise UsageError(f"--distill_temperature {temperature:g}: give a positive number, or leave it out")
    if model_args.loss_impl == "local":
        raise UsageError("--teacher distils the global batch's similarities: use --loss_impl tiled (or disco)")
    if model_args.verify_teacher_weights and model_args.teacher_embeddings is None:
        raise UsageError(
            "--verify_teacher_weights checks the teachers against the sidecars of --teacher_embeddings: add them, or "
            "leave it out (a teacher run live is loaded, not compared)"
        )
    check_listed_once(teachers)
    configs = [_family_config(teacher, student) for teacher in teachers]
    if model_args.teacher_embeddings is None or model_args.live_teacher:  # run: loaded once the student is built
        for teacher in teachers:
            check_teacher_weights(teacher)
    return weight, configs


def check_listed_once(teachers: list[str]) -> None:
    """An ensemble lists each teacher once: a teacher listed twice would count twice in the mean of the teachers'
    distributions (and its inputs be made twice). Names are compared as the folders or hub ids they resolve to."""
    seen = {}
    for teacher in teachers:
        folder = Path(teacher).expanduser()
        key = str(folder.resolve()) if is_path(teacher) or folder.exists() else teacher
        if key in seen:
            raise UsageError(
                f"--teacher {' '.join(teachers)}: {teacher} is listed twice"
                + (f" (as {seen[key]})" if seen[key] != teacher else "")
                + "; list each teacher once"
            )
        seen[key] = teacher


def _family_config(teacher: str, student):
    """One teacher's config, once it is there and of the student's family."""
    check_model_source(teacher, "--teacher")
    with usage_error(f"--teacher {teacher}: "):
        config = load_config(teacher)
    if config.model_type != student.model_type:
        raise UsageError(
            f"--teacher {teacher}: a {config.model_type} model cannot teach a {student.model_type} one; give a "
            f"{student.model_type} teacher"
        )
    return config


def check_teacher_weights(teacher: str) -> None:
    """A teacher folder must hold a model's weights (transformers' file names, whole or sharded), verified as
    `disco-clip export` verifies a model (`verify_model_folder`): a DeepSpeed
    checkpoint's folder holds ZeRO shards (and no weights under ZeRO-3) that `from_pretrained` cannot read, and
    would fail only once the student is built. (A hub id is left to the hub.)"""
    from transformers.utils import SAFE_WEIGHTS_INDEX_NAME, SAFE_WEIGHTS_NAME, WEIGHTS_INDEX_NAME, WEIGHTS_NAME

    folder = Path(teacher).expanduser()
    names = (SAFE_WEIGHTS_NAME, SAFE_WEIGHTS_INDEX_NAME, WEIGHTS_NAME, WEIGHTS_INDEX_NAME)
    if folder.is_dir() and not any((folder / name).is_file() for name in names):
        raise UsageError(
            f"--teacher {teacher}: no model weights in the folder ({SAFE_WEIGHTS_NAME} or {WEIGHTS_NAME}); for a "
            "training checkpoint, give the folder `disco-clip export CHECKPOINT DIR` makes of it"
        )
    verify_model_folder(teacher, "--teacher")  # a final or exported model against its manifest


def check_teacher_embeddings(model_args: ModelArguments, urls: list[str], configs: list | None = None):
    """The EmbeddingStore (data/embeddings.py) of the --teacher(s)' stored embeddings, once a sidecar is found for
    every training shard and every teacher, made by it (fingerprint) for that very shard (a sidecar of another
    source's shard of the same name is refused), its embeddings as wide as each teacher's (`configs`, in --teacher's
    order, when given): checked from the sidecars' headers before any work (their checksums and values are verified
    as each block is read). Says how many samples `data embed` skipped (they are skipped and counted in training).
    None without --teacher_embeddings."""
    folder = model_args.teacher_embeddings
    if folder is None:
        return None
    from disco_clip_ds.data.embeddings import EmbeddingStore, check_sidecars

    if not urls:
        raise UsageError("--teacher_embeddings are stored per shard: train from --train_shards")
    if not Path(folder).is_dir():
        raise UsageError(f"--teacher_embeddings {folder}: no such folder")
    fingerprints = teacher_fingerprints(model_args, urls)
    skipped = check_sidecars(folder, urls, fingerprints, " ".join(teachers(model_args)))
    if skipped:
        logger.warning(
            "--teacher_embeddings %s: its sidecars have no row for %d samples of the training shards (`data embed` "
            "skipped them: no image, undecodable, or a caption key missing): training skips and counts them",
            folder,
            skipped,
        )
    store = EmbeddingStore(folder, fingerprints, shards=urls)
    try:
        store.teachers  # the settings, read from the first shard's sidecar (each of the others is checked as read)
    except DataError as error:
        raise UsageError(str(error)) from error
    _check_widths(model_args, store, configs)
    return store


def _check_widths(model_args: ModelArguments, store, configs: list | None) -> None:
    """Each teacher's stored embeddings as wide as its model's (a sidecar of another model under its fingerprint
    would otherwise be distilled from)."""
    from disco_clip_ds.plan.memory import embedding_width

    for name, config, width in zip(teachers(model_args), configs or [], store.widths):
        if width is not None and width != embedding_width(config):
            raise UsageError(
                f"--teacher_embeddings {store.folder}: its embeddings of --teacher {name} are {width} wide, the "
                f"teacher's are {embedding_width(config)}: embed the shards with this teacher again"
            )


def teacher_fingerprints(model_args: ModelArguments, urls: list[str] = ()) -> list[str]:
    """Each teacher's fingerprint (`data.teacher_id`), made on rank 0 and handed to every rank, so that a run reads a
    folder's weights once at most, and not at all while the fingerprint cache holds them (`--verify_teacher_weights`:
    read them all the same); an error there is raised on every rank. A run from stored embeddings without
    `--live_teacher` (`urls`: its shards) reads no weight byte unless asked: a folder this node's cache has never
    seen takes the fingerprint its first shard's sidecar records for a teacher given by that very path (a warning
    says the weights were not hashed); a folder whose files changed since it was cached is hashed."""
    from disco_clip_ds.data.teacher_id import cache_entry, teacher_fingerprint

    trust_sidecar = bool(urls) and not model_args.live_teacher and not model_args.verify_teacher_weights

    def on_rank0():
        fingerprints = []
        for name in teachers(model_args):
            folder = Path(name).expanduser()
            recorded = None
            # no cache entry at all: a node that never hashed this folder (a changed folder has a stale entry: hashed)
            if trust_sidecar and folder.is_dir() and not cache_entry(folder).is_file():
                recorded = _recorded_fingerprint(model_args.teacher_embeddings, urls[0], folder)
            if recorded is not None:
                logger.warning(
                    "--teacher %s: its weights were not hashed (no fingerprint cached for the folder): the stored "
                    "embeddings' own record of it (%s) is used; pass --verify_teacher_weights true to hash them",
                    name,
                    recorded,
                )
                fingerprints.append(recorded)
                continue
            with usage_error(f"--teacher {name}: "):
                fingerprints.append(teacher_fingerprint(name, verify=model_args.verify_teacher_weights))
        return fingerprints

    return decided_on_rank0(on_rank0)


def _recorded_fingerprint(embeddings: str, shard: str, folder: Path) -> str | None:
    """The fingerprint the sidecar of `shard` records for the teacher embedded from `folder` (by its resolved path);
    None when it has none (or cannot be read: the sidecar checks then say why)."""
    from disco_clip_ds.data.embeddings import read_metadata, settings_of, sidecar_path

    try:
        stored = settings_of(read_metadata(sidecar_path(embeddings, shard))).teachers
    except (DiscoClipError, OSError, ValueError, KeyError):
        return None
    for facts in stored:
        if facts.name and Path(facts.name).expanduser().resolve() == folder.resolve():
            return facts.fingerprint
    return None


def teachers(model_args: ModelArguments) -> list[str]:
    """--teacher as the list of the ensemble's teachers, in the order given."""
    return list(model_args.teacher or [])
