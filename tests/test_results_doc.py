"""`docs/results.md` agrees with the JSON it cites, and the check would notice if it did not: a copy with
one number altered fails naming that cell, and a copy citing a file that does not exist fails naming it.
"""

from pathlib import Path

from loadtest.results_doc import DOC, ROOT, check, main

S4_ROW = "| the same WCS code, fourth session (6cb6639) | 1.08 | 1.02 | 1.00 | 0.93 | 0.95 | 1.33 |"
OVERLOAD_CELL = "| | 4x | 3.80 | 0.51 | 42.9% | 68.5% | 654 | 0 | |"


def altered(tmp_path: Path, old: str, new: str) -> Path:
    text = DOC.read_text()
    assert text.count(old) == 1, old
    copy = tmp_path / "results.md"
    copy.write_text(text.replace(old, new))
    return copy


def test_the_real_document_matches_its_json(capsys):
    report = check()
    assert report.problems == []
    checked = {name for table in report.tables if table.annotated and table.cells_checked for name in table.files}
    assert {"bench_engine_steady_s4.json", "overload.json", "bench_engine.json", "compare_tpot_sweep.json"} <= checked
    assert sum(table.cells_checked for table in report.tables) >= 250
    assert main(["check"]) == 0
    assert "bench_engine_steady_s4.json" in capsys.readouterr().out


def test_an_altered_number_fails_naming_its_file_row_and_column(tmp_path, capsys):
    copy = altered(tmp_path, S4_ROW, S4_ROW.replace("| 0.93 |", "| 0.94 |"))
    [problem] = check(copy, ROOT).problems
    assert "bench_engine_steady_s4.json" in problem.message
    assert "fourth session (6cb6639)" in problem.message and "column '64'" in problem.message
    assert "quoted 0.94" in problem.message

    copy = altered(tmp_path, OVERLOAD_CELL, OVERLOAD_CELL.replace("42.9%", "43.9%"))
    [problem] = check(copy, ROOT).problems
    assert "overload_before.json" in problem.message and "2c10150 / 4x" in problem.message
    assert "column 'admitted attainment'" in problem.message
    assert main(["check", str(copy)]) == 1
    assert "admitted attainment" in capsys.readouterr().err


def test_a_missing_file_fails(tmp_path):
    copy = altered(tmp_path, "| `compare_seed6.json` |", "| `compare_seed9.json` |")
    [problem] = check(copy, ROOT).problems
    assert "compare_seed9.json" in problem.message and "does not exist" in problem.message

    copy.write_text(DOC.read_text() + "\nSee `results/never_run.json`.\n")
    [problem] = check(copy, ROOT).problems
    assert "results/never_run.json" in problem.message and "does not exist" in problem.message
    assert main(["check", str(copy)]) == 1
