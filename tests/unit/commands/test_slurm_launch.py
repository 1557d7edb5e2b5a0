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
    ],
)
def test_bad_slurm_variables_are_one_line(env, message, monkeypatch, capsys):
    for name in ("SLURM_JOB_NODELIST", "SLURM_JOB_NUM_NODES", "SLURM_NNODES", "SLURM_NODEID"):
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
