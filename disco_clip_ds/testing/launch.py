"""The one way tests and benchmarks launch `disco_clip_ds.train` on CPU ranks from a source checkout.

What a launch is: a command (`train_command` for one node, `node_command` for one of several nodes on this host),
its environment (`train_env`), the arguments every test launch shares (LAUNCH_COMMON, SGD), and `start`: the command
in its own session (its process group is the launcher's pid), its output appended to a log file. `finish` waits
for it and for every process of its group, then kills what is left. Everything else is built on these two:

    run_training(command)              to its end, AssertionError with the log's tail if it failed
    start_forked(command)              `start` on ranks forked with their imports done (testing/forked.py)
    launch(launcher, nproc, output)    the same with LAUNCH_COMMON, the DeepSpeed or accelerate config, OUTPUT.log
    start_run / run_to_end             a run that a test signals or kills, or whose exit code it checks
    start_nodes                        one launcher per node on 127.0.0.1 (`hostfile` for deepspeed's)
    launch_in_one_process              single-process runs in one interpreter (the imports paid once)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from disco_clip_ds.testing.processes import descendants, kill_all, kill_group, wait_gone, wait_group
from disco_clip_ds.testing.ranks import free_port

REPO = Path(__file__).resolve().parents[2]  # the checkout this package is installed from (pip install -e .)
TINY_CONFIG = REPO / "recipes" / "models" / "tiny.json"
TOKENIZER_DIR = REPO / "recipes" / "tokenizer"
VENV_BIN = Path(sys.executable).parent
MODULE = "disco_clip_ds.train"


def train_env(**extra: str) -> dict:
    """The environment of a training launch on CPU: one thread per rank, offline, this checkout importable."""
    return {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "PYTHONPATH": str(REPO),
        **extra,
    }


def train_command(launcher: str, nproc: int, config: str | None = None, launcher_args=()) -> list[str]:
    """The command that starts `disco_clip_ds.train` on `nproc` CPU ranks: deepspeed | torchrun | accelerate
    (`config`: its --config_file), on a free master port, `launcher_args` given to the launcher. One process without
    a launcher: launch_in_one_process."""
    port, module = str(free_port()), MODULE
    if launcher == "deepspeed":
        cmd = [VENV_BIN / "deepspeed", "--num_gpus", str(nproc), "--master_port", port, "--module", module]
    elif launcher == "torchrun":
        cmd = [VENV_BIN / "torchrun", "--nproc_per_node", str(nproc), "--master_port", port, "-m", module]
    elif launcher == "accelerate":
        cmd = [
            VENV_BIN / "accelerate",
            "launch",
            "--config_file",
            config,
            "--num_processes",
            str(nproc),
            "--main_process_port",
            port,
            *launcher_args,
            "-m",
            module,
        ]
    else:
        raise ValueError(f"unknown launcher {launcher!r}")
    return [str(c) for c in cmd]


def start(command: list, log: Path, **env: str) -> subprocess.Popen:
    """Start COMMAND (from the checkout, `train_env(**env)`) in its own session, so that its process group is the
    launcher's pid and holds every rank it starts; stdout and stderr appended to LOG."""
    with open(log, "a") as out:
        return subprocess.Popen(
            [str(c) for c in command],
            cwd=REPO,
            env=train_env(**env),
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def finish(proc: subprocess.Popen, timeout: float, linger: float = 120) -> int:
    """Wait up to TIMEOUT s for a started launcher (subprocess.TimeoutExpired past it), then up to LINGER s for the
    rest of its process group (ranks may outlive a launcher killed by a signal: let them save); kill whatever is
    left, whatever happened. The launcher's exit code."""
    try:
        proc.wait(timeout=timeout)
        wait_group(proc.pid, timeout=linger)
    finally:
        strays = descendants(proc.pid)  # torch elastic (torchrun, accelerate) starts each rank in a session of its own
        kill_group(proc.pid)
        kill_all(strays)
        # SIGKILL lands when the kernel next runs each process: return once they are gone, not while they end
        wait_group(proc.pid, timeout=10)
        wait_gone(strays, timeout=10)
    return proc.returncode


def run_training(cmd: list, log: Path | None = None, timeout: float = 300, forked_nproc: int = 0, **env: str) -> str:
    """Run a training command to its end, its output written afresh to LOG (a temporary file when None); raises
    AssertionError with the log's tail when it fails, so that a test shows why. The log's text.
    forked_nproc: a deepspeed command (`train_command`) run on that many forked ranks instead (`start_forked`)."""
    with tempfile.TemporaryDirectory() as scratch:
        log = Path(log) if log is not None else Path(scratch) / "run.log"
        log.write_text("")
        proc = start_forked(cmd, forked_nproc, log, **env) if forked_nproc else start(cmd, log, **env)
        code = finish(proc, timeout)
        text = log.read_text()
    if code != 0:
        raise AssertionError(f"{cmd[0]} run failed:\n" + text[-4000:])
    return text


def start_forked(command: list, nproc: int, log: Path, **env: str):
    """`start` a deepspeed COMMAND (`train_command("deepspeed", ...)` + arguments) as the `forked` launcher does:
    NPROC ranks forked from a server that imported the training stack once (testing/forked.py); the deepspeed
    command itself runs where the environment changes what the server imported under."""
    from disco_clip_ds.testing import forked

    split = command.index("--module")
    port = int(command[command.index("--master_port") + 1])
    return forked.start(nproc, command[split + 1], command[split + 2 :], log, train_env(**env), REPO, port, command)


# The launcher of a test whose subject is not the launcher: forked ranks, their imports done (testing/forked.py).
QUICK = "forked"
LAUNCH_SEED = 7
LAUNCH_COMMON = [
    "--tokenizer_name",
    str(TOKENIZER_DIR),
    "--logging_steps",
    "1",
    "--save_steps",
    "3",
    "--save_total_limit",
    "5",
    "--dataloader_num_workers",
    "1",
    "--shuffle_buffer",
    "8",
    "--disable_tqdm",
    "true",
    "--report_to",
    "none",
    "--seed",
    str(LAUNCH_SEED),
]
# Plain SGD without clipping: the update is linear in the gradient, so a gradient off by any factor (the
# published DisCo code's 1/N) shows in the weights; Adam would normalise such a factor away.
SGD = [
    "--optim",
    "sgd",
    "--learning_rate",
    "0.5",
    "--lr_scheduler_type",
    "constant",
    "--warmup_steps",
    "0",
    "--max_grad_norm",
    "0",
    "--weight_decay",
    "0",
]


def launch(
    launcher: str,
    nproc: int,
    output: Path,
    *args: str,
    ds_config: str | None = "cpu_zero2.json",
    timeout=300,
    launcher_args=(),
):
    """Run `disco_clip_ds.train` with LAUNCH_COMMON on `nproc` CPU ranks with `launcher` (given `launcher_args`); log
    in OUTPUT.log.

    launcher: deepspeed | torchrun | accelerate (ds_config picks recipes/accelerate/deepspeed_zeroN.yaml, None
    fsdp.yaml) | forked (deepspeed's, its ranks forked with their imports done: testing/forked.py; for tests whose
    subject is not the launcher). The log's text."""
    train_args = [*LAUNCH_COMMON, "--output_dir", str(output), *args]
    if ds_config and launcher != "accelerate":
        train_args += ["--deepspeed", str(REPO / "ds_configs" / ds_config)]
    yaml = None
    if launcher == "accelerate":
        name = ds_config.replace("cpu_", "deepspeed_").replace(".json", ".yaml") if ds_config else "fsdp.yaml"
        yaml = REPO / "recipes/accelerate" / name
    forked = launcher == "forked"
    return run_training(
        train_command("deepspeed" if forked else launcher, nproc, yaml, launcher_args) + train_args,
        log=output.parent / f"{output.name}.log",
        timeout=timeout,
        forked_nproc=nproc if forked else 0,
    )


# --- a run a test signals, kills or checks the exit code of: OUTPUT.log beside the run folder ---


def start_run(output: Path, train_args: list[str], launcher="deepspeed", fault: str = "", nproc=2, **env):
    """Start `disco-clip train TRAIN_ARGS` on NPROC ranks under LAUNCHER (`start`), with DISCO_FAULT=FAULT, output
    appended to OUTPUT.log. Under accelerate the ZeRO-2 yaml is the DeepSpeed config."""
    yaml = REPO / "recipes/accelerate/deepspeed_zero2.yaml" if launcher == "accelerate" else None
    log = output.parent / f"{output.name}.log"
    if launcher == "forked":
        return start_forked(train_command("deepspeed", nproc) + train_args, nproc, log, DISCO_FAULT=fault, **env)
    return start(train_command(launcher, nproc, yaml) + train_args, log, DISCO_FAULT=fault, **env)


def run_to_end(output: Path, train_args: list[str], launcher="deepspeed", fault="", timeout=400, **kw):
    """Run `start_run` to its end (`finish`): (exit code, this launch's part of the log); no process it started is
    left."""
    logfile = output.parent / f"{output.name}.log"
    before = logfile.stat().st_size if logfile.exists() else 0
    code = finish(start_run(output, train_args, launcher=launcher, fault=fault, **kw), timeout)
    return code, logfile.read_text()[before:]


# --- several nodes on this host: one launcher per node, each in its own session, all on 127.0.0.1 ---
#
# A node is a launcher with its own node rank; two on one machine run the same code paths as two hosts, over
# loopback instead of a network.


def node_command(
    launcher: str, nnodes: int, node_rank: int, port: int, nproc=1, config=None, script=None, rendezvous=None
) -> list:
    """Node NODE_RANK's command for `disco_clip_ds.train` (or SCRIPT, a file taking its arguments) on NNODES nodes
    of NPROC CPU ranks, master 127.0.0.1:PORT. launcher: torchrun (`rendezvous`: its rendezvous arguments in place
    of the static --node_rank and master) | accelerate (`config`: its --config_file) | deepspeed (`config`: its
    hostfile; --no_ssh)."""
    master = ["--master_addr", "127.0.0.1", "--master_port", str(port)]
    if launcher == "torchrun":
        where = rendezvous if rendezvous is not None else ["--node_rank", node_rank, *master]
        cmd = [VENV_BIN / "torchrun", "--nnodes", nnodes, "--nproc_per_node", nproc, *where, "-m", MODULE]
    elif launcher == "accelerate":
        cmd = [
            VENV_BIN / "accelerate", "launch", "--config_file", config,
            "--num_machines", nnodes, "--machine_rank", node_rank, "--num_processes", nnodes * nproc,
            "--main_process_ip", "127.0.0.1", "--main_process_port", port, "-m", MODULE,
        ]  # fmt: skip
    elif launcher == "deepspeed":
        cmd = [VENV_BIN / "deepspeed", "--hostfile", config, "--no_ssh", "--node_rank", node_rank, *master]
        cmd += ["--module", MODULE]
    else:
        raise ValueError(f"unknown launcher {launcher!r}")
    if script is not None:  # every launcher above ends with its module flag and the module
        cmd[-2:] = [script]
    return [str(c) for c in cmd]


def hostfile(folder: Path, nnodes: int, slots: int = 1) -> Path:
    """A DeepSpeed hostfile naming this host NNODES times (localhost, 127.0.0.1, 127.0.0.2, ...: distinct names)."""
    names = ["localhost", *(f"127.0.0.{i}" for i in range(1, nnodes))][:nnodes]
    path = folder / "hostfile"
    path.write_text("".join(f"{name} slots={slots}\n" for name in names))
    return path


def start_nodes(
    launcher: str, nnodes: int, train_args: list, log: Path, nproc=1, config=None, only=None, port=0, script=None, **env
):
    """Start the launchers of `disco_clip_ds.train TRAIN_ARGS` for NNODES nodes (or the node ranks in `only`), each
    `start`ed in its own session, node R's output appended to LOG.nodeR.log, master port PORT (0: a free one), SCRIPT
    in place of the module if given: [Popen per node started]."""
    port = port or free_port()
    return [
        start(
            node_command(launcher, nnodes, rank, port, nproc, config, script) + list(train_args),
            f"{log}.node{rank}.log",
            **env,
        )
        for rank in (range(nnodes) if only is None else only)
    ]


def launch_in_one_process(runs: list[tuple[Path, list[str]]], timeout: float = 600) -> None:
    """Run single-process trainings (`python -m disco_clip_ds.train` with LAUNCH_COMMON, --output_dir OUTPUT and
    the run's args) one after another in ONE fresh interpreter, each logging to OUTPUT.log; raises AssertionError
    with the failed run's log.

    A training run spends most of its time importing when the model is tiny; here the imports are paid once.
    Each `main()` seeds itself and loads its weights from disk, so a run does not depend on the one before it;
    pass each reference before the runs compared with it (the first one runs in an untouched interpreter)."""
    plan = [(str(output), [*LAUNCH_COMMON, "--output_dir", str(output), *map(str, args)]) for output, args in runs]
    proc = subprocess.run(
        [sys.executable, "-c", _ONE_PROCESS, json.dumps(plan)],
        cwd=REPO,
        env=train_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if proc.returncode != 0:
        started = proc.stdout.split()  # the driver names each run before starting it
        log = Path(started[-1] + ".log") if started else None
        tail = log.read_text()[-4000:] if log and log.exists() else ""
        raise AssertionError(f"single-process runs failed ({log}):\n{tail}\n{proc.stderr[-2000:]}")


# Each run's stdout and stderr (the logging handler writes to fd 2 too) go to its own OUTPUT.log, as a launch's do.
_ONE_PROCESS = """
import json, os, sys
from disco_clip_ds.commands.train import main
for output, argv in json.loads(sys.argv[1]):
    print(output, flush=True)
    saved = os.dup(1), os.dup(2)
    with open(output + ".log", "w") as log:
        os.dup2(log.fileno(), 1), os.dup2(log.fileno(), 2)
        try:
            code = main(argv)
        finally:
            sys.stdout.flush(), sys.stderr.flush()
            os.dup2(saved[0], 1), os.dup2(saved[1], 2)
    if code:
        sys.exit(f"exit code {code}")
"""
