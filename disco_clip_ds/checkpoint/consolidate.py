"""A checkpoint's weights as one state dict, and the plain transformers model holding them: what export writes and
what the final model is rewritten from when a ZeRO-3 checkpoint holds no full weights. Here, below both, so that
checkpoint/final_model.py and export/ share it (checkpoint does not import export).

Nothing here unpickles an arbitrary object: a checkpoint is a file anyone may have handed over, and DeepSpeed's
zero_to_fp32 reads its partitions with `torch.load(weights_only=False)`, which runs whatever code a pickle names.
Its loads are made `weights_only=True` (`_weights_only_loads`), with the few DeepSpeed classes an optimizer partition
holds allow-listed (`DEEPSPEED_SAFE_GLOBALS`); a file naming anything else is refused, in one line naming it.
"""

from __future__ import annotations

import contextlib
import functools
import json
import re
from pathlib import Path

from disco_clip_ds.checkpoint.layout import WEIGHT_FILES, deepspeed_tag, has_zero_partitions
from disco_clip_ds.errors import ExportError


def load_state_dict(checkpoint: Path) -> tuple[dict, str]:
    """The checkpoint's weights and where they came from.

    A ZeRO (stage 1-3) checkpoint is consolidated from the fp32 master weights in the optimizer partitions
    with DeepSpeed's own zero_to_fp32 (exact even for bf16 runs; ZeRO-3 writes no full weights unless told
    to gather them); otherwise the Trainer's full weight file is used.
    """
    tag = deepspeed_tag(checkpoint)
    if tag is not None and not tag.is_dir():
        raise ExportError(
            f"partial checkpoint: '{checkpoint / 'latest'}' names '{tag.name}', which does not exist in {checkpoint}"
        )
    if has_zero_partitions(checkpoint):
        from deepspeed.utils import zero_to_fp32

        try:
            with _weights_only_loads(zero_to_fp32):
                state_dict = zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(str(checkpoint), tag=tag.name)
        except (ValueError, FileNotFoundError, RuntimeError, KeyError, EOFError) as e:
            raise ExportError(f"partial or corrupt DeepSpeed checkpoint in {tag}: {e}") from e
        return state_dict, f"DeepSpeed ZeRO fp32 partitions ({tag.name})"
    for name in WEIGHT_FILES:
        if (checkpoint / name).is_file():
            return _read_weight_file(checkpoint / name), name
    raise ExportError(
        f"no weights in '{checkpoint}': expected {' or '.join(WEIGHT_FILES)} or a DeepSpeed ZeRO checkpoint"
    )


def deepspeed_safe_globals() -> list:
    """The classes besides tensors and plain containers that DeepSpeed 0.19's ZeRO-1/2/3 files pickle (found with
    torch.serialization.get_unsafe_globals_in_checkpoint on fp32 and bf16 checkpoints): the stage enum, the loss
    scaler (dynamic under fp16) and ZeRO-2's fragment addresses. Each is plain data: building one runs no code of
    the file's choosing."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [ZeroStageEnum, LossScaler, DynamicLossScaler, fragment_address]


_NOT_ALLOWED = re.compile(r"GLOBAL (\S+)")  # torch names the first global it refused


@contextlib.contextmanager
def _weights_only_loads(module):
    """While open, `module`'s `torch.load` reads weights only (`weights_only=True`, whatever the caller passes) with
    `deepspeed_safe_globals` allowed, and a file it refuses is an ExportError naming the file and what it holds.
    Only `module`'s names `torch` (by a view of torch) and `tqdm` are replaced: no other caller's loads change."""
    import pickle

    import torch

    allowed = deepspeed_safe_globals()

    def load(f, *args, **kwargs):
        kwargs["weights_only"] = True
        try:
            with torch.serialization.safe_globals(allowed):
                return torch.load(f, *args, **kwargs)
        except pickle.UnpicklingError as error:
            found = _NOT_ALLOWED.search(str(error))
            what = f"a pickled {found.group(1)}" if found else "pickled objects other than tensors"
            raise ExportError(
                f"refused to read '{f}': it holds {what}, which a DeepSpeed checkpoint does not and which could run "
                "code when loaded; the checkpoint was altered or is not one `disco-clip train` wrote"
            ) from error

    saved = module.torch, module.tqdm
    # its progress bars too: on stderr, a bar left at 0% would stand before a refusal's one line
    module.torch, module.tqdm = _TorchView(torch, load), functools.partial(module.tqdm, disable=True)
    try:
        yield
    finally:
        module.torch, module.tqdm = saved


class _TorchView:
    """torch with its `load` replaced."""

    def __init__(self, torch, load):
        self._torch, self.load = torch, load

    def __getattr__(self, name):
        return getattr(self._torch, name)


def _read_weight_file(path: Path) -> dict:
    try:
        if path.name.endswith(".index.json"):  # sharded: the index maps each weight to its shard file
            shards = sorted(set(json.loads(path.read_text())["weight_map"].values()))
            return {name: tensor for shard in shards for name, tensor in _read_one_file(path.parent / shard).items()}
        return _read_one_file(path)
    except Exception as e:
        raise ExportError(f"cannot read weights '{path}': {e}") from e


def _read_one_file(path: Path) -> dict:
    import torch
    from safetensors.torch import load_file

    if path.suffix == ".safetensors":
        return load_file(str(path))
    return torch.load(path, map_location="cpu", weights_only=True)


# What DiscoCLIPModel/DiscoSiglipModel add to a transformers config (models/base.py): training settings, which a
# plain model's config.json does not carry
TRAINING_KEYS = ("loss_impl", "chunk_size")


def build_plain_model(checkpoint: Path, state_dict: dict):
    """The plain transformers model (CLIPModel, SiglipModel or Siglip2Model, by the checkpoint's config) holding
    `state_dict`, every parameter accounted for."""
    from transformers import AutoConfig, CLIPModel, Siglip2Model, SiglipModel

    if not (checkpoint / "config.json").is_file():
        raise ExportError(f"partial checkpoint: no config.json in {checkpoint}")
    config = AutoConfig.from_pretrained(checkpoint)
    plain = {"clip": CLIPModel, "siglip": SiglipModel, "siglip2": Siglip2Model}.get(config.model_type)
    if plain is None:
        raise ExportError(f"{checkpoint}: a {config.model_type} model; export reads CLIP and SigLIP (2) checkpoints")
    config.architectures = [plain.__name__]
    for key in TRAINING_KEYS:  # how it was trained, not what the model is: run.json and the model card say it
        if key in config.__dict__:
            delattr(config, key)
    model = plain(config)
    model.load_state_dict(_fit(model, state_dict), strict=True)
    return model


def _fit(model, state_dict: dict) -> dict:
    """`state_dict` with each weight shaped as `model` wants it; ExportError for a weight without a place, one of
    another size, or one missing."""
    expected = model.state_dict()
    buffers = {name for name, _ in model.named_buffers()}
    fixed = {}
    for name, tensor in state_dict.items():
        if name not in expected:
            if name in buffers:  # a non-persistent buffer DeepSpeed recorded anyway
                continue
            raise ExportError(
                f"checkpoint weight '{name}' has no place in {type(model).__name__}: is config.json this run's?"
            )
        target = expected[name]
        if tensor.shape != target.shape:
            if tensor.numel() != target.numel():
                raise ExportError(
                    f"weight '{name}' has shape {tuple(tensor.shape)}, config.json wants {tuple(target.shape)}"
                )
            # DeepSpeed 0.19.8 trains CLIP's 0-dim logit_scale as a 1-element vector (see compat.py)
            tensor = tensor.reshape(target.shape)
        fixed[name] = tensor
    missing = sorted(set(expected) - set(fixed))
    if missing:
        raise ExportError(f"partial checkpoint: {len(missing)} weights missing, e.g. {missing[:3]}")
    return fixed
