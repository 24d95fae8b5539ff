"""A load test's report from its per-request rows: SLO attainment, goodput, latency percentiles, throughput.

A request meets the SLOs when it succeeded and each configured threshold
holds (a one-token reply has no TPOT and meets that one). Attainment is over
every request sent, failures included; goodput is the requests meeting every
SLO per second of the arrival window.
"""

from __future__ import annotations

import csv
from collections import Counter
from pathlib import Path

import numpy as np
from pydantic import BaseModel

from loadtest.config import SLOConfig
from loadtest.server_metrics import ReplicaLoad, format_loads

PERCENTILES = (50, 90, 99)
LAG_WARN_MS = 100.0  # a p99 arrival lag above this means the load generator, not the server, shaped the arrivals


# Set by the server on the refusals its HTTP proxy answers itself (`cluster/proxy_gate.py`'s ANSWERED_HEADER).
ANSWERED_HEADER = "x-forespark-refused-by"


class RequestRow(BaseModel):
    request_id: str
    domain: str
    status: int
    scheduled_s: float | None = None  # planned arrival; start_s is when it was sent
    lag_ms: float | None = None
    start_s: float
    end_s: float
    first_token_s: float | None = None
    prompt_tokens: int | None = None
    output_tokens: int | None = None
    ttft_ms: float | None = None
    tpot_ms: float | None = None
    itl_mean_ms: float | None = None
    itl_max_ms: float | None = None
    e2e_ms: float
    error: str = ""
    refused_by: str = ""  # "proxy": a refusal Serve's proxy replayed (cluster/proxy_gate.py); else the ingress's

    @property
    def ok(self) -> bool:
        return self.status == 200

    def meets(self, slo: SLOConfig) -> bool:
        if not self.ok:
            return False
        checks = ((slo.ttft_ms, self.ttft_ms), (slo.tpot_ms, self.tpot_ms), (slo.e2e_ms, self.e2e_ms))
        return all(limit is None or value is None or value <= limit for limit, value in checks)


def read_rows(out_dir: Path) -> list[RequestRow]:
    rows = []
    for path in sorted(Path(out_dir).glob("requests-*.csv")):
        with path.open(newline="") as f:
            for raw in csv.DictReader(f):
                rows.append(RequestRow.model_validate({k: v for k, v in raw.items() if v != ""}))
    rows.sort(key=lambda r: r.start_s)
    return rows


class Percentiles(BaseModel):
    p50: float | None
    p90: float | None
    p99: float | None
    mean: float | None


def _percentiles(values: list[float]) -> Percentiles:
    if not values:
        return Percentiles(p50=None, p90=None, p99=None, mean=None)
    p = np.percentile(values, PERCENTILES)
    return Percentiles(p50=float(p[0]), p90=float(p[1]), p99=float(p[2]), mean=float(np.mean(values)))


class LoadTestReport(BaseModel):
    rate: float
    duration_s: float
    slo: SLOConfig
    requests: int
    succeeded: int
    met_slo: int
    attainment: float
    sustainable: bool
    goodput_rps: float
    request_throughput_rps: float
    output_token_throughput: float
    offered_rate_rps: float
    errors_by_status: dict[str, int]
    ttft_ms: Percentiles
    tpot_ms: Percentiles
    itl_ms: Percentiles
    e2e_ms: Percentiles
    arrival_lag_ms: Percentiles  # how late the load generator sent requests against its Poisson schedule
    by_domain: dict[str, dict[str, float]]
    attainment_over_time: list[tuple[float, float, int]]  # (window start s, attainment, requests)
    replicas: dict[str, ReplicaLoad] = {}  # the server's own account per engine replica (loadtest/server_metrics.py)


def build_report(rows: list[RequestRow], slo: SLOConfig, rate: float, duration_s: float, window_s: float = 5.0) -> LoadTestReport:
    ok = [r for r in rows if r.ok]
    met = [r.meets(slo) for r in rows]
    t0 = rows[0].start_s if rows else 0.0
    span = max((max(r.end_s for r in rows) - t0) if rows else duration_s, 1e-9)
    attainment = sum(met) / len(rows) if rows else 0.0
    windows: list[tuple[float, float, int]] = []
    if rows:
        bins: dict[int, list[bool]] = {}
        for r, m in zip(rows, met):
            bins.setdefault(int((r.start_s - t0) // window_s), []).append(m)
        windows = [(k * window_s, sum(v) / len(v), len(v)) for k, v in sorted(bins.items())]
    by_domain = {}
    for domain in sorted({r.domain for r in rows}):
        mine = [(r, m) for r, m in zip(rows, met) if r.domain == domain]
        by_domain[domain] = {"requests": len(mine), "attainment": sum(m for _, m in mine) / len(mine)}
    return LoadTestReport(
        rate=rate,
        duration_s=duration_s,
        slo=slo,
        requests=len(rows),
        succeeded=len(ok),
        met_slo=sum(met),
        attainment=attainment,
        sustainable=bool(rows) and attainment >= slo.attainment_target,
        goodput_rps=sum(met) / duration_s,
        request_throughput_rps=len(ok) / span,
        output_token_throughput=sum(r.output_tokens or 0 for r in ok) / span,
        offered_rate_rps=len(rows) / duration_s,
        errors_by_status=dict(Counter(str(r.status) for r in rows if not r.ok)),
        ttft_ms=_percentiles([r.ttft_ms for r in ok if r.ttft_ms is not None]),
        tpot_ms=_percentiles([r.tpot_ms for r in ok if r.tpot_ms is not None]),
        itl_ms=_percentiles([r.itl_mean_ms for r in ok if r.itl_mean_ms is not None]),
        e2e_ms=_percentiles([r.e2e_ms for r in ok]),
        arrival_lag_ms=_percentiles([r.lag_ms for r in rows if r.lag_ms is not None]),
        by_domain=by_domain,
        attainment_over_time=windows,
    )


def generator_lagged(report: LoadTestReport) -> bool:
    return report.arrival_lag_ms.p99 is not None and report.arrival_lag_ms.p99 > LAG_WARN_MS


def format_report(report: LoadTestReport) -> str:
    def fmt(p: Percentiles) -> str:
        return "-" if p.p50 is None else f"{p.p50:8.1f} {p.p90:8.1f} {p.p99:8.1f}"

    slo = report.slo
    limits = ", ".join(f"{k} <= {v:g} ms" for k, v in (("TTFT", slo.ttft_ms), ("TPOT", slo.tpot_ms), ("E2E", slo.e2e_ms)) if v is not None)
    lines = [
        f"rate {report.rate:g}/s for {report.duration_s:g} s: {report.requests} requests, {report.succeeded} succeeded",
        f"SLO ({limits or 'none'}): attainment {report.attainment:.1%} (target {slo.attainment_target:.0%}: "
        f"{'sustainable' if report.sustainable else 'NOT sustainable'}), goodput {report.goodput_rps:.2f} req/s",
        f"throughput {report.request_throughput_rps:.2f} req/s, {report.output_token_throughput:.1f} output tokens/s",
        f"{'ms':>6} {'p50':>8} {'p90':>8} {'p99':>8}",
        f"{'TTFT':>6} {fmt(report.ttft_ms)}",
        f"{'TPOT':>6} {fmt(report.tpot_ms)}",
        f"{'ITL':>6} {fmt(report.itl_ms)}",
        f"{'E2E':>6} {fmt(report.e2e_ms)}",
    ]
    if generator_lagged(report):
        lines.append(
            f"warning: the load generator sent requests late (arrival lag p99 {report.arrival_lag_ms.p99:.0f} ms): "
            "its process did not get the CPU in time, so the latencies may include its own delays; give it more (--processes, another machine)"
        )
    if report.replicas:
        lines.append("server: " + format_loads(report.replicas))
    if report.errors_by_status:
        lines.append("errors by status: " + ", ".join(f"{k}: {v}" for k, v in sorted(report.errors_by_status.items())))
    return "\n".join(lines)


def plot_report(rows: list[RequestRow], report: LoadTestReport, path: Path) -> None:
    """Latency distributions (CDFs of TTFT, TPOT, E2E with the SLO lines) and attainment over time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in rows if r.ok]
    fig, axes = plt.subplots(1, 4, figsize=(18, 4))
    for ax, (name, values, limit) in zip(
        axes,
        (
            ("TTFT (ms)", [r.ttft_ms for r in ok if r.ttft_ms is not None], report.slo.ttft_ms),
            ("TPOT (ms)", [r.tpot_ms for r in ok if r.tpot_ms is not None], report.slo.tpot_ms),
            ("E2E (ms)", [r.e2e_ms for r in ok], report.slo.e2e_ms),
        ),
    ):
        if values:
            xs = np.sort(values)
            ax.plot(xs, np.arange(1, len(xs) + 1) / len(xs))
        if limit is not None:
            ax.axvline(limit, color="red", linestyle="--", label="SLO")
            ax.legend()
        ax.set_xlabel(name)
        ax.set_ylabel("share of requests")
        ax.grid(alpha=0.3)
    ax = axes[3]
    if report.attainment_over_time:
        t, a, _ = zip(*report.attainment_over_time)
        ax.step(t, a, where="post")
    ax.axhline(report.slo.attainment_target, color="red", linestyle="--", label="target")
    ax.set_ylim(-0.05, 1.05)
    ax.set_xlabel("time since first request (s)")
    ax.set_ylabel("SLO attainment")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.suptitle(f"{report.rate:g} req/s: attainment {report.attainment:.1%}, goodput {report.goodput_rps:.2f} req/s")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
