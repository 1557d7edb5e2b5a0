"""accelerate across machines: `accelerate launch --num_machines 2 --machine_rank R --main_process_ip 127.0.0.1`, one
CPU rank per machine, each machine its own accelerate process (and session) on this host, trains like one node
with two ranks from the same saved init, with the repo's ZeRO-2 and FSDP yamls.

The reference is torchrun on one node with two ranks under DeepSpeed ZeRO-2: another launcher and engine, so the
comparison does not hold accelerate against itself. On CPU accelerate runs the FSDP yaml as plain DDP (its FSDP
is a GPU path), which the reference's weights show all the same."""

import pytest

from disco_clip_ds.testing.launch import LAUNCH_COMMON, REPO, SGD, launch, start_nodes
from disco_clip_ds.testing.processes import kill_group, wait_group
from disco_clip_ds.testing.runs import (
    assert_trained_under_fsdp,
    complete_checkpoints,
    run_and_data,
    same_weights,
    two_shards_and_init,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

STEPS = 4
ARGS = [
    "--train_num_samples", "64", "--per_device_train_batch_size", "8", "--max_steps", str(STEPS),
    "--save_steps", "2", *SGD,
]  # fmt: skip


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return two_shards_and_init(tmp_path_factory.mktemp("accelerate_nodes"))


@pytest.fixture(scope="module")
def reference(data):
    out = data["root"] / "one_node"
    launch("torchrun", 2, out, *run_and_data(out, data)[2:], *ARGS)
    return out


def _two_machines(data, yaml: str):
    """Run both machines to their end: (exit codes, their logs, the run folder)."""
    out = data["root"] / yaml.split(".")[0]
    args = [*LAUNCH_COMMON, *run_and_data(out, data), *ARGS]
    config = REPO / "recipes/accelerate" / yaml
    nodes = start_nodes("accelerate", 2, args, out.parent / out.name, config=config)
    try:
        codes = [node.wait(timeout=400) for node in nodes]
        for node in nodes:
            wait_group(node.pid, timeout=60)
    finally:
        for node in nodes:
            kill_group(node.pid)
    logs = [(out.parent / f"{out.name}.node{r}.log").read_text() for r in range(2)]
    return codes, logs, out


@pytest.mark.parametrize("yaml", ["deepspeed_zero2.yaml", "fsdp.yaml"])
def test_two_machines_train_like_one_node_with_two_ranks(data, reference, yaml):
    codes, logs, out = _two_machines(data, yaml)
    assert codes == [0, 0], "\n".join(log[-3000:] for log in logs)
    # one world of two ranks across the machines (each machine's first rank logs), each machine running one of them
    assert all("4 steps of 8 x 2 ranks" in log for log in logs), logs[0][-3000:]
    rng_states = sorted(p.name for p in (out / "checkpoint-2").glob("rng_state_*.pth"))
    assert rng_states == ["rng_state_0.pth", "rng_state_1.pth"]
    if yaml.startswith("deepspeed"):  # each machine's rank wrote its own ZeRO-2 optimizer shard
        assert len(list((out / "checkpoint-2").glob("global_step2/*optim_states.pt"))) == 2
    else:  # one FSDP2 world across the machines, not DDP
        assert_trained_under_fsdp(out)
    assert complete_checkpoints(out) == ["checkpoint-2", "checkpoint-4"]
    assert same_weights(out, reference) <= 1e-4
