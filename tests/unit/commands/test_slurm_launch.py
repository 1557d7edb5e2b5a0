"""`disco-clip slurm-launch`: bad SLURM variables and missing training arguments are one line, exit 2."""

import pytest

from disco_clip_ds.commands.slurm_launch import main
from disco_clip_ds.errors import UsageError, run_main

SLURM = {"SLURM_JOB_NODELIST": "gpu[07-08],cpu3", "SLURM_JOB_NUM_NODES": "3", "SLURM_NODEID": "1"}


@pytest.mark.parametrize(
    "env, message",
    [
        ({}, "SLURM_JOB_NODELIST, SLURM_NODEID not set: run this under srun"),
        ({**SLURM, "SLURM_NODEID": "3"}, "SLURM_NODEID 3 is out of range for 3 nodes (gpu07, gpu08, cpu3)"),
        ({**SLURM, "SLURM_JOB_NUM_NODES": "4"}, "SLURM_JOB_NUM_NODES 4 but SLURM_JOB_NODELIST names 3 hosts"),
        ({**SLURM, "SLURM_JOB_NODELIST": "gpu[07-"}, "SLURM_JOB_NODELIST 'gpu[07-' is not a host list"),
        ({**SLURM, "SLURM_NODEID": "one"}, "SLURM_NODEID 'one' is not a whole number"),
        ({**SLURM, "SLURM_NODEID": "-1"}, "SLURM_NODEID '-1' is not a whole number"),
        ({**SLURM, "SLURM_JOB_NUM_NODES": "3 nodes"}, "SLURM_JOB_NUM_NODES '3 nodes' is not a whole number"),
        ({**SLURM, "SLURM_JOB_NUM_NODES": "", "SLURM_NNODES": "x"}, "SLURM_NNODES 'x' is not a whole number"),
        ({**SLURM, "SLURM_JOB_NODELIST": "gpu 7,b,c"}, "names 'gpu 7', not a host name"),
        ({**SLURM, "SLURM_JOB_NODELIST": "-gpu7,b,c"}, "names '-gpu7', not a host name"),
        ({**SLURM, "MASTER_PORT": "http"}, "--master_port / MASTER_PORT 'http': give a TCP port, 1 to 65535"),
        ({**SLURM, "MASTER_PORT": "65536"}, "--master_port / MASTER_PORT '65536': give a TCP port"),
        ({**SLURM, "MASTER_PORT": "0"}, "--master_port / MASTER_PORT '0': give a TCP port"),
    ],
)
def test_bad_slurm_variables_are_one_line(env, message, monkeypatch, capsys):
    """Before: a non-numeric SLURM_NODEID, SLURM_JOB_NUM_NODES or MASTER_PORT was a ValueError traceback, and a port
    out of range or a host that is no name went on to torchrun, which failed with a traceback of its own."""
    for name in ("SLURM_JOB_NODELIST", "SLURM_JOB_NUM_NODES", "SLURM_NNODES", "SLURM_NODEID", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert run_main(main, ["--", "--output_dir", "x"], "disco-clip slurm-launch") == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1, err


def test_train_arguments_are_required(monkeypatch):
    monkeypatch.setenv("SLURM_JOB_NODELIST", "a")
    monkeypatch.setenv("SLURM_NODEID", "0")
    with pytest.raises(UsageError, match="give the training arguments after `--`"):
        main(["--nproc_per_node", "2"])


@pytest.mark.parametrize("port", ["-1", "99999", "1e3"])
def test_a_bad_master_port_flag_is_one_line(port, monkeypatch, capsys):
    for name, value in SLURM.items():
        monkeypatch.setenv(name, value)
    assert run_main(main, ["--master_port", port, "--", "--output_dir", "x"], "disco-clip slurm-launch") == 2
    err = capsys.readouterr().err.strip()
    assert f"--master_port / MASTER_PORT '{port}': give a TCP port" in err and len(err.splitlines()) == 1, err
