"""The scale benchmark (issue 49): the same measurements at a commit before and at the commit after, interleaved, on
synthetic data of DataCompDR's shapes (bench/scale/synthetic.py; scaled where this machine forbids, as the README
states).

    python bench/scale/scale_bench.py --before 9b87829 [--after /tmp/scale_after] [--rounds 2] [--quick]

`--before COMMIT` is checked out into a temporary git worktree; `--after` is a tree (default: this checkout). Each
measurement runs as a subprocess (bench/scale/probes.py, the CLI, torchrun) with PYTHONPATH set to one side's tree,
before and after alternately (the side that goes first swaps every round). Per row: the metric, each side's
min/median/max over the rounds, the per-round ratio after / before, both commits.

Rows: per DataLoader worker reading stored embeddings from 1, 4 and 8 mixed sources: peak RSS, private (anonymous)
peak, sidecar opens per 1,000 samples (strace), sidecar bytes read from storage per 1,000 samples (/proc/self/io
read_bytes, the sidecars evicted from the page cache first: each page counts once); a training start-up with stored
embeddings: opens of the teachers' weight files and the bytes read() from them, per run (strace); the eval suite's
wall time on 1 and on 2 ranks (torchrun); `copies_within` at two sizes (the before side capped: --dedup_cap); `data
filter` (CLIP score only) and `data embed` samples/s; the imports' RSS of one rank (the planner's baseline).
Writes bench/scale/results/scale.csv (scale_quick.csv with --quick) and a markdown table beside it.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from disco_clip_ds.testing.bench_record import bench_row, command_line, write_rows  # first: the commit at start

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(HERE))
from synthetic import CAPTION_KEYS, SOURCES, build  # noqa: E402

SIZES = {
    "default": {
        "samples": 256,
        "eval_images": 800,
        "embed_samples": 48,
        "stream_samples": 400,
        "dedup": (50_000, 250_000, 1_000_000),
        "cap": 180,
    },
    "quick": {
        "samples": 24,
        "eval_images": 40,
        "embed_samples": 6,
        "stream_samples": 40,
        "dedup": (2_000, 5_000, 20_000),
        "cap": 60,
    },
}
STREAM_SOURCES = (1, 4, 8)
MEASURES = ("imports", "stream", "startup", "suite", "dedup", "filter", "embed")
DATACOMPDR_SHARD = 10_000  # samples in a DataCompDR shard (the scaling's reference)
MiB = 2**20


@dataclass
class Side:
    name: str
    tree: Path
    commit: str

    def env(self) -> dict:
        return {
            **os.environ,
            "PYTHONPATH": str(self.tree),
            "OMP_NUM_THREADS": "1",
            "HF_HUB_OFFLINE": "1",
            "TOKENIZERS_PARALLELISM": "false",
        }


def tree_commit(tree: Path) -> str:
    git = ["git", "-C", str(tree)]
    head = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run([*git, "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True)
    return head + ("+dirty" if dirty.stdout.strip() else "")


def run(side: Side, argv: list[str], timeout: float, log: Path) -> tuple[dict | None, float]:
    """ARGV under SIDE's tree: (its last JSON line, or None, and its wall seconds); None too when it timed out. The
    output is appended to LOG; a failure is raised with its tail."""
    start = time.perf_counter()
    with open(log, "a") as out:
        out.write(f"\n$ [{side.name}] {' '.join(map(str, argv))}\n")
        out.flush()
        proc = subprocess.Popen(
            [str(a) for a in argv],
            cwd=side.tree,  # `python -m` puts the working folder first on sys.path: the side's tree
            env=side.env(),
            stdout=subprocess.PIPE,
            stderr=out,
            text=True,
            start_new_session=True,  # its own process group: torchrun's ranks and strace's child end with it
        )
        try:
            stdout, _ = proc.communicate(timeout=timeout)
        except BaseException as error:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            if not isinstance(error, subprocess.TimeoutExpired):
                raise
            out.write(f"(stopped after {timeout:.0f} s)\n")
            return None, time.perf_counter() - start
        out.write(stdout)
    seconds = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(f"[{side.name}] {' '.join(map(str, argv[:6]))} ... failed ({proc.returncode}); see {log}")
    return last_json(stdout), seconds


def last_json(text: str) -> dict | None:
    """The last line of TEXT that is a JSON object (a probe's result; training prints dicts of its own)."""
    for line in reversed(text.splitlines()):
        try:
            value = json.loads(line)
        except ValueError:
            continue
        if isinstance(value, dict):
            return value
    return None


def probe(*args) -> list[str]:
    return [sys.executable, str(HERE / "probes.py"), *map(str, args)]


def traced(trace: Path, calls: str, argv: list[str]) -> list[str]:
    """ARGV under strace: every process and thread (-ff: a file each), successful calls, file descriptors as paths."""
    return ["strace", "-ff", "-qq", "-y", "-e", f"trace={calls}", "-e", "status=successful", "-o", str(trace), *argv]


def trace_lines(trace: Path):
    for path in trace.parent.glob(trace.name + ".*"):
        yield from path.read_text(errors="replace").splitlines()


def file_reads(trace: Path, folders: list[Path], suffix: str) -> tuple[int, int, int]:
    """(opens, bytes read(), bytes mapped) of the files under FOLDERS whose name ends with SUFFIX, from the strace
    files (a mapping counts its whole length: what is touched of it is not seen)."""
    opens = nbytes = mapped = 0
    marks = [str(f.resolve()) + "/" for f in folders]
    for line in trace_lines(trace):
        name, _, rest = line.partition("(")
        if not any(m in rest for m in marks) or suffix not in rest:
            continue
        if name.endswith("openat"):
            opens += 1
        elif name.endswith(("read", "pread64", "readv", "preadv", "preadv2")) and " = " in line:
            nbytes += int(line.rsplit(" = ", 1)[1].split()[0])
        elif name.endswith("mmap"):
            mapped += int(rest.split(", ")[1])
    return opens, nbytes, mapped


class Bench:
    def __init__(self, args, sides: list[Side], data: Path, work: Path):
        self.args, self.sides, self.data, self.work = args, sides, data, work
        self.sizes = SIZES["quick" if args.quick else "default"]
        self.values: dict[str, dict[str, list]] = {}  # metric -> side -> per-round values
        self.capped: dict[str, str] = {}  # metric -> why the before side has no value
        self.log = work / "bench.log"
        self.teachers = [data / "teachers" / t for t in ("t0", "t1")]

    def record(self, metric: str, side: Side, value: float) -> None:
        self.values.setdefault(metric, {}).setdefault(side.name, []).append(value)

    def sidecars(self, side: Side) -> Path:
        """The side's sidecars, kept with the data for its commit (a dirty tree's are made afresh)."""
        if side.commit.endswith("+dirty"):
            return self.work / f"sidecars_{side.name}"
        return self.data / "sidecars" / side.commit

    def embed_argv(self, shards: str, output: Path) -> list[str]:
        return [
            "data",
            "embed",
            "--teacher",
            *map(str, self.teachers),
            "--shards",
            shards,
            "--output",
            str(output),
            "--augmentations",
            "30",
            "--caption_keys",
            ",".join(CAPTION_KEYS),
            "--embedding_dtype",
            "float16",
            "--tokenizer_name",
            str(REPO / "recipes/tokenizer"),
        ]

    def all_shards(self) -> str:
        return "::".join(str(self.data / "shards" / f"src{s}") for s in range(SOURCES))

    def prepare(self) -> None:
        """Each side's sidecars of every shard, in its own format (probes.py `sidecars`)."""
        for side in self.sides:
            done = self.sidecars(side) / "done"
            if done.is_file():
                continue
            shutil.rmtree(self.sidecars(side), ignore_errors=True)
            argv = probe("sidecars", "--data", self.data, "--output", self.sidecars(side))
            run(side, [*argv, "--tokenizer", REPO / "recipes/tokenizer"], 1800, self.log)
            done.write_text(side.commit)

    # --- the measurements: each takes a side and records its values ---

    def imports(self, side: Side) -> None:
        result, _ = run(side, probe("imports"), 300, self.log)
        self.record("rank process RSS after imports (MiB)", side, result["peak_rss"] / MiB)

    def stream(self, side: Side, sources: int) -> None:
        samples = self.sizes["stream_samples"]
        buffer = max(8, 1000 * self.sizes["samples"] // DATACOMPDR_SHARD)  # training's 1,000 of 10,000, scaled
        trace = self.work / "trace" / f"stream_{side.name}_{sources}"
        shutil.rmtree(trace.parent, ignore_errors=True)
        trace.parent.mkdir(parents=True)
        argv = probe("stream", "--data", self.data, "--sidecars", self.sidecars(side), "--sources", sources)
        argv += ["--samples", samples, "--shuffle_buffer", buffer, "--shard_samples", self.sizes["samples"]]
        result, _ = run(side, traced(trace, "openat,read,pread64,readv,preadv,preadv2,mmap", argv), 1800, self.log)
        opens, nbytes, mapped = file_reads(trace, [self.sidecars(side)], ".teacher.safetensors")
        per_k = 1000 / samples
        label = f"{sources} source{'s' if sources > 1 else ''}"
        self.record(f"worker peak RSS, {label} (MiB)", side, result["peak_rss"] / MiB)
        self.record(f"worker private peak (RssAnon), {label} (MiB)", side, result["peak_anon"] / MiB)
        if sources == 1:  # what a forked worker could add at most beyond its parent's pages: the planner's allowance
            before = result["anon_before"] / MiB
            self.record("reader private memory (RssAnon) before its first sample (MiB)", side, before)
        growth = (result["peak_anon"] - result["anon_before"]) / MiB
        self.record(f"worker private growth while reading, {label} (MiB)", side, growth)
        if result["planned"] is not None:  # the planner's store bound and shuffle buffers, where the side has them
            self.record(f"planner: store bound + shuffle buffers, {label} (MiB)", side, result["planned"] / MiB)
        self.record(f"sidecar opens per 1,000 samples, {label}", side, opens * per_k)
        self.record(f"sidecar MB read() or mapped per 1,000 samples, {label}", side, (nbytes + mapped) * per_k / 1e6)
        megabytes = result["read_bytes"] * per_k / 1e6
        self.record(f"sidecar MB read from storage per 1,000 samples, {label}", side, megabytes)

    def startup(self, side: Side) -> None:
        """`disco-clip train` with stored embeddings for one step (one process, one DataLoader worker)."""
        trace = self.work / "trace" / f"startup_{side.name}"
        shutil.rmtree(trace.parent, ignore_errors=True)
        trace.parent.mkdir(parents=True)
        output = self.work / f"run_{side.name}"
        shutil.rmtree(output, ignore_errors=True)
        shards = str(self.data / "shards" / "src0" / "{00000..00001}.tar")
        argv = [sys.executable, "-m", "disco_clip_ds.train", "--model_name_or_path", self.data / "student"]
        argv += ["--tokenizer_name", REPO / "recipes/tokenizer", "--train_shards", shards, "--output_dir", output]
        argv += ["--teacher", *self.teachers, "--teacher_embeddings", self.sidecars(side), "--augmentation_pool"]
        argv += ["--synthetic_caption_ratio", "0.5", "--max_steps", "1", "--per_device_train_batch_size", "8"]
        argv += ["--dataloader_num_workers", "1", "--shuffle_buffer", "8", "--report_to", "none"]
        argv += ["--disable_tqdm", "true", "--save_steps", "1000", "--optim", "sgd", "--learning_rate", "0.1"]
        _, seconds = run(side, traced(trace, "openat,read,pread64,readv,preadv,preadv2", argv), 900, self.log)
        opens, nbytes, _ = file_reads(trace, self.teachers, ".safetensors")
        weights = sum(p.stat().st_size for t in self.teachers for p in t.glob("*.safetensors"))
        self.record("teacher weight file opens per training start-up", side, opens)
        self.record("teacher weights read() per training start-up (x their size)", side, nbytes / weights)
        self.record("training start-up to 1 step, under strace (s)", side, seconds)

    def suite(self, side: Side, ranks: int) -> None:
        from disco_clip_ds.testing.ranks import free_port

        eval_root = self.data / "eval"
        argv = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", ranks, "--master_port", free_port()]
        argv += ["-m", "disco_clip_ds.cli", "eval", "--model", eval_root / "model", "--tasks", eval_root / "tasks.yml"]
        _, seconds = run(side, argv, 900, self.log)
        self.record(f"eval suite wall time, {ranks} rank{'s' if ranks > 1 else ''} (s)", side, seconds)

    def dedup(self, side: Side, n: int) -> None:
        metric = f"dedup (copies_within) of {n:,} fingerprints (s)"
        if side.name == "before" and any(int(m.split()[3].replace(",", "")) <= n for m in self.capped):
            self.capped.setdefault(metric, "not run: a smaller size did not finish within the cap")
            return
        cap = self.sizes["cap"] if side.name == "before" else 3600
        result, seconds = run(side, probe("dedup", "--n", n), cap, self.log)
        if result is None:
            self.capped[metric] = f"not done within {cap} s (capped)"
            return
        self.record(metric, side, result["seconds"])
        self.record(metric.replace(" (s)", ": samples dropped"), side, result["dropped"])

    def filter(self, side: Side) -> None:
        output = self.work / f"filtered_{side.name}"
        shutil.rmtree(output, ignore_errors=True)
        argv = ["data", "filter", "--shards", self.all_shards(), "--embeddings", self.sidecars(side)]
        result, _ = run(side, probe("cli", "--", *argv, "--output", output, "--clip_score_min", "0.0"), 1800, self.log)
        samples = SOURCES * 2 * self.sizes["samples"]
        self.record("data filter --clip_score_min samples/s", side, samples / result["seconds"])

    def embed(self, side: Side) -> None:
        output = self.work / f"embedded_{side.name}"
        shutil.rmtree(output, ignore_errors=True)
        shards = str(self.data / "shards" / "embed" / "00000.tar")
        result, _ = run(side, probe("cli", "--", *self.embed_argv(shards, output)), 1800, self.log)
        samples = self.sizes["embed_samples"]
        self.record("data embed samples/s (K = 30, 2 teachers, 6 captions)", side, samples / result["seconds"])

    def measurements(self):
        """(name, measure) in order; --only keeps the named ones."""
        yield "imports", self.imports
        for sources in STREAM_SOURCES:
            yield "stream", lambda side, s=sources: self.stream(side, s)
        yield "startup", self.startup
        for ranks in (1, 2):
            yield "suite", lambda side, r=ranks: self.suite(side, r)
        for n in self.sizes["dedup"]:
            yield "dedup", lambda side, n=n: self.dedup(side, n)
        yield "filter", self.filter
        yield "embed", self.embed

    def run_rounds(self, done) -> None:
        """Every round; `done(rounds)` after each (the CSV is written then: a run stopped later keeps those rows)."""
        for r in range(self.args.rounds):
            order = self.sides if r % 2 == 0 else self.sides[::-1]
            for name, measure in self.measurements():
                if self.args.only and name not in self.args.only:
                    continue
                for side in order:
                    measure(side)
            print(f"round {r + 1} of {self.args.rounds} done", flush=True)
            done(r + 1)


def rows(bench: Bench, scale: str) -> list[dict]:
    before, after = bench.sides
    out = []
    for metric, by_side in bench.values.items():
        settings = {"metric": metric, "before_commit": before.commit, "after_commit": after.commit, "scale": scale}
        if "before" not in by_side:
            settings["before_note"] = bench.capped.get(metric.replace(": samples dropped", " (s)"), "not measured")
            out.append(bench_row(settings, {"after": by_side["after"]}))
            continue
        pairs = list(zip(by_side["before"], by_side["after"]))
        ratio = [a / b if b else float("nan") for b, a in pairs]
        samples = {"before": [b for b, _ in pairs], "after": [a for _, a in pairs]}
        if all(r == r for r in ratio):
            samples["ratio"] = ratio
        out.append(bench_row(settings, samples))
    return out


def table(rows: list[dict]) -> str:
    """The README's table: median (min to max) of each side and the ratio."""

    def cell(row, name):
        if f"{name}_median" not in row:
            return row.get("before_note", "") if name == "before" else ""
        lo, mid, hi = (row[f"{name}_{s}"] for s in ("min", "median", "max"))
        return f"{mid:.4g} ({lo:.4g} to {hi:.4g})" if lo != hi else f"{mid:.4g}"

    lines = ["| metric | before | after | after / before |", "| --- | --- | --- | --- |"]
    lines += [f"| {r['metric']} | {cell(r, 'before')} | {cell(r, 'after')} | {cell(r, 'ratio')} |" for r in rows]
    return "\n".join(lines) + "\n"


def before_tree(commit: str, work: Path) -> Path:
    tree = work / "before"
    subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(tree), commit], check=True)
    return tree


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", required=True, help="the commit before (checked out into a temporary worktree)")
    parser.add_argument("--after", default=str(REPO), help="the tree after (default: this checkout)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="every measurement at small sizes (a smoke run)")
    parser.add_argument("--data", default=os.path.join(tempfile.gettempdir(), "scale_bench_data"))
    parser.add_argument("--only", type=lambda s: s.split(","), help="comma-separated: " + ", ".join(MEASURES))
    parser.add_argument("--csv", help="default: bench/scale/results/scale.csv (scale_quick.csv with --quick)")
    args = parser.parse_args()
    sizes = SIZES["quick" if args.quick else "default"]
    data = Path(args.data) / ("quick" if args.quick else "default")
    build(data, sizes["samples"], sizes["eval_images"], sizes["embed_samples"])
    work = Path(tempfile.mkdtemp(prefix="scale_bench_"))
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # the worktree is removed on a kill too
    tree = before_tree(args.before, work)
    try:
        after = Path(args.after).resolve()
        sides = [Side("before", tree, tree_commit(tree)), Side("after", after, tree_commit(after))]
        bench = Bench(args, sides, data, work)
        print(f"log: {bench.log}", flush=True)
        bench.prepare()
        scale = f"{sizes['samples']} samples a shard (DataCompDR: {DATACOMPDR_SHARD:,})"
        csv = Path(args.csv or HERE / "results" / f"{'scale_quick' if args.quick else 'scale'}.csv")

        def write(rounds: int) -> None:
            result = rows(bench, scale)
            write_rows(csv, result, command=command_line())
            csv.with_suffix(".md").write_text(table(result))
            print(table(result), f"wrote {csv} ({rounds} of {args.rounds} rounds)", sep="\n", flush=True)

        bench.run_rounds(write)
    finally:
        subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(tree)], check=False)
        if (work / "bench.log").exists():  # kept for a look at what each command printed
            shutil.copy(work / "bench.log", Path(tempfile.gettempdir()) / "scale_bench_last.log")
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
