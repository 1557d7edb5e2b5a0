"""train/node_facts.py with distributed/nodes.py's launch_problem: what two nodes' ranks would gather is compared, and
what differs (arguments, ranks per node, the model config, the model's weights, the shard list) is named in one
line."""

import json
from pathlib import Path

from disco_clip_ds.distributed import nodes
from disco_clip_ds.testing.launch import (
    REPO,
    TINY_CONFIG,
)
from disco_clip_ds.train.node_facts import node_facts


def _parsed(tmp_path: Path, *extra: str):
    from disco_clip_ds.train.args import parse_args

    return parse_args(
        [
            "--output_dir", str(tmp_path / "run"), "--model_config", str(tmp_path / "model.json"), "--tokenizer_name",
            str(REPO / "recipes/tokenizer"), "--train_shards", str(tmp_path / "shards"), "--report_to", "none",
            *extra,
        ]
    )  # fmt: skip


def test_what_differs_between_two_nodes_is_named(tmp_path, monkeypatch):
    """The facts two nodes' ranks would gather: node 1 runs 2 ranks where node 0 runs 1 (torchrun's
    --nproc_per_node), has another learning rate, and sees another model config and a third shard at the same
    paths."""
    config = json.loads(TINY_CONFIG.read_text())
    (tmp_path / "model.json").write_text(json.dumps(config))
    (tmp_path / "shards").mkdir()
    for name in ("00000.tar", "00001.tar"):
        (tmp_path / "shards" / name).write_bytes(b"")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    node0 = node_facts(*_parsed(tmp_path))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    layers = config["text_config"]["num_hidden_layers"]
    config["text_config"]["num_hidden_layers"] += 1
    (tmp_path / "model.json").write_text(json.dumps(config))
    (tmp_path / "shards" / "00002.tar").write_bytes(b"")
    node1 = node_facts(*_parsed(tmp_path, "--learning_rate", "0.1"))
    ranks = [{"rank": 0, "node": 0, "host": "a", "facts": node0}, {"rank": 1, "node": 1, "host": "b", "facts": node1}]
    problem = nodes.launch_problem(ranks)
    assert problem.startswith(
        "the nodes were not started alike: rank 1 (node 1 on b) differs from rank 0 (node 0 on a)"
    )
    assert "--learning_rate 5e-05 -> 0.1" in problem and "ranks per node 1 -> 2" in problem
    assert f"the model (text_config.num_hidden_layers {layers} -> {layers + 1})" in problem
    assert "the training shards (count 2 -> 3, sha256 " in problem
    assert problem.endswith("start every node with the same arguments, files and software")
    assert len(problem.splitlines()) == 1
    assert nodes.launch_problem([ranks[0], {**ranks[0], "rank": 1}]) is None
    three = [*ranks, {**ranks[1], "rank": 2}]
    assert "(ranks 2 differ too): start every node" in nodes.launch_problem(three)


def test_other_weights_under_the_same_config_are_named(tmp_path):
    """A pretrained model folder at the same path with the same config.json but other weights: another run."""
    from disco_clip_ds.train.args import parse_args

    init = tmp_path / "init"
    init.mkdir()
    (init / "config.json").write_text(TINY_CONFIG.read_text())
    argv = [
        "--output_dir", str(tmp_path / "run"), "--model_name_or_path", str(init), "--tokenizer_name",
        str(REPO / "recipes/tokenizer"), "--train_shards", str(tmp_path / "x.tar"), "--report_to", "none",
    ]  # fmt: skip
    facts = []
    for weights in (b"\0" * 64, b"\1" * 64):
        (init / "model.safetensors").write_bytes(weights)
        facts.append(node_facts(*parse_args(argv)))
    problem = nodes.launch_problem([{"rank": r, "node": r, "host": "h", "facts": f} for r, f in enumerate(facts)])
    assert " in the model files (model.safetensors " in problem and "config.json" not in problem


def test_other_weights_of_a_teacher_are_named(tmp_path):
    """--teacher A B: every node loads each teacher; the second teacher's weights differ on node 1."""
    from disco_clip_ds.train.args import parse_args

    teachers = [tmp_path / "a", tmp_path / "b"]
    for folder in teachers:
        folder.mkdir()
        (folder / "config.json").write_text(TINY_CONFIG.read_text())
        (folder / "model.safetensors").write_bytes(b"\0" * 64)
    argv = [
        "--output_dir", str(tmp_path / "run"), "--model_config", str(TINY_CONFIG), "--tokenizer_name",
        str(REPO / "recipes/tokenizer"), "--train_shards", str(tmp_path / "x.tar"), "--report_to", "none",
        "--teacher", *map(str, teachers),
    ]  # fmt: skip
    facts = [node_facts(*parse_args(argv))]
    (teachers[1] / "model.safetensors").write_bytes(b"\1" * 64)
    facts.append(node_facts(*parse_args(argv)))
    problem = nodes.launch_problem([{"rank": r, "node": r, "host": "h", "facts": f} for r, f in enumerate(facts)])
    assert f" in the --teacher {teachers[1]} files (model.safetensors " in problem
    assert f"{teachers[0]} files" not in problem


def test_a_stored_run_reads_no_teacher_weights_for_its_node_facts(tmp_path):
    """From stored embeddings without --live_teacher no node loads the teacher: its weights are not sampled (the
    sidecars carry its fingerprint); with --live_teacher every node loads it, so its files are compared."""
    from disco_clip_ds.testing.file_opens import recorded_opens
    from disco_clip_ds.train.args import parse_args

    teacher = tmp_path / "teacher"
    teacher.mkdir()
    (teacher / "config.json").write_text(TINY_CONFIG.read_text())
    (teacher / "model.safetensors").write_bytes(b"\0" * 64)
    argv = [
        "--output_dir", str(tmp_path / "run"), "--model_config", str(TINY_CONFIG), "--tokenizer_name",
        str(REPO / "recipes/tokenizer"), "--train_shards", str(tmp_path / "x.tar"), "--report_to", "none",
        "--teacher", str(teacher), "--teacher_embeddings", str(tmp_path / "stored"),
    ]  # fmt: skip
    parsed = parse_args(argv)
    with recorded_opens() as opened:
        facts = node_facts(*parsed)
    assert not any(name.startswith("the --teacher") for name in facts)
    assert str(teacher / "model.safetensors") not in map(str, opened)
    live = node_facts(*parse_args([*argv, "--live_teacher", "true"]))
    assert f"the --teacher {teacher} files" in live
