"""Workarounds for other packages' releases, each behind a gate and with the reason; nothing else lives here.

Delete an entry when the oldest supported release of its package no longer needs it; tests/unit/test_compat.py shows,
for each, that the installed release still does.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Callable
from importlib import metadata

from packaging.version import Version


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


# --- torch: the single-tensor collectives renamed ----------------------------------------------------------------
# torch 2.13 renamed all_gather_into_tensor / reduce_scatter_tensor to all_gather_single / reduce_scatter_single and
# warns (FutureWarning) at every call of the old names; the releases before it that pyproject admits have only the
# old names. Gate: the new name where torch.distributed has it. Looked up at each call, so that a caller can wrap
# torch.distributed's functions (the loss's byte-counting test and benchmark do).
def all_gather_single(output, input, group=None) -> None:
    """torch.distributed's single-tensor all-gather, under the installed release's name."""
    import torch.distributed as dist

    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(output, input, group=group)


def reduce_scatter_single(output, input, op, group=None) -> None:
    """torch.distributed's single-tensor reduce-scatter, under the installed release's name."""
    import torch.distributed as dist

    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    scatter(output, input, op=op, group=group)


# --- deepspeed: its torch backend calls the renamed collectives by their old names ---------------------------------
# deepspeed (0.19.8 included) picks torch.distributed.all_gather_into_tensor / reduce_scatter_tensor for its single-
# tensor collectives (comm/torch.py, TorchBackend.get_all_gather_function / get_reduce_scatter_function), which torch
# 2.13 deprecated: every ZeRO run printed the FutureWarning once per rank and call site. Under the gate the backend
# takes torch's current names (the same collectives: the old names call them), on the class before a backend exists
# and on the one that exists already. Gate: a torch with the new names and a deepspeed whose backend still picks an
# old one (tests/unit/test_compat.py checks the installed release still does).
def _deepspeed_picks_old_collectives() -> bool:
    import torch.distributed as dist

    if not (hasattr(dist, "all_gather_single") and hasattr(dist, "reduce_scatter_single")):
        return False
    from deepspeed.comm.torch import TorchBackend

    picked = (TorchBackend.get_all_gather_function(), TorchBackend.get_reduce_scatter_function())
    return picked != (dist.all_gather_single, dist.reduce_scatter_single)


def deepspeed_current_collectives() -> None:
    """Under the gate (above), DeepSpeed's torch backend calls torch's current single-tensor collectives. Call before
    deepspeed.comm starts (init_deepspeed_comm does); idempotent."""
    if not _deepspeed_picks_old_collectives():
        return
    import torch.distributed as dist
    from deepspeed.comm import comm as ds_comm
    from deepspeed.comm.torch import TorchBackend

    TorchBackend.get_all_gather_function = classmethod(lambda cls: dist.all_gather_single)
    TorchBackend.get_reduce_scatter_function = classmethod(lambda cls: dist.reduce_scatter_single)
    if isinstance(ds_comm.cdb, TorchBackend):  # started already (accelerate starts it on GPU)
        ds_comm.cdb.all_gather_function = dist.all_gather_single
        ds_comm.cdb.reduce_scatter_function = dist.reduce_scatter_single


# --- deepspeed: 0-dim parameters ----------------------------------------------------------------------------
# deepspeed 0.19.8 broadcasts every parameter as `p.data.view(torch.uint8)`, which raises for a 0-dim tensor such as
# CLIP's `logit_scale` (engine init under ZeRO-1/2, zero.Init and weight gathering under ZeRO-3). Under those
# releases, and only then, DiscoCLIPModel holds it as a 1-element vector; its state dict, its `save_pretrained`
# output and its `from_pretrained` input keep CLIP's 0-dim layout (the functions below). Widen the tuple when a later
# release turns out to share the bug (tests/unit/test_compat.py checks the gate against the installed release).
ZERO_DIM_BROKEN_DEEPSPEED = ("0.19.8",)
LOGIT_SCALE_AS_VECTOR = _version("deepspeed") in ZERO_DIM_BROKEN_DEEPSPEED

# Set while a non-ZeRO-3 `from_pretrained` runs: transformers then loads tensors by attribute with a shape check, so
# the model must keep CLIP's 0-dim shape until the weights are in.
_defer_vector_logit_scale = contextvars.ContextVar("defer_vector_logit_scale", default=False)


def adopt_vector_logit_scale(model) -> None:
    """At a CLIPModel's construction, under the gate: the hooks that keep CLIP's 0-dim layout in its state dict, and
    the vector parameter itself (deferred inside `load_with_vector_logit_scale`)."""
    if not LOGIT_SCALE_AS_VECTOR:
        return
    model._register_state_dict_hook(logit_scale_to_scalar_hook)
    model.register_load_state_dict_pre_hook(logit_scale_to_param_shape_hook)
    if not _defer_vector_logit_scale.get():
        make_logit_scale_vector(model)


def load_with_vector_logit_scale(load, zero3: bool):
    """`load()` (a `from_pretrained`) under the gate: the plain loader needs CLIP's 0-dim shape while it sets the
    weights, so the vector comes after it; ZeRO-3 builds the model inside zero.Init, which needs the vector at
    construction, and loads through `_load_from_state_dict`, where the pre-hook reshapes."""
    token = _defer_vector_logit_scale.set(LOGIT_SCALE_AS_VECTOR and not zero3)
    try:
        model = load()
    finally:
        _defer_vector_logit_scale.reset(token)
    make_logit_scale_vector(model)
    return model


def make_logit_scale_vector(model) -> None:
    """Under the gate: replace a 0-dim `model.logit_scale` with a 1-element parameter."""
    if LOGIT_SCALE_AS_VECTOR and model.logit_scale.dim() == 0:
        import torch

        scale = model.logit_scale
        model.logit_scale = torch.nn.Parameter(scale.detach().reshape(1), requires_grad=scale.requires_grad)


def scalar_logit_scale_in(state_dict: dict | None) -> dict | None:
    """A state dict passed to `save_pretrained`, with CLIP's 0-dim `logit_scale`: ZeRO-3's consolidated state dict is
    gathered from the parameters and bypasses the state-dict hook."""
    if state_dict is None or "logit_scale" not in state_dict:
        return state_dict
    return {**state_dict, "logit_scale": state_dict["logit_scale"].reshape(())}


def logit_scale_to_scalar_hook(module, state_dict, prefix, local_metadata):
    """State-dict hook: the vector `logit_scale` is saved in CLIP's 0-dim layout."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch < 2.5
        from torch.distributed._tensor import DTensor

    key = prefix + "logit_scale"
    value = state_dict.get(key)
    # A ZeRO-3 partitioned parameter is an empty tensor. An FSDP2 one is a DTensor, sharded along the dimension the
    # reshape would drop; the full state dict is gathered after the hooks, and `save_pretrained` reshapes it.
    if value is not None and value.numel() == 1 and not isinstance(value, DTensor):
        state_dict[key] = value.reshape(())
    return state_dict


def logit_scale_to_param_shape_hook(module, state_dict, prefix, *args):
    """Load-state-dict pre-hook: a 0-dim `logit_scale` from a CLIP checkpoint loads into the vector parameter."""
    key = prefix + "logit_scale"
    if key in state_dict and state_dict[key].numel() == 1:
        shape = getattr(module.logit_scale, "ds_shape", module.logit_scale.shape)  # ZeRO-3 keeps the full shape there
        state_dict[key] = state_dict[key].reshape(shape)


# --- transformers 5: a model class defined outside transformers is "custom code" ---------------------------------
# For custom code (`PreTrainedModel.is_custom_code()`: any class whose module is not under `transformers.`),
# `_initialize_weights(module, is_custom_code=True)` marks a module as initialised without running `_init_weights`
# when all its own parameters are loaded: vacuously true for a module with none of its own (CLIPAttention, CLIPMLP),
# so CLIP's rules for those would never run in DiscoCLIPModel. Its init writes only through
# `transformers.initialization`, which skips loaded tensors as the library's own rules do, so it can run as library
# code. Gate: releases whose PreTrainedModel has `is_custom_code`.
def init_as_library_code(initialize):
    """`initialize` (a model's `_initialize_weights`) as transformers calls it for its own classes."""
    from transformers import PreTrainedModel

    if not hasattr(PreTrainedModel, "is_custom_code"):
        return initialize

    def initialize_weights(module, is_custom_code: bool = False) -> None:
        initialize(module, False)

    return initialize_weights


# --- transformers: a live ZeRO-3 config partitions every model built, even one on the meta device -----------------
# `_from_config` (which CLIPModel and SiglipModel use for their towers) enters deepspeed.zero.Init whenever a ZeRO-3
# config is live (TrainingArguments with a ZeRO-3 JSON registers one for the whole process), and then initialises
# the partitioned weights from meta tensors: "Cannot copy out of meta tensor". The planner's parameter count on the
# meta device (the trainer's FLOPs per sample) must build a plain model: the registration is paused meanwhile.
# transformers keeps it as a module-level weak reference (`_hf_deepspeed_config_weak_ref`, read by
# `is_deepspeed_zero3_enabled`); a release without it has nothing to pause.
@contextlib.contextmanager
def zero3_init_paused():
    """Within: models are built plainly even where a ZeRO-3 config is live (restored on leaving)."""
    from transformers.integrations import deepspeed as hf_deepspeed

    if not hasattr(hf_deepspeed, "_hf_deepspeed_config_weak_ref"):
        yield
        return
    saved = hf_deepspeed._hf_deepspeed_config_weak_ref
    hf_deepspeed._hf_deepspeed_config_weak_ref = None
    try:
        yield
    finally:
        hf_deepspeed._hf_deepspeed_config_weak_ref = saved


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


def end_img2dataset_logger(timeout_s: float = 30.0) -> None:
    """End img2dataset's logger process, which `img2dataset.download` leaves running when its distributor raises
    (it joins the logger only after a distributor that returned). That process reads every `*.json` of the output
    folder as `NNNNN_stats.json` every few seconds: left running, it prints a traceback (`invalid literal for int()`)
    once our sizes.json is there. It is asked to stop after a last read, as its own `join` asks; one that does not
    end is terminated. Gate: img2dataset 1.45-1.47's `img2dataset.logger.LoggerProcess` and its stop queue `q` (none
    found: nothing to end)."""
    import multiprocessing
    from multiprocessing.process import BaseProcess

    try:
        from img2dataset.logger import LoggerProcess
    except ImportError:
        return
    for child in multiprocessing.active_children():
        if isinstance(child, LoggerProcess):
            if hasattr(child, "q"):
                child.q.put("stop")  # what its own join sends, which then waits without a timeout
            BaseProcess.join(child, timeout_s)
            if child.is_alive():
                child.terminate()


# --- accelerate: a launched CPU world counted as one process --------------------------------------------------------
def use_cpu_without_gpu(args) -> None:
    """accelerate (1.x) on a machine without a GPU counts one process while the launcher (deepspeed, torchrun,
    accelerate launch) started several, unless TrainingArguments says use_cpu; DeepSpeed then refuses the batch
    arithmetic (`train_batch_size is not equal to ...`). ACCELERATE_USE_CPU instead silently drops DeepSpeed for DDP.
    Call on TrainingArguments before its own __post_init__. Gate: no CUDA device."""
    import torch

    if not torch.cuda.is_available():
        args.use_cpu = True


# --- transformers: --ddp_timeout dropped on CPU ----------------------------------------------------------------------
def init_cpu_process_group(args) -> None:
    """transformers (5.x) passes `ddp_timeout` to the process group on GPU only: with use_cpu, `_setup_devices` hands
    accelerate no timeout and gloo's group gets torch's 30 minutes, so a lost peer hangs its survivors that long.
    Joining the group here first, with the timeout, is what accelerate would do (env://, the launcher's RANK and
    WORLD_SIZE); it then finds the group up and keeps it. Call before TrainingArguments.__post_init__. Gate: use_cpu
    in a launched rank whose group is not up yet."""
    import os
    from datetime import timedelta

    import torch.distributed as dist

    launched = all(name in os.environ for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))
    if not (args.use_cpu and launched and int(os.environ["WORLD_SIZE"]) > 1) or dist.is_initialized():
        return
    dist.init_process_group(
        backend=args.ddp_backend or "gloo",
        timeout=timedelta(seconds=args.ddp_timeout),
        rank=int(os.environ["RANK"]),
        world_size=int(os.environ["WORLD_SIZE"]),
    )


# --- deepspeed: deepspeed.comm unset on CPU before the engine exists -------------------------------------------------
def init_deepspeed_comm(args, at_buffers: Callable[[], None] | None = None) -> None:
    """ZeRO-3 builds the model inside deepspeed.zero.Init, which reads the world size from deepspeed.comm. With
    use_cpu, accelerate (1.x) sets up torch.distributed but not deepspeed.comm, which DeepSpeed itself sets up only
    when the engine starts, after the model is built: zero.Init would partition for a world of 1. Call before
    building the model. Up here, DeepSpeed's shm buffers exist and are unlinked at once (below), on one rank too: a
    launched one-rank run creates its buffer at engine start all the same, and nothing would unlink it later.
    Gate: a DeepSpeed run of several ranks, or of one launched rank (the launcher's rendezvous variables set: without
    them DeepSpeed would look for MPI, and no launcher means no buffer); where deepspeed.comm is up already
    (accelerate does it on GPU), init_distributed does nothing. `at_buffers`: called while the buffers are still
    named (start-up's fault point, where a stop must remove them: `remove_deepspeed_shm_buffers`)."""
    import os

    launched = all(name in os.environ for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))
    if args.deepspeed or args.deepspeed_plugin is not None:
        deepspeed_current_collectives()  # before DeepSpeed's backend exists, here or at the engine's start
    if (args.deepspeed or args.deepspeed_plugin is not None) and (args.world_size > 1 or launched):
        import deepspeed

        deepspeed.init_distributed(timeout=args.ddp_timeout_delta)  # its default is DeepSpeed's own 10 minutes
        if at_buffers is not None:
            at_buffers()
        unlink_deepspeed_shm_buffer()


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


# --- deepspeed: the CPU comm op's shared-memory buffers are never unlinked ------------------------------------------
# On its CPU accelerator DeepSpeed's TorchBackend starts the shm comm op (`ShareMemCommBuilder`) whenever all ranks
# are on one machine (LOCAL_SIZE == world size; the deepspeed launcher sets LOCAL_SIZE): each rank creates
# /dev/shm/deepspeed_allreduce_buffer_UID_ADDR_PORT_RANK (66 MiB) and maps every rank's buffer (shm.cpp
# `shm_initialize`); nothing ever unlinks them (its `shared_close` is never called), so every run, finished or not,
# leaves them behind. They serve `inference_all_reduce` only. Once every rank has mapped every buffer the names can
# go: the mappings stay valid, and the kernel frees the memory when the last rank exits, however it exits.
# Gate: the releases pyproject admits (all < 0.20 create them so); the runtime condition is that the buffers exist.
SHM_BUFFERS_LEFT_DEEPSPEED = _version("deepspeed") is not None and Version(_version("deepspeed")) < Version("0.20")
SHM_BUFFER_PREFIX = "deepspeed_allreduce_buffer"


def deepspeed_shm_buffer(rank: int | None = None):
    """The /dev/shm path of `rank`'s (default: this rank's) DeepSpeed CPU comm buffer, by shm.cpp's naming."""
    import os
    from pathlib import Path

    rank = int(os.environ.get("RANK", "0")) if rank is None else rank
    return Path("/dev/shm") / f"{_run_shm_prefix()}_{rank}"


def _run_shm_prefix() -> str:
    """What the names of this run's buffers begin with: DeepSpeed's prefix, the user, the launcher's address, port."""
    import os

    addr, port = os.environ.get("MASTER_ADDR", ""), os.environ.get("MASTER_PORT", "")
    return f"{SHM_BUFFER_PREFIX}_{os.getuid()}_{addr}_{port}"


def unlink_deepspeed_shm_buffer() -> None:
    """Under the gate, once deepspeed.comm is up on every rank: wait until every rank has mapped every buffer (a
    barrier: `shm_initialize` returns only then), then unlink this rank's. Call on every rank."""
    import torch.distributed as dist

    if not SHM_BUFFERS_LEFT_DEEPSPEED or not (dist.is_available() and dist.is_initialized()):
        return
    dist.barrier()
    deepspeed_shm_buffer(dist.get_rank()).unlink(missing_ok=True)


def remove_deepspeed_shm_buffers() -> None:
    """Under the gate, unlink every rank's buffer of this run on this machine (its names carry the launcher's
    MASTER_ADDR and MASTER_PORT, so another run's are never touched): for a rank that ends before
    `unlink_deepspeed_shm_buffer` could run (a stop signal during start-up), and for its peers, which the launcher
    then ends as well. Waits for no one: a peer still mapping them is ended with the run."""
    import glob
    import os
    from pathlib import Path

    if not SHM_BUFFERS_LEFT_DEEPSPEED or not os.environ.get("MASTER_PORT"):
        return  # no launcher, no buffer
    for buffer in Path("/dev/shm").glob(glob.escape(_run_shm_prefix()) + "_*"):  # PREFIX_RANK
        buffer.unlink(missing_ok=True)


# --- accelerate: the FSDP config ignored on CPU ---------------------------------------------------------------------
# accelerate's AcceleratorState (1.x, 1.16 included) turns ACCELERATE_USE_FSDP (what `accelerate launch` sets from an
# FSDP config, and the Accelerator from the Trainer's --fsdp) into DistributedType.FSDP only for the GPU-like
# distributed types (MULTI_GPU, MULTI_XPU, ...): on CPU ranks it silently stays MULTI_CPU, the Trainer sees no
# fsdp_plugin, and an FSDP recipe trains plain DDP. torch's FSDP2 (`fully_shard`) itself runs on CPU over gloo, so
# the state is completed here as accelerate completes it for a GPU.
# Gate: a state that came up MULTI_CPU under ACCELERATE_USE_FSDP (tests/unit/test_compat.py checks that the installed
# release still leaves it so; a release that honours FSDP on CPU makes this a no-op).
def fsdp_on_cpu(state, plugin_args: dict | None = None) -> bool:
    """Under FSDP on CPU ranks, make a just-built AcceleratorState FSDP's, as accelerate's own GPU branch does
    (nothing in the Accelerator's setup after that branch differs on CPU), with the plugin the Trainer built from
    `plugin_args` (TrainingArguments.fsdp_plugin_args) or else the one `accelerate launch`'s environment describes.
    True when it did."""
    import os

    from accelerate.state import PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    if (
        os.environ.get("ACCELERATE_USE_FSDP", "").lower() != "true"
        or state.distributed_type != DistributedType.MULTI_CPU
    ):
        return False
    plugin = FullyShardedDataParallelPlugin(**(plugin_args or {}))
    if state.mixed_precision != "no":
        plugin.set_mixed_precision(state.mixed_precision)
    state.distributed_type = PartialState._shared_state["distributed_type"] = DistributedType.FSDP
    state.fsdp_plugin = plugin
    return True


# --- transformers: a SigLIP config's every save and repr warns about the class's own default token ids ------------
# transformers 5 validates each config it constructs (validate_token_ids) and warns, once per process, when a
# special-token id lies outside the vocabulary. SiglipTextConfig's own defaults do (vocab_size 32000, bos_token_id
# 49406, eos_token_id 49407), and `to_diff_dict` (config.json on every save, the config's repr that from_pretrained
# logs) builds each sub-config's bare default to diff against (`recursive_diff_dict`: `config_obj.__class__()`). So a
# SigLIP run warned "bos_token_id must be None or an integer within the vocabulary ... got 49406" at its start, its
# eval and its export, about ids no config of ours has. Gate: a shipped config class whose defaults are outside its
# vocabulary; the workaround quiets that logger while the defaults are built for the diff, and only then (a config
# the user gives is validated, and warned about, when it is loaded).
def _default_ids_outside_vocab(config_class) -> bool:
    vocab = getattr(config_class, "vocab_size", None)
    ids = [getattr(config_class, name, None) for name in ("bos_token_id", "eos_token_id", "pad_token_id")]
    return isinstance(vocab, int) and any(isinstance(i, int) and not 0 <= i < vocab for i in ids)


def quiet_default_config_warnings() -> None:
    """Install, once per process, the quiet diff against the default configs (see above) where it is needed."""
    import logging

    from transformers import configuration_utils
    from transformers.models.siglip.configuration_siglip import SiglipTextConfig

    original = configuration_utils.recursive_diff_dict
    if getattr(original, "quiet_defaults", False) or not _default_ids_outside_vocab(SiglipTextConfig):
        return

    @functools.wraps(original)
    def recursive_diff_dict(dict_a, dict_b, config_obj=None):
        logger = configuration_utils.logger
        level = logger.level
        logger.setLevel(logging.ERROR)
        try:
            return original(dict_a, dict_b, config_obj=config_obj)
        finally:
            logger.setLevel(level)

    recursive_diff_dict.quiet_defaults = True
    configuration_utils.recursive_diff_dict = recursive_diff_dict


# transformers 5 without torchvision: `<Name>ImageProcessor` warns once per class and process (the PIL ones are tested)
def image_processor_class(name: str):
    """transformers' image processor class NAME ("CLIPImageProcessor"): the PIL one without torchvision, unwarned."""
    import transformers
    from transformers.utils import is_torchvision_available

    return getattr(transformers, name if is_torchvision_available() else f"{name}Pil")
