"""Start-up teacher weight reads: the bytes a 2-rank training run reads from its teacher's weight files, counted by
strace (every read/pread64 on a file descriptor of a weight file, and the length of every mmap of one), for the
checkout before the fingerprint cache (`--base`, e.g. a worktree of commit 9b87829) and this one, with an empty
fingerprint cache (`cold`: a machine the teacher was not embedded on) and with the cache `data embed` filled
(`warm`: the usual embed-then-train on one machine, or machines sharing $DISCO_CLIP_CACHE).

The teacher: the quickstart's tiny CLIP with an 80,000-token vocabulary, so that its one weight file (about 21 MB)
is above the 16 MiB up to which the node facts (train/node_facts.py) hash a file whole: they sample 3 x 1 MiB of it
on every rank, a read this bench shows apart from the fingerprint's whole-file read. The student: the tiny CLIP.
2 torchrun CPU ranks (plain DDP), 1 step of 2 x 8 pairs. The runs:

- `stored`: --teacher T --teacher_embeddings E (the teacher never runs);
- `replayed`: the same with --live_teacher (the teacher runs on the stored crops: fingerprinted and loaded);
- `live`: --teacher T alone (loaded, never fingerprinted, in either checkout).

The counts do not depend on timing: every round gives the same bytes (`rounds` shows it), and the wall time of a
run is recorded for information only (strace slows every run alike).

    python bench/train/teacher_reads.py --base /tmp/base_teacher --rounds 2   # writes results/teacher_reads.csv
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import tempfile
import time
from collections import defaultdict
from pathlib import Path

from disco_clip_ds.testing.bench_record import bench_row, write_rows
from disco_clip_ds.testing.images import write_shards
from disco_clip_ds.testing.launch import LAUNCH_COMMON, REPO, SGD, TINY_CONFIG, TOKENIZER_DIR, train_command, train_env
from disco_clip_ds.testing.runs import save_initial_model

HERE = Path(__file__).resolve().parent
VOCAB = 80_000
SIDES = ("stored", "replayed", "live")
_READ = re.compile(r"^(\d+)\s+(?:read|pread64)\(\d+<([^>]*)>,.*\)\s+=\s+(\d+)")
_READ_START = re.compile(r"^(\d+)\s+(?:read|pread64)\(\d+<([^>]*)>,.*<unfinished \.\.\.>")
_READ_END = re.compile(r"^(\d+)\s+<\.\.\. (?:read|pread64) resumed>.*=\s+(\d+)")
_MMAP = re.compile(r"^(\d+)\s+mmap\([^,]+, (\d+), [^,]+, [^,]+, \d+<([^>]*)>")


def strace_counts(log: Path, weights: set[str]) -> dict:
    """Bytes read and mapped from the files `weights`, and the processes that read them, from an `strace -f -y` log."""
    read = mapped = 0
    readers, pending = set(), {}
    for line in log.read_text(errors="replace").splitlines():
        if m := _READ.match(line):
            pid, path, n = m.groups()
        elif m := _READ_START.match(line):
            pending[m.group(1)] = m.group(2)
            continue
        elif m := _READ_END.match(line):
            pid, n = m.groups()
            path = pending.pop(pid, "")
        elif m := _MMAP.match(line):
            if m.group(3) in weights:
                mapped += int(m.group(2))
            continue
        else:
            continue
        if path in weights and int(n) > 0:
            read += int(n)
            readers.add(pid)
    return {"read_bytes": read, "mapped_bytes": mapped, "reading_processes": len(readers)}


def prepare(root: Path, warm_cache: Path) -> dict:
    """Shards, the student, the big-vocabulary teacher and its embeddings (made with the fingerprint cache
    `warm_cache`, which `data embed` fills)."""
    import os

    from disco_clip_ds.commands.data import embed_main

    write_shards(root / "data", num_shards=2, per_shard=32, seed=3)
    config = json.loads(TINY_CONFIG.read_text())
    config["text_config"]["vocab_size"] = VOCAB
    (root / "teacher.json").write_text(json.dumps(config))
    teacher = save_initial_model(root / "teacher", 21, root / "teacher.json")
    student = save_initial_model(root / "init", 11)
    os.environ["DISCO_CLIP_CACHE"] = str(warm_cache)
    argv = ["--teacher", str(teacher), "--shards", str(root / "data"), "--output", str(root / "emb")]
    assert embed_main([*argv, "--tokenizer_name", str(TOKENIZER_DIR)]) == 0
    return {"teacher": teacher, "student": student, "emb": root / "emb", "data": root / "data"}


def run_args(made: dict, side: str, output: Path) -> list[str]:
    args = [*LAUNCH_COMMON, *SGD, "--output_dir", str(output), "--model_name_or_path", str(made["student"])]
    args += ["--train_shards", f"{made['data']}/{{00000..00001}}.tar", "--train_num_samples", "64"]
    args += ["--max_steps", "1", "--per_device_train_batch_size", "8", "--teacher", str(made["teacher"])]
    if side != "live":
        args += ["--teacher_embeddings", str(made["emb"])]
    return args + (["--live_teacher"] if side == "replayed" else [])


def measure(checkout: Path, cache: Path, made: dict, side: str, scratch: Path) -> dict:
    """One 2-rank run of `side` from `checkout` under strace, with the fingerprint cache `cache`: its counts."""
    output = Path(tempfile.mkdtemp(dir=scratch))
    log = output / "strace.log"
    trace = ["strace", "-f", "--seccomp-bpf", "-qq", "-y", "-s", "0", "-e", "trace=read,pread64,mmap"]
    command = [*trace, "-e", "signal=none", "-o", str(log), *train_command("torchrun", 2)]
    env = train_env(PYTHONPATH=str(checkout), DISCO_CLIP_CACHE=str(cache))
    start = time.perf_counter()
    done = subprocess.run(
        [*command, *run_args(made, side, output / "run")], cwd=checkout, env=env, capture_output=True, text=True
    )
    wall = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"{side} from {checkout} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    weights = {str(p.resolve()) for p in made["teacher"].glob("*.safetensors")}
    return {**strace_counts(log, weights), "wall_s": wall}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", required=True, help="a checkout of the commit to compare with (git worktree add)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", default=str(HERE / "results" / "teacher_reads.csv"))
    a = parser.parse_args()
    base = Path(a.base).resolve()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        made = prepare(root / "set", root / "warm")
        weight_bytes = sum(p.stat().st_size for p in made["teacher"].glob("*.safetensors"))
        cases = [("base", base, None), ("after", REPO, "cold"), ("after", REPO, "warm")]
        samples = defaultdict(lambda: defaultdict(list))
        for r in range(a.rounds):
            for name, checkout, cache in cases if r % 2 == 0 else cases[::-1]:
                for side in SIDES:
                    folder = root / "warm" if cache == "warm" else Path(tempfile.mkdtemp(dir=root))  # cold: empty
                    got = measure(checkout, folder, made, side, root)
                    print(name, cache or "-", side, got, flush=True)
                    for key, value in got.items():
                        samples[(name, cache or "none", side)][key].append(value)
        rows = []
        for (name, cache, side), got in samples.items():
            settings = {"checkout": name, "cache": cache, "run": side, "ranks": 2, "weight_file_bytes": weight_bytes}
            rows.append(bench_row(settings, dict(got), digits=2))
    write_rows(a.out, rows)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
