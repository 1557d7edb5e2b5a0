"""compat.py: each workaround is still needed on the installed release (each test reproduces the upstream behaviour
it works around, and fails once that is gone), each gate matches the installed release's behaviour, and the branch
for releases without the deepspeed bug (CLIP's own 0-dim logit_scale) runs here too, with the gate forced off."""

from __future__ import annotations

import importlib
import inspect
import os
import re
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset
from transformers import CLIPConfig, CLIPModel

from disco_clip_ds import compat
from disco_clip_ds.models.build import build_model
from disco_clip_ds.models.clip import DiscoCLIPModel
from disco_clip_ds.testing.launch import REPO, TINY_CONFIG
from disco_clip_ds.testing.ranks import run_ranks

TINY = TINY_CONFIG
PYPROJECT = REPO / "pyproject.toml"


# --- torch: the single-tensor collectives renamed ---


def test_both_names_of_the_single_tensor_collectives_are_still_needed():
    """pyproject admits a torch older than 2.13, which has only the old names; a torch with the new names warns at
    every call of the old ones. compat's choice calls without a warning."""
    import torch.distributed as dist

    floor = re.search(r'"torch>=([0-9.]+)', PYPROJECT.read_text()).group(1)
    assert tuple(int(part) for part in floor.split(".")[:2]) < (2, 13), "drop the old names from compat.py"
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            compat.all_gather_single(torch.empty(2), torch.ones(2))
            compat.reduce_scatter_single(torch.empty(2), torch.ones(2), op=dist.ReduceOp.SUM)
            ours = len(caught)
            dist.all_gather_into_tensor(torch.empty(2), torch.ones(2))
            dist.reduce_scatter_tensor(torch.empty(2), torch.ones(2), op=dist.ReduceOp.SUM)
    finally:
        dist.destroy_process_group()
    assert ours == 0, [str(w.message) for w in caught]
    if hasattr(dist, "all_gather_single"):
        old = [str(w.message) for w in caught[ours:]]
        assert len(old) == 2 and all("deprecated" in message for message in old), old


# --- deepspeed: 0-dim parameters ---


def _deepspeed_init_with_a_0dim_parameter(rank, world_size):
    os.environ.update(DS_ACCELERATOR="cpu", LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size))
    import deepspeed

    class Scaled(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.scale, self.weight = torch.nn.Parameter(torch.tensor(1.0)), torch.nn.Parameter(torch.ones(3))

    config = {
        "train_micro_batch_size_per_gpu": 1,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "zero_optimization": {"stage": 2},
    }
    try:
        deepspeed.initialize(model=Scaled(), config=config)
    except RuntimeError as error:
        return str(error)
    return None


@pytest.mark.slow
@pytest.mark.timeout(600)  # one deepspeed import and engine start: minutes on a busy 2-core machine
def test_the_logit_scale_gate_matches_the_installed_deepspeed():
    """The gate is on exactly when the installed deepspeed fails to start an engine on a 0-dim parameter."""
    (error,) = run_ranks(_deepspeed_init_with_a_0dim_parameter, 1, timeout=500)
    assert (error is not None) == compat.LOGIT_SCALE_AS_VECTOR, error
    if error is not None:
        assert "dim" in error  # the uint8 view of a 0-dim tensor, not some other failure


def _batch(n=4):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(2, 539, (n, 8), generator=g)
    ids[:, 0], ids[:, -1] = 0, 1  # bos, eos as in recipes/tokenizer
    return {"input_ids": ids, "pixel_values": torch.randn(n, 3, 64, 64, generator=g)}


@pytest.mark.slow  # beyond the fast tier's time budget
def test_the_model_without_the_workaround_is_clip_itself(monkeypatch, tmp_path):
    """Gate off (a deepspeed without the bug): CLIP's 0-dim parameter, CLIP's loss, and a save/load round trip."""
    monkeypatch.setattr(compat, "LOGIT_SCALE_AS_VECTOR", False)
    torch.manual_seed(0)
    model = build_model(model_config=str(TINY), loss_impl="local").eval()
    assert model.logit_scale.dim() == 0
    stock = CLIPModel(CLIPConfig.from_json_file(str(TINY))).eval()
    stock.load_state_dict(model.state_dict(), strict=True)
    inputs = _batch()
    with torch.no_grad():
        expected = stock(**inputs, return_loss=True).loss
        assert model(**inputs, return_loss=True).loss.item() == pytest.approx(expected.item(), rel=1e-6)
        model.config.loss_impl = "tiled"  # one process: the global batch is this batch
        assert model(**inputs, return_loss=True).loss.item() == pytest.approx(expected.item(), rel=1e-5)
        model.logit_scale.fill_(2.5)
    model.save_pretrained(tmp_path / "m")
    again = DiscoCLIPModel.from_pretrained(tmp_path / "m")
    assert again.logit_scale.dim() == 0 and again.logit_scale.item() == pytest.approx(2.5)
    assert again._weight_conversions == []


# --- transformers 5 ---


def test_transformers_skips_the_init_of_custom_code_modules_without_parameters_of_their_own():
    """A class defined outside transformers is custom code, and its modules without parameters of their own (CLIP's
    attention and MLP blocks) are marked initialised without `_init_weights`: DiscoCLIPModel runs as library code."""
    assert DiscoCLIPModel.is_custom_code() and not CLIPModel.is_custom_code()
    model = CLIPModel(CLIPConfig.from_json_file(str(TINY)))
    attention = model.text_model.encoder.layers[0].self_attn
    assert not list(attention.parameters(recurse=False))
    seen = []
    model._init_weights = seen.append
    for initialize in (model._initialize_weights, compat.init_as_library_code(model._initialize_weights)):
        attention.__dict__.pop("_is_hf_initialized", None)
        initialize(attention, is_custom_code=True)
    assert seen == [attention]  # the stock call skipped it; the library-code one ran the init


def test_transformers_zero3_loader_keeps_key_conversions_that_re_prefix_the_saved_keys():
    """transformers' ZeRO-3 loader keeps every registered key conversion on the model, used or not, and saving
    reverses them into "vision_model.vision_model.*" keys; `clear_weight_conversions` keeps CLIP's keys."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import revert_weight_conversion
    from transformers.integrations.deepspeed import _load_state_dict_into_zero3_model

    model = CLIPModel(CLIPConfig.from_json_file(str(TINY)))
    weights = dict(model.state_dict())
    _load_state_dict_into_zero3_model(
        model, weights, SimpleNamespace(weight_mapping=get_model_conversion_mapping(model))
    )
    assert any(key.startswith("vision_model.vision_model.") for key in revert_weight_conversion(model, weights))
    compat.clear_weight_conversions(model)
    assert set(revert_weight_conversion(model, weights)) == set(weights)


# --- accelerate: re-sharding an iterable dataset that is already per-rank ---


class _Stream(IterableDataset):
    def __iter__(self):
        return iter(range(8))


def test_accelerate_keeps_one_nth_of_a_ranks_own_stream():
    """Without dispatch_batches accelerate shards an IterableDataset over the processes: rank 0 of 2 keeps every
    other batch of a stream that is already its own."""
    from accelerate.data_loader import prepare_data_loader

    loader = DataLoader(_Stream(), batch_size=2)
    loader = prepare_data_loader(loader, num_processes=2, process_index=0, dispatch_batches=False, put_on_device=False)
    assert [batch.tolist() for batch in loader] == [[0, 1], [4, 5]]
    compat.unshard_iterable_dataset(loader)
    assert [batch.tolist() for batch in loader] == [[0, 1], [2, 3], [4, 5], [6, 7]]


# --- accelerate: the FSDP config ignored on CPU ---


def _fsdp_launch_env(*launcher_args: str) -> dict[str, str]:
    """The environment `accelerate launch --config_file recipes/accelerate/fsdp.yaml LAUNCHER_ARGS` gives its ranks,
    derived by accelerate's own launcher code."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_multi_gpu_env

    args = launch_command_parser().parse_args(
        ["--config_file", str(REPO / "recipes/accelerate/fsdp.yaml"), *launcher_args, "x.py"]
    )
    args, _, _ = _validate_launch_command(args)
    return {k: v for k, v in prepare_multi_gpu_env(args).items() if k.startswith(("ACCELERATE_", "FSDP_"))}


@pytest.mark.parametrize(
    "config, launcher_args",
    [
        ("tiny.json", []),
        ("siglip_tiny.json", ["--fsdp_transformer_layer_cls_to_wrap", "SiglipEncoderLayer"]),
        ("siglip2_tiny.json", ["--fsdp_transformer_layer_cls_to_wrap", "Siglip2EncoderLayer"]),
    ],
    ids=["clip", "siglip", "siglip2"],
)
@pytest.mark.slow  # beyond the fast tier's time budget
def test_accelerate_trains_an_fsdp_launch_on_cpu_as_ddp_unless_the_state_is_completed(
    monkeypatch, config, launcher_args
):
    """A launched CPU rank (one here) under the FSDP recipe's environment: accelerate's state stays MULTI_CPU with
    no FSDP plugin (so the Trainer would wrap the model in DDP); completed by compat, it is FSDP with the recipe's
    plugin (FSDP2) and `prepare` shards the model (CLIP's, SigLIP's and SigLIP 2's encoder layers as units) with torch's
    fully_shard; the full state dict the Trainer saves has the plain model's keys."""
    import torch.distributed as dist
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState
    from accelerate.utils import DistributedType
    from torch.distributed.fsdp import FSDPModule

    env = _fsdp_launch_env(*launcher_args)
    assert env["ACCELERATE_USE_FSDP"] == "true" and env["FSDP_VERSION"] == "2", env
    threads = str(torch.get_num_threads())  # accelerate sets torch's thread count when OMP_NUM_THREADS is unset
    for name, value in {**env, "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "OMP_NUM_THREADS": threads}.items():
        monkeypatch.setenv(name, value)
    AcceleratorState._reset_state(reset_partial_state=True)  # one an earlier test left (accelerate keeps one)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        accelerator = Accelerator(cpu=True)
        assert accelerator.distributed_type == DistributedType.MULTI_CPU, "accelerate honours FSDP on CPU: drop it"
        assert getattr(accelerator.state, "fsdp_plugin", None) is None
        assert compat.fsdp_on_cpu(accelerator.state)
        assert accelerator.distributed_type == DistributedType.FSDP and accelerator.is_fsdp2
        model = build_model(model_config=str(REPO / "recipes/models" / config))
        model, _ = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
        layers = list(model.text_model.encoder.layers) + list(model.vision_model.encoder.layers)
        assert isinstance(model, FSDPModule) and all(isinstance(layer, FSDPModule) for layer in layers)
        assert not compat.fsdp_on_cpu(accelerator.state)  # done once; nothing else is touched
        full = accelerator.get_state_dict(model)  # what the Trainer saves; the logit_scale hook meets a DTensor
        assert full.keys() == model.PLAIN(model.config).state_dict().keys()
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
        dist.destroy_process_group()


# --- img2dataset: no hook for the fetch function ---


@pytest.mark.slow  # beyond the fast tier's time budget
def test_img2dataset_takes_no_fetch_function_and_the_wrapped_downloader_is_there():
    import img2dataset

    assert not any(
        "fetch" in name or "download_image" in name for name in inspect.signature(img2dataset.download).parameters
    )
    i2d_main = importlib.import_module("img2dataset.main")
    original = i2d_main.Downloader
    with compat.img2dataset_fetch(lambda *args, **kwargs: None):
        assert i2d_main.Downloader is not original
    assert i2d_main.Downloader is original


# --- training on CPU under a launcher: use_cpu, deepspeed.comm, the process group ------------------------------------

_LAUNCHED_RANK = r"""
import json, sys
import torch
import torch.distributed as dist
from transformers import Trainer, TrainingArguments
from disco_clip_ds import compat

class Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Linear(2, 1)

    def forward(self, x):
        return {"loss": self.w(x).pow(2).mean()}

workaround = sys.argv[3] == "on"
args = TrainingArguments(output_dir=sys.argv[1], deepspeed=sys.argv[2], report_to="none", max_steps=1,
                         per_device_train_batch_size=2, save_strategy="no", disable_tqdm=True, use_cpu=workaround)
seen = {"world": args.world_size}
if workaround:
    import deepspeed.comm
    seen["ds_comm_before_the_engine"] = deepspeed.comm.is_initialized()
    compat.init_deepspeed_comm(args)
    seen["ds_comm_world"] = deepspeed.comm.get_world_size()
    Trainer(model=Tiny(), args=args, train_dataset=[{"x": torch.ones(2)}] * 8).train()
    seen["group_after_train"] = dist.is_initialized()
    compat.destroy_process_group()
    seen["group_after_destroy"] = dist.is_initialized()
print("RESULT " + json.dumps(seen), flush=True)
"""


def _launch_two_cpu_ranks(tmp_path, workaround: str) -> list[dict]:
    """Two fresh interpreters with the environment torchrun or deepspeed gives its ranks (no process group yet), each
    building TrainingArguments with a DeepSpeed ZeRO-2 config; what each saw."""
    import json
    import subprocess
    import sys

    from disco_clip_ds.testing.launch import REPO
    from disco_clip_ds.testing.ranks import free_port

    port, procs = free_port(), []
    for rank in range(2):
        env = {
            **os.environ,
            "DS_ACCELERATOR": "cpu",
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": "2",
            "LOCAL_WORLD_SIZE": "2",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
        }
        command = [sys.executable, "-c", _LAUNCHED_RANK, str(tmp_path / workaround), "ds_configs/cpu_zero2.json"]
        procs.append(subprocess.Popen([*command, workaround], env=env, cwd=REPO, stdout=subprocess.PIPE, text=True))
    outputs = [proc.communicate(timeout=400)[0] for proc in procs]
    seen = [
        json.loads(line[len("RESULT ") :]) for out in outputs for line in out.splitlines() if line.startswith("RESULT ")
    ]
    assert len(seen) == 2, outputs
    return seen


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.skipif(torch.cuda.is_available(), reason="the workarounds concern training on CPU")
def test_a_launched_cpu_run_needs_use_cpu_deepspeed_comm_and_the_group_teardown(tmp_path):
    # without use_cpu, accelerate counts one process where the launcher started two
    assert [rank["world"] for rank in _launch_two_cpu_ranks(tmp_path, "off")] == [1, 1]
    for rank in _launch_two_cpu_ranks(tmp_path, "on"):
        assert rank["world"] == 2
        # nothing has set up deepspeed.comm before the engine exists (zero.Init would see a world of 1) ...
        assert rank["ds_comm_before_the_engine"] is False and rank["ds_comm_world"] == 2
        # ... and the group the Trainer had accelerate create outlives training unless it is destroyed
        assert rank["group_after_train"] is True and rank["group_after_destroy"] is False


# --- deepspeed: the CPU comm op's /dev/shm buffers ---


def _deepspeed_comm_buffers(rank, world, unlink):
    """Start deepspeed.comm on a rank whose launcher said all ranks are local, as the deepspeed launcher does:
    (whether this rank's buffer exists once every rank started, whether it does after the workaround)."""
    import deepspeed
    import torch.distributed as dist

    deepspeed.init_distributed()
    dist.barrier()  # every rank has created its buffer and mapped the others'
    created = compat.deepspeed_shm_buffer(rank).exists()
    if unlink:
        compat.unlink_deepspeed_shm_buffer()
    dist.barrier()
    return created, compat.deepspeed_shm_buffer(rank).exists(), str(compat.deepspeed_shm_buffer(rank))


@pytest.mark.slow
@pytest.mark.timeout(600)  # deepspeed imports in two spawned ranks
# one rank with the workaround: tests/launched/test_initial_weights.py's one-rank run leaves nothing in /dev/shm
@pytest.mark.parametrize(
    "world, unlink", [(2, False), (2, True), (1, False)], ids=["2-deepspeed_alone", "2-workaround", "1-deepspeed_alone"]
)
def test_deepspeed_leaves_its_cpu_comm_buffers_unless_they_are_unlinked(world, unlink):
    """The gate is on exactly when the installed deepspeed creates the buffers, on one rank as on several; without
    the workaround they outlive the ranks, with it they are gone while the ranks still run."""
    env = {"LOCAL_SIZE": str(world), "DS_ACCELERATOR": "cpu"}
    results = run_ranks(_deepspeed_comm_buffers, world, unlink, timeout=500, env=env)
    paths = [Path(path) for _, _, path in results]
    try:
        assert all(created for created, _, _ in results) == compat.SHM_BUFFERS_LEFT_DEEPSPEED, results
        assert all(exists != unlink for _, exists, _ in results), results
        assert all(path.exists() != unlink for path in paths)  # after the ranks ended
    finally:
        for path in paths:
            path.unlink(missing_ok=True)


def test_siglips_default_text_config_has_token_ids_outside_its_vocab_and_every_save_warned_of_them(monkeypatch):
    """Still needed: SiglipTextConfig's defaults (bos 49406, eos 49407) lie outside its vocab_size (32000), and
    transformers builds those defaults to diff a SigLIP config against on every save and repr, warning of them.
    With the workaround a save of the recipe's config warns of nothing; a config the user gives with an id outside
    its vocabulary is still warned of, when it is built."""
    import logging

    from transformers import SiglipConfig, SiglipTextConfig
    from transformers import configuration_utils as cu
    from transformers.utils import logging as hf_logging

    from disco_clip_ds import compat
    from disco_clip_ds.testing.launch import REPO

    assert compat._default_ids_outside_vocab(SiglipTextConfig)

    def warned(call) -> list[str]:
        seen, handler = [], logging.Handler()
        handler.emit = lambda record: seen.append(record.getMessage())
        hf_logging.warning_once.cache_clear()  # warned once per process: forget what was
        hf_logging.get_logger().addHandler(handler)
        try:
            call()
        finally:
            hf_logging.get_logger().removeHandler(handler)
        return [m for m in seen if "must be `None` or an integer within the vocabulary" in m]

    config = SiglipConfig.from_json_file(str(REPO / "recipes/models/siglip_tiny.json"))
    monkeypatch.setattr(
        cu, "recursive_diff_dict", getattr(cu.recursive_diff_dict, "__wrapped__", cu.recursive_diff_dict)
    )
    assert any("got 49406" in m for m in warned(config.to_json_string))  # transformers alone
    saved = config.to_json_string()
    compat.quiet_default_config_warnings()
    assert warned(config.to_json_string) == [] and config.to_json_string() == saved  # the same config.json
    assert warned(lambda: SiglipTextConfig(vocab_size=10, bos_token_id=20)) != []


def test_a_stopped_runs_buffers_are_removed_and_no_other_runs(monkeypatch):
    """remove_deepspeed_shm_buffers (start-up's watch, before it ends a rank): every rank's
    buffer of this run, named as shm.cpp names them, and none of a run on another port or address."""
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "61")  # no real launcher's port: 61 and 610 are below 1024
    ours = [Path(f"/dev/shm/deepspeed_allreduce_buffer_{os.getuid()}_127.0.0.1_61_{rank}") for rank in (0, 1, 12)]
    others = [
        Path(f"/dev/shm/deepspeed_allreduce_buffer_{os.getuid()}_127.0.0.1_610_0"),
        Path(f"/dev/shm/deepspeed_allreduce_buffer_{os.getuid()}_127.0.0.2_61_0"),
    ]
    for path in ours + others:
        path.write_bytes(b"")
    try:
        assert ours[:2] == [compat.deepspeed_shm_buffer(0), compat.deepspeed_shm_buffer(1)]
        compat.remove_deepspeed_shm_buffers()
        assert [p.exists() for p in ours + others] == [not compat.SHM_BUFFERS_LEFT_DEEPSPEED] * 3 + [True, True]
    finally:
        for path in ours + others:
            path.unlink(missing_ok=True)


# --- deepspeed: its torch backend calls the renamed collectives by their old names ---


@pytest.mark.slow  # imports deepspeed
def test_deepspeeds_backend_calls_the_current_collectives_without_a_warning(monkeypatch):
    """The gate is on where the installed torch has the new names and the installed deepspeed's backend still picks
    the old ones (which warn at every call); with the workaround the backend's all-gather and reduce-scatter warn no
    more and give what the old names gave (one rank: its own tensor)."""
    import torch.distributed as dist
    from deepspeed.comm.torch import TorchBackend

    for getter in ("get_all_gather_function", "get_reduce_scatter_function"):  # restored after the test
        monkeypatch.setattr(TorchBackend, getter, TorchBackend.__dict__[getter])
    picked = TorchBackend.get_all_gather_function(), TorchBackend.get_reduce_scatter_function()
    assert compat._deepspeed_picks_old_collectives() == hasattr(dist, "all_gather_single")
    assert picked == (dist.all_gather_into_tensor, dist.reduce_scatter_tensor)  # what the gate is about
    compat.deepspeed_current_collectives()
    assert not compat._deepspeed_picks_old_collectives()  # applied once
    backend = TorchBackend.__new__(TorchBackend)  # its collectives as __init__ picks them, without a process group
    backend.all_gather_function = TorchBackend.get_all_gather_function()
    backend.reduce_scatter_function = TorchBackend.get_reduce_scatter_function()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        gathered, scattered = torch.zeros(3), torch.zeros(3)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            backend.all_gather_into_tensor(gathered, torch.arange(3.0))
            backend.reduce_scatter_tensor(scattered, torch.arange(3.0))
    finally:
        dist.destroy_process_group()
    assert [str(w.message) for w in caught] == []
    assert gathered.tolist() == scattered.tolist() == [0.0, 1.0, 2.0]


def test_a_live_zero3_config_does_not_partition_the_planners_meta_count():
    """TrainingArguments with a ZeRO-3 JSON registers it for the whole process; the trainer's FLOPs per sample
    (ModelShape on the meta device) must still build a plain model, and count what it counts without one."""
    from transformers.integrations import HfDeepSpeedConfig
    from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled

    from disco_clip_ds.models.configs import load_config
    from disco_clip_ds.plan.memory import ModelShape

    config = load_config(model_config=str(TINY_CONFIG))
    plain = ModelShape.from_config(config)
    live = HfDeepSpeedConfig({"zero_optimization": {"stage": 3}, "train_micro_batch_size_per_gpu": 1})
    assert is_deepspeed_zero3_enabled()  # the registration this works around is in force
    assert ModelShape.from_config(config) == plain
    assert is_deepspeed_zero3_enabled()  # and given back
    del live


def test_the_image_processor_class_is_the_one_transformers_falls_back_to_without_its_warning():
    """Without torchvision, transformers' CLIPImageProcessor is CLIPImageProcessorPil (reached through a fallback that
    warns once per class and process: the workaround's reason); compat names the same class directly."""
    import transformers
    from transformers.utils import is_torchvision_available

    for name in ("CLIPImageProcessor", "Siglip2ImageProcessor"):
        cls = compat.image_processor_class(name)
        assert cls.__name__ == (name if is_torchvision_available() else f"{name}Pil")
        assert cls is getattr(transformers, name)
