"""Host memory per node (plan/host.py): each term against hand-computed bytes, DeepSpeed's host estimate written out
by hand, every `disco-clip plan` flag of it, the warning, MemTotal, and the start-up check (train/host_memory.py)."""

from __future__ import annotations

import io
import json
import logging
from types import SimpleNamespace

import pytest

from disco_clip_ds.commands import plan as plan_command
from disco_clip_ds.data import embeddings
from disco_clip_ds.errors import PlanConfigError
from disco_clip_ds.plan import host as H
from disco_clip_ds.testing.launch import REPO
from disco_clip_ds.train import host_memory

MiB, GiB = 2**20, 2**30
TINY = REPO / "recipes/models/tiny.json"  # CLIP, 64 px images, 32 text tokens, projection 64
ZERO2 = REPO / "ds_configs/cpu_zero2.json"


@pytest.fixture
def fake_store(monkeypatch):
    """The store's bound and row as data/embeddings.py's contract states them, replaced by recorded stand-ins: the
    planner's arithmetic is tested here, the store's own bound where the store is."""
    calls = []

    def bound(sources, row_bytes):
        calls.append((sources, row_bytes))
        return 1000 * sources * row_bytes

    row = lambda widths, augmentations, captions, dtype: sum(widths) * (augmentations + captions) * 2
    monkeypatch.setattr(embeddings, "store_memory_bound", bound, raising=False)
    monkeypatch.setattr(embeddings, "stored_row_bytes", row, raising=False)
    return calls


def test_every_term_against_hand_computed_bytes(fake_store):
    host = H.HostSettings(
        ranks_per_node=4,
        workers=3,
        micro_batch=10,
        image_elements=3 * 64 * 64,
        text_length=32,
        prefetch_factor=2,
        shuffle_buffer=100,
        sources=2,
        sample_bytes=5000,
        stored_row_bytes=700,
        target_width=128,
    )
    plan = H.host_memory_plan(host, model_states=12345, live_teacher_params=1000, node_bytes=10 * GiB)
    batch = 10 * (12288 + 16 * 32 + 8 * 128)  # uint8 pixels, ids + mask int64, fp32 image and text targets
    assert host.batch_bytes() == batch == 138240
    assert plan.terms == {
        "processes": 4 * H.PROCESS_BASELINE,
        "model states": 12345,
        "live teachers": 4 * 4 * 1000,
        "workers": 12 * H.WORKER_BASELINE,
        "embedding stores": 12 * 1000 * 2 * 700,
        "shuffle buffers": 12 * 2 * 100 * 5000,
        "batches in flight": 12 * 2 * 262144,  # pinned: 138240 rounded up to 2^18
        "batches built": 12 * batch,
    }
    assert fake_store == [(2, 700)]
    assert plan.total == sum(plan.terms.values()) and plan.fits is True and plan.store_per_worker == 1_400_000


def test_no_workers_reads_in_the_rank_itself(fake_store):
    host = H.HostSettings(ranks_per_node=2, workers=0, micro_batch=1, image_elements=1, stored_row_bytes=10)
    plan = H.host_memory_plan(host, 0)
    assert plan.terms["workers"] == 0
    batch = 1 + 16 * 77  # no prefetch: one batch pinned per rank (1233 bytes, a 2048-byte block), one being built
    assert plan.terms["batches in flight"] == 2 * 2048 and plan.terms["batches built"] == 2 * batch
    assert plan.terms["embedding stores"] == 2 * 1000 * 10 and plan.terms["shuffle buffers"] == 2 * 1000 * 40_000


def test_without_stored_embeddings_the_store_is_not_asked(fake_store):
    plan = H.host_memory_plan(H.HostSettings(1, 2, 1, 1), 0)
    assert plan.terms["embedding stores"] == 0 and fake_store == []


@pytest.mark.parametrize(
    "stage, offload_optimizer, offload_param, expected",
    [
        (2, False, False, 1000 * 4 * 8 * 1.5),  # every rank's fp32 load
        (1, False, False, 1000 * 4 * 8 * 1.5),
        (2, True, False, 1000 * max(4 * 16, 16) * 1.5),  # 2 nodes x 8: fp32 states offloaded
        (3, False, False, 10 * 4 * 8 * 1.5),  # zero.Init: the largest layer, per rank
        (3, True, False, 1000 * 16 / 2 * 1.5),
        (3, True, True, 1000 * 18 / 2 * 1.5),
    ],
)
def test_model_states_are_deepspeeds_host_estimate(stage, offload_optimizer, offload_param, expected):
    got = H.model_state_host_bytes(1000, 10, stage, 16, 8, offload_optimizer, offload_param)
    assert got == int(expected)


def test_the_warning_names_the_largest_terms():
    terms = {"processes": 3 * GiB, "model states": 1 * GiB, "shuffle buffers": 5 * GiB}
    over = H.HostPlan(terms, 9.0 * GiB, 8.0 * GiB, 0).as_dict()
    line = H.host_warning(over)
    assert line.startswith("host memory per node 9.00 GiB passes the node's 8.00 GiB")
    assert "shuffle buffers (5.00 GiB) and processes (3.00 GiB)" in line
    assert H.host_warning(H.HostPlan(terms, 9.0 * GiB, 9.0 * GiB, 0).as_dict()) is None
    assert H.host_warning(H.HostPlan(terms, 9.0 * GiB, None, 0).as_dict()) is None


def test_memtotal_is_read_from_proc_meminfo(monkeypatch):
    monkeypatch.setattr(H, "open", lambda *a, **k: io.StringIO("MemFree: 5 kB\nMemTotal:  2048 kB\n"), raising=False)
    assert H.node_memory_bytes() == 2048 * 1024

    def unreadable(*a, **k):
        raise OSError("no /proc")

    monkeypatch.setattr(H, "open", unreadable, raising=False)
    monkeypatch.setattr(H.os, "sysconf", {"SC_PAGE_SIZE": 4096, "SC_PHYS_PAGES": 10}.get)
    assert H.node_memory_bytes() == 40960


def plan_json(tmp_path, *flags: str) -> dict:
    out = tmp_path / "plan.json"
    argv = ["--deepspeed", str(ZERO2), "--model", str(TINY), "--gpus", "16", "--per_device_batch", "8"]
    plan_command.main([*argv, "--precision", "bf16", "--loss_impl", "tiled", *flags, "--json", str(out)])
    return json.loads(out.read_text())["host"]


def test_plan_defaults(tmp_path, capsys):
    host = plan_json(tmp_path)
    s, terms = host["settings"], host["plan"]["terms"]
    assert (s["ranks_per_node"], s["workers"], s["prefetch_factor"], s["pin_memory"]) == (8, 2, 2, True)
    assert (s["shuffle_buffer"], s["sources"], s["sample_bytes"], s["stored_row_bytes"]) == (1000, 1, 40_000, 0)
    assert host["plan"]["node_bytes"] is None and host["plan"]["fits"] is None
    assert s["image_elements"] == 3 * 64 * 64 and s["text_length"] == 32 and s["micro_batch"] == 8
    assert terms["shuffle buffers"] == 8 * 2 * 1000 * 40_000
    assert "(not compared: give --node_memory_gb)" in capsys.readouterr().out


@pytest.mark.parametrize(
    "flags, field, value, term, ratio",
    [
        (["--gpus_per_node", "4"], "ranks_per_node", 4, "processes", 0.5),
        (["--dataloader_num_workers", "4"], "workers", 4, "shuffle buffers", 2.0),
        (["--dataloader_prefetch_factor", "4"], "prefetch_factor", 4, "batches in flight", 2.0),
        (["--dataloader_num_workers", "4"], "workers", 4, "batches built", 2.0),
        (["--shuffle_buffer", "500"], "shuffle_buffer", 500, "shuffle buffers", 0.5),
        (["--train_sources", "3"], "sources", 3, "shuffle buffers", 3.0),
        (["--sample_bytes", "80000"], "sample_bytes", 80_000, "shuffle buffers", 2.0),
    ],
)
def test_each_flag_moves_its_term(tmp_path, flags, field, value, term, ratio):
    base, flagged = plan_json(tmp_path), plan_json(tmp_path, *flags)
    assert flagged["settings"][field] == value
    assert flagged["plan"]["terms"][term] == pytest.approx(ratio * base["plan"]["terms"][term])


def test_no_pin_memory_holds_batches_at_their_size(tmp_path):
    pinned, plain = plan_json(tmp_path), plan_json(tmp_path, "--no_dataloader_pin_memory")
    batch = 8 * (3 * 64 * 64 + 16 * 32)  # 102400 bytes: a 131072-byte pinned block
    assert plain["settings"]["pin_memory"] is False and pinned["settings"]["pin_memory"] is True
    assert plain["plan"]["terms"]["batches in flight"] == 8 * 2 * 2 * batch
    assert pinned["plan"]["terms"]["batches in flight"] == 8 * 2 * 2 * 131072


def test_node_memory_is_compared_with_a_warning_line(tmp_path, capsys):
    assert plan_json(tmp_path, "--node_memory_gb", "1000")["plan"]["fits"] is True
    capsys.readouterr()
    host = plan_json(tmp_path, "--node_memory_gb", "1")
    out = capsys.readouterr().out
    assert host["plan"]["fits"] is False and host["plan"]["node_bytes"] == GiB
    assert "PASSES the node memory" in out and "\nwarning: host memory per node" in out


def test_stored_embeddings_flags(tmp_path, fake_store):
    flags = ["--teacher_embeddings", "--augmentations", "30", "--caption_keys", "6", "--embedding_dtype", "float16"]
    host = plan_json(tmp_path, *flags, "--teacher_widths", "768", "768", "--train_sources", "4")
    row = (768 + 768) * (30 + 6) * 2  # the stand-in's row of these settings
    assert host["settings"]["stored_row_bytes"] == row and host["settings"]["target_width"] == 1536
    assert host["plan"]["terms"]["embedding stores"] == 8 * 2 * 1000 * 4 * row
    assert fake_store == [(4, row)]


def test_stored_embeddings_replace_the_live_teacher(tmp_path, fake_store):
    live = plan_json(tmp_path, "--teacher", str(TINY))
    stored = plan_json(tmp_path, "--teacher", str(TINY), "--teacher_embeddings")
    assert live["plan"]["terms"]["live teachers"] > 0 and stored["plan"]["terms"]["live teachers"] == 0
    assert stored["settings"]["target_width"] == 64  # the teacher's projection, its stored width


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--gpus_per_node", "3"], "--gpus_per_node 3: give a divisor of --gpus 16"),
        (["--dataloader_num_workers", "-1"], "--dataloader_num_workers -1: give a whole number of at least 0"),
        (["--dataloader_prefetch_factor", "0"], "--dataloader_prefetch_factor 0: give a whole number of at least 1"),
        (["--train_sources", "0"], "--train_sources 0: give a whole number of at least 1"),
        (["--node_memory_gb", "0"], "--node_memory_gb 0: give a node's memory in GiB"),
        (["--teacher_embeddings"], "--teacher_embeddings: give --teacher"),
        (["--teacher_embeddings", "--teacher_widths", "0"], "--teacher_widths [0]: give each teacher's embedding"),
        (["--teacher_embeddings", "--teacher_widths", "8", "--embedding_dtype", "int8"], "--embedding_dtype int8"),
        (["--teacher_embeddings", "--teacher_widths", "8", "--caption_keys", "0"], "--caption_keys 0: give a whole"),
        (["--teacher_embeddings", "--teacher_widths", "8", "--augmentations", "-2"], "--augmentations -2: give a"),
        (["--shuffle_buffer", "-1"], "--shuffle_buffer -1: give a whole number of at least 0"),
        (["--sample_bytes", "0"], "--sample_bytes 0: give a whole number of at least 1"),
    ],
)
def test_bad_host_flags_are_one_line_each(tmp_path, flags, message):
    with pytest.raises(PlanConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        plan_json(tmp_path, *flags)


def test_the_real_store_bound_is_what_the_plan_counts(tmp_path):
    """Against data/embeddings.py's own `store_memory_bound` and `stored_row_bytes` (the `store` branch's)."""
    from disco_clip_ds.data.embeddings import store_memory_bound, stored_row_bytes

    row = stored_row_bytes([768, 768], 30, 6, "float16")
    assert row >= (768 + 768) * (30 + 6) * 2  # at least the embeddings themselves
    assert store_memory_bound(8, row) >= store_memory_bound(1, row) >= row
    flags = ["--teacher_embeddings", "--augmentations", "30", "--caption_keys", "6", "--embedding_dtype", "float16"]
    host = plan_json(tmp_path, *flags, "--teacher_widths", "768", "768", "--train_sources", "8")
    assert host["plan"]["terms"]["embedding stores"] == 8 * 2 * store_memory_bound(8, row)


# --- the start-up check ---


def run_facts(tmp_path, **changes):
    shards = []
    for i, size in enumerate((3000, 5000)):
        shards.append(tmp_path / f"{i:05d}.tar")
        shards[-1].write_bytes(b"x" * size)
    args = SimpleNamespace(
        dataloader_num_workers=3,
        per_device_train_batch_size=4,
        dataloader_prefetch_factor=None,
        dataloader_pin_memory=True,
        device=SimpleNamespace(type="cpu"),
        world_size=2,
        process_index=0,
    )
    checked = SimpleNamespace(
        max_length=32,
        mixture=None,
        urls=[str(s) for s in shards],
        num_samples=4,
        teacher_store=None,
        naflex=None,
        image_size=64,
        deepspeed={"zero_optimization": {"stage": 2}},
    )
    for name, value in changes.items():
        setattr(args if hasattr(args, name) else checked, name, value)
    return args, SimpleNamespace(shuffle_buffer=7), checked


def test_startup_settings_come_from_the_run(tmp_path, monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    args, data_args, checked = run_facts(tmp_path, mixture=SimpleNamespace(sources=((), (), ())))
    host = host_memory.host_settings(args, data_args, checked, on_device=False, image_elements=100)
    assert (host.ranks_per_node, host.workers, host.micro_batch, host.shuffle_buffer) == (2, 3, 4, 7)
    assert (host.prefetch_factor, host.pin_memory, host.sources, host.pixel_bytes) == (2, False, 3, 4)
    assert host.sample_bytes == (3000 + 5000) // 4 and host.stored_row_bytes == 0


def test_startup_warns_on_rank_0_only_when_it_passes(tmp_path, monkeypatch, caplog):
    import torch

    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    model = torch.nn.Linear(10, 10)
    model.config = SimpleNamespace(vision_config=SimpleNamespace(num_channels=3))
    monkeypatch.setattr(host_memory, "node_memory_bytes", lambda: 1 * MiB)
    for rank, expected in ((0, 1), (1, 0)):
        args, data_args, checked = run_facts(tmp_path, process_index=rank)
        caplog.clear()
        with caplog.at_level(logging.INFO, logger=host_memory.__name__):
            result = host_memory.log_host_memory(args, data_args, checked, model, None, on_device=True)
        warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warnings) == expected and result["plan"]["fits"] is False
        assert all(w.startswith("host memory per node") and "passes the node's 1.0 MiB" in w for w in warnings)
        # 110 parameters under ZeRO-2 on 2 ranks of one node: 110 x 4 x 2 x 1.5 bytes
        assert result["plan"]["terms"]["model states"] == 1320
    monkeypatch.setattr(host_memory, "node_memory_bytes", lambda: 1 << 50)
    args, data_args, checked = run_facts(tmp_path)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger=host_memory.__name__):
        assert host_memory.log_host_memory(args, data_args, checked, model, None, on_device=True)["plan"]["fits"]
    assert [r.levelno for r in caplog.records] == [logging.INFO] and "host memory per node" in caplog.text


def test_startup_reads_the_stored_row_from_the_sidecars(tmp_path, monkeypatch, fake_store):
    import torch
    from safetensors.torch import save_file

    args, data_args, checked = run_facts(tmp_path)
    folder = tmp_path / "sidecars"
    folder.mkdir()
    save_file({"x": torch.zeros(1)}, str(embeddings.sidecar_path(folder, checked.urls[0])), {"dtype": "bfloat16"})
    seen = []
    monkeypatch.setattr(
        embeddings, "stored_row_bytes", lambda *a: seen.append(a) or 4321, raising=False
    )  # records what the run asks for
    checked.teacher_store = SimpleNamespace(folder=folder, augmentations=30, caption_keys=["txt", "syn0.txt"])
    clip = SimpleNamespace(model_type="clip", projection_dim=768)
    siglip = SimpleNamespace(model_type="siglip", text_config=SimpleNamespace(projection_size=1152))
    checked.teacher_config = [clip, siglip]
    host = host_memory.host_settings(args, data_args, checked, on_device=True, image_elements=100)
    assert seen == [([768, 1152], 30, 2, "bfloat16")]
    assert host.stored_row_bytes == 4321 and host.target_width == 768 + 1152
