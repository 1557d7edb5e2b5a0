"""A benchmark suite: a task list in DataComp's `tasklist.yml` form over CLIP_benchmark-format sets, every task in
one process, each task's main metric and their average as DataComp reports it.

The task list is YAML: a mapping from each task's key to its fields, as DataComp's (`vtab/cifar100: {name: ...,
main_metric: ...}`), or a list of such mappings each with a `key`. Fields:

    name           the task's name in the table (default: its key)
    type           zeroshot_classification (default), zeroshot_retrieval (or retrieval; the default for a key
                   under retrieval/, as DataComp's), linear_probe
    main_metric    the metric in the table and the average (default: acc1; mean_recall@1 for retrieval, the mean of
                   image and text recall@1, as DataComp's)
    path           a folder in CLIP_benchmark's wds layout (DIR/test/, DIR/train/ for linear_probe) or shards;
                   relative to the task list's folder; default: the task list's folder / key
    dataset        a 🤗 datasets source instead (id or folder), with split, train_split, config, image_column,
                   label_column, caption_column
    classnames, templates   as `disco-clip eval` takes them (files, shipped or CLIP_benchmark names)
    fewshot_k      linear_probe: training samples per class (-1: all)
    val_proportion linear_probe: the share of the train split held out to choose the weight decay (CLIP_benchmark's
                   --val_proportion; default none: no sweep, weight decay 0, as its default)
    train          true: run during training by `--eval_tasks` (when no task is marked, all are)

DataComp's descriptive fields (size, time, num_classes, random_score, tags) are accepted and shown nowhere; any
other field is refused, so a misspelt one is not silently ignored.

On N ranks (`disco-clip eval` under torchrun, `--eval_tasks` in training) the suite runs on every rank together and
the work is split: each task's batches are dealt out across the ranks and their outputs gathered back in order
(eval/spread.py; under ZeRO-3 a forward is a collective, so every rank takes part in each round), and a linear
probe's weight-decay candidates are trained on different ranks (eval/probe.py), on the model's device. Every rank
ends with the same metrics, equal to one rank's.
"""

from __future__ import annotations

import csv
import io
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from disco_clip_ds.data.redact import public_text
from disco_clip_ds.data.shards import write_json
from disco_clip_ds.errors import DataError, DiscoClipError, UsageError
from disco_clip_ds.eval.encode import EvalMode, encode_images, unwrap, zeroshot_classifier
from disco_clip_ds.eval.probe import CLIP_BENCHMARK_NAMES as PROBE_NAMES
from disco_clip_ds.eval.probe import linear_probe
from disco_clip_ds.eval.sources import as_raw_batches, kept, skipped_of, split_shards
from disco_clip_ds.eval.spread import spread
from disco_clip_ds.eval.tasks import (
    find_templates,
    open_eval_data,
    progress_bar,
    skipped_note,
    with_skipped,
    zeroshot_classification,
    zeroshot_retrieval,
)

TYPES = {"zeroshot_classification", "zeroshot_retrieval", "linear_probe"}
TYPE_ALIASES = {"retrieval": "zeroshot_retrieval", "classification": "zeroshot_classification"}
CLASSIFICATION_METRICS = {"acc1", "acc5", "mean_per_class_recall"}
RETRIEVAL_METRICS = {f"{side}_retrieval_recall@{k}" for side in ("image", "text") for k in (1, 5, 10)} | {
    "mean_recall@1"
}
METRICS = {
    "zeroshot_classification": CLASSIFICATION_METRICS,
    "zeroshot_retrieval": RETRIEVAL_METRICS,
    "linear_probe": CLASSIFICATION_METRICS,
}
DEFAULT_METRIC = {"zeroshot_classification": "acc1", "zeroshot_retrieval": "mean_recall@1", "linear_probe": "acc1"}
SOURCE_FIELDS = ("split", "train_split", "config", "image_column", "label_column", "caption_column")
FIELDS = {"key", "name", "type", "main_metric", "path", "dataset", "classnames", "templates", "train", *SOURCE_FIELDS}
FIELDS |= {"fewshot_k", "val_proportion"}
DATACOMP_FIELDS = {"size", "time", "num_classes", "random_score", "tags"}  # descriptive: accepted, not used


@dataclass(frozen=True)
class Task:
    """One entry of the task list, its fields checked and its path resolved (`load_tasks`)."""

    key: str
    name: str
    type: str
    main_metric: str
    source: str  # a folder / shard spec, or a datasets source
    columns: dict = field(default_factory=dict)  # split, config and columns of a datasets source (or a wds split)
    train_split: str = "train"
    classnames: str | None = None
    templates: str | None = None
    fewshot_k: int = -1
    val_proportion: float | None = None
    train: bool = False
    is_path: bool = True  # `source` is the task's path (else a datasets source)


@dataclass
class TaskResult:
    """A task's CLIP_benchmark record, or the one-line error that stopped it; the seconds it took."""

    task: Task
    record: dict | None = None
    error: DiscoClipError | OSError | None = None
    seconds: float = 0.0

    @property
    def value(self) -> float | None:
        if self.record is None:
            return None
        return self.record["metrics"].get(record_metric(self.task.type, self.task.main_metric))


def record_metric(kind: str, metric: str) -> str:
    """A metric's name in the CLIP_benchmark record: a linear probe's are lp_acc1, lp_acc5, ... there."""
    return PROBE_NAMES.get(metric, metric) if kind == "linear_probe" else metric


def load_tasks(path: str | Path, flag: str = "--tasks") -> list[Task]:
    """The tasks of a task list (see the module docstring); every problem is a one-line UsageError naming `flag`."""
    import yaml

    path, where = Path(path), f"{flag} {path}"
    if not path.is_file():
        raise UsageError(f"{where}: no such file (a YAML task list in DataComp's tasklist.yml form)")
    try:
        entries = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise UsageError(f"{where}: not valid YAML ({str(e).splitlines()[0]})") from e
    if isinstance(entries, dict) and all(isinstance(fields, (dict, type(None))) for fields in entries.values()):
        entries = [{"key": key, **(fields or {})} for key, fields in entries.items()]
    if not isinstance(entries, list) or not entries or not all(isinstance(e, dict) for e in entries):
        raise UsageError(f"{where}: give a mapping of task keys to their fields, or a list of tasks")
    tasks = [_task(entry, path.parent, where) for entry in entries]
    keys = [task.key for task in tasks]
    repeated = sorted({key for key in keys if keys.count(key) > 1})
    if repeated:
        raise UsageError(f"{where}: task {repeated[0]} is listed twice")
    files: dict[str, str] = {}
    for key in keys:  # one record file per task, and none that the summary's own files would overwrite
        name = record_file(key)
        if name in SUMMARY_FILES:
            raise UsageError(f"{where}: task {key} would write {name}, the summary's own file: rename the task")
        if name in files:
            raise UsageError(f"{where}: tasks {files[name]} and {key} would both write {name}: rename one")
        files[name] = key
    return tasks


SUMMARY_FILES = ("suite.md", "suite.csv", "suite.json")


def record_file(key: str) -> str:
    """The file name of a task's CLIP_benchmark record in the suite's output folder (its key, / as _)."""
    return f"{key.replace('/', '_')}.json"


def check_output(output: str | Path, flag: str = "--output") -> None:
    """Refuse, before any work, an output folder that is an existing file."""
    if Path(output).exists() and not Path(output).is_dir():
        raise UsageError(f"{flag} {output} is a file: name a folder for the tasks' records and the summary")


def _task(entry: dict, base: Path, where: str) -> Task:
    key = str(entry.get("key") or entry.get("name") or "")
    if not key:
        raise UsageError(f"{where}: a task without a key or name")
    unknown = sorted(set(entry) - FIELDS - DATACOMP_FIELDS)
    if unknown:
        raise UsageError(f"{where}: task {key} has unknown field '{unknown[0]}' (fields: {', '.join(sorted(FIELDS))})")
    default_type = "zeroshot_retrieval" if key.startswith("retrieval/") else "zeroshot_classification"
    kind = TYPE_ALIASES.get(entry.get("type"), entry.get("type") or default_type)
    if kind not in TYPES:
        raise UsageError(f"{where}: task {key} has type '{kind}' (types: {', '.join(sorted(TYPES))}, retrieval)")
    metric = entry.get("main_metric") or DEFAULT_METRIC[kind]
    if metric not in METRICS[kind]:
        raise UsageError(f"{where}: task {key}: {kind} has no metric '{metric}' ({', '.join(sorted(METRICS[kind]))})")
    if entry.get("path") and entry.get("dataset"):
        raise UsageError(f"{where}: task {key} names both a path and a dataset: give one")
    source = entry.get("dataset") or str(base / str(entry.get("path") or key))
    fewshot_k = entry.get("fewshot_k", -1)
    if not isinstance(fewshot_k, int) or fewshot_k == 0 or fewshot_k < -1:
        raise UsageError(f"{where}: task {key}: fewshot_k {fewshot_k} must be -1 (all) or a positive count")
    val_proportion = entry.get("val_proportion")
    if val_proportion is not None and not (isinstance(val_proportion, float) and 0 < val_proportion < 1):
        raise UsageError(f"{where}: task {key}: val_proportion {val_proportion} must be a fraction, e.g. 0.2")
    columns = {name: entry[name] for name in SOURCE_FIELDS if entry.get(name) and name != "train_split"}
    return Task(
        key=key,
        name=str(entry.get("name") or key),
        type=kind,
        main_metric=metric,
        source=source,
        columns=columns,
        train_split=entry.get("train_split") or "train",
        classnames=entry.get("classnames"),
        templates=entry.get("templates"),
        fewshot_k=fewshot_k,
        val_proportion=val_proportion,
        train=bool(entry.get("train", False)),
        is_path=not entry.get("dataset"),
    )


def training_tasks(tasks: Sequence[Task]) -> list[Task]:
    """The tasks marked `train: true`, or all of them when none is."""
    return [task for task in tasks if task.train] or list(tasks)


def run_suite(
    tasks: Sequence[Task],
    model,
    tokenizer,
    image_processor,
    *,
    batch_size: int = 64,
    progress: bool = True,
    model_name: str = "",
    agree: Callable[[bool], bool] | None = None,
) -> list[TaskResult]:
    """Evaluate every task with one model (loaded once by the caller); a task that fails (a missing folder, an
    unreadable shard: a project error or an OSError) is recorded in its result with its error and the others still
    run. The text tower's class-name classifiers are computed once per (class names, templates) and shared.

    Each task's files are opened and checked (`prepare_task`) before its first forward. `agree(ok)` (training: true on
    every rank when true on all) then decides on every rank whether the task runs: under ZeRO-3 a task that could not
    be opened on one rank is skipped on all of them, where the others would wait for it in a forward."""
    classifiers: dict = {}
    results = []
    for task in tasks:
        started = time.perf_counter()
        result, evaluate = TaskResult(task), None
        try:
            evaluate = prepare_task(task, model, tokenizer, image_processor, batch_size, progress, classifiers)
        except (DiscoClipError, OSError) as e:
            result.error = e
        if agree is not None and not agree(evaluate is not None) and evaluate is not None:
            evaluate = None
            result.error = DataError(f"task {task.key} failed on another rank: skipped on every rank")
        if evaluate is not None:
            try:
                result.record = clip_benchmark_record(task, evaluate(), model_name)
            except (DiscoClipError, OSError) as e:
                result.error = e
        result.seconds = time.perf_counter() - started
        results.append(result)
    return results


def prepare_task(
    task: Task, model, tokenizer, image_processor, batch_size: int, progress: bool, classifiers: dict
) -> Callable[[], dict]:
    """Open and check one task's files (shards' headers, class names, templates: no forward yet) and return the
    function that evaluates it: its metrics with CLIP_benchmark's names (retrieval adds DataComp's mean_recall@1)."""
    desc = f"{task.key} ({task.type})"
    if task.is_path and not any(c in task.source for c in "{:") and not Path(task.source).exists():
        raise UsageError(f"task {task.key}: no such folder '{task.source}' (its path, relative to the task list)")
    settings = dict(image_processor=image_processor, batch_size=batch_size, progress=progress, desc=desc)
    if task.type == "zeroshot_retrieval":
        data, _ = open_eval_data(task.source, task.type, **task.columns)

        def retrieval() -> dict:
            metrics = zeroshot_retrieval(model, tokenizer, data, **settings)
            metrics["mean_recall@1"] = (metrics["image_retrieval_recall@1"] + metrics["text_retrieval_recall@1"]) / 2
            return metrics

        return retrieval
    if task.type == "linear_probe":
        return _linear_probe(task, model, image_processor, batch_size, progress, desc)
    data, classnames = open_eval_data(task.source, task.type, task.classnames, **task.columns)
    templates = find_templates(task.source, task.templates)

    def classification() -> dict:
        key = (tuple(classnames), tuple(templates))
        if key not in classifiers:
            with EvalMode(unwrap(model)):
                classifiers[key] = zeroshot_classifier(model, tokenizer, classnames, templates, max(batch_size, 64))
        return zeroshot_classification(
            model, tokenizer, data, classnames, templates, classifier=classifiers[key], **settings
        )

    return classification


def _linear_probe(task: Task, model, image_processor, batch_size: int, progress: bool, desc: str):
    """The probe's splits opened; then image features (L2-normalised, as CLIP_benchmark's probe takes them) of the
    train and test splits, and the logistic-regression probe of eval/probe.py."""
    if task.is_path and split_shards(task.source, task.train_split) is None:
        raise UsageError(
            f"task {task.key}: a linear probe reads a {task.train_split}/ and a test/ split folder in "
            f"'{task.source}' (CLIP_benchmark's layout)"
        )
    train, _ = open_eval_data(task.source, task.type, **{**task.columns, "split": task.train_split})
    test, _ = open_eval_data(task.source, task.type, **task.columns)

    def probe() -> dict:
        train_x, train_y, skipped = image_features(model, train, image_processor, batch_size, progress, desc + " train")
        test_x, test_y, more = image_features(model, test, image_processor, batch_size, progress, desc + " test")
        device = next(unwrap(model).parameters()).device  # the model's GPU, where it has one
        metrics = linear_probe(
            train_x,
            train_y,
            test_x,
            test_y,
            fewshot_k=task.fewshot_k,
            val_proportion=task.val_proportion,
            seed=0,
            device=device,
        )
        return with_skipped(metrics, skipped + more)

    return probe


def image_features(model, data, image_processor, batch_size: int, progress: bool, desc: str):
    """(features, labels, images skipped) of a classification set: the image tower's normalised embeddings and the
    class indices of the images that decode, their batches dealt out across ranks (eval/spread.py), all of them on
    every rank, and the count of those that did not (each logged with its reason)."""
    raw, decode = as_raw_batches(data, image_processor, "cls", batch_size)

    def forward(batch):
        features = kept(encode_images(model, batch[0]), batch)
        return features, torch.as_tensor(batch[1], dtype=torch.long), len(skipped_of(batch))

    with EvalMode(unwrap(model)):
        outputs = spread(progress_bar(raw, desc, progress), decode, forward)
    features, labels, skipped = zip(*outputs) if outputs else ((), (), ())
    if sum(len(y) for y in labels) == 0:
        raise UsageError(f"{desc}: the split holds no samples" + skipped_note(sum(skipped)))
    return torch.cat(features), torch.cat(labels), sum(skipped)


def clip_benchmark_record(task: Task, metrics: dict, model_name: str) -> dict:
    """CLIP_benchmark's result record for one task, as `disco-clip eval --output` writes it."""
    return {
        "dataset": task.key,
        "model": model_name,
        "pretrained": model_name,
        "task": task.type,
        "metrics": {record_metric(task.type, name): value for name, value in metrics.items()},
        "language": "en",
    }


def average(results: Sequence[TaskResult]) -> tuple[float, int]:
    """DataComp's average: the mean of the tasks' main metrics (of those that ran, and how many did)."""
    values = [r.value for r in results if r.value is not None and not math.isnan(r.value)]
    return (sum(values) / len(values) if values else float("nan")), len(values)


def error_line(error: BaseException) -> str:
    return str(error).splitlines()[0] if str(error) else type(error).__name__


def summary_rows(results: Sequence[TaskResult]) -> list[dict]:
    """One row per task and the average: task, name, type, main metric, value, seconds, error."""
    rows = [
        {
            "task": r.task.key,
            "name": r.task.name,
            "type": r.task.type,
            "main_metric": r.task.main_metric,
            "value": r.value,
            "seconds": round(r.seconds, 2),
            "error": error_line(r.error) if r.error else "",
        }
        for r in results
    ]
    mean, counted = average(results)
    label = "average" if counted == len(results) else f"average ({counted} of {len(results)} tasks)"
    rows.append({"task": label, "name": "", "type": "", "main_metric": "", "value": mean, "seconds": "", "error": ""})
    return rows


def _shown(value) -> str:
    return f"{value:.4f}" if isinstance(value, float) and not math.isnan(value) else ("failed" if value is None else "")


def markdown(rows: Sequence[dict]) -> str:
    """The summary as a markdown table."""
    lines = ["| task | type | main metric | value | seconds | error |", "|---|---|---|---|---|---|"]
    for row in rows:
        value = _shown(row["value"]) if row["type"] else f"**{row['value']:.4f}**"
        cells = [public_text(row[k]) for k in ("task", "type", "main_metric")]  # escaped, no local path or secret
        lines.append(f"| {' | '.join(cells)} | {value} | {row['seconds']} | {public_text(row['error'])} |")
    return "\n".join(lines) + "\n"


def write_suite(results: Sequence[TaskResult], output_dir: str | Path) -> list[dict]:
    """Write one CLIP_benchmark JSON per task (`<key with / as _>.json`), suite.md, suite.csv and suite.json (the
    rows, for the model card) into `output_dir`; returns the rows."""
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    for result in results:
        record = out / record_file(result.task.key)
        if result.record is not None:
            write_json(record, result.record)
        else:  # a failed task's record of an earlier run would stand beside a summary saying it failed
            record.unlink(missing_ok=True)
    rows = summary_rows(results)
    (out / "suite.md").write_text(markdown(rows))
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=list(rows[0]))
    writer.writeheader()
    writer.writerows(rows)
    (out / "suite.csv").write_text(buffer.getvalue())
    strict = [{k: None if isinstance(v, float) and math.isnan(v) else v for k, v in row.items()} for row in rows]
    write_json(out / "suite.json", {"rows": strict, "records": [r.record for r in results if r.record]})  # no NaN
    return rows


def scalars(results: Sequence[TaskResult], prefix: str = "suite/") -> dict[str, float]:
    """{prefix + key: main metric} of the tasks that ran, and the average: what TensorBoard and the training log
    get."""
    values = {f"{prefix}{r.task.key}": r.value for r in results if r.value is not None}
    values[f"{prefix}average"] = average(results)[0]
    return values


def log_tensorboard(results: Sequence[TaskResult], run_dir: str | Path, step: int = 0) -> None:
    """The main metrics and their average as TensorBoard scalars in `run_dir` at `step`."""
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(log_dir=str(run_dir))
    try:
        for tag, value in scalars(results).items():
            writer.add_scalar(tag, value, step)
    finally:
        writer.close()
