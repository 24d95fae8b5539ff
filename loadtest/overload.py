"""Goodput under overload: open-loop Poisson load at multiples of the sustainable rate.

`forespark overload --url URL [--capacity R] --multiples 1,2,4 --json PATH`
finds the sustainable rate with the capacity search (or takes `--capacity`),
then runs one load test per multiple and reports, per row:

- `goodput`: requests meeting every SLO per second of arrivals;
- `attainment_admitted`: SLO attainment among the requests the server took
  (not refused with 429);
- `rejected_share`: share of requests refused with 429;
- `reject_p99_ms`: p99 time to the refusal;
- `errors_5xx`: responses with a 5xx status;
- `arrival_lag_p99_ms`: how late the load generator sent requests (above
  `report.LAG_WARN_MS` the generator, not the server, shaped the arrivals);
- `host_busy_cores`: this host's busy CPU cores over the run (`/proc/stat`):
  the load generator's, and the server's when it runs here.

With `--off-url` (the same application with `router.admission.enabled:
false`), the 1x load also runs there, back to back, and `admission_cost_1x`
is 1 - goodput(on) / goodput(off). Where two servers cannot run side by side
(a 2-core machine: the idle one still takes CPU), `--off-json PATH` takes the
1x row of an earlier run against the admission-off server instead (same
capacity, same seed, so the same arrival schedule); `off_source` then names
that file, so the JSON says that the two were measured one after the other.

Each server first gets `--warmup` seconds (10) of load at 1x, not counted:
the first seconds after a start miss SLOs for reasons admission does not own
(first touches of the KV cache, the engines' and the router's first
measurements), and they fell on the 1x row, whichever server it was (an
admission-off server run cold attained 63% at a rate where, warm, it attained
97-100%). The warm-up's own row is kept in the JSON (`warmup`, `off_warmup`).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
from pydantic import BaseModel

from loadtest.config import LoadTestConfig, SLOConfig
from loadtest.refusal_cpu import busy_seconds
from loadtest.report import LoadTestReport, RequestRow


class OverloadRow(BaseModel):
    multiple: float
    rate: float
    goodput: float
    attainment_admitted: float | None
    rejected_share: float
    reject_p99_ms: float | None
    errors_5xx: int
    arrival_lag_p99_ms: float | None = None
    # Refusals answered by Serve's proxy while admission's gate is shut (cluster/proxy_gate.py), and the rest
    # (decided in the ingress), apart: where the refusals' tail comes from.
    refused_in_proxy_share: float | None = None
    reject_p99_ms_proxy: float | None = None
    reject_p99_ms_ingress: float | None = None
    # This host's busy CPU cores over the run (load generator included; the server's too when it runs here).
    host_busy_cores: float | None = None


class OverloadResult(BaseModel):
    capacity: float
    rows: list[OverloadRow]
    off_1x: OverloadRow | None = None
    admission_cost_1x: float | None = None
    off_source: str | None = None  # "same run" (--off-url) or the JSON of a separate run (--off-json)
    warmup: OverloadRow | None = None  # the warm-up before the rows, not counted in them
    off_warmup: OverloadRow | None = None  # the admission-off server's (--off-url)


def with_off(result: OverloadResult, off: OverloadRow, source: str) -> OverloadResult:
    """`result` with the admission-off server's 1x row and admission's cost at 1x: 1 - goodput(on) / goodput(off)."""
    on = next((r for r in result.rows if r.multiple == 1.0), None)
    if on is None:
        raise ValueError("admission's cost needs a 1x row in the admission-on run")
    if not math.isclose(off.rate, on.rate, rel_tol=1e-6):
        raise ValueError(f"the admission-off run loaded {off.rate:g} req/s at 1x, this one {on.rate:g}: not comparable")
    cost = 1.0 - on.goodput / off.goodput if off.goodput > 0 else None
    return result.model_copy(update={"off_1x": off, "admission_cost_1x": cost, "off_source": source})


def off_row_from(path: Path) -> OverloadRow:
    """The 1x row of an earlier `forespark overload` run (against the admission-off server)."""
    earlier = OverloadResult.model_validate_json(Path(path).read_text())
    row = next((r for r in earlier.rows if r.multiple == 1.0), None)
    if row is None:
        raise ValueError(f"{path} has no 1x row")
    return row


def _p99(values: list[float]) -> float | None:
    return float(np.percentile(values, 99)) if values else None


def overload_row(multiple: float, rate: float, rows: list[RequestRow], report: LoadTestReport, slo: SLOConfig) -> OverloadRow:
    refused = [r for r in rows if r.status == 429]
    admitted = [r for r in rows if r.status != 429]
    return OverloadRow(
        multiple=multiple,
        rate=rate,
        goodput=report.goodput_rps,
        attainment_admitted=sum(r.meets(slo) for r in admitted) / len(admitted) if admitted else None,
        rejected_share=len(refused) / len(rows) if rows else 0.0,
        reject_p99_ms=_p99([r.e2e_ms for r in refused]),
        refused_in_proxy_share=sum(r.refused_by == "proxy" for r in refused) / len(refused) if refused else None,
        reject_p99_ms_proxy=_p99([r.e2e_ms for r in refused if r.refused_by == "proxy"]),
        reject_p99_ms_ingress=_p99([r.e2e_ms for r in refused if r.refused_by != "proxy"]),
        errors_5xx=sum(1 for r in rows if r.status >= 500),
        arrival_lag_p99_ms=report.arrival_lag_ms.p99,
    )


def _busy() -> float | None:
    """`busy_seconds()`, or None on a host without `/proc/stat`."""
    try:
        return busy_seconds()
    except OSError:
        return None


def run_row(base: LoadTestConfig, slo: SLOConfig, multiple: float, capacity: float, label: str = "") -> OverloadRow:
    from loadtest.report import build_report, read_rows
    from loadtest.run import run_locust

    rate = multiple * capacity
    config = base.model_copy(update={"rate": rate, "out_dir": Path(base.out_dir) / f"{label}x{multiple:g}"})
    t0, busy0 = time.perf_counter(), _busy()
    rows = run_locust(config)
    busy1 = _busy()
    cores = (busy1 - busy0) / (time.perf_counter() - t0) if busy0 is not None and busy1 is not None else None
    report = build_report(rows, slo, rate, config.duration_s)
    row = overload_row(multiple, rate, read_rows(config.out_dir), report, slo)
    return row.model_copy(update={"host_busy_cores": cores})


RunRow = Callable[..., OverloadRow]


def measure_overload(
    base: LoadTestConfig,
    slo: SLOConfig,
    multiples: list[float],
    rate: float,
    warmup_s: float = 10.0,
    off_url: str | None = None,
    run: RunRow = run_row,
) -> OverloadResult:
    """One row per multiple of `rate` after `warmup_s` of load at `rate` that is not counted (its row is kept
    apart); with `off_url`, then a warm-up and a 1x row on the admission-off server, and admission's cost."""

    def warm(config: LoadTestConfig, label: str) -> OverloadRow | None:
        if warmup_s <= 0:
            return None
        return run(config.model_copy(update={"duration_s": warmup_s, "seed": config.seed + 1}), slo, 1.0, rate, label=label)

    warmed = warm(base, "warm-")
    result = OverloadResult(capacity=rate, rows=[run(base, slo, m, rate) for m in multiples], warmup=warmed)
    if off_url:
        off_base = base.model_copy(update={"url": off_url.rstrip("/")})
        off_warmed = warm(off_base, "off-warm-")
        off = run(off_base, slo, 1.0, rate, label="off-")
        if not any(r.multiple == 1.0 for r in result.rows):
            result.rows.insert(0, run(base, slo, 1.0, rate))
        result = with_off(result, off, "same run").model_copy(update={"off_warmup": off_warmed})
    return result


def format_overload(result: OverloadResult) -> str:
    def f(v, spec):
        return "-" if v is None else format(v, spec)

    lines = [f"capacity {result.capacity:g} req/s",
             f"{'multiple':>8} {'rate':>7} {'goodput':>8} {'attain.adm':>10} {'rejected':>8} {'rej p99 ms':>10} {'5xx':>4} {'lag p99 ms':>10}"
             f" {'in proxy':>8} {'proxy p99':>9} {'ingress p99':>11} {'host cores':>10}"]
    rows = result.rows + ([result.off_1x] if result.off_1x else [])
    for i, r in enumerate(rows):
        name = f"{r.multiple:g}x" + (" off" if i == len(result.rows) else "")
        lines.append(
            f"{name:>8} {r.rate:7.2f} {r.goodput:8.2f} {f(r.attainment_admitted, '10.1%')} {r.rejected_share:8.1%} "
            f"{f(r.reject_p99_ms, '10.0f')} {r.errors_5xx:4d} {f(r.arrival_lag_p99_ms, '10.0f')}"
            f" {f(r.refused_in_proxy_share, '8.1%')} {f(r.reject_p99_ms_proxy, '9.0f')} {f(r.reject_p99_ms_ingress, '11.0f')}"
            f" {f(r.host_busy_cores, '10.2f')}"
        )
    if result.warmup is not None:
        w = result.warmup
        lines.append(f"warm-up, not counted: {w.rate:g} req/s, attainment {f(w.attainment_admitted, '.1%')} of admitted, "
                     f"{w.rejected_share:.1%} refused")
    if result.admission_cost_1x is not None:
        lines.append(f"admission cost at 1x: {result.admission_cost_1x:.1%} of goodput (target <= 3%)"
                     + (f"; off measured in {result.off_source}" if result.off_source and result.off_source != "same run" else ""))
    return "\n".join(lines)
