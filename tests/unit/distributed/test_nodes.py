"""distributed/nodes.py: launches that cannot work across nodes are refused before any work (torchrun restarts through
the shared rendezvous store, --save_on_each_node). What differs between nodes is named in test_node_facts.py; the
launched refusals are in tests/launched/test_multinode.py."""

from pathlib import Path

import pytest

from disco_clip_ds.distributed import nodes
from disco_clip_ds.errors import UsageError
from disco_clip_ds.testing.launch import (
    REPO,
)
from disco_clip_ds.train.node_facts import node_facts


@pytest.mark.parametrize(
    "env, refused",
    [
        ({"TORCHELASTIC_MAX_RESTARTS": "1", "GROUP_WORLD_SIZE": "2", "TORCHELASTIC_USE_AGENT_STORE": "True"}, True),
        ({"TORCHELASTIC_MAX_RESTARTS": "1", "GROUP_WORLD_SIZE": "2", "TORCHELASTIC_USE_AGENT_STORE": "False"}, False),
        ({"TORCHELASTIC_MAX_RESTARTS": "0", "GROUP_WORLD_SIZE": "2", "TORCHELASTIC_USE_AGENT_STORE": "True"}, False),
        ({"TORCHELASTIC_MAX_RESTARTS": "3", "GROUP_WORLD_SIZE": "1", "TORCHELASTIC_USE_AGENT_STORE": "True"}, False),
    ],
)
def test_restarts_across_nodes_through_the_shared_rendezvous_store_are_refused(env, refused):
    """torchrun's environment, as its workers see it: restarts across nodes need TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
    (which makes TORCHELASTIC_USE_AGENT_STORE False); the elastic run below hangs without it."""
    if refused:
        with pytest.raises(UsageError, match="TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in its environment"):
            nodes.check_elastic(env)
    else:
        nodes.check_elastic(env)


def _parsed(tmp_path: Path, *extra: str):
    from disco_clip_ds.train.args import parse_args

    return parse_args(
        [
            "--output_dir", str(tmp_path / "run"), "--model_config", str(tmp_path / "model.json"), "--tokenizer_name",
            str(REPO / "recipes/tokenizer"), "--train_shards", str(tmp_path / "shards"), "--report_to", "none",
            *extra,
        ]
    )  # fmt: skip


def test_save_on_each_node_is_refused_before_any_work(tmp_path):
    with pytest.raises(UsageError, match="--save_on_each_node: checkpoints are written once, into one --output_dir"):
        model_args, data_args, args = _parsed(tmp_path, "--save_on_each_node")
        nodes.check_nodes(args, lambda: node_facts(model_args, data_args, args))
    assert not (tmp_path / "run").exists()
