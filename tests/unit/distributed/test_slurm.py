"""distributed/slurm.py: a node's launcher command from SLURM's variables, and a node's launch arguments (hostfile,
node rank) read by DeepSpeed's own rule."""

from pathlib import Path

import pytest

from disco_clip_ds.distributed.slurm import check_node_launch, launch_command, read_hostfile, slurm_nodes
from disco_clip_ds.errors import UsageError

SLURM = {"SLURM_JOB_NODELIST": "gpu[07-08],cpu3", "SLURM_JOB_NUM_NODES": "3", "SLURM_NODEID": "1"}


def test_node_rank_and_master_address_come_from_slurm():
    assert slurm_nodes(SLURM) == (["gpu07", "gpu08", "cpu3"], 1)
    cmd = launch_command(
        ["--output_dir", "x"], SLURM, "torchrun", nproc_per_node=8, master_port=1234, python="/v/python"
    )
    assert cmd == [
        "/v/torchrun", "--nnodes", "3", "--nproc_per_node", "8",
        "--node_rank", "1", "--master_addr", "gpu07", "--master_port", "1234",
        "-m", "disco_clip_ds.train", "--output_dir", "x",
    ]  # fmt: skip


def test_deepspeed_gets_a_hostfile_of_the_job_nodes():
    cmd = launch_command([], {**SLURM, "SLURM_NODEID": "2"}, "deepspeed", nproc_per_node=4, python="/v/python")
    hostfile = Path(cmd[cmd.index("--hostfile") + 1])
    assert hostfile.read_text() == "gpu07 slots=4\ngpu08 slots=4\ncpu3 slots=4\n"
    assert cmd[0] == "/v/deepspeed" and "--no_ssh" in cmd
    assert cmd[cmd.index("--node_rank") + 1] == "2" and cmd[cmd.index("--master_addr") + 1] == "gpu07"
    assert cmd[-2:] == ["--module", "disco_clip_ds.train"]


HOSTFILES = {
    "good": "# two nodes\nnode1 slots=8\n\nnode2   slots=8\n",
    "bad slots": "node1 slots=8\nnode2 slots eight\n",
    "no slots": "node1\n",
    "twice": "node1 slots=8\nnode1 slots=4\n",
    "empty": "# nothing\n\n",
}


def test_good_node_arguments_pass(tmp_path):
    (tmp_path / "h").write_text(HOSTFILES["good"])
    assert read_hostfile(tmp_path / "h") == [("node1", 8), ("node2", 8)]
    check_node_launch(hostfile=str(tmp_path / "h"), node_rank=1)
    check_node_launch(nnodes="2", node_rank=1)
    check_node_launch(nnodes="1:4", node_rank=7)  # an elastic range: torchrun assigns the ranks


@pytest.mark.slow  # imports deepspeed (seconds)
def test_hostfiles_are_read_by_deepspeeds_own_rule(tmp_path):
    """The reference is deepspeed's own parser: the same hostfiles pass and fail, with the same hosts."""
    from deepspeed.launcher.runner import _parse_hostfile

    for name, text in HOSTFILES.items():
        try:
            theirs = list(_parse_hostfile(text.splitlines(keepends=True)).items())
        except ValueError:
            theirs = None
        (tmp_path / name).write_text(text)
        try:
            ours = read_hostfile(tmp_path / name)
        except UsageError:
            ours = None
        assert ours == theirs, name
