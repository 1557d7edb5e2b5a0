"""What every rank of a run must agree on before any work: its arguments, the contents of the files they name, ranks
per node and package versions, as comparable values (distributed.nodes.check_nodes gathers and compares them).

Here, not in distributed/: reading them takes the model's config loader, the checkpoint manifests' hash and the
shard list's expansion, which live in rooms above distributed/.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

PACKAGES = ("disco-clip-ds", "torch", "transformers", "deepspeed", "accelerate")
PER_PROCESS = ("local_rank",)  # training arguments that differ between the ranks of one run by design


def node_facts(model_args, data_args, args) -> dict:
    """What every rank of a run must agree on, as comparable values: every argument, the contents of the files they
    name (DeepSpeed config, model config, the files of a model or tokenizer folder, the shard list), ranks per node
    and package versions. A fact that cannot be read here is its error's text (the same error on every node passes
    on to the argument checks). `args`: DiscoTrainingArguments."""
    from dataclasses import asdict

    arguments = {f"--{k}": v for k, v in {**asdict(model_args), **asdict(data_args), **args.to_dict()}.items()}
    facts = {name: _plain(value) for name, value in arguments.items() if name[2:] not in PER_PROCESS}
    facts["ranks per node"] = int(os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("LOCAL_SIZE") or 1)
    facts["world size"] = args.world_size
    if isinstance(args.deepspeed, str) and not args.deepspeed.lstrip().startswith("{"):
        facts["the DeepSpeed config file"] = _read(lambda: json.loads(Path(args.deepspeed).read_text()))
    facts["the model"] = _read(lambda: _model(model_args))
    for name, folder in (("model", model_args.model_name_or_path), ("tokenizer", model_args.tokenizer_name)):
        if folder and Path(folder).is_dir():  # a hub id is compared as an argument
            facts[f"the {name} files"] = _read(lambda folder=folder: _files(Path(folder)))
    facts["the training shards"] = _read(lambda: _shards(data_args.train_shards))
    facts["package versions"] = _read(_versions)
    return facts


def _plain(value):
    """`value` as JSON would hold it (enums, dataclasses and sets as their text): comparable after a gather."""
    return json.loads(json.dumps(value, default=str))


def _read(compute):
    try:
        return _plain(compute())
    except Exception as error:  # any reader's failure is a fact to compare; the argument checks report it
        return f"unreadable ({type(error).__name__}: {error})"


def _model(model_args) -> dict:
    from disco_clip_ds.models.build import load_config

    config = load_config(model_args.model_name_or_path, model_args.model_config).to_dict()
    config.pop("transformers_version", None)
    return config


def _files(folder: Path) -> dict:
    """The checksum of each file directly in `folder` (weights included: the same config with other weights
    trains another run; xxh3 reads at about disk speed)."""
    from disco_clip_ds.checkpoint.manifest import file_checksums  # the checkpoint manifests' hash

    names = sorted(p.name for p in folder.iterdir() if p.is_file())
    return dict(zip(names, file_checksums(folder, names), strict=True))


def _shards(spec: str) -> dict:
    from disco_clip_ds.checkpoint.resume import shards_digest
    from disco_clip_ds.data.shards import expand_shards

    urls = expand_shards(spec)
    return {"count": len(urls), "sha256": shards_digest(urls)}


def _versions() -> dict:
    from importlib import metadata

    found = {}
    for name in PACKAGES:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = None
    return found
