"""`python -m disco_clip_ds.testing.zygote`: the server behind testing/forked.py's launcher.

It imports what a training rank imports (torch, transformers, DeepSpeed, accelerate, the package) once, then
forks a launcher per request; that launcher forks the ranks, which start with every import done. A rank's imports
take most of a tiny run's CPU time, and a test session launches many tiny runs.

Protocol: one JSON request per line on stdin ({"nproc", "module", "args", "env", "cwd", "log", "master_port",
"fallback"}); on the reply pipe (fd given as argv[1]) one JSON line {"pid": P} per request, in request order,
then {"exit": P, "status": S} (os.waitpid's status) when that launcher ends. EOF on stdin ends the server.

What the forked launcher does is what DeepSpeed's per-node launcher (deepspeed/launcher/launch.py) does: its own
session (a process group the test can signal or kill), output appended to the log, each rank with RANK,
LOCAL_RANK, WORLD_SIZE, LOCAL_SIZE, CROSS_RANK, CROSS_SIZE, MASTER_ADDR/PORT and `--local_rank=I` before the
arguments, unbuffered output; the first rank to fail makes it terminate the others and exit with that rank's code;
SIGTERM or SIGINT to it terminates the ranks. A request whose environment differs from the server's in a variable
that libraries read at import time cannot use the imports: its launcher execs the real command (`fallback`).
"""

from __future__ import annotations

import atexit
import io
import json
import os
import runpy
import select
import signal
import sys
import threading
import time
import traceback

# Read by a library when it is imported (huggingface_hub's constants, OpenMP's thread count, ...): a request that
# changes one of these cannot reuse this server's imports.
IMPORT_TIME_PREFIXES = (
    "HF_", "HUGGINGFACE", "TRANSFORMERS", "TOKENIZERS", "TORCH", "OMP_", "MKL_", "KMP_", "PYTHON", "DS_",
    "DEEPSPEED", "ACCELERATE", "CUDA", "NCCL", "XDG_", "HOME", "LD_", "NO_ALBUMENTATIONS", "MALLOC_",
)  # fmt: skip


def import_time_env(env: dict) -> dict:
    """The variables of ENV that a process reads when it starts or imports (IMPORT_TIME_PREFIXES)."""
    return {k: v for k, v in env.items() if k.startswith(IMPORT_TIME_PREFIXES)}


def _preload() -> None:
    """Import what a rank of `disco_clip_ds.train` imports before its first step."""
    import accelerate  # noqa: F401
    import deepspeed  # noqa: F401
    import deepspeed.runtime.engine  # noqa: F401
    import transformers.integrations.deepspeed  # noqa: F401

    import disco_clip_ds.commands.train  # noqa: F401
    import disco_clip_ds.train.run  # noqa: F401


def _unbuffered() -> None:
    """`python -u`: what a rank prints reaches the log at once, in the order the ranks print it."""
    for name, fd in (("stdout", 1), ("stderr", 2)):
        raw = io.FileIO(fd, "w", closefd=False)
        setattr(sys, name, io.TextIOWrapper(raw, encoding="utf-8", errors="backslashreplace", write_through=True))


def _exit(code) -> None:
    """End a forked process as the interpreter ends one: threads joined, atexit handlers, streams flushed."""
    if code is None:
        code = 0
    elif not isinstance(code, int):
        print(code, file=sys.stderr)
        code = 1
    try:
        threading._shutdown()
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        os._exit(code & 0xFF)


def _rank(request: dict, rank: int) -> None:
    """In a forked rank: the launcher's environment for RANK, then `python -m MODULE --local_rank=RANK ARGS`."""
    nproc = request["nproc"]
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nproc), LOCAL_SIZE=str(nproc), CROSS_RANK="0",
        CROSS_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(request["master_port"]),
    )  # fmt: skip
    sys.argv = [request["module"], f"--local_rank={rank}", *request["args"]]
    code = 0
    try:
        runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
    except SystemExit as stop:
        code = stop.code
    except BaseException:
        traceback.print_exc()
        code = 1
    _exit(code)


def _terminate(pids: list[int], grace: float = 30.0) -> None:
    """SIGTERM each live rank, SIGKILL those still alive after GRACE s (launch.py's terminate_process_tree)."""
    for pid in pids:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + grace
    while pids and time.monotonic() < deadline:
        pids = [p for p in pids if os.waitpid(p, os.WNOHANG) == (0, 0)]
        time.sleep(0.1)
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass


def _code(status: int) -> int:
    return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


def _launcher(request: dict, preloaded_env: dict, set_by_imports: dict) -> None:
    """In the forked launcher: a session of its own, the log as stdout and stderr, then the ranks."""
    os.setsid()
    os.chdir(request["cwd"])
    log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(log, 1), os.dup2(log, 2), os.close(log)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0), os.close(devnull)
    os.environ.clear()
    os.environ.update({**set_by_imports, **request["env"]})
    if import_time_env(request["env"]) != preloaded_env:
        fallback = request["fallback"]
        os.execvpe(fallback[0], fallback, request["env"])
    _unbuffered()
    ranks: list[int] = []
    stop = {"code": None}

    def on_signal(signum, frame):
        _terminate(list(ranks))
        os._exit(1)

    for rank in range(request["nproc"]):
        pid = os.fork()
        if pid == 0:
            signal.signal(signal.SIGTERM, signal.SIG_DFL), signal.signal(signal.SIGINT, signal.default_int_handler)
            _rank(request, rank)
        ranks.append(pid)
    signal.signal(signal.SIGTERM, on_signal), signal.signal(signal.SIGINT, on_signal)
    alive = list(ranks)
    while alive and stop["code"] is None:
        pid, status = os.waitpid(-1, 0)
        if pid in alive:
            alive.remove(pid)
            if _code(status) != 0:
                stop["code"] = _code(status)
    if stop["code"] is not None:
        _terminate(alive)
        sys.stderr.write(f"forked launcher: a rank exited with code {stop['code']}: the others were stopped\n")
        os._exit(stop["code"] & 0xFF)
    os._exit(0)


def serve(reply_fd: int) -> None:
    """Import, then fork a launcher per request on stdin until stdin ends."""
    before = dict(os.environ)
    _preload()
    preloaded_env = import_time_env(before)
    # what the imports set (torch's inductor cache folder, ...): a fresh rank's imports would set it too
    set_by_imports = {k: v for k, v in os.environ.items() if before.get(k) != v}
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    replies = os.fdopen(reply_fd, "w", buffering=1)
    pending = b""
    while True:
        readable, _, _ = select.select([0, wake_r], [], [])
        if wake_r in readable:
            os.read(wake_r, 4096)
        while True:  # reap every launcher that ended
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            replies.write(json.dumps({"exit": pid, "status": status}) + "\n")
        if 0 in readable:
            chunk = os.read(0, 65536)
            if not chunk:
                return
            pending += chunk
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                request = json.loads(line)
                sys.stdout.flush(), sys.stderr.flush()
                pid = os.fork()
                if pid == 0:
                    signal.set_wakeup_fd(-1)
                    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                    for fd in (wake_r, wake_w, reply_fd):
                        os.close(fd)
                    try:
                        _launcher(request, preloaded_env, set_by_imports)
                    except BaseException:
                        traceback.print_exc()
                    os._exit(1)
                replies.write(json.dumps({"pid": pid}) + "\n")


if __name__ == "__main__":
    serve(int(sys.argv[1]))
