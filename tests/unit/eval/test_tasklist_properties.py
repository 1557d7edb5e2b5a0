"""Property tests of the task list reader (eval/tasklist.load_tasks): whatever a task list holds (wrong types,
non-finite and huge numbers, empty, control and markup text, path-like strings, keys given twice, bytes that are not
UTF-8), the only outcomes are tasks whose fields have their types, or the project's one-line UsageError."""

from __future__ import annotations

import math

import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from disco_clip_ds.errors import UsageError
from disco_clip_ds.eval.tasklist import FIELDS, Task, load_tasks

HOSTILE_TEXT = st.sampled_from(
    ["", " ", "../../etc/passwd", "/abs/path", "C:\\x", "a/b", "suite", "<b>x</b>", "| x |", "[x](y)", "{c}", "é",
     "x\ny", "\x00", "\x1b[31m", "retrieval/coco", "linear_probe", "acc1", "mean_recall@1", "true", "false", "null",
     "1e308", "x" * 300]
)  # fmt: skip
SCALARS = st.one_of(
    HOSTILE_TEXT,
    st.text(max_size=8),
    st.booleans(),
    st.none(),
    st.integers(min_value=-(10**30), max_value=10**30),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([-1, 0, 1, 5, 0.2, 1.0, 1e308, -0.0]),
)
VALUES = st.one_of(SCALARS, st.lists(SCALARS, max_size=2), st.dictionaries(st.text(max_size=3), SCALARS, max_size=2))
FIELD_NAMES = st.one_of(st.sampled_from(sorted(FIELDS | {"size", "tags"})), HOSTILE_TEXT)
# each field's good values, mixed with hostile ones, so that many lists get past the first check
GOOD = {
    "type": st.sampled_from(["zeroshot_classification", "retrieval", "linear_probe", "zeroshot_retrieval"]),
    "main_metric": st.sampled_from(["acc1", "acc5", "mean_recall@1", "text_retrieval_recall@5"]),
    "path": st.sampled_from(["cls", "a/b", "x"]),
    "dataset": st.sampled_from(["org/set", "data/x.parquet"]),
    "fewshot_k": st.sampled_from([-1, 1, 16]),
    "val_proportion": st.sampled_from([0.2, 0.5]),
    "train": st.booleans(),
    "name": st.text(max_size=8),
    "split": st.sampled_from(["test", "validation"]),
}
TASK = st.one_of(
    st.dictionaries(FIELD_NAMES, VALUES, max_size=5),
    st.fixed_dictionaries({}, optional={name: st.one_of(good, good, VALUES) for name, good in GOOD.items()}),
)
KEYS = st.one_of(st.sampled_from(["a", "b/c", "retrieval/coco", "vtab/x"]), HOSTILE_TEXT, st.text(max_size=6))
MAPPING_FORM = st.dictionaries(KEYS, st.one_of(TASK, st.none()), min_size=1, max_size=3)
LIST_FORM = st.lists(st.one_of(TASK.map(lambda t: {"key": "k", **t}), TASK), min_size=1, max_size=3)


def _documents():
    dumped = st.one_of(MAPPING_FORM, LIST_FORM, st.one_of(SCALARS, st.lists(SCALARS, max_size=2))).map(
        lambda v: yaml.safe_dump(v, allow_unicode=True).encode()
    )
    duplicated = dumped.map(lambda d: d + d if d.strip() and not d.startswith(b"-") else d)  # every key twice
    garbled = st.tuples(dumped, st.binary(max_size=4)).map(lambda pair: pair[0] + pair[1])  # maybe not UTF-8
    return st.one_of(dumped, dumped, duplicated, garbled, st.binary(max_size=40))


def _check(task: Task) -> None:
    assert isinstance(task.key, str) and task.key.isprintable() and task.key
    assert all(isinstance(v, str) for v in (task.name, task.type, task.main_metric, task.source, task.train_split))
    assert all(v is None or isinstance(v, str) for v in (task.classnames, task.templates))
    assert all(isinstance(v, str) and v for v in task.columns.values())
    assert isinstance(task.train, bool) and isinstance(task.fewshot_k, int) and not isinstance(task.fewshot_k, bool)
    assert task.fewshot_k == -1 or task.fewshot_k > 0
    assert task.val_proportion is None or (math.isfinite(task.val_proportion) and 0 < task.val_proportion < 1)


@settings(max_examples=50, derandomize=True, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(_documents())
def test_any_task_list_gives_typed_tasks_or_one_line(tmp_path, document):
    path = tmp_path / "tasks.yml"
    path.write_bytes(document)
    try:
        tasks = load_tasks(path)
    except UsageError as error:
        assert "\n" not in str(error) and str(error).startswith(f"--tasks {path}: ")
        assert len(str(error)) < 400 + len(str(path))
    else:
        assert tasks and len({task.key for task in tasks}) == len(tasks)
        for task in tasks:
            _check(task)
