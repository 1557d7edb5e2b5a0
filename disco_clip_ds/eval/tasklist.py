"""The suite's task list: read, checked against its schema and turned into `Task`s before any model loads.

The task list is YAML in DataComp's `tasklist.yml` form: a mapping from each task's key to its fields (`vtab/cifar100:
{name: ..., main_metric: ...}`), or a list of such mappings each with a `key`. Its fields are `TaskFields` (a
pydantic model, strict: a string field takes only a string, `train` only true or false, `fewshot_k` only an
integer) and mean:

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
other field is refused, so a misspelt one is not silently ignored. The YAML loader refuses a key given twice in one
mapping (a task listed twice, a field given twice), which YAML's own loaders keep silently as the last one.
"""

from __future__ import annotations

import reprlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, StrictBool, StrictFloat, StrictInt, StrictStr, ValidationError

from disco_clip_ds.errors import UsageError
from disco_clip_ds.texts import read_text

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
SUMMARY_FILES = ("suite.md", "suite.csv", "suite.json")
MAX_KEY_BYTES = 200  # a key names its record file (`record_file`), and a file name holds at most 255 bytes


class TaskFields(BaseModel):
    """The schema of one task of the list (see the module docstring); strict, so that `train: "false"` is not read
    as true nor `dataset: 123` passed on as a number."""

    model_config = ConfigDict(extra="forbid", strict=True)

    key: StrictStr | None = None
    name: StrictStr | None = None
    type: StrictStr | None = None
    main_metric: StrictStr | None = None
    path: StrictStr | None = None
    dataset: StrictStr | None = None
    classnames: StrictStr | None = None
    templates: StrictStr | None = None
    split: StrictStr | None = None
    train_split: StrictStr | None = None
    config: StrictStr | None = None
    image_column: StrictStr | None = None
    label_column: StrictStr | None = None
    caption_column: StrictStr | None = None
    fewshot_k: StrictInt = -1
    val_proportion: StrictFloat | None = None
    train: StrictBool = False
    # DataComp's descriptive fields: accepted, unused
    size: Any = None
    time: Any = None
    num_classes: Any = None
    random_score: Any = None
    tags: Any = None


FIELDS = set(TaskFields.model_fields) - {"size", "time", "num_classes", "random_score", "tags"}
EXPECTED = {"fewshot_k": "an integer", "val_proportion": "a fraction such as 0.2", "train": "true or false"}


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


_REPR = reprlib.Repr()
_REPR.maxstring = _REPR.maxother = 60
_REPR.maxlist = _REPR.maxdict = 4


def _shown(value) -> str:
    """`value` in one short line (its repr, cut): a hostile value is named without flooding the message."""
    return _REPR.repr(value)


def _named(key) -> str:
    """A key or field name as the message shows it: as written when it is short printable text, else `_shown`."""
    return key if isinstance(key, str) and key.isprintable() and 0 < len(key) <= 60 else _shown(key)


class _DuplicateKey(yaml.YAMLError):
    def __init__(self, key, lines: tuple[int, int], top_level: bool):
        what = f"task {_named(key)} is listed twice" if top_level else f"{_named(key)} is given twice in one mapping"
        super().__init__(f"{what} (lines {lines[0]} and {lines[1]}): give it once")


class _UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML's safe loader, refusing a key given twice in one mapping (the safe loader keeps the last)."""

    def construct_document(self, node):
        self._root = node
        return super().construct_document(node)

    def construct_mapping(self, node, deep=False):
        seen: dict = {}
        for key_node, _ in node.value:  # the mapping's own keys; a merge (<<) may be overridden on purpose
            if not isinstance(key_node, yaml.ScalarNode) or key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node)
            if key in seen:
                raise _DuplicateKey(key, (seen[key], key_node.start_mark.line + 1), node is self._root)
            seen[key] = key_node.start_mark.line + 1
        return super().construct_mapping(node, deep)


def load_tasks(path: str | Path, flag: str = "--tasks") -> list[Task]:
    """The tasks of a task list (see the module docstring), every one checked before any is run; every problem is a
    one-line UsageError naming `flag` and the file."""
    path, where = Path(path), f"{flag} {path}"
    if not path.is_file():
        raise UsageError(f"{where}: no such file (a YAML task list in DataComp's tasklist.yml form)")
    text = read_text(path, flag)
    try:
        entries = yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 (a SafeLoader)
    except _DuplicateKey as e:
        raise UsageError(f"{where}: {e}") from None
    except yaml.YAMLError as e:
        raise UsageError(f"{where}: not valid YAML ({_yaml_problem(e)})") from None
    except (ValueError, OverflowError, RecursionError) as e:  # a scalar the safe loader cannot build (a bad date)
        raise UsageError(f"{where}: not valid YAML ({type(e).__name__}: {_shown(str(e))})") from e
    tasks = [_task(entry, path.parent, where) for entry in _entries(entries, where)]
    _check_unique(tasks, where)
    return tasks


def _yaml_problem(error: yaml.YAMLError) -> str:
    """What YAML's parser says is wrong, and where, in one line."""
    mark, problem = getattr(error, "problem_mark", None), getattr(error, "problem", None)
    if mark is not None and problem:
        return f"{problem} at line {mark.line + 1}, column {mark.column + 1}"
    return str(error).splitlines()[0] if str(error) else type(error).__name__


def _entries(entries, where: str) -> list[dict]:
    """The list's entries as mappings with their keys: the mapping form's keys become each entry's `key`."""
    if isinstance(entries, dict) and all(isinstance(fields, (dict, type(None))) for fields in entries.values()):
        for key in entries:
            if not isinstance(key, str):
                raise UsageError(f"{where}: task key {_shown(key)} is not text: quote it")
            if isinstance(entries[key], dict) and entries[key].get("key", key) != key:
                raise UsageError(f"{where}: task {_named(key)} has a key field: its key is the mapping's, drop one")
        entries = [{**(fields or {}), "key": key} for key, fields in entries.items()]
    if not isinstance(entries, list) or not entries or not all(isinstance(e, dict) for e in entries):
        raise UsageError(f"{where}: give a mapping of task keys to their fields, or a list of tasks")
    return entries


def _fields(entry: dict, where: str) -> TaskFields:
    """`entry` checked against the schema; the first problem as one line naming the task and the field."""
    key = entry.get("key") or entry.get("name")
    task = f"task {_named(key)}" if key else "a task without a key"
    for name in entry:
        if not isinstance(name, str):
            raise UsageError(
                f"{where}: {task} has a field named {_shown(name)}: fields are {', '.join(sorted(FIELDS))}"
            )
    try:
        return TaskFields.model_validate(entry)
    except ValidationError as e:
        error = e.errors()[0]
        name = str(error["loc"][0]) if error["loc"] else "?"
        if error["type"] == "extra_forbidden":
            raise UsageError(
                f"{where}: {task} has unknown field '{_named(name)}' (fields: {', '.join(sorted(FIELDS))})"
            ) from None
        expected = EXPECTED.get(name, "text (quote it)")
        raise UsageError(f"{where}: {task}: {name} must be {expected}, not {_shown(error['input'])}") from None


def _check_key(key: str, where: str) -> None:
    if not key:
        raise UsageError(f"{where}: a task without a key or name")
    if not key.isprintable() or len(key.encode()) > MAX_KEY_BYTES:
        raise UsageError(
            f"{where}: task key {_shown(key)} must be printable text of at most {MAX_KEY_BYTES} bytes (it names the "
            "task's record file)"
        )


def _task(entry: dict, base: Path, where: str) -> Task:
    fields = _fields(entry, where)
    key = fields.key or fields.name or ""
    _check_key(key, where)
    default_type = "zeroshot_retrieval" if key.startswith("retrieval/") else "zeroshot_classification"
    kind = TYPE_ALIASES.get(fields.type or "", fields.type or default_type)
    if kind not in TYPES:
        raise UsageError(f"{where}: task {key} has type {_shown(kind)} (types: {', '.join(sorted(TYPES))}, retrieval)")
    metric = fields.main_metric or DEFAULT_METRIC[kind]
    if metric not in METRICS[kind]:
        raise UsageError(
            f"{where}: task {key}: {kind} has no metric {_shown(metric)} ({', '.join(sorted(METRICS[kind]))})"
        )
    if fields.path and fields.dataset:
        raise UsageError(f"{where}: task {key} names both a path and a dataset: give one")
    if fields.fewshot_k == 0 or fields.fewshot_k < -1:
        raise UsageError(f"{where}: task {key}: fewshot_k {fields.fewshot_k} must be -1 (all) or a positive count")
    if fields.val_proportion is not None and not 0 < fields.val_proportion < 1:
        raise UsageError(f"{where}: task {key}: val_proportion {fields.val_proportion} must be a fraction, e.g. 0.2")
    texts = {name: value for name, value in fields.model_dump().items() if isinstance(value, str)}
    bad = next((name for name, value in texts.items() if name != "name" and not _is_name(value)), None)
    if bad:
        raise UsageError(
            f"{where}: task {key}: {bad} {_shown(texts[bad])} holds a character that is not printable (a control "
            "character, NUL or an escaped surrogate): it names a file, a dataset or a column"
        )
    columns = {name: getattr(fields, name) for name in SOURCE_FIELDS if getattr(fields, name) and name != "train_split"}
    return Task(
        key=key,
        name=fields.name or key,
        type=kind,
        main_metric=metric,
        source=fields.dataset or str(base / (fields.path or key)),
        columns=columns,
        train_split=fields.train_split or "train",
        classnames=fields.classnames,
        templates=fields.templates,
        fewshot_k=fields.fewshot_k,
        val_proportion=fields.val_proportion,
        train=fields.train,
        is_path=not fields.dataset,
    )


def _is_name(text: str) -> bool:
    """Whether `text` can name a file, a dataset or a column: printable (no newline, NUL, or a lone surrogate that
    YAML's escapes can write and no file name holds)."""
    return text.isprintable()


def record_file(key: str) -> str:
    """The file name of a task's CLIP_benchmark record in the suite's output folder (its key, / as _)."""
    return f"{key.replace('/', '_')}.json"


def _check_unique(tasks: list[Task], where: str) -> None:
    """One task per key, one record file per task, and none that the summary's own files would overwrite."""
    keys = [task.key for task in tasks]
    repeated = sorted({key for key in keys if keys.count(key) > 1})
    if repeated:
        raise UsageError(f"{where}: task {repeated[0]} is listed twice")
    files: dict[str, str] = {}
    for key in keys:
        name = record_file(key)
        if name in SUMMARY_FILES:
            raise UsageError(f"{where}: task {key} would write {name}, the summary's own file: rename the task")
        if name in files:
            raise UsageError(f"{where}: tasks {files[name]} and {key} would both write {name}: rename one")
        files[name] = key


def training_tasks(tasks: list[Task]) -> list[Task]:
    """The tasks marked `train: true`, or all of them when none is."""
    return [task for task in tasks if task.train] or list(tasks)
