"""eval/suite.py: a task list in DataComp's form, every task run with one model (a failing one reported in its row),
the table and its average, TensorBoard scalars; eval/callback.py's SuiteCallback during training; the model card's
suite section."""

from __future__ import annotations

import csv
import json
import math
import re
import tarfile

import pytest
import torch

from disco_clip_ds.errors import DataError, UsageError
from disco_clip_ds.eval import suite as suite_module
from disco_clip_ds.eval.encode import encode_images
from disco_clip_ds.eval.sources import as_batches
from disco_clip_ds.eval.suite import load_tasks, log_tensorboard, run_suite, training_tasks, write_suite
from disco_clip_ds.eval.tasks import zeroshot_classification, zeroshot_retrieval
from disco_clip_ds.testing.images import noise_image_bytes, write_samples

from unit.eval.sets import CLASSNAMES, TEMPLATES, tiny_clip, tiny_trainer

DATACOMP_FORM = """
# as DataComp's tasklist.yml: a key per task, descriptive fields besides
cifar_like:
  name: Digits
  size: 11
  time: 3
  num_classes: 6
  random_score: 0.166
  tags: [val_task]
  path: cls
retrieval/captions:
  name: Captions
  main_metric: mean_recall@1
  path: ret
  train: true
probe_like:
  type: linear_probe
  main_metric: mean_per_class_recall
  path: probe
  fewshot_k: 1
"""


@pytest.fixture(scope="module")
def sets(tmp_path_factory, cls_set):
    """A task list's folder: cls (cls_set's shards), ret (6 images, two captions each), probe (train/ and test/
    splits of cls_set's images), a shard that is not a tar (bad)."""
    import numpy as np

    root = tmp_path_factory.mktemp("suite")
    folder, images, labels = cls_set
    write_samples(root / "cls", [{"jpg": b, "cls": str(y)} for b, y in zip(images, labels)], per_shard=4)
    for name in ("classnames.txt", "zeroshot_classification_templates.txt"):
        (root / "cls" / name).write_text((folder / name).read_text())
    rng = np.random.default_rng(3)
    captions = [[f"picture number {i}", f"an image, {i * 7} of them"] for i in range(6)]
    write_samples(
        root / "ret", [{"jpg": noise_image_bytes(rng, "JPEG"), "txt": "\n".join(c)} for c in captions], per_shard=4
    )
    samples = [{"jpg": b, "cls": str(y)} for b, y in zip(images, labels)]
    write_samples(root / "probe" / "train", samples[:8] + samples[:8], per_shard=8)
    write_samples(root / "probe" / "test", samples, per_shard=8)
    (root / "bad").mkdir()
    (root / "bad" / "00000.tar").write_bytes(b"this is not a tar file" * 40)
    (root / "tasks.yml").write_text(DATACOMP_FORM)
    (root / "latin1_classnames.txt").write_bytes("zero\ncafé\n".encode("latin-1"))
    (root / "blank_templates.txt").write_text("\n  \n")
    (root / "seven_names.txt").write_text("\n".join(CLASSNAMES + ["six"]))
    latin1 = [{"jpg": noise_image_bytes(rng, "JPEG"), "txt": text.encode("latin-1")} for text in ("a", "b\ncafé")]
    write_samples(root / "ret_latin1", latin1, per_shard=4)
    return root


def test_datacomp_form_fields_and_defaults(sets):
    tasks = load_tasks(sets / "tasks.yml")
    assert [(t.key, t.name, t.type, t.main_metric) for t in tasks] == [
        ("cifar_like", "Digits", "zeroshot_classification", "acc1"),  # DataComp's default main metric
        ("retrieval/captions", "Captions", "zeroshot_retrieval", "mean_recall@1"),  # retrieval/ keys: retrieval
        ("probe_like", "probe_like", "linear_probe", "mean_per_class_recall"),
    ]
    assert tasks[0].source == str(sets / "cls")  # relative to the task list
    assert tasks[2].fewshot_k == 1 and [t.key for t in training_tasks(tasks)] == ["retrieval/captions"]
    listed = sets / "list.yml"
    listed.write_text("- {key: a, path: cls}\n- {key: b, type: retrieval, dataset: some/hub_id, split: test}\n")
    a, b = load_tasks(listed)
    assert (a.type, b.type, b.source, b.columns, b.is_path) == (
        "zeroshot_classification",
        "zeroshot_retrieval",
        "some/hub_id",
        {"split": "test"},
        False,
    )
    assert training_tasks([a, b]) == [a, b]  # none marked: all of them


@pytest.mark.parametrize(
    "text, message",
    [
        ("a: {path: x, main_metirc: acc1}", "task a has unknown field 'main_metirc'"),
        ("a: {type: detection}", "task a has type 'detection'"),
        ("a: {main_metric: recall@1}", "zeroshot_classification has no metric 'recall@1'"),
        ("a: {type: linear_probe, fewshot_k: 0}", "fewshot_k 0 must be -1 (all) or a positive count"),
        ("a: {type: linear_probe, val_proportion: 2}", "val_proportion 2.0 must be a fraction"),
        ("a: {type: linear_probe, val_proportion: .nan}", "val_proportion nan must be a fraction"),
        ("a: {path: x, dataset: y}", "names both a path and a dataset"),
        ("- {key: a}\n- {key: a}", "task a is listed twice"),
        ("a: [unclosed", "not valid YAML"),
        ("just text", "give a mapping of task keys"),
        ("a: 3", "give a mapping of task keys"),
        ("a/b: {path: x}\na_b: {path: y}", "tasks a/b and a_b would both write a_b.json: rename one"),
        ("suite: {path: x}", "task suite would write suite.json, the summary's own file: rename the task"),
        # issue 54: each was a TypeError traceback (some after the model loaded), read as true, or kept silently
        ("a: {type: [a, b]}", "task a: type must be text (quote it), not ['a', 'b']"),
        ("a: {main_metric: {x: 1}}", "task a: main_metric must be text (quote it), not {'x': 1}"),
        ("a: {dataset: 123}", "task a: dataset must be text (quote it), not 123"),
        ("a: {classnames: 5}", "task a: classnames must be text (quote it), not 5"),
        ("a: {split: [a]}", "task a: split must be text (quote it), not ['a']"),
        ('a: {train: "false"}', "task a: train must be true or false, not 'false'"),
        ("a: {fewshot_k: 1.5}", "task a: fewshot_k must be an integer, not 1.5"),
        ("a: {path: x}\nb: {}\na: {path: y}", "task a is listed twice (lines 1 and 3): give it once"),
        ("a: {path: x, path: y}", "path is given twice in one mapping (lines 1 and 1): give it once"),
        ("1: {path: x}", "task key 1 is not text: quote it"),
        ('"a\\nb": {path: x}', "task key 'a\\nb' must be printable text"),
        ('a: {path: "x\\0y"}', "task a: path 'x\\x00y' holds a character that is not printable"),
        ('a: {classnames: "\\ud800.txt"}', "task a: classnames '\\ud800.txt' holds a character that is not printable"),
        ('a: {templates: "a\\nb"}', "task a: templates 'a\\nb' holds a character that is not printable"),
        ("a: {path: x\n b: 1", "not valid YAML (expected ',' or '}', but got ':' at line 2, column 3)"),
    ],
)
def test_malformed_task_lists_are_one_line_usage_errors(tmp_path, text, message):
    path = tmp_path / "tasks.yml"
    path.write_text(text)
    with pytest.raises(UsageError, match=re.escape(message)) as caught:
        load_tasks(path)
    assert "\n" not in str(caught.value)


def test_missing_task_list_is_a_usage_error(tmp_path):
    with pytest.raises(UsageError, match="no such file"):
        load_tasks(tmp_path / "none.yml")


# issue 54: text that is not UTF-8, empty lists, a probe's class names that do not fit its labels (the first four
# tracebacks that ended the whole suite, the last said nothing); `sets` writes the files they name
HOSTILE_TEXTS = """
latin1_names: {{path: cls, classnames: '{root}/latin1_classnames.txt'}}
no_templates: {{path: cls, templates: '{root}/blank_templates.txt'}}
no_names: {{path: cls, classnames: '{root}/blank_templates.txt'}}
retrieval/latin1_caption: {{path: ret_latin1}}
probe_names: {{type: linear_probe, path: probe, classnames: '{root}/seven_names.txt'}}
"""


@pytest.fixture(scope="module")
def suite_run(sets):
    """The task list plus a missing folder and an unreadable shard, run with one tiny CLIP."""
    (sets / "with_failures.yml").write_text(
        DATACOMP_FORM + f"gone: {{path: nowhere}}\nbroken: {{path: bad, classnames: '{sets}/cls/classnames.txt'}}\n"
        "flat_probe: {type: linear_probe, path: cls}\n" + HOSTILE_TEXTS.format(root=sets)
    )
    model, tokenizer, processor = tiny_clip()
    tasks = load_tasks(sets / "with_failures.yml")
    results = run_suite(tasks, model, tokenizer, processor, batch_size=4, progress=False, model_name="tiny")
    return results, (model, tokenizer, processor)


@pytest.mark.slow  # beyond the fast tier's time budget
def test_each_task_equals_its_own_evaluation_and_failures_stay_in_their_rows(sets, suite_run):
    results, (model, tokenizer, processor) = suite_run
    by_key = {r.task.key: r for r in results}
    cls = zeroshot_classification(model, tokenizer, str(sets / "cls"), CLASSNAMES, TEMPLATES, image_processor=processor)
    assert by_key["cifar_like"].record["metrics"] == cls
    ret = zeroshot_retrieval(model, tokenizer, str(sets / "ret"), image_processor=processor)
    got = by_key["retrieval/captions"].record["metrics"]
    assert {k: got[k] for k in ret} == ret
    assert got["mean_recall@1"] == pytest.approx((ret["image_retrieval_recall@1"] + ret["text_retrieval_recall@1"]) / 2)
    assert isinstance(by_key["gone"].error, UsageError) and "no such folder" in str(by_key["gone"].error)
    assert isinstance(by_key["broken"].error, DataError) and "not a tar" in str(by_key["broken"].error)
    assert [r.value is None for r in results] == [False, False, False] + [True] * 8
    assert "a linear probe reads a train/ and a test/ split folder in" in str(by_key["flat_probe"].error)
    record = by_key["cifar_like"].record
    assert set(record) == {"dataset", "model", "pretrained", "task", "metrics", "language"}
    assert (record["dataset"], record["model"], record["task"]) == ("cifar_like", "tiny", "zeroshot_classification")


@pytest.mark.slow  # beyond the fast tier's time budget
def test_text_that_is_not_utf8_empty_lists_and_misfit_class_names_fail_their_task_alone(sets, suite_run):
    """Each is its task's one-line error; the tasks before and after them ran (the test above)."""
    errors = {r.task.key: (type(r.error), str(r.error)) for r in suite_run[0] if r.error is not None}
    assert errors["latin1_names"] == (
        UsageError,
        f"class names file {sets}/latin1_classnames.txt: line 2 is not UTF-8 text (byte 0xe9 at column 4): "
        "save it as UTF-8",
    )
    assert errors["no_templates"][0] is UsageError and "holds no lines: give a template" in errors["no_templates"][1]
    assert errors["no_names"][0] is UsageError and "holds no lines: give a class name" in errors["no_names"][1]
    kind, text = errors["retrieval/latin1_caption"]
    assert kind is DataError and text.endswith(
        "its .txt: line 2 is not UTF-8 text (byte 0xe9 at column 4): save it as UTF-8"
    )
    assert errors["probe_names"] == (
        UsageError,
        f"task probe_names: 7 class names ({sets}/seven_names.txt) for the 6 classes "
        "of its train split (labels 0..5): give one name per class, or none",
    )
    assert all("\n" not in text for _, text in errors.values())


@pytest.mark.slow  # beyond the fast tier's time budget
def test_linear_probe_task_takes_the_image_features_of_both_splits(sets, suite_run, monkeypatch):
    """The probe gets the image tower's normalised features of train/ and test/ with their labels, and its
    few-shot k; its metrics land in the record under CLIP_benchmark's lp_ names."""
    results, (model, _, processor) = suite_run
    probe = next(r for r in results if r.task.key == "probe_like")
    assert probe.value == probe.record["metrics"]["lp_mean_per_class_recall"]
    assert set(probe.record["metrics"]) >= {"lp_acc1", "lp_acc5", "lp_mean_per_class_recall"}
    seen = {}

    def fake_probe(train_x, train_y, test_x, test_y, **settings):
        seen.update(train=(train_x, train_y), test=(test_x, test_y), settings=settings)
        return {"acc1": 0.5, "acc5": 1.0, "mean_per_class_recall": 0.25}

    monkeypatch.setattr(suite_module, "linear_probe", fake_probe)
    (result,) = run_suite([probe.task], model, None, processor, batch_size=5, progress=False)
    for split in ("train", "test"):
        batches = list(as_batches(str(sets / "probe" / split), processor, "cls", 3))
        want_x = torch.cat([encode_images(model, pixels) for pixels, _ in batches])
        assert torch.allclose(seen[split][0], want_x, atol=1e-6)
        assert seen[split][1].tolist() == [y for _, ys in batches for y in ys]
    assert seen["settings"]["fewshot_k"] == 1 and result.value == 0.25


@pytest.mark.slow  # beyond the fast tier's time budget
def test_tasks_of_the_same_classes_share_one_classifier(sets, monkeypatch):
    """The text tower runs once per (class names, templates): two tasks over the same classes, one classifier."""
    calls = []
    real = suite_module.zeroshot_classifier
    monkeypatch.setattr(suite_module, "zeroshot_classifier", lambda *a, **k: calls.append(a[2]) or real(*a, **k))
    (sets / "twice.yml").write_text("a: {path: cls}\nb: {path: cls}\n")
    model, tokenizer, processor = tiny_clip()
    a, b = run_suite(load_tasks(sets / "twice.yml"), model, tokenizer, processor, progress=False)
    assert len(calls) == 1 and a.record["metrics"] == b.record["metrics"]


def test_table_csv_json_and_average(tmp_path, suite_run):
    results, _ = suite_run
    rows = write_suite(results, tmp_path)
    values = [r.value for r in results if r.value is not None]
    assert rows[-1]["task"] == "average (3 of 11 tasks)"
    assert rows[-1]["value"] == pytest.approx(sum(values) / 3)  # DataComp's average, of the tasks that ran
    with open(tmp_path / "suite.csv") as f:
        table = list(csv.DictReader(f))
    assert [row["task"] for row in table] == [r.task.key for r in results] + ["average (3 of 11 tasks)"]
    assert float(table[0]["value"]) == pytest.approx(results[0].value) and table[3]["error"].startswith("task gone:")
    assert json.loads((tmp_path / "cifar_like.json").read_text()) == results[0].record
    assert (tmp_path / "retrieval_captions.json").is_file() and not (tmp_path / "gone.json").exists()
    markdown = (tmp_path / "suite.md").read_text().splitlines()
    assert markdown[2].startswith(f"| cifar_like | zeroshot_classification | acc1 | {results[0].value:.4f} |")
    assert "| gone | zeroshot_classification | acc1 | failed |" in markdown[5]
    assert json.loads((tmp_path / "suite.json").read_text())["rows"][0]["task"] == "cifar_like"


def test_tensorboard_scalars(tmp_path, suite_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    results, _ = suite_run
    log_tensorboard(results, tmp_path, step=7)
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    logged = {tag: events.Scalars(tag) for tag in events.Tags()["scalars"]}
    assert set(logged) == {"suite/cifar_like", "suite/retrieval/captions", "suite/probe_like", "suite/average"}
    assert [(e.step, e.value) for e in logged["suite/cifar_like"]] == [(7, pytest.approx(results[0].value))]
    values = [r.value for r in results if r.value is not None]
    assert logged["suite/average"][0].value == pytest.approx(sum(values) / 3, abs=1e-6)


@pytest.mark.slow  # beyond the fast tier's time budget
def test_suite_callback_logs_training_tasks_then_all_and_writes_the_final_suite(sets, tmp_path, cls_set):
    """Every 2 steps the tasks marked train (retrieval/captions), at the last step all of them; the last step's
    values equal a suite run of the final weights, and its table lands in OUTPUT_DIR/suite."""
    from disco_clip_ds.eval.callback import SuiteCallback

    model, tokenizer, processor = tiny_clip()
    trainer = tiny_trainer(model, tokenizer, processor, cls_set[1], tmp_path)
    SuiteCallback(sets / "tasks.yml", tokenizer, processor, every_n_steps=2, batch_size=4).attach(trainer)
    trainer.train()
    logged = {e["step"]: e for e in trainer.state.log_history if any(k.startswith("suite/") for k in e)}
    assert sorted(logged) == [2, 3]
    assert {k for k in logged[2] if k.startswith("suite/")} == {"suite/retrieval/captions", "suite/average"}
    assert {k for k in logged[3] if k.startswith("suite/")} == {
        "suite/cifar_like",
        "suite/retrieval/captions",
        "suite/probe_like",
        "suite/average",
    }
    assert any("loss" in e for e in trainer.state.log_history if e.get("step") == 2)  # the step's own log kept
    final = run_suite(load_tasks(sets / "tasks.yml"), model, tokenizer, processor, batch_size=4, progress=False)
    assert logged[3]["suite/cifar_like"] == pytest.approx(final[0].value)
    assert logged[3]["suite/probe_like"] == pytest.approx(final[2].value)
    table = json.loads((tmp_path / "suite" / "suite.json").read_text())
    assert [row["task"] for row in table["rows"]] == ["cifar_like", "retrieval/captions", "probe_like", "average"]
    assert table["rows"][-1]["value"] == pytest.approx(logged[3]["suite/average"])


def test_suite_callback_refuses_a_bad_task_list_before_training(tmp_path):
    from disco_clip_ds.eval.callback import SuiteCallback

    (tmp_path / "t.yml").write_text("a: {type: nope}\n")
    with pytest.raises(UsageError, match=r"^--eval_tasks \S+t.yml: task a has type 'nope'"):
        SuiteCallback(tmp_path / "t.yml", None, None, every_n_steps=5)
    with pytest.raises(UsageError, match="--eval_steps must be 0"):
        SuiteCallback(tmp_path / "t.yml", None, None, every_n_steps=-1)


def test_model_card_shows_the_final_suite(tmp_path, suite_run):
    from disco_clip_ds.export.card import describe_run, model_card

    results, _ = suite_run
    write_suite(results, tmp_path / "suite")
    run = describe_run(tmp_path)
    card = str(model_card(run, [], "a test"))
    section = card[card.index("## Benchmark suite") :].splitlines()
    assert f"| cifar_like | zeroshot_classification | acc1 | {results[0].value:.4f} |" in section
    assert any(line.startswith("| gone | zeroshot_classification | acc1 | failed: task gone:") for line in section)
    average = [r.value for r in results if r.value is not None]
    assert f"| average (3 of 11 tasks) |  |  | {sum(average) / 3:.4f} |" in section
    assert "## Benchmark suite" not in str(model_card(describe_run(tmp_path / "suite"), [], "a test"))


def test_unreadable_shard_member_is_reported_not_raised(tmp_path):
    """A tar cut short inside a member (a partial download) fails its task, as a DataError in its row."""
    import numpy as np

    rng = np.random.default_rng(0)
    write_samples(
        tmp_path / "cut", [{"jpg": noise_image_bytes(rng, "JPEG"), "cls": "0"} for _ in range(3)], per_shard=3
    )
    shard = tmp_path / "cut" / "00000.tar"
    with tarfile.open(shard) as tar:
        first = tar.getmembers()[0]
    shard.write_bytes(shard.read_bytes()[: first.offset_data + 10])
    (tmp_path / "t.yml").write_text("cut: {path: cut, classnames: imagenet1k, templates: openai_imagenet}\n")
    model, tokenizer, processor = tiny_clip()
    (result,) = run_suite(load_tasks(tmp_path / "t.yml"), model, tokenizer, processor, progress=False)
    assert isinstance(result.error, DataError) and result.value is None and not math.isnan(result.seconds)


def test_train_run_attaches_the_suite_every_eval_steps_or_a_fraction_of_max_steps(sets, tmp_path):
    """train/run.py's `_attach_suite`: --eval_steps is TrainingArguments' own (N steps, or a fraction of
    --max_steps), and a bad --eval_tasks is refused there, before training, as a UsageError."""
    from types import SimpleNamespace

    from disco_clip_ds.train.run import _attach_suite

    added = []
    processor = SimpleNamespace(tokenizer="tok", image_processor="images")
    for eval_steps, every in ((None, 0), (4, 4), (0.25, 3)):
        args = SimpleNamespace(eval_steps=eval_steps, max_steps=10, per_device_eval_batch_size=7)
        trainer = SimpleNamespace(args=args, add_callback=added.append)
        _attach_suite(trainer, SimpleNamespace(eval_tasks=str(sets / "tasks.yml")), processor)
        assert (added[-1].every_n_steps, added[-1].batch_size, added[-1].trainer) == (every, 7, trainer)
    (tmp_path / "bad.yml").write_text("a: {main_metric: nope}\n")
    with pytest.raises(UsageError, match="has no metric 'nope'"):
        _attach_suite(trainer, SimpleNamespace(eval_tasks=str(tmp_path / "bad.yml")), processor)


def test_a_task_that_fails_to_open_on_any_rank_is_skipped_on_all(sets, monkeypatch):
    """`agree` hears each task's local outcome before its first forward; when it says no, the task is skipped with a
    message saying so (and no forward runs), even where it opened."""
    heard = []
    (sets / "agree.yml").write_text("cifar_like: {path: cls}\ngone: {path: nowhere}\n")
    model, tokenizer, processor = tiny_clip()
    monkeypatch.setattr(suite_module, "zeroshot_classification", lambda *a, **k: pytest.fail("a forward ran"))
    results = run_suite(
        load_tasks(sets / "agree.yml"), model, tokenizer, processor, progress=False, agree=lambda ok: heard.append(ok)
    )
    assert heard == [True, False]
    assert str(results[0].error) == "task cifar_like failed on another rank: skipped on every rank"
    assert "no such folder" in str(results[1].error)


def _suite_on_rank(rank: int, world_size: int, root: str) -> list:
    from disco_clip_ds.distributed.ranks import all_true

    tasks = load_tasks(f"{root}/rank{rank}.yml")
    model, tokenizer, processor = tiny_clip()
    results = run_suite(tasks, model, tokenizer, processor, progress=False, agree=lambda ok: all_true(ok, "cpu"))
    return [(r.task.key, r.value, str(r.error or "")) for r in results]


@pytest.mark.slow
def test_two_ranks_agree_on_which_tasks_run(sets):
    """2 spawned ranks (gloo) whose second task opens on rank 0 only: both skip it, both run the others alike."""
    from disco_clip_ds.testing.ranks import run_ranks

    (sets / "rank0.yml").write_text("a: {path: cls}\nb: {path: cls}\nc: {path: ret, type: retrieval}\n")
    (sets / "rank1.yml").write_text("a: {path: cls}\nb: {path: only_on_rank0}\nc: {path: ret, type: retrieval}\n")
    rank0, rank1 = run_ranks(_suite_on_rank, 2, str(sets), timeout=300)
    assert [(key, value) for key, value, _ in rank0] == [(key, value) for key, value, _ in rank1]
    assert rank0[1] == ("b", None, "task b failed on another rank: skipped on every rank")
    assert "no such folder" in rank1[1][2] and rank0[0][1] is not None and rank0[2][1] is not None


@pytest.mark.slow
def test_a_bad_shard_checked_by_one_rank_fails_its_task_on_every_rank(sets):
    """The shards' checks are dealt out across ranks: a task whose second shard is not a tar (checked by rank 1 alone)
    fails on both ranks with that shard's error, no rank waiting for the other, and the next task runs on both."""
    import shutil

    from disco_clip_ds.testing.ranks import run_ranks

    half = sets / "half_bad"
    half.mkdir(exist_ok=True)
    shutil.copy(sets / "cls" / "00000.tar", half / "00000.tar")
    (half / "00001.tar").write_bytes(b"this is not a tar file" * 40)
    shutil.copy(sets / "cls" / "classnames.txt", half / "classnames.txt")
    for rank in (0, 1):
        (sets / f"rank{rank}.yml").write_text("bad: {path: half_bad}\nc: {path: ret, type: retrieval}\n")
    rank0, rank1 = run_ranks(_suite_on_rank, 2, str(sets), timeout=300)
    assert rank0 == rank1
    assert rank0[0][1] is None and "00001.tar" in rank0[0][2] and "not a tar" in rank0[0][2]
    assert rank0[1][1] is not None


def test_a_rerun_removes_a_failed_tasks_old_record_writes_strict_json_and_escapes_the_table(tmp_path, suite_run):
    """A task that failed this time leaves no record of an earlier run beside the summary; suite.json holds no NaN
    (strict JSON readers refuse it: null instead); suite.md shows a key with a pipe, markup or a local path as one
    escaped cell."""
    import dataclasses
    import math

    from disco_clip_ds.eval.suite import TaskResult, check_output

    results, _ = suite_run
    (tmp_path / "gone.json").write_text("{}")  # as an earlier run that succeeded wrote it
    write_suite(results, tmp_path)
    assert not (tmp_path / "gone.json").exists()
    failed = [r for r in results if r.value is None]
    hostile = dataclasses.replace(failed[0].task, key="x|<b>y</b> /home/alice/private/set")
    rows = write_suite([TaskResult(hostile, None, failed[0].error, 0.0)], tmp_path / "all_failed")
    assert math.isnan(rows[-1]["value"])
    text = (tmp_path / "all_failed" / "suite.json").read_text()
    assert "NaN" not in text and json.loads(text)["rows"][-1]["value"] is None
    table = (tmp_path / "all_failed" / "suite.md").read_text()
    assert "<b>" not in table and "/home/alice" not in table and "x\\|&lt;b&gt;y&lt;/b&gt; set" in table
    (tmp_path / "a_file").write_text("")
    with pytest.raises(UsageError, match="--output .*a_file is a file: name a folder"):
        check_output(tmp_path / "a_file")
