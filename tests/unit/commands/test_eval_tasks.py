"""`disco-clip eval --tasks FILE --output DIR` (commands/eval.py): every task with one model load, each task's
record as the single-set form writes it, the table, TensorBoard scalars, and the exit code of a failed task."""

from __future__ import annotations

import json

import pytest

from disco_clip_ds.errors import EXIT_FAILED, EXIT_USAGE

from unit.eval.sets import eval_main, record


@pytest.fixture
def task_list(cls_set, tmp_path):
    """Two tasks over cls_set: as plain shards beside the list, and as CLIP_benchmark's layout (test/ split)."""
    folder = cls_set[0]
    (tmp_path / "wds" / "test").mkdir(parents=True)
    for i, shard in enumerate(sorted(folder.glob("*.tar"))):
        (tmp_path / "wds" / "test" / f"{i}.tar").write_bytes(shard.read_bytes())
    (tmp_path / "wds" / "test" / "nshards.txt").write_text("3\n")
    for name in ("classnames.txt", "zeroshot_classification_templates.txt"):
        (tmp_path / "wds" / name).write_text((folder / name).read_text())
    text = f"plain:\n  name: Plain\n  path: {folder}\nwds:\n  main_metric: mean_per_class_recall\n  path: wds\n"
    (tmp_path / "tasks.yml").write_text(text)
    return tmp_path / "tasks.yml"


@pytest.mark.slow  # beyond the fast tier's time budget
def test_tasks_write_each_record_as_the_single_set_form_and_the_table(task_list, model_dir, cls_set, tmp_path, capsys):
    out, runs = tmp_path / "out", tmp_path / "tb"
    argv = ["--model", str(model_dir), "--tasks", str(task_list), "--output", str(out), "--run_dir", str(runs)]
    assert eval_main([*argv, "--batch_size", "3"]) == 0
    printed = capsys.readouterr().out
    single = record(["--model", str(model_dir), "--data", str(cls_set[0]), "--batch_size", "3"], capsys)
    for key in ("plain", "wds"):
        written = json.loads((out / f"{key}.json").read_text())
        assert written["metrics"] == single["metrics"] and written["dataset"] == key
    rows = (out / "suite.csv").read_text().splitlines()
    assert rows[0] == "task,name,type,main_metric,value,seconds,error" and rows[-1].startswith("average,")
    acc1, recall = single["metrics"]["acc1"], single["metrics"]["mean_per_class_recall"]
    assert float(rows[-1].split(",")[4]) == pytest.approx((acc1 + recall) / 2)
    assert printed == (out / "suite.md").read_text() + f"each task's record and the table (suite.md) in {out}\n"
    assert f"| wds | zeroshot_classification | mean_per_class_recall | {recall:.4f} |" in printed
    assert list(runs.glob("events.out.tfevents.*"))


@pytest.mark.slow  # beyond the fast tier's time budget
def test_a_failed_task_is_in_its_row_the_others_run_and_the_exit_code_says_so(task_list, model_dir, tmp_path, capsys):
    """A missing folder: exit 2 (a usage error, errors.py's map), an unreadable shard: exit 1 (a data error); the
    other task's record is written either way, and the message names the failed tasks."""
    out = tmp_path / "out"
    with open(task_list, "a") as f:
        f.write("missing: {path: no_such_folder}\n")
    assert eval_main(["--model", str(model_dir), "--tasks", str(task_list), "--output", str(out)]) == EXIT_USAGE
    captured = capsys.readouterr()
    assert "| missing | zeroshot_classification | acc1 | failed |" in captured.out
    assert "1 of 3 tasks failed (missing; each error is in its row" in captured.err
    assert (out / "plain.json").is_file() and (out / "wds.json").is_file()

    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "00000.tar").write_bytes(b"not a tar" * 100)
    task_list.write_text(f"bad: {{path: bad, classnames: {tmp_path / 'wds' / 'classnames.txt'}}}\nwds: {{path: wds}}\n")
    assert eval_main(["--model", str(model_dir), "--tasks", str(task_list), "--output", str(out)]) == EXIT_FAILED
    assert "not a tar" in capsys.readouterr().out


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--data", "somewhere"], "--tasks FILE: --data belong to a single set; name them in the task list"),
        (["--split", "test"], "--tasks FILE: --split belong to a single set"),
        (["--batch_size", "0"], "--batch_size must be positive"),
    ],
)
def test_tasks_usage_errors(task_list, model_dir, capsys, extra, message):
    assert eval_main(["--model", str(model_dir), "--tasks", str(task_list), *extra]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1


def test_a_malformed_task_list_is_refused_before_the_model_loads(tmp_path, capsys):
    (tmp_path / "t.yml").write_text("a: {type: nope}\n")
    assert eval_main(["--model", "/nonexistent_but_not_checked_yet", "--tasks", str(tmp_path / "t.yml")]) == 2
    assert "--model /nonexistent_but_not_checked_yet: no such folder" in capsys.readouterr().err
    assert eval_main(["--model", "some/hub_id", "--tasks", str(tmp_path / "t.yml")]) == 2
    assert "task a has type 'nope'" in capsys.readouterr().err


def test_neither_data_nor_tasks(model_dir, capsys):
    assert eval_main(["--model", str(model_dir)]) == EXIT_USAGE
    assert "give --data (one set) or --tasks FILE" in capsys.readouterr().err


@pytest.mark.slow  # beyond the fast tier's time budget
def test_an_output_being_written_is_refused_before_the_model_loads(task_list, model_dir, cls_set, tmp_path, capsys):
    """A suite's folder, or a single set's record file (locked beside it): one line naming the writer's host and pid,
    exit 2; the holder here is a forked process holding the lock, as a running `disco-clip eval` does."""
    import socket

    from disco_clip_ds.distributed.runlock import writer_lock
    from disco_clip_ds.testing.writers import held_elsewhere

    suite, single = tmp_path / "out", tmp_path / "records" / "plain.json"
    for output, argv, beside in (
        (suite, ["--tasks", str(task_list)], False),
        (single, ["--data", str(cls_set[0])], True),
    ):
        with held_elsewhere(writer_lock(output, "--output", "disco-clip eval", beside=beside)) as pid:
            assert eval_main(["--model", str(model_dir), *argv, "--output", str(output)]) == EXIT_USAGE
        err = capsys.readouterr().err
        holder = f"(disco-clip eval: host {socket.gethostname()}, pid {pid}, since "
        assert err.startswith(f"disco-clip eval: --output {output}: being written by another process {holder}")
        assert err.count("\n") == 1 and not output.exists()
