"""distributed/slurm.py: a node's launcher command from SLURM's variables, and a node's launch arguments (hostfile,
node rank) read by DeepSpeed's own rule."""

from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from disco_clip_ds.distributed.slurm import (
    check_node_launch,
    check_port,
    is_host,
    launch_command,
    read_hostfile,
    slurm_nodes,
)
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


# --- property tests: hostile SLURM variables, hostfiles and ports give a result or one UsageError line ---

_TEXT = st.one_of(
    st.text(max_size=16),  # empty, whitespace, newlines, any Unicode
    st.text(st.characters(min_codepoint=0xDC80, max_codepoint=0xDCFF), min_size=1, max_size=4),  # non-UTF-8 bytes
    st.integers(-(2**70), 2**70).map(str),
    st.sampled_from(["gpu[01-04,07]", "n[1-99999999]", "a,,b", "[]", "-x", "x" * 70, "1e3", " 2 ", "٣", "../etc"]),
)
_PROPERTY = settings(max_examples=80, derandomize=True, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _one_line(error: UsageError) -> None:
    assert str(error) and "\n" not in str(error), str(error)


@_PROPERTY
@given(
    env=st.fixed_dictionaries(
        {},
        optional={n: _TEXT for n in ("SLURM_JOB_NODELIST", "SLURM_NODEID", "SLURM_JOB_NUM_NODES", "SLURM_NNODES")},
    )
)
def test_any_slurm_environment_gives_this_nodes_place_or_one_line(env):
    try:
        hosts, node = slurm_nodes(env)
    except UsageError as error:
        _one_line(error)
        return
    assert 0 <= node < len(hosts) and all(is_host(h) for h in hosts)
    assert node == int(env["SLURM_NODEID"])


@_PROPERTY
@given(text=st.binary(max_size=80) | st.text(max_size=60).map(str.encode))
def test_any_hostfile_gives_its_nodes_or_one_line(tmp_path_factory, text):
    path = tmp_path_factory.mktemp("hostfile") / "hosts"
    path.write_bytes(text)
    try:
        nodes = read_hostfile(path)
    except UsageError as error:
        _one_line(error)
        return
    assert nodes and all(slots >= 1 for _, slots in nodes) and len({h for h, _ in nodes}) == len(nodes)


@_PROPERTY
@given(port=st.one_of(_TEXT, st.integers(-(2**40), 2**40)))
def test_any_master_port_is_a_tcp_port_or_one_line(port):
    try:
        number = check_port(port)
    except UsageError as error:
        _one_line(error)
        return
    assert 1 <= number <= 65535 and number == int(str(port))
