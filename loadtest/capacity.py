"""The highest request rate a server sustains within its SLOs, searched as `vllm bench sweep serve_sla` does.

Open-loop Poisson load at a rate; a rate is sustainable when SLO attainment
reaches the target. Double from `start_rate` until a rate fails (or halve
until one passes), then bisect between the highest pass and the lowest fail.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Iterator
from pathlib import Path

from pydantic import BaseModel

from loadtest.config import LoadTestConfig, SLOConfig
from loadtest.report import LoadTestReport
from loadtest.run import run_loadtest
from loadtest.server_metrics import ReplicaLoad, format_loads


class Probe(BaseModel):
    rate: float
    attainment: float
    goodput_rps: float
    requests: int
    sustainable: bool
    offered_rate_rps: float | None = None  # arrivals actually sent per second
    lag_p99_ms: float | None = None  # the load generator's p99 lateness against its schedule
    replicas: dict[str, ReplicaLoad] = {}  # the server's own account per engine replica


class CapacityResult(BaseModel):
    max_rate: float  # 0 when not even the lowest probed rate is sustainable
    slo: SLOConfig
    path: list[Probe]
    crossing_rate: float = 0.0  # where attainment crosses the target, interpolated (see `crossing_rate`)


def crossing_rate(path: list[Probe], max_rate: float, target: float) -> float:
    """The rate at which attainment falls to `target`, interpolated linearly between the highest sustainable
    probe and the lowest failing probe above it: finer than the bisection's last bracket, whose width
    quantises `max_rate`. `max_rate` itself when no probe above it failed; 0 when none passed."""
    if max_rate <= 0:
        return 0.0
    passed = max((p for p in path if p.sustainable and p.rate == max_rate), key=lambda p: p.attainment)
    above = [p for p in path if not p.sustainable and p.rate > max_rate]
    if not above:
        return max_rate
    failed = min(above, key=lambda p: p.rate)
    return max_rate + (failed.rate - max_rate) * (passed.attainment - target) / (passed.attainment - failed.attainment)


def probe_of(rate: float, report: LoadTestReport) -> Probe:
    return Probe(
        rate=rate, attainment=report.attainment, goodput_rps=report.goodput_rps, requests=report.requests,
        sustainable=report.sustainable, offered_rate_rps=report.offered_rate_rps, lag_p99_ms=report.arrival_lag_ms.p99,
        replicas=report.replicas,
    )


def rates_to_probe(
    start_rate: float = 1.0, bisect_steps: int = 3, max_doublings: int = 8, min_rate: float = 0.05
) -> Generator[float, bool, float]:
    """The search's decisions alone: yields the next rate to probe, is sent whether it was sustainable,
    returns the highest sustainable rate (0 when none). Whoever sends decides how and when rates are measured."""
    lo, hi = 0.0, 0.0
    rate = start_rate
    if (yield rate):
        lo = rate
        for _ in range(max_doublings):
            rate *= 2
            if not (yield rate):
                hi = rate
                break
            lo = rate
        else:
            return lo
    else:
        hi = rate
        while rate / 2 >= min_rate:
            rate /= 2
            if (yield rate):
                lo = rate
                break
            hi = rate
        if lo == 0.0:
            return 0.0
    for _ in range(bisect_steps):
        mid = (lo + hi) / 2
        if (yield mid):
            lo = mid
        else:
            hi = mid
    return lo


class Search:
    """One capacity search advanced a probe at a time: `rate` is the next rate to probe, `record` takes its
    report; `result` is set once the search is over. Searches of several servers can so take turns."""

    def __init__(self, slo: SLOConfig, start_rate: float = 1.0, bisect_steps: int = 3, max_doublings: int = 8, min_rate: float = 0.05):
        self.slo = slo
        self.path: list[Probe] = []
        self.result: CapacityResult | None = None
        self._plan = rates_to_probe(start_rate, bisect_steps, max_doublings, min_rate)
        self.rate = next(self._plan)

    def record(self, report: LoadTestReport) -> Probe:
        probe = probe_of(self.rate, report)
        self.path.append(probe)
        try:
            self.rate = self._plan.send(probe.sustainable)
        except StopIteration as done:
            self.result = CapacityResult(
                max_rate=done.value, slo=self.slo, path=self.path,
                crossing_rate=crossing_rate(self.path, done.value, self.slo.attainment_target),
            )
        return probe


class SLOSweep:
    """Capacity searches on one server against several SLOs, one after another, sharing probes: a rate an
    earlier search measured is re-evaluated against the later search's SLO from its per-request rows, not
    measured again. `search` is the open search; `record` takes a measurement of its rate; `replay` then
    advances every search that asks for a rate already measured."""

    def __init__(self, slos: list[SLOConfig], start_rate: float = 1.0, bisect_steps: int = 3):
        self.searches = [Search(slo, start_rate, bisect_steps) for slo in slos]
        self.measured: dict[float, LoadTestConfig] = {}

    @property
    def search(self) -> Search | None:
        return next((s for s in self.searches if s.result is None), None)

    def record(self, load: LoadTestConfig, report: LoadTestReport) -> Probe:
        search = self.search
        assert search is not None and load.rate == search.rate
        self.measured[load.rate] = load
        return search.record(report)

    def replay(self, evaluate: Callable[[LoadTestConfig, SLOConfig], LoadTestReport]) -> Iterator[tuple[Search, Probe]]:
        while (s := self.search) is not None and s.rate in self.measured:
            yield s, s.record(evaluate(self.measured[s.rate], s.slo))


def search(
    measure: Callable[[float], LoadTestReport],
    slo: SLOConfig,
    start_rate: float = 1.0,
    bisect_steps: int = 3,
    max_doublings: int = 8,
    min_rate: float = 0.05,
    on_probe: Callable[[Probe], None] | None = None,
) -> CapacityResult:
    """`measure(rate)` runs one load test at `rate`; the search is independent of how."""
    s = Search(slo, start_rate, bisect_steps, max_doublings, min_rate)
    while s.result is None:
        probe = s.record(measure(s.rate))
        if on_probe:
            on_probe(probe)
    return s.result


def load_at(base: LoadTestConfig, rate: float) -> LoadTestConfig:
    """`base` at `rate`, writing to its own `out_dir/rate-<r>`."""
    return base.model_copy(update={"rate": rate, "out_dir": Path(base.out_dir) / f"rate-{rate:.4g}"})


def capacity(
    base: LoadTestConfig, slo: SLOConfig, start_rate: float, bisect_steps: int = 3, on_probe=None, progress: bool = True
) -> CapacityResult:
    """The search with real load tests: each probe runs `base` at its rate, in `out_dir/rate-<r>`."""

    def measure(rate: float) -> LoadTestReport:
        return run_loadtest(load_at(base, rate), slo, progress=progress, plots=False)

    return search(measure, slo, start_rate=start_rate, bisect_steps=bisect_steps, on_probe=on_probe)


def _lag(p: Probe) -> str:
    return "-" if p.lag_p99_ms is None else f"{p.lag_p99_ms:.0f}"


def format_probe(p: Probe) -> str:
    offered = "" if p.offered_rate_rps is None else f" (offered {p.offered_rate_rps:.3g}, arrival lag p99 {_lag(p)} ms)"
    loads = f"; {format_loads(p.replicas)}" if p.replicas else ""
    return f"{p.rate:.3g} req/s{offered}: attainment {p.attainment:.1%} -> {'pass' if p.sustainable else 'FAIL'}{loads}"


def format_path(result: CapacityResult) -> str:
    lines = [f"{'rate':>8} {'offered':>8} {'lag p99':>8} {'attain':>7} {'goodput':>8} {'reqs':>5}  verdict"]
    for p in result.path:
        offered = "-" if p.offered_rate_rps is None else f"{p.offered_rate_rps:.3g}"
        lines.append(
            f"{p.rate:>8.3g} {offered:>8} {_lag(p):>8} {p.attainment:>7.1%} {p.goodput_rps:>8.2f} {p.requests:>5}  "
            f"{'pass' if p.sustainable else 'FAIL'}"
        )
    lines.append(
        f"max sustainable rate: {result.max_rate:.3g} req/s (attainment >= {result.slo.attainment_target:.0%}); "
        f"attainment crosses the target at {result.crossing_rate:.3g} req/s (interpolated)"
    )
    return "\n".join(lines)


def plot_capacity(results: dict[str, CapacityResult], path: Path) -> None:
    """Attainment and goodput against rate, one line per variant."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, g) = plt.subplots(1, 2, figsize=(12, 4))
    for name, result in results.items():
        probes = sorted(result.path, key=lambda p: p.rate)
        rates = [p.rate for p in probes]
        a.plot(rates, [p.attainment for p in probes], marker="o", label=f"{name} (max {result.max_rate:.3g})")
        g.plot(rates, [p.goodput_rps for p in probes], marker="o", label=name)
    target = next(iter(results.values())).slo.attainment_target if results else 0.9
    a.axhline(target, color="red", linestyle="--", label="target")
    a.set_xlabel("request rate (req/s)")
    a.set_ylabel("SLO attainment")
    g.set_xlabel("request rate (req/s)")
    g.set_ylabel("goodput (req/s meeting every SLO)")
    for ax in (a, g):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
