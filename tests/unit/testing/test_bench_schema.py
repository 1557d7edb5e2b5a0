"""testing/bench_record.py: every bench result CSV carries the command, commit, machine, rounds and each measured
quantity's min / median / max; the helper writes exactly that, and the checker refuses what lacks it."""

import csv
import statistics

import pytest

from disco_clip_ds.testing.bench_record import REPO, SCHEMA, bench_row, ratios, schema_problems, write_rows

RESULTS = sorted(REPO.glob("bench/**/results/**/*.csv"))


def test_there_are_results_to_check():
    assert len(RESULTS) > 10


@pytest.mark.parametrize("path", RESULTS, ids=lambda p: str(p.relative_to(REPO)))
def test_every_bench_result_follows_the_schema(path):
    assert schema_problems(path) == []


def test_every_bench_script_writes_its_csv_through_the_helper():
    """A script with its own csv writer would write rows without the command, commit, machine and spread."""
    scripts = sorted(REPO.glob("bench/**/*.py"))
    assert scripts
    writers = ("csv.DictWriter", "csv.writer")
    own = [str(p.relative_to(REPO)) for p in scripts if any(w in p.read_text() for w in writers)]
    assert own == []


def test_a_row_holds_each_quantity_s_spread_over_its_rounds():
    row = bench_row({"model": "tiny"}, {"step_s": [0.3, 0.1, 0.2, 0.7], "ratio": [1.5, 1.0, 2.0, 1.25]})
    assert row["model"] == "tiny" and row["rounds"] == 4 and row["measured"] == "step_s;ratio"
    # by hand: sorted 0.1 0.2 0.3 0.7 -> median (0.2 + 0.3) / 2; sorted 1.0 1.25 1.5 2.0 -> (1.25 + 1.5) / 2
    assert (row["step_s_min"], row["step_s_median"], row["step_s_max"]) == (0.1, 0.25, 0.7)
    assert (row["ratio_min"], row["ratio_median"], row["ratio_max"]) == (1.0, 1.375, 2.0)


def test_rounds_must_agree_and_ratios_pair_rounds():
    with pytest.raises(ValueError, match="different round counts"):
        bench_row({}, {"a": [1, 2], "b": [1]})
    assert ratios([2.0, 3.0], [1.0, 4.0]) == [2.0, 0.75]
    with pytest.raises(ValueError, match="same number"):
        ratios([1.0], [1.0, 2.0])


def test_written_rows_carry_the_stamp_and_pass_the_check(tmp_path):
    rows = [bench_row({"K": k}, {"s": [k, 2 * k, 3 * k]}) for k in (1, 2)]
    rows.append({"K": "plan", "rounds": 1, "measured": "", "estimate_mib": 12})  # a computed row: no spread
    path = write_rows(tmp_path / "r.csv", rows, command="python bench/x.py --k 1 2")
    with open(path, newline="") as f:
        read = list(csv.DictReader(f))
    assert list(read[0])[: len(SCHEMA)] == list(SCHEMA)
    assert {r["command"] for r in read} == {"python bench/x.py --k 1 2"}
    assert all(r["commit"] and r["machine"] for r in read)
    assert float(read[1]["s_median"]) == statistics.median([2, 4, 6])
    assert read[2]["estimate_mib"] == "12" and read[0]["estimate_mib"] == ""
    assert schema_problems(path) == []


@pytest.mark.parametrize(
    "text, problem",
    [
        ("model,step_s\ntiny,1.0\n", "no column(s) command, commit, machine, rounds, measured"),
        ("command,commit,machine,rounds,measured,t_min,t_median\nc,abc,m,3,t,1,2\n", "no column(s) t_max"),
        ("command,commit,machine,rounds,measured,t_min,t_median,t_max\nc,abc,m,3,t,1,3,2\n", "does not hold"),
        ("command,commit,machine,rounds,measured\nc,abc,m,some,\n", "neither a positive count"),
        ("command,commit,machine,rounds,measured\n,abc,m,1,\n", "empty command"),
    ],
)
def test_the_check_refuses_a_file_off_the_schema(tmp_path, text, problem):
    path = tmp_path / "bad.csv"
    path.write_text(text)
    problems = schema_problems(path)
    assert len(problems) == 1 and problem in problems[0]


# The scripts that run again, or are imported, inside a peer's own venv without this checkout on its path (the
# open_clip side of bench/data/input_pipeline.py: `python input_pipeline.py --side open_clip` there, which imports
# vs_open_clip): the package may be imported only inside the functions that write results.
IN_A_PEER_VENV = ["bench/data/input_pipeline.py", "bench/vs_open_clip/vs_open_clip.py"]


@pytest.mark.parametrize("script", IN_A_PEER_VENV)
def test_a_script_run_in_a_peer_venv_imports_nothing_of_the_package_at_its_top(script):
    import ast

    tree = ast.parse((REPO / script).read_text())
    top = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
    named = [a.name for n in top if isinstance(n, ast.Import) for a in n.names]
    named += [n.module or "" for n in top if isinstance(n, ast.ImportFrom)]
    assert not [m for m in named if m.split(".")[0] == "disco_clip_ds"], named
