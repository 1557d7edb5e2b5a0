"""Workarounds for other packages' releases, each behind a gate and with the reason; nothing else lives here.

Delete an entry when the oldest supported release of its package no longer needs it.
"""

from __future__ import annotations

import contextlib
import functools
from importlib import metadata


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


# --- deepspeed: 0-dim parameters ----------------------------------------------------------------------------
# deepspeed 0.19.8 broadcasts every parameter as `p.data.view(torch.uint8)`, which raises for a 0-dim tensor such as
# CLIP's `logit_scale` (engine init under ZeRO-1/2, zero.Init and weight gathering under ZeRO-3). Under those
# releases, and only then, DiscoCLIPModel holds it as a 1-element vector; its state dict keeps CLIP's 0-dim layout
# through the two hooks below. Widen the tuple when a later release turns out to share the bug (tests/test_compat.py
# checks the gate against the installed release's behaviour).
ZERO_DIM_BROKEN_DEEPSPEED = ("0.19.8",)
LOGIT_SCALE_AS_VECTOR = _version("deepspeed") in ZERO_DIM_BROKEN_DEEPSPEED


def logit_scale_to_scalar_hook(module, state_dict, prefix, local_metadata):
    """State-dict hook: the vector `logit_scale` is saved in CLIP's 0-dim layout."""
    key = prefix + "logit_scale"
    if key in state_dict and state_dict[key].numel() == 1:  # a ZeRO-3 partitioned parameter is an empty tensor
        state_dict[key] = state_dict[key].reshape(())
    return state_dict


def logit_scale_to_param_shape_hook(module, state_dict, prefix, *args):
    """Load-state-dict pre-hook: a 0-dim `logit_scale` from a CLIP checkpoint loads into the vector parameter."""
    key = prefix + "logit_scale"
    if key in state_dict and state_dict[key].numel() == 1:
        shape = getattr(module.logit_scale, "ds_shape", module.logit_scale.shape)  # ZeRO-3 keeps the full shape there
        state_dict[key] = state_dict[key].reshape(shape)


# --- transformers 5: weight conversions kept on the model --------------------------------------------------------
def clear_weight_conversions(model) -> None:
    """transformers 5's ZeRO-3 loader leaves its key transforms on the model (`_weight_conversions`) and
    `save_pretrained` reverses them into "vision_model.vision_model.*" keys; our state dict already is CLIP's
    checkpoint layout, so the list must be empty, as the plain loader leaves it. Gate: releases that have it."""
    if hasattr(model, "_weight_conversions"):
        model._weight_conversions = []


# --- accelerate: re-sharding an iterable dataset that is already per-rank -----------------------------------------
def unshard_iterable_dataset(loader) -> None:
    """accelerate (1.x, no option for it) wraps an IterableDataset in IterableDatasetShard when dispatch_batches is
    off, which keeps 1/N of each rank's stream; ours is already this rank's own (ShardStream), so the wrapper is told
    it is one process of one. Gate: a loader whose dataset carries the shard fields."""
    shard = getattr(loader, "dataset", None)
    if hasattr(shard, "process_index") and hasattr(shard, "num_processes"):
        shard.num_processes, shard.process_index = 1, 0


# --- img2dataset: no hook for the fetch function -------------------------------------------------------------------
class _SwappedFetchDownloader:
    """What img2dataset's distributor pickles and calls in each worker: it swaps in `fetch` there, then downloads
    the shard through `run(downloader, row)`."""

    def __init__(self, downloader, fetch, run):
        self.downloader, self.fetch, self.run = downloader, fetch, run

    def __call__(self, row):
        import img2dataset.downloader as dl

        dl.download_image = self.fetch
        return self.run(self.downloader, row)


def _call(downloader, row):
    return downloader(row)


@contextlib.contextmanager
def img2dataset_fetch(fetch, run=_call):
    """Make `img2dataset.download` fetch each image with `fetch` (same contract as its `downloader.download_image`),
    each shard downloaded in the worker as `run(downloader, row)` (default: `downloader(row)`).

    img2dataset (1.45-1.47) has no hook for the fetch function and builds its Downloader inside `download()`, in
    `img2dataset.main`; the Downloader is wrapped there. Gate: fails with what to do when those internals moved."""
    import importlib

    import img2dataset.downloader as dl

    # `img2dataset.main` as an attribute is the CLI function of the same name; the module is what we need.
    i2d_main = importlib.import_module("img2dataset.main")
    if not hasattr(i2d_main, "Downloader") or not hasattr(dl, "download_image"):
        raise RuntimeError(
            f"img2dataset {_version('img2dataset')} moved its Downloader/download_image: "
            "install a release within requirements.txt's range (tested 1.45-1.47)"
        )
    original = i2d_main.Downloader
    i2d_main.Downloader = functools.partial(_wrap_downloader, original, fetch, run)
    try:
        yield
    finally:
        i2d_main.Downloader = original


def _wrap_downloader(original, fetch, run, **kwargs):
    return _SwappedFetchDownloader(original(**kwargs), fetch, run)


# --- accelerate: a launched CPU world counted as one process --------------------------------------------------------
def use_cpu_without_gpu(args) -> None:
    """accelerate (1.x) on a machine without a GPU counts one process while the launcher (deepspeed, torchrun,
    accelerate launch) started several, unless TrainingArguments says use_cpu; DeepSpeed then refuses the batch
    arithmetic (`train_batch_size is not equal to ...`). ACCELERATE_USE_CPU instead silently drops DeepSpeed for DDP.
    Call on TrainingArguments before its own __post_init__. Gate: no CUDA device."""
    import torch

    if not torch.cuda.is_available():
        args.use_cpu = True


# --- deepspeed: deepspeed.comm unset on CPU before the engine exists -------------------------------------------------
def init_deepspeed_comm(args) -> None:
    """ZeRO-3 builds the model inside deepspeed.zero.Init, which reads the world size from deepspeed.comm. With
    use_cpu, accelerate (1.x) sets up torch.distributed but not deepspeed.comm, which DeepSpeed itself sets up only
    when the engine starts, after the model is built: zero.Init would partition for a world of 1. Call before
    building the model. Gate: a DeepSpeed run of several ranks; where deepspeed.comm is up already (accelerate does
    it on GPU), init_distributed does nothing."""
    if (args.deepspeed or args.deepspeed_plugin is not None) and args.world_size > 1:
        import deepspeed

        deepspeed.init_distributed()


# --- transformers Trainer: the process group is never destroyed ----------------------------------------------------
def destroy_process_group() -> None:
    """torch.distributed asks that a process group be destroyed before the interpreter exits: gloo worker threads
    still holding work at finalization abort the process ("terminate called without an active exception", SIGABRT)
    after a finished run. The Trainer (5.x) has accelerate create the group and never destroys it (accelerate's
    Accelerator.end_training would; the Trainer does not call it), nor does DeepSpeed. Call at the end of a launched
    rank. Gate: a group that is still initialized."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
