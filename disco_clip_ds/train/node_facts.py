"""What every rank of a run must agree on before any work: its arguments, the contents of the files they name, ranks
per node and package versions, as comparable values (distributed.nodes.check_nodes gathers and compares them).

Here, not in distributed/: reading them takes the shard list's expansion, which lives in a room above distributed/.

They are gathered before the arguments are checked (a check that failed on some nodes only would leave the others
waiting), so each rank reads its own files here, cheaply: the DeepSpeed JSON as `parse_args` read it, the model's
config.json as written (not loaded as a config: that is the checks' one load), and a fingerprint of a model or
tokenizer folder from its files' names, sizes and a few sampled blocks (`folder_fingerprint`), never every byte
of its weights.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from disco_clip_ds.distributed.ranks import ranks_per_node

PACKAGES = ("disco-clip-ds", "torch", "transformers", "deepspeed", "accelerate")
PER_PROCESS = ("local_rank",)  # training arguments that differ between the ranks of one run by design
# A file up to this size (configs, tokenizers, a small model) is hashed whole; a larger one by its size and BLOCK
# bytes at its start (a safetensors header and its first tensors), middle and end: other weights of the same shapes
# differ there too (a trained weight changes nearly every byte), while a 1B-parameter folder costs a few MiB to read.
WHOLE_FILE_BYTES = 16 << 20
BLOCK = 1 << 20


def node_facts(model_args, data_args, args) -> dict:
    """What every rank of a run must agree on, as comparable values: every argument, the contents of the files they
    name (DeepSpeed config, model config, the files of a model, tokenizer or teacher folder, the shard list), ranks per
    node and package versions. A fact that cannot be read here is its error's text (the same error on every node passes
    on to the argument checks). `args`: DiscoTrainingArguments."""
    from dataclasses import asdict

    arguments = {f"--{k}": v for k, v in {**asdict(model_args), **asdict(data_args), **args.to_dict()}.items()}
    facts = {name: _plain(value) for name, value in arguments.items() if name[2:] not in PER_PROCESS}
    facts["ranks per node"] = ranks_per_node()
    facts["world size"] = args.world_size
    if args.deepspeed_json is not None:  # read by parse_args, which refuses an unreadable file
        facts["the DeepSpeed config file"] = args.deepspeed_json
    model_file = model_args.model_config or (
        model_args.model_name_or_path and Path(model_args.model_name_or_path) / "config.json"
    )
    if model_file and Path(model_file).is_file():  # a hub id is compared as an argument
        facts["the model"] = _read(lambda: json.loads(Path(model_file).read_text()))
    folders = [("model", model_args.model_name_or_path), ("tokenizer", model_args.tokenizer_name)]
    if model_args.teacher_embeddings is None or model_args.live_teacher:  # loaded on each node; a stored run's is not
        folders += [(f"--teacher {teacher}", teacher) for teacher in model_args.teacher or ()]
    for name, folder in folders:
        if folder and Path(folder).is_dir():
            facts[f"the {name} files"] = _read(lambda folder=folder: folder_fingerprint(Path(folder)))
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


def folder_fingerprint(folder: Path) -> dict:
    """{name: fingerprint} of each file directly in `folder`: its sha256 for a file up to WHOLE_FILE_BYTES, else its
    size and the sha256 of BLOCK bytes at its start, middle and end. Weights are compared too (the same config with
    other weights trains another run), at a cost that does not grow with the model."""
    names = sorted(p.name for p in folder.iterdir() if p.is_file())
    return {name: _file_fingerprint(folder / name) for name in names}


def _file_fingerprint(path: Path) -> str:
    size = path.stat().st_size
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        if size <= WHOLE_FILE_BYTES:
            for block in iter(lambda: f.read(BLOCK), b""):
                digest.update(block)
            return digest.hexdigest()[:16]
        for offset in (0, size // 2, size - BLOCK):
            f.seek(offset)
            digest.update(f.read(BLOCK))
    return f"{size} bytes, sampled {digest.hexdigest()[:16]}"


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
