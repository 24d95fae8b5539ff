"""Load tests: the capacity search on a known threshold, and real Locust runs against a real `forespark serve`."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import httpx
import numpy as np
import pytest
from scipy import stats

from loadtest.capacity import search
from loadtest.config import LoadTestConfig, SLOConfig
from loadtest.report import LoadTestReport, Percentiles, build_report, read_rows
from loadtest.run import free_port


def _fake_measure(capacity: float, calls: list[float]):
    """A measurement whose outcome is known: sustainable exactly up to `capacity` (not a server; tests the search only)."""

    def measure(rate: float) -> LoadTestReport:
        calls.append(rate)
        return LoadTestReport.model_construct(
            attainment=1.0 if rate <= capacity else 0.5, goodput_rps=rate, requests=10, sustainable=rate <= capacity,
            offered_rate_rps=rate, arrival_lag_ms=Percentiles(p50=0.0, p90=0.0, p99=0.0, mean=0.0),
        )

    return measure


@pytest.mark.parametrize("capacity", [0.3, 5.3, 1000.0])
def test_capacity_search_doubles_then_bisects_to_the_threshold(capacity):
    calls: list[float] = []
    result = search(_fake_measure(capacity, calls), SLOConfig(), start_rate=1.0, bisect_steps=4, max_doublings=6)
    assert result.max_rate <= capacity
    if capacity < 64:
        passes = [r for r in calls if r <= capacity]
        fails = [r for r in calls if r > capacity]
        assert min(fails) - max(passes) <= max(passes) / 2 ** 4 + 1e-9  # bisection narrowed the bracket
        assert result.max_rate == max(passes)
    else:  # never failed: stops at the last doubling
        assert result.max_rate == 64.0 and calls == [1, 2, 4, 8, 16, 32, 64]
    assert [p.rate for p in result.path] == calls


def test_capacity_search_reports_zero_when_nothing_passes():
    calls: list[float] = []
    result = search(_fake_measure(0.0, calls), SLOConfig(), start_rate=1.0, min_rate=0.1)
    assert result.max_rate == 0.0 and all(not p.sustainable for p in result.path) and min(calls) >= 0.1


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """A real `forespark serve`: two engine replicas, real Ray Serve, real HTTP."""
    from loadtest.compare import ServerProcess

    work = tmp_path_factory.mktemp("server")
    app = {"replica": {"num_replicas": 2, "num_cpus": 0.5, "served_model_name": "forespark"}}
    with ServerProcess(app, free_port(), work) as srv:
        yield srv


def _successes(url: str) -> float:
    """The server's own count of completed requests: vLLM's request_success counter (finished by stop or
    length, not abort) summed over the replicas."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{url}/metrics", timeout=30).text
    return sum(
        s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name == "vllm:request_success_total" and s.labels.get("finished_reason") in ("stop", "length")
    )


def _settled_successes(url: str) -> float:
    """Replicas post their metrics every stats period: read until two reads a period apart agree."""
    last = _successes(url)
    for _ in range(10):
        time.sleep(2.5)
        now = _successes(url)
        if now == last:
            return now
        last = now
    return last


def _inter_arrivals(rows) -> np.ndarray:
    return np.diff(np.sort([r.start_s for r in rows]))


def test_a_real_locust_run_agrees_with_the_server_and_paces_poisson_arrivals(server, tmp_path):
    """`forespark loadtest` (Locust in 2 processes) against the real server, with an impossibly tight SLO."""
    rate, duration = 6.0, 25.0
    before = _settled_successes(server.url)
    out = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "cluster.cli", "loadtest", "--url", server.url, "--rate", str(rate), "--duration", str(duration),
         "--max-tokens", "4", "--processes", "2", "--ttft-ms", "0.001", "--out", str(out)],
        capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    assert (out / "report.png").stat().st_size > 10_000
    rows = read_rows(out)
    assert len(list(out.glob("requests-*.csv"))) == 2  # both Locust worker processes sent requests
    assert report["requests"] == len(rows) and abs(len(rows) - rate * duration) < 4 * np.sqrt(rate * duration)

    # The server's own counter agrees with the client's rows (all requests drained before Locust exited).
    ok = [r for r in rows if r.ok]
    assert len(ok) >= 0.95 * len(rows)
    assert _settled_successes(server.url) - before == len(ok)
    assert all(r.ttft_ms <= r.e2e_ms and r.first_token_s <= r.end_s and r.output_tokens == 4 for r in ok)

    # Impossibly tight TTFT: nobody meets it. The same rows against loose SLOs: everybody does.
    assert report["attainment"] == 0.0 and report["sustainable"] is False and report["goodput_rps"] == 0.0
    loose = build_report(rows, SLOConfig(ttft_ms=1e9, tpot_ms=1e9, e2e_ms=1e9), rate, duration)
    assert loose.attainment == len(ok) / len(rows) and loose.met_slo == len(ok)

    # No request left before its planned arrival (1 ms for the clock), and each one's lateness is recorded and summarised.
    assert all(r.start_s >= r.scheduled_s - 0.001 and abs((r.start_s - r.scheduled_s) * 1000 - r.lag_ms) < 1.0 for r in rows)
    assert report["arrival_lag_ms"]["p50"] == pytest.approx(float(np.median([r.lag_ms for r in rows])))

    # Open-loop Poisson pacing: the inter-arrival times fit Exp(rate).
    gaps = _inter_arrivals(rows)
    assert stats.kstest(gaps, "expon", args=(0, 1 / rate)).pvalue > 0.01


def test_a_closed_loop_run_at_the_same_mean_rate_is_not_poisson(server, tmp_path):
    """Negative control for the pacing test: Locust's classic closed loop (constant_throughput users)."""
    from loadtest.run import run_locust

    rate, duration = 6.0, 20.0
    config = LoadTestConfig(url=server.url, rate=rate, duration_s=duration, arrivals="closed", users=2, max_tokens=4, out_dir=tmp_path)
    rows = run_locust(config, progress=False)
    assert len(rows) > 0.7 * rate * duration
    assert stats.kstest(_inter_arrivals(rows), "expon", args=(0, 1 / rate)).pvalue < 0.01


def _schedule(rows) -> tuple[np.ndarray, list[str]]:
    """Planned arrival times relative to the first, and the domains in that order."""
    rows = sorted(rows, key=lambda r: r.scheduled_s)
    return np.array([r.scheduled_s - rows[0].scheduled_s for r in rows]), [r.domain for r in rows]


def test_the_same_seed_sends_the_same_load_and_another_seed_does_not(server, tmp_path):
    """Common random numbers for A/B runs: a seed fixes the arrival schedule and the prompt mix, whatever the
    process ids; the negative control is a second seed."""
    from loadtest.run import run_locust

    def run(seed: int, name: str):
        config = LoadTestConfig(url=server.url, rate=4.0, duration_s=8.0, max_tokens=4, seed=seed, out_dir=tmp_path / name)
        return _schedule(run_locust(config, progress=False))

    (t_a, d_a), (t_b, d_b), (t_c, _) = run(0, "a"), run(0, "b"), run(1, "c")
    assert len(t_a) >= 10
    assert len(t_a) == len(t_b) and np.abs(t_a - t_b).max() < 0.001 and d_a == d_b
    assert len(t_c) != len(t_a) or np.abs(t_c - t_a).max() > 0.5


def test_compare_searches_every_variant_per_round_and_reports_ratios_of_medians(tmp_path):
    """`compare`'s own logic with a stand-in server and capacity search (the real ones are tested above;
    a real compare is a benchmark of many minutes): each round starts every variant once, in order, with
    its policy and router in the application config; rates are medians over rounds; ratios are of medians."""
    from contextlib import contextmanager

    from loadtest.capacity import CapacityResult
    from loadtest.compare import compare

    started: list[tuple[str, str, str]] = []
    rounds = {"wcs": [6.0, 9.0, 7.0], "dspark": [4.0, 5.0, 3.0], "wcs-pow2": [7.0, 2.0, 5.0]}
    served = {("wcs", "acceptance_headroom"): "wcs", ("dspark", "acceptance_headroom"): "dspark", ("wcs", "pow2"): "wcs-pow2"}

    @contextmanager
    def fake_server(app_config, work):
        key = (app_config["replica"]["engine"]["wcs"]["policy"], app_config["router"]["kind"])
        started.append((served[key], *key))
        assert app_config["replica"]["num_replicas"] == 3  # the base config is kept
        assert app_config["replica"]["tpot_slo_ms"] == 37.0  # the replicas' headroom uses the load test's TPOT SLO
        yield f"http://stand-in/{served[key]}"

    def fake_capacity(load, slo, start_rate, bisect_steps, on_probe=None):
        name = load.url.rsplit("/", 1)[1]
        rep = int(load.out_dir.name.split("-")[1])
        return CapacityResult(max_rate=rounds[name][rep], slo=slo, path=[])

    warmed: list[tuple[str, float, float]] = []

    def fake_warm_up(load, slo):
        warmed.append((load.url.rsplit("/", 1)[1], load.rate, load.duration_s))
        return 0.5

    base = LoadTestConfig(url="http://unused", rate=1.0, duration_s=1.0, out_dir=tmp_path)
    result = compare(
        base, SLOConfig(tpot_ms=37.0), ["wcs", "dspark", "wcs-pow2"], {"replica": {"num_replicas": 3, "tpot_slo_ms": 50}},
        fake_server, 1.5,
        repeats=3, log=lambda _: None, search_capacity=fake_capacity, warmup_s=7.0, warm=fake_warm_up,
    )
    assert [s[0] for s in started] == ["wcs", "dspark", "wcs-pow2"] * 3
    assert warmed == [(name, 1.5, 7.0) for name in ["wcs", "dspark", "wcs-pow2"] * 3]  # each fresh server, at the start rate
    warmed.clear()
    compare(base, SLOConfig(tpot_ms=37.0), ["wcs"], {"replica": {"num_replicas": 3}}, fake_server, 1.5, log=lambda _: None,
            search_capacity=fake_capacity, warmup_s=0.0, warm=fake_warm_up)
    assert warmed == []
    assert {name: v.max_rates for name, v in result.variants.items()} == rounds
    assert (result.variants["wcs"].max_rate, result.variants["dspark"].max_rate, result.variants["wcs-pow2"].max_rate) == (7.0, 4.0, 5.0)
    assert result.ratios["wcs_vs_dspark"] == pytest.approx(7 / 4) and result.ratios["router_vs_pow2"] == pytest.approx(7 / 5)
    assert result.ratios["wcs_vs_ar"] is None  # ar was not run
