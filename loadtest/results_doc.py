"""The numbers in `docs/results.md`, recomputed from the JSON files they cite.

A figure copied by hand into prose or a table drifts from its file as the text is edited, and nobody
notices until someone reruns the command. So every table of measurements names, per row, the
committed JSON it was read from (a column headed `JSON`), and an HTML comment right above the table
says where each checked column's value lives in that file:

    <!-- check: 1=wcs_vs_best.1 "vs dspark"=ratios.wcs_vs_dspark -->

Each entry maps a column header (quoted when it has spaces; backticks and bold are ignored) to an
expression over the row's JSON:

- a path of dict keys and list indices joined by dots; `name[k=v,...]` picks the one element of a
  list whose fields (dotted paths) equal those values, numbers comparing as numbers;
- `{column}` anywhere in it stands for that row's cell in `column` (its leading number if it has one:
  `2x` gives 2, `12 ms` gives 12);
- `a/b` is a ratio of two paths, and `a,b` lists values (lists flattened) that the cell quotes in order,
  as in `13 (15, 11)`.

A quoted number must equal its value rounded to the decimals it is written with; `96.5%` quotes the
fraction 0.965, `-` quotes a null, a cell without digits quotes a string, and an empty cell is not
checked. A row names its file in its JSON cell (a bare name is under `results/`); a row whose first
cell is empty continues the one above and shares its file; a row without a file is not checked.
Every cited JSON file must exist: those of the JSON columns and every `results/....json` in the text.

`python -m loadtest.results_doc check [DOC]` prints each table it checked and exits 1 on any problem;
`main(argv)` is the same for the `forespark` CLI.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import shlex
import sys
from pathlib import Path
from typing import Any

from pydantic import BaseModel

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "results.md"

_CELL_SPLIT = re.compile(r"(?<!\\)\|")
_NUMBER = re.compile(r"(?<![\w.])-?\d+(?:\.\d+)?%?")
_LEADING_NUMBER = re.compile(r"^-?\d+(?:\.\d+)?")
_JSON_NAME = re.compile(r"[\w./-]+\.json")
_CITED = re.compile(r"(?<![\w/.-])results/[\w./-]+\.json")
_CHECK = re.compile(r"<!--\s*check:(.*?)-->", re.S)
_SELECTOR = re.compile(r"^([^\[]*)\[(.*)\]$")


class Problem(BaseModel):
    """One thing wrong, located so that it can be fixed without rereading the table."""

    line: int
    message: str


class TableReport(BaseModel):
    """What one table's check covered."""

    line: int
    header: list[str]
    rows_checked: int
    cells_checked: int
    files: list[str]
    annotated: bool


class DocReport(BaseModel):
    doc: str
    tables: list[TableReport]
    problems: list[Problem]


class _Table(BaseModel):
    line: int
    header: list[str]
    rows: list[tuple[int, list[str]]]
    check: str | None


def _cells(line: str) -> list[str]:
    parts = _CELL_SPLIT.split(line.strip())
    return [p.strip() for p in parts[1:-1]]


def _plain(text: str) -> str:
    return text.replace("`", "").replace("*", "").strip()


def _tables(lines: list[str]) -> list[_Table]:
    tables: list[_Table] = []
    i = 0
    while i < len(lines):
        if not (lines[i].lstrip().startswith("|") and i + 1 < len(lines) and re.match(r"^\s*\|[\s:|-]+\|\s*$", lines[i + 1])):
            i += 1
            continue
        start = i
        header = [_plain(c) for c in _cells(lines[i])]
        i += 2
        rows: list[tuple[int, list[str]]] = []
        while i < len(lines) and lines[i].lstrip().startswith("|"):
            rows.append((i + 1, _cells(lines[i])))
            i += 1
        above = start - 1
        while above >= 0 and not lines[above].strip():
            above -= 1
        check = None
        if above >= 0 and lines[above].rstrip().endswith("-->"):
            first = above
            while first >= 0 and "<!--" not in lines[first]:
                first -= 1
            match = _CHECK.search("\n".join(lines[first : above + 1]))
            if match:
                check = match.group(1)
        tables.append(_Table(line=start + 1, header=header, rows=rows, check=check))
    return tables


def _split_top(text: str, sep: str) -> list[str]:
    parts, depth, current = [], 0, ""
    for ch in text:
        depth += {"[": 1, "]": -1}.get(ch, 0)
        if ch == sep and depth == 0:
            parts.append(current)
            current = ""
        else:
            current += ch
    parts.append(current)
    return parts


def _as_number(value: Any) -> float | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int | float):
        return float(value)
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def _equal(a: Any, b: Any) -> bool:
    na, nb = _as_number(a), _as_number(b)
    if na is not None and nb is not None:
        return math.isclose(na, nb, rel_tol=0, abs_tol=1e-12)
    return str(a) == str(b)


def _resolve(data: Any, path: str) -> Any:
    node = data
    for segment in _split_top(path, ".") if path else []:
        selector = _SELECTOR.match(segment)
        name, conditions = (selector.group(1), selector.group(2)) if selector else (segment, None)
        if name:
            if isinstance(node, dict):
                if name not in node:
                    raise KeyError(f"no key {name!r} in {path!r}")
                node = node[name]
            elif isinstance(node, list) and name.lstrip("-").isdigit():
                node = node[int(name)]
            else:
                raise KeyError(f"{name!r} of {path!r} indexes a {type(node).__name__}")
        if conditions is not None:
            if not isinstance(node, list):
                raise KeyError(f"[{conditions}] in {path!r} selects from a {type(node).__name__}, not a list")
            wanted = [c.split("=", 1) for c in conditions.split(",")]
            matches = [item for item in node if all(_equal(_lookup(item, k.strip()), v.strip()) for k, v in wanted)]
            if len(matches) != 1:
                raise KeyError(f"[{conditions}] in {path!r} matches {len(matches)} elements, not one")
            node = matches[0]
    return node


def _lookup(item: Any, path: str) -> Any:
    try:
        return _resolve(item, path)
    except (KeyError, IndexError):
        return None


def _evaluate(data: Any, expression: str) -> list[Any]:
    values: list[Any] = []
    for term in _split_top(expression, ","):
        parts = [p.strip() for p in _split_top(term, "/")]
        if len(parts) == 2:
            num, den = (_as_number(_resolve(data, p)) for p in parts)
            if num is None or den is None or den == 0:
                raise ValueError(f"{term.strip()!r} is not a ratio of two numbers")
            values.append(num / den)
        elif len(parts) == 1:
            value = _resolve(data, parts[0])
            values.extend(value if isinstance(value, list) else [value])
        else:
            raise ValueError(f"{term.strip()!r}: one '/' at most")
    return values


def _substitute(expression: str, header: list[str], cells: list[str]) -> str:
    def cell(match: re.Match[str]) -> str:
        name = match.group(1).strip()
        if name not in header:
            raise KeyError(f"{{{name}}} names no column")
        text = _plain(cells[header.index(name)])
        number = _LEADING_NUMBER.match(text)
        return number.group(0) if number else text

    return re.sub(r"\{([^}]*)\}", cell, expression)


def _compare(cell: str, values: list[Any]) -> str | None:
    """None when `cell` quotes `values`, else what differs."""
    text = _plain(cell)
    if text == "-":
        return None if all(v is None for v in values) else f"quoted a null, the file gives {values}"
    numbers = _NUMBER.findall(text)
    if not numbers:
        if len(values) == 1 and isinstance(values[0], str) and values[0] == text:
            return None
        return f"quoted {text!r}, the file gives {values}"
    if len(numbers) != len(values):
        return f"quoted {len(numbers)} numbers ({', '.join(numbers)}), the file gives {len(values)}: {values}"
    for quoted, value in zip(numbers, values):
        percent = quoted.endswith("%")
        digits = quoted.rstrip("%")
        number = _as_number(value)
        if number is None:
            return f"quoted {quoted}, the file gives {value!r}"
        shown = number * 100 if percent else number
        decimals = len(digits.split(".")[1]) if "." in digits else 0
        if abs(shown - float(digits)) > 0.5 * 10**-decimals + 1e-9:
            return f"quoted {quoted}, the file gives {shown:.{decimals + 3}f}{'%' if percent else ''}"
    return None


def _json_path(cell: str, root: Path) -> tuple[str, Path] | None:
    names = _JSON_NAME.findall(cell)
    if not names:
        return None
    name = names[0]
    return name, (root / name if "/" in name else root / "results" / name)


def _mapping(check: str) -> dict[str, str]:
    mapping: dict[str, str] = {}
    for entry in shlex.split(check):
        if "=" not in entry:
            raise ValueError(f"check entry {entry!r} is not column=path")
        column, expression = entry.split("=", 1)
        mapping[_plain(column)] = expression
    return mapping


def _check_table(table: _Table, root: Path, problems: list[Problem]) -> TableReport:
    json_column = next((i for i, h in enumerate(table.header) if h.lower() == "json"), None)
    report = TableReport(line=table.line, header=table.header, rows_checked=0, cells_checked=0, files=[], annotated=table.check is not None)
    if json_column is None:
        if table.check is not None:
            problems.append(Problem(line=table.line, message="a check comment above a table without a JSON column"))
        return report
    try:
        mapping = _mapping(table.check) if table.check is not None else {}
    except ValueError as exc:
        problems.append(Problem(line=table.line, message=str(exc)))
        return report
    for column in mapping:
        if column not in table.header:
            problems.append(Problem(line=table.line, message=f"check names column {column!r}, the table has {table.header}"))
            return report
    cache: dict[Path, Any] = {}
    current: tuple[str, Path] | None = None
    group = ""
    for line, cells in table.rows:
        cells = cells + [""] * (len(table.header) - len(cells))
        cited = _json_path(cells[json_column], root)
        if cited is not None:
            current = cited
        elif cells[0].strip():
            current = None
        if cells[0].strip():
            group = _plain(cells[0])
            label = group
        else:
            label = " / ".join(filter(None, [group, next((_plain(c) for c in cells if _plain(c)), "")]))
        if cited is not None and cited[0] not in report.files:
            report.files.append(cited[0])
        if current is None:
            continue
        name, path = current
        if not path.is_file():
            if cited is not None:
                problems.append(Problem(line=line, message=f"{name}: cited, but {path} does not exist"))
            continue
        if not mapping:
            continue
        if path not in cache:
            cache[path] = json.loads(path.read_text())
        report.rows_checked += 1
        for column, expression in mapping.items():
            cell = cells[table.header.index(column)]
            if not _plain(cell):
                continue
            where = f"{name}, row {label!r}, column {column!r}"
            try:
                values = _evaluate(cache[path], _substitute(expression, table.header, cells))
            except (KeyError, IndexError, ValueError) as exc:
                problems.append(Problem(line=line, message=f"{where}: {exc}"))
                continue
            report.cells_checked += 1
            difference = _compare(cell, values)
            if difference is not None:
                problems.append(Problem(line=line, message=f"{where}: {difference} ({expression})"))
    return report


def check(doc: Path = DOC, root: Path = ROOT) -> DocReport:
    """Every annotated table of `doc` against its JSON under `root`, and every cited file's existence."""
    lines = doc.read_text().splitlines()
    problems: list[Problem] = []
    tables = [_check_table(t, root, problems) for t in _tables(lines)]
    for number, text in enumerate(lines, start=1):
        for cited in _CITED.findall(text):
            if not (root / cited).is_file():
                problems.append(Problem(line=number, message=f"{cited}: cited, but it does not exist"))
    return DocReport(doc=str(doc), tables=tables, problems=problems)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtest.results_doc", description="check docs/results.md against the JSON it cites")
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser("check", help="recompute every annotated table from its JSON; exit 1 on any mismatch or missing file")
    run.add_argument("doc", nargs="?", type=Path, default=DOC, help="the markdown file (default docs/results.md)")
    run.add_argument("--root", type=Path, default=ROOT, help="where results/ is (default: this repository)")
    args = parser.parse_args(argv)
    report = check(args.doc, args.root)
    shown = args.doc.resolve()
    doc = str(shown.relative_to(Path.cwd())) if shown.is_relative_to(Path.cwd()) else str(shown)
    for table in report.tables:
        if not table.files:
            continue
        title = " | ".join(table.header)
        if table.annotated:
            print(f"{doc}:{table.line}: {table.rows_checked} rows, {table.cells_checked} cells against {', '.join(table.files)}  [{title}]")
        else:
            print(f"{doc}:{table.line}: files exist, numbers not annotated  [{title}]")
    for problem in report.problems:
        print(f"{doc}:{problem.line}: {problem.message}", file=sys.stderr)
    if report.problems:
        print(f"{len(report.problems)} problem(s)", file=sys.stderr)
        return 1
    print("all checked numbers match their JSON")
    return 0


if __name__ == "__main__":
    sys.exit(main())
