"""The Grafana dashboard (`manifests/grafana/forespark.json`) and the Prometheus text its queries read.

What a query needs (the metric names in its PromQL), what a scrape of a Ray
metrics agent offers (the sample names in its text), and which of the
dashboard's names a scrape lacks: the check that the dashboard shows series
the running application exports. Pure text handling: no Ray, no Serve.

Ray's metrics agent exports every `ray.util.metrics` series under Ray's
namespace: `forespark_wcs_steps` (a counter) is scraped as
`ray_forespark_wcs_steps_total`, vLLM's `vllm:time_to_first_token_seconds`
(through `RayPrometheusStatLogger`) as `ray_vllm_time_to_first_token_seconds_*`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

DASHBOARD = Path(__file__).resolve().parent.parent / "manifests" / "grafana" / "forespark.json"
SERIES_PREFIXES = ("ray_forespark_", "ray_vllm_")  # ForeSpark's own series and vLLM's, as Ray exports them

_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
_VARIABLE = re.compile(r"\$\{[^}]*\}|\$\w+")
_MATCHERS = re.compile(r"\{[^{}]*\}")
_RANGE = re.compile(r"\[[^\[\]]*\]")
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^()]*\)")
_IDENT = re.compile(r"(?<![\w.:])([a-zA-Z_:][\w:]*)(?![\w:])(?!\s*\()")
_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or", "unless", "offset", "inf", "nan"}
_LABEL_VALUES = re.compile(r"^\s*label_values\((.*)\)\s*$", re.S)
_QUERY_RESULT = re.compile(r"^\s*query_result\((.*)\)\s*$", re.S)


def query_metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression (or a Grafana `label_values` / `query_result` variable query) reads.

    Function names, label matchers and values, grouping labels, ranges, numbers, keywords and Grafana
    variables are not metric names.
    """
    values = _LABEL_VALUES.match(expr)
    if values:  # label_values(label) reads no metric; label_values(metric{...}, label) reads the metric
        masked = _MATCHERS.sub(lambda m: " " * len(m.group()), values.group(1))
        comma = masked.rfind(",")
        return query_metric_names(values.group(1)[:comma]) if comma >= 0 else set()
    result = _QUERY_RESULT.match(expr)
    if result:
        return query_metric_names(result.group(1))
    text = _STRING.sub('""', expr)
    text = _VARIABLE.sub("", text)
    text = _MATCHERS.sub(" ", text)
    text = _RANGE.sub(" ", text)
    text = _GROUPING.sub(" ", text)
    return {m for m in _IDENT.findall(text) if m.lower() not in _KEYWORDS}


def exported_names(text: str) -> set[str]:
    """The sample names in a Prometheus text exposition (`name_total`, `name_bucket`, ... as scraped)."""
    names = set()
    for line in text.splitlines():
        line = line.lstrip()
        if not line or line.startswith("#"):
            continue
        ends = [i for i in (line.find("{"), line.find(" ")) if i >= 0]
        names.add(line[: min(ends)] if ends else line)
    return names


def missing_metrics(queries: Iterable[str], text: str) -> dict[str, list[str]]:
    """Per query, the metric names it reads that the exposition `text` does not export (queries with none
    missing are left out)."""
    exported = exported_names(text)
    out = {}
    for query in queries:
        missing = sorted(query_metric_names(query) - exported)
        if missing:
            out[query] = missing
    return out


def filter_series(text: str, prefixes: tuple[str, ...] = SERIES_PREFIXES) -> str:
    """The families of `text` whose names start with one of `prefixes`, with their HELP and TYPE lines."""
    out = []
    for line in text.splitlines(keepends=True):
        if line.startswith("#"):
            parts = line.split(" ", 3)
            name = parts[2] if len(parts) > 2 else ""
        else:
            name = line
        if name.startswith(prefixes):
            out.append(line)
    return "".join(out)


def load_dashboard(path: Path = DASHBOARD) -> dict[str, Any]:
    return json.loads(Path(path).read_text())


def _panels(panels: list[dict]) -> Iterable[dict]:
    for panel in panels:
        yield panel
        yield from _panels(panel.get("panels") or [])  # collapsed rows hold their panels


def dashboard_queries(dashboard: dict[str, Any]) -> list[str]:
    """Every PromQL expression of the dashboard's panels, then its query variables' queries."""
    queries = [t["expr"] for p in _panels(dashboard.get("panels") or []) for t in p.get("targets") or [] if t.get("expr")]
    for var in (dashboard.get("templating") or {}).get("list") or []:
        if var.get("type") == "query":
            q = var.get("query")
            q = q.get("query") if isinstance(q, dict) else q
            if q:
                queries.append(q)
    return queries


def check_dashboard(dashboard: Any, prefixes: tuple[str, ...] = SERIES_PREFIXES) -> int:
    """Offline: a Grafana dashboard whose panels each query something, over a `datasource` variable, reading only
    series under `prefixes`, with balanced brackets. Returns the number of queries; raises ValueError."""
    if not isinstance(dashboard, dict) or not dashboard.get("uid") or not dashboard.get("title"):
        raise ValueError("Grafana dashboard: needs a uid and a title")
    variables = {v.get("name"): v for v in (dashboard.get("templating") or {}).get("list") or []}
    if variables.get("datasource", {}).get("type") != "datasource":
        raise ValueError("Grafana dashboard: needs a `datasource` variable (type datasource) for its panels")
    for panel in _panels(dashboard.get("panels") or []):
        if panel.get("type") == "row":
            continue
        targets = [t for t in panel.get("targets") or [] if t.get("expr")]
        if not targets:
            raise ValueError(f"Grafana dashboard: panel {panel.get('title')!r} has no query")
        if panel.get("datasource", {}).get("uid") != "${datasource}":
            raise ValueError(f"Grafana dashboard: panel {panel.get('title')!r} does not use the datasource variable")
    queries = dashboard_queries(dashboard)
    for q in queries:
        stripped = _STRING.sub('""', q)
        for a, b in ("()", "[]", "{}"):
            if stripped.count(a) != stripped.count(b):
                raise ValueError(f"Grafana dashboard: unbalanced {a}{b} in {q!r}")
        names = query_metric_names(q)
        if not names:
            raise ValueError(f"Grafana dashboard: {q!r} reads no metric")
        foreign = sorted(n for n in names if not n.startswith(prefixes))
        if foreign:
            raise ValueError(f"Grafana dashboard: {q!r} reads {foreign}, not series under {list(prefixes)}")
    return len(queries)
