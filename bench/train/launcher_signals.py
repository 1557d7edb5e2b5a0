"""What each launcher does with SIGTERM / SIGUSR1, measured with 2 probe ranks (no model): a probe logs the
signals it gets, then "saves" for SAVE_S seconds and exits 75, as a preempted training rank does.

For each launcher (deepspeed, torchrun, torchrun with TORCHELASTIC_SIGNALS_TO_HANDLE including SIGUSR1,
accelerate) and each of {SIGTERM, SIGUSR1} sent {to the launcher alone, to the whole process group}: did the
ranks get the signal, did they finish their save, were ranks left running, the launcher's exit code. Writes
bench/train/results/launcher_signals.csv.

    .venv/bin/python bench/train/launcher_signals.py [LAUNCHER ...]   (a subset goes to launcher_signals_LAUNCHER.csv)
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

from disco_clip_ds.testing.bench_record import write_rows
from disco_clip_ds.testing.launch import REPO
from disco_clip_ds.testing.ranks import free_port

BIN = Path(sys.executable).parent
SAVE_S = 5

PROBE = (
    r"""
import os, signal, sys, time
log = open(sys.argv[-1] + f".{os.environ.get('RANK', '?')}", "a", buffering=1)
def on(sig, frame):
    log.write(f"got {signal.Signals(sig).name}\n")
    time.sleep(%d)  # the checkpoint
    log.write("saved\n")
    sys.exit(75)
for s in (signal.SIGTERM, signal.SIGUSR1):
    signal.signal(s, on)
log.write(f"pid {os.getpid()}\n")
time.sleep(300)
"""
    % SAVE_S
)


def command(launcher: str, probe: Path, log: Path, port: int) -> list[str]:
    if launcher == "deepspeed":
        return [str(BIN / "deepspeed"), "--num_gpus", "2", "--master_port", str(port), str(probe), str(log)]
    if launcher.startswith("torchrun"):
        return [str(BIN / "torchrun"), "--nproc_per_node", "2", "--master_port", str(port), str(probe), str(log)]
    return [
        str(BIN / "accelerate"),
        "launch",
        "--config_file",
        str(REPO / "recipes/accelerate/fsdp.yaml"),
        "--num_processes",
        "2",
        "--main_process_port",
        str(port),
        str(probe),
        str(log),
    ]


def trial(launcher: str, sig: signal.Signals, target: str, tmp: Path, port: int) -> dict:
    probe, log = tmp / "probe.py", tmp / f"{launcher}-{sig.name}-{target}"
    probe.write_text(PROBE)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"}
    if launcher == "torchrun_usr1":  # torchrun told to forward SIGUSR1 as well
        env["TORCHELASTIC_SIGNALS_TO_HANDLE"] = "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"
    proc = subprocess.Popen(
        command(launcher, probe, log, port),
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    deadline = time.monotonic() + 120
    while (
        sum(Path(f"{log}.{r}").exists() and "\n" in Path(f"{log}.{r}").read_text() for r in (0, 1)) < 2
        and time.monotonic() < deadline
    ):
        time.sleep(0.2)
    ranks = [int(Path(f"{log}.{r}").read_text().split()[1]) for r in (0, 1)]
    if target == "launcher":
        proc.send_signal(sig)
    else:
        os.killpg(proc.pid, sig)
    try:
        rc = proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        rc = "still running after 60 s"
    time.sleep(SAVE_S + 3)
    left = [r for r in ranks if psutil.pid_exists(r) and psutil.Process(r).status() != psutil.STATUS_ZOMBIE]
    for r in left:  # orphans: the launcher is gone
        os.kill(r, signal.SIGKILL)
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    texts = [Path(f"{log}.{r}").read_text() if Path(f"{log}.{r}").exists() else "" for r in (0, 1)]
    return {
        "launcher": launcher,
        "signal": sig.name,
        "sent_to": target,
        "launcher_exit": rc,
        "ranks_got_signal": sum(f"got {sig.name}" in t or "got SIGTERM" in t for t in texts),
        "signal_ranks_got": "/".join(
            sorted({line[4:] for t in texts for line in t.splitlines() if line.startswith("got ")})
        )
        or "-",
        "ranks_finished_save": sum("saved" in t for t in texts),
        f"ranks_alive_{SAVE_S + 3}s_after": len(left),
    }


def main() -> None:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for launcher in sys.argv[1:] or ("deepspeed", "torchrun", "torchrun_usr1", "accelerate"):
            for sig in (signal.SIGTERM, signal.SIGUSR1):
                for target in ("launcher", "group"):
                    rows.append(trial(launcher, sig, target, Path(tmp), free_port()))
                    print(rows[-1], flush=True)
    out = (
        Path(__file__).parent
        / "results"
        / ("launcher_signals.csv" if len(sys.argv) == 1 else f"launcher_signals_{'_'.join(sys.argv[1:])}.csv")
    )
    write_rows(out, rows, rounds=1)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
