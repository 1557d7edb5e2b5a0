"""A benchmark suite: a task list in DataComp's `tasklist.yml` form over CLIP_benchmark-format sets, every task in
one process, each task's main metric and their average as DataComp reports it.

The task list (its YAML form, fields and schema) is read and checked by eval/tasklist.py, before any model
loads; `load_tasks` and `training_tasks` are imported from here too.

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
from dataclasses import dataclass
from pathlib import Path

import torch

from disco_clip_ds.atomic import write_json, write_text
from disco_clip_ds.data.redact import public_text
from disco_clip_ds.errors import DataError, DiscoClipError, UsageError
from disco_clip_ds.eval.encode import EvalMode, encode_images, unwrap, zeroshot_classifier
from disco_clip_ds.eval.probe import CLIP_BENCHMARK_NAMES as PROBE_NAMES
from disco_clip_ds.eval.probe import linear_probe
from disco_clip_ds.eval.sources import as_raw_batches, check_eval_shards, kept, skipped_of, split_shards
from disco_clip_ds.eval.spread import spread
from disco_clip_ds.eval.tasklist import Task, record_file
from disco_clip_ds.eval.tasklist import load_tasks as load_tasks
from disco_clip_ds.eval.tasklist import training_tasks as training_tasks
from disco_clip_ds.eval.tasks import (
    check_class_indices,
    find_templates,
    open_eval_data,
    progress_bar,
    skipped_note,
    with_skipped,
    zeroshot_classification,
    zeroshot_retrieval,
)


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


def check_output(output: str | Path, flag: str = "--output") -> None:
    """Refuse, before any work, an output folder that is an existing file."""
    if Path(output).exists() and not Path(output).is_dir():
        raise UsageError(f"{flag} {output} is a file: name a folder for the tasks' records and the summary")


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

    Each task's files are opened (`prepare_task`) before its first forward. `agree(ok)` (training: true on every rank
    when true on all) then decides on every rank whether the task runs: under ZeRO-3 a task that could not be opened
    on one rank is skipped on all of them, where the others would wait for it in a forward. A task that runs first
    checks its shards' headers, dealt out across ranks (a shard that fails fails the task on every rank)."""
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
    """Open one task's files (shard lists, class names, templates: no forward yet) and return the function that
    evaluates it: its shards' headers checked across ranks first (`checked`), then its metrics with CLIP_benchmark's
    names (retrieval adds DataComp's mean_recall@1)."""
    desc = f"{task.key} ({task.type})"
    if task.is_path and not any(c in task.source for c in "{:") and not Path(task.source).exists():
        raise UsageError(f"task {task.key}: no such folder '{task.source}' (its path, relative to the task list)")
    settings = dict(image_processor=image_processor, batch_size=batch_size, progress=progress, desc=desc)
    if task.type == "zeroshot_retrieval":
        data, _ = open_eval_data(task.source, task.type, check=False, **task.columns)

        def retrieval() -> dict:
            checked(data, task.type)
            metrics = zeroshot_retrieval(model, tokenizer, data, **settings)
            metrics["mean_recall@1"] = (metrics["image_retrieval_recall@1"] + metrics["text_retrieval_recall@1"]) / 2
            return metrics

        return retrieval
    if task.type == "linear_probe":
        return _linear_probe(task, model, image_processor, batch_size, progress, desc)
    data, classnames = open_eval_data(task.source, task.type, task.classnames, check=False, **task.columns)
    templates = find_templates(task.source, task.templates)

    def classification() -> dict:
        checked(data, task.type)
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
    columns = {**task.columns, "split": task.train_split}
    train, classnames = open_eval_data(task.source, task.type, task.classnames, check=False, **columns)
    test, _ = open_eval_data(task.source, task.type, task.classnames, check=False, **task.columns)

    def probe() -> dict:
        checked(train, task.type)
        checked(test, task.type)
        train_x, train_y, skipped = image_features(model, train, image_processor, batch_size, progress, f"{desc} train")
        test_x, test_y, more = image_features(model, test, image_processor, batch_size, progress, f"{desc} test")
        if classnames is not None:  # the probe needs no names, but names it is given must fit its labels
            check_class_names(task, classnames, train_y, test_y)
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


def checked(data, task_type: str) -> None:
    """A task's shards' headers checked across ranks before its first forward (`check_eval_shards`, dealt: a
    collective, reached by every rank once they agreed the task opened); a datasets source was checked on opening."""
    if isinstance(data, list):
        check_eval_shards(data, task_type, dealt=True)


def check_class_names(task: Task, classnames: list[str], train_y: torch.Tensor, test_y: torch.Tensor) -> None:
    """A linear probe's class names fit its labels: every index names one, and the task's own list (its
    `classnames` field) has one name per class of the train split, which sizes the probe (CLIP_benchmark's rule)."""
    for split, labels in ((task.train_split, train_y), ("test", test_y)):
        check_class_indices(labels, classnames, f"task {task.key}, {split} split: ")
    n_classes = int(train_y.max()) + 1
    if task.classnames and len(classnames) != n_classes:
        raise UsageError(
            f"task {task.key}: {len(classnames)} class names ({task.classnames}) for the {n_classes} classes of its "
            f"{task.train_split} split (labels 0..{n_classes - 1}): give one name per class, or none"
        )


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
    write_text(out / "suite.md", markdown(rows))
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=list(rows[0]))
    writer.writeheader()
    writer.writerows(rows)
    write_text(out / "suite.csv", buffer.getvalue())
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
