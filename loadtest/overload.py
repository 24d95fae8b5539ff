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

With `--repeats N` the multiples run N times, interleaved (1, 2, 4, 1, 2, 4, ...; repeat r at seed `--seed`
+ 1000 r), and each row is pooled over its N pieces: the requests of all of them, as one run N times as long
would count them, but spread over the whole measurement, so that a slow spell of the host falls on every
multiple alike instead of deciding one row (in single 30-second runs of one commit on the 2-core CPU host,
admitted attainment at 4x ranged over 9 points, and admission's cost at 1x from 0.3% to 27%). The pieces'
own rows stay in the JSON (`pieces`). The admission-off side is measured the same way: `--off-url` runs N pieces
of its 1x load; a `--off-json` run must have been made with the same `--repeats` (and so the same arrival
schedules).

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
from typing import NamedTuple

import numpy as np
from pydantic import BaseModel

from loadtest.config import LoadTestConfig, SLOConfig
from loadtest.refusal_cpu import busy_seconds
from loadtest.report import LoadTestReport, RequestRow, build_report


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


REPEAT_SEED_STRIDE = 1000  # repeat r runs at seed + r * this (the warm-up's is seed + 1)


class OverloadResult(BaseModel):
    capacity: float
    rows: list[OverloadRow]  # one per multiple, pooled over the repeats
    repeats: int = 1
    pieces: list[OverloadRow] = []  # with repeats > 1: each repeat's row per multiple, in the order they ran
    off_1x: OverloadRow | None = None
    admission_cost_1x: float | None = None
    off_source: str | None = None  # "same run" (--off-url) or the JSON of a separate run (--off-json)
    warmup: OverloadRow | None = None  # the warm-up before the rows, not counted in them
    off_warmup: OverloadRow | None = None  # the admission-off server's (--off-url)


def with_off(result: OverloadResult, off: OverloadRow, source: str, off_repeats: int = 1) -> OverloadResult:
    """`result` with the admission-off server's 1x row (pooled over `off_repeats` pieces) and admission's cost at
    1x: 1 - goodput(on) / goodput(off)."""
    on = next((r for r in result.rows if r.multiple == 1.0), None)
    if on is None:
        raise ValueError("admission's cost needs a 1x row in the admission-on run")
    if not math.isclose(off.rate, on.rate, rel_tol=1e-6):
        raise ValueError(f"the admission-off run loaded {off.rate:g} req/s at 1x, this one {on.rate:g}: not comparable")
    if off_repeats != result.repeats:
        raise ValueError(f"the admission-off run pooled {off_repeats} repeats, this one {result.repeats}: not comparable")
    cost = 1.0 - on.goodput / off.goodput if off.goodput > 0 else None
    return result.model_copy(update={"off_1x": off, "admission_cost_1x": cost, "off_source": source})


def off_row_from(path: Path) -> tuple[OverloadRow, int]:
    """The 1x row of an earlier `forespark overload` run (against the admission-off server), and its repeats."""
    earlier = OverloadResult.model_validate_json(Path(path).read_text())
    row = next((r for r in earlier.rows if r.multiple == 1.0), None)
    if row is None:
        raise ValueError(f"{path} has no 1x row")
    return row, earlier.repeats


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


class Piece(NamedTuple):
    """One load test at one multiple: its requests, how long it offered load, and this host's busy cores over it."""

    requests: list[RequestRow]
    duration_s: float
    busy_cores: float | None = None


def pooled_row(multiple: float, rate: float, pieces: list[Piece], slo: SLOConfig) -> OverloadRow:
    """The row of `pieces` at one multiple, counted as one run: their requests together, over their summed duration."""
    requests = sorted((r for p in pieces for r in p.requests), key=lambda r: r.start_s)
    report = build_report(requests, slo, rate, sum(p.duration_s for p in pieces))
    cores = [p.busy_cores for p in pieces if p.busy_cores is not None]
    return overload_row(multiple, rate, requests, report, slo).model_copy(
        update={"host_busy_cores": float(np.mean(cores)) if cores else None})


def run_piece(base: LoadTestConfig, slo: SLOConfig, multiple: float, capacity: float, label: str = "") -> Piece:
    from loadtest.run import run_locust

    rate = multiple * capacity
    config = base.model_copy(update={"rate": rate, "out_dir": Path(base.out_dir) / f"{label}x{multiple:g}"})
    t0, busy0 = time.perf_counter(), _busy()
    requests = run_locust(config)
    busy1 = _busy()
    cores = (busy1 - busy0) / (time.perf_counter() - t0) if busy0 is not None and busy1 is not None else None
    return Piece(requests, config.duration_s, cores)


RunPiece = Callable[..., Piece]


def measure_overload(
    base: LoadTestConfig,
    slo: SLOConfig,
    multiples: list[float],
    rate: float,
    warmup_s: float = 10.0,
    off_url: str | None = None,
    run: RunPiece = run_piece,
    repeats: int = 1,
) -> OverloadResult:
    """One row per multiple of `rate`, pooled over `repeats` interleaved pieces, after `warmup_s` of load at `rate`
    that is not counted (its row is kept apart); with `off_url` (`multiples` must hold 1), then a warm-up and the
    1x pieces on the admission-off server, and admission's cost."""
    if repeats < 1:
        raise ValueError("repeats must be at least 1")

    def warm(config: LoadTestConfig, label: str) -> OverloadRow | None:
        if warmup_s <= 0:
            return None
        return pooled_row(1.0, rate, [run(config.model_copy(update={"duration_s": warmup_s, "seed": config.seed + 1}),
                                          slo, 1.0, rate, label=label)], slo)

    def measure(config: LoadTestConfig, at: list[float], label: str) -> tuple[list[OverloadRow], list[OverloadRow]]:
        """Pooled rows per multiple, and each piece's row in the order they ran."""
        pieces: dict[float, list[Piece]] = {m: [] for m in at}
        order: list[OverloadRow] = []
        for r in range(repeats):
            seeded = config.model_copy(update={"seed": config.seed + r * REPEAT_SEED_STRIDE})
            for m in at:
                piece = run(seeded, slo, m, rate, label=f"{label}r{r}-" if repeats > 1 else label)
                pieces[m].append(piece)
                if repeats > 1:
                    order.append(pooled_row(m, m * rate, [piece], slo))
        return [pooled_row(m, m * rate, pieces[m], slo) for m in at], order

    warmed = warm(base, "warm-")
    rows, order = measure(base, multiples, "")
    result = OverloadResult(capacity=rate, rows=rows, repeats=repeats, pieces=order, warmup=warmed)
    if off_url:
        off_base = base.model_copy(update={"url": off_url.rstrip("/")})
        off_warmed = warm(off_base, "off-warm-")
        off_rows, _ = measure(off_base, [1.0], "off-")
        result = with_off(result, off_rows[0], "same run", repeats).model_copy(update={"off_warmup": off_warmed})
    return result


def format_overload(result: OverloadResult) -> str:
    def f(v, spec):
        return "-" if v is None else format(v, spec)

    def line(name: str, r: OverloadRow) -> str:
        return (f"{name:>8} {r.rate:7.2f} {r.goodput:8.2f} {f(r.attainment_admitted, '10.1%')} {r.rejected_share:8.1%} "
                f"{f(r.reject_p99_ms, '10.0f')} {r.errors_5xx:4d} {f(r.arrival_lag_p99_ms, '10.0f')}"
                f" {f(r.refused_in_proxy_share, '8.1%')} {f(r.reject_p99_ms_proxy, '9.0f')} {f(r.reject_p99_ms_ingress, '11.0f')}"
                f" {f(r.host_busy_cores, '10.2f')}")

    header = (f"{'multiple':>8} {'rate':>7} {'goodput':>8} {'attain.adm':>10} {'rejected':>8} {'rej p99 ms':>10} {'5xx':>4}"
              f" {'lag p99 ms':>10} {'in proxy':>8} {'proxy p99':>9} {'ingress p99':>11} {'host cores':>10}")
    pooled = f", each row pooled over {result.repeats} interleaved repeats" if result.repeats > 1 else ""
    lines = [f"capacity {result.capacity:g} req/s{pooled}", header]
    lines += [line(f"{r.multiple:g}x", r) for r in result.rows]
    if result.off_1x:
        lines.append(line("1x off", result.off_1x))
    if result.pieces:
        lines += ["each repeat, in the order they ran:", header]
        lines += [line(f"{r.multiple:g}x", r) for r in result.pieces]
    if result.warmup is not None:
        w = result.warmup
        lines.append(f"warm-up, not counted: {w.rate:g} req/s, attainment {f(w.attainment_admitted, '.1%')} of admitted, "
                     f"{w.rejected_share:.1%} refused")
    if result.admission_cost_1x is not None:
        lines.append(f"admission cost at 1x: {result.admission_cost_1x:.1%} of goodput (target <= 3%)"
                     + (f"; off measured in {result.off_source}" if result.off_source and result.off_source != "same run" else ""))
    return "\n".join(lines)
