"""`forespark overload`'s rows from per-request rows (the load test itself is `tests/test_loadtest.py`'s)."""

import json

from loadtest.config import SLOConfig
from loadtest.overload import OverloadResult, format_overload, overload_row
from loadtest.report import RequestRow, build_report


def row(i, status, ttft=100.0, tpot=10.0, e2e=500.0, refused_by=""):
    ok = status == 200
    return RequestRow(request_id=str(i), domain="code", status=status, start_s=i * 0.1, end_s=i * 0.1 + e2e / 1000,
                      ttft_ms=ttft if ok else None, tpot_ms=tpot if ok else None, e2e_ms=e2e, lag_ms=1.0, refused_by=refused_by)


def test_rows_split_refused_from_admitted_and_count_5xx():
    slo = SLOConfig(ttft_ms=1000, tpot_ms=20)
    rows = [row(i, 200) for i in range(6)] + [row(6, 200, tpot=40.0)] + [row(7 + i, 429, e2e=5.0 + i) for i in range(3)]
    rows.append(row(10, 503))
    report = build_report(rows, slo, rate=10.0, duration_s=1.1)
    r = overload_row(2.0, 10.0, rows, report, slo)
    assert r.rejected_share == 3 / 11 and r.errors_5xx == 1
    assert r.attainment_admitted == 6 / 8  # the slow one and the 503 miss; refusals are not counted against it
    assert 5.0 <= r.reject_p99_ms <= 7.0 and r.goodput == report.goodput_rps
    out = OverloadResult(capacity=5.0, rows=[r])
    assert set(json.loads(out.model_dump_json())["rows"][0]) >= {
        "multiple", "rate", "goodput", "attainment_admitted", "rejected_share", "reject_p99_ms", "errors_5xx"}
    assert "2x" in format_overload(out)
    assert r.refused_in_proxy_share == 0.0 and r.reject_p99_ms_proxy is None  # no refusal came from the proxy


def test_refusals_the_proxy_answered_are_timed_apart_from_the_ingresses():
    from cluster.proxy_gate import ANSWERED_HEADER
    from loadtest.report import ANSWERED_HEADER as READ_HEADER

    assert READ_HEADER == ANSWERED_HEADER  # the load generator reads the header the server sets
    slo = SLOConfig(ttft_ms=1000, tpot_ms=20)
    rows = [row(0, 200)] + [row(1 + i, 429, e2e=2.0, refused_by="proxy") for i in range(3)] + [row(4, 429, e2e=80.0)]
    r = overload_row(4.0, 20.0, rows, build_report(rows, slo, rate=20.0, duration_s=0.6), slo)
    assert r.refused_in_proxy_share == 3 / 4
    assert r.reject_p99_ms_proxy == 2.0 and r.reject_p99_ms_ingress == 80.0 and r.reject_p99_ms > 70.0


def test_admission_cost_against_an_earlier_admission_off_run_at_the_same_rate(tmp_path):
    import pytest

    from loadtest.overload import OverloadRow, off_row_from, with_off

    def r(multiple, rate, goodput):
        return OverloadRow(multiple=multiple, rate=rate, goodput=goodput, attainment_admitted=1.0, rejected_share=0.0,
                           reject_p99_ms=None, errors_5xx=0)

    off_run = OverloadResult(capacity=10.0, rows=[r(1.0, 10.0, 9.8)])
    path = tmp_path / "off.json"
    path.write_text(off_run.model_dump_json())
    on = OverloadResult(capacity=10.0, rows=[r(1.0, 10.0, 9.604), r(2.0, 20.0, 9.5)])
    off, off_repeats = off_row_from(path)
    assert off_repeats == 1  # (a file written before repeats existed reads as one)
    merged = with_off(on, off, str(path))
    assert merged.admission_cost_1x == pytest.approx(0.02) and merged.off_source == str(path)
    assert merged.off_1x.goodput == 9.8 and str(path) in format_overload(merged)
    # Control: an off run at another rate is not comparable, and a run without a 1x row gives no cost.
    with pytest.raises(ValueError, match="not comparable"):
        with_off(OverloadResult(capacity=12.0, rows=[r(1.0, 12.0, 9.6)]), off, str(path))
    with pytest.raises(ValueError, match="1x"):
        with_off(OverloadResult(capacity=10.0, rows=[r(2.0, 20.0, 9.5)]), off, str(path))
    with pytest.raises(ValueError, match="repeats"):  # pooled over other arrival schedules
        with_off(on.model_copy(update={"repeats": 3}), off, str(path), off_repeats)


def test_host_busy_time_is_read_from_proc_stat_without_idle_and_io_wait(tmp_path):
    import os

    from cluster.admission import TTFT_HEADER
    from loadtest.refusal_cpu import TTFT_HEADER as SENT_HEADER, busy_seconds

    assert SENT_HEADER == TTFT_HEADER  # the probe's refusals use the header admission reads
    stat = tmp_path / "stat"
    stat.write_text("cpu  100 10 50 800 40 5 5 0 0 0\ncpu0 50 5 25 400 20 2 3 0 0 0\n")
    assert busy_seconds(stat) == (100 + 10 + 50 + 5 + 5) / os.sysconf("SC_CLK_TCK")


def fake_piece(multiple, rate, goodput, duration_s=30.0, refusal_ms=5.0):
    """A load test's requests: `goodput` per second meet their SLOs, one more request a second misses its TPOT,
    and one a second is refused after `refusal_ms`."""
    from loadtest.overload import Piece

    n = round(goodput * duration_s)
    rows = [row(i, 200) for i in range(n)]
    rows += [row(n + i, 200, tpot=40.0) for i in range(round(duration_s))]
    rows += [row(n + round(duration_s) + i, 429, e2e=refusal_ms) for i in range(round(duration_s))]
    return Piece(rows, duration_s, 1.5)


def test_each_server_is_warmed_at_1x_before_its_rows_and_the_warm_up_is_not_counted():
    from loadtest.config import LoadTestConfig, SLOConfig
    from loadtest.overload import measure_overload

    calls = []

    def run(config, slo, multiple, rate, label=""):
        calls.append((label, config.url, multiple, config.duration_s, config.seed))
        goodput = 1.0 if label.endswith("warm-") else multiple * rate  # a cold server misses; the rows do not
        return fake_piece(multiple, rate, goodput, config.duration_s)

    base = LoadTestConfig(url="http://on", rate=5.0, duration_s=30.0, seed=7)
    slo = SLOConfig(ttft_ms=1000, tpot_ms=20)
    result = measure_overload(base, slo, [1.0, 2.0], 5.0, warmup_s=10.0, off_url="http://off/", run=run)
    assert calls == [("warm-", "http://on", 1.0, 10.0, 8), ("", "http://on", 1.0, 30.0, 7), ("", "http://on", 2.0, 30.0, 7),
                     ("off-warm-", "http://off", 1.0, 10.0, 8), ("off-", "http://off", 1.0, 30.0, 7)]
    assert [r.goodput for r in result.rows] == [5.0, 10.0] and result.admission_cost_1x == 0.0
    assert result.warmup.goodput == 1.0 and result.off_warmup.goodput == 1.0
    assert result.repeats == 1 and result.pieces == []
    assert "warm-up, not counted" in format_overload(result)
    # Control: without a warm-up the first row is the cold one.
    calls.clear()
    cold = measure_overload(base, slo, [1.0], 5.0, warmup_s=0.0, run=run)
    assert [c[0] for c in calls] == [""] and cold.warmup is None


def test_repeats_interleave_the_multiples_and_pool_each_multiples_requests():
    """A slow spell of the host in one repeat: pooled, each multiple's row counts it with its other repeats', as
    one run three times as long would; the pieces' own rows stay apart."""
    import pytest

    from loadtest.config import LoadTestConfig, SLOConfig
    from loadtest.overload import measure_overload

    calls = []

    def run(config, slo, multiple, rate, label=""):
        calls.append((label, multiple, config.seed))
        spell = len(calls) == 2  # the first repeat's 4x piece: a slow spell, goodput halved and refusals slow
        goodput = multiple * rate * (0.5 if spell else 1.0)
        return fake_piece(multiple, rate, goodput, config.duration_s, refusal_ms=200.0 if spell else 5.0)

    base = LoadTestConfig(url="http://on", rate=5.0, duration_s=30.0, seed=7)
    slo = SLOConfig(ttft_ms=1000, tpot_ms=20)
    result = measure_overload(base, slo, [1.0, 4.0], 5.0, warmup_s=0.0, off_url="http://off", run=run, repeats=3)
    assert calls == [("r0-", 1.0, 7), ("r0-", 4.0, 7), ("r1-", 1.0, 1007), ("r1-", 4.0, 1007), ("r2-", 1.0, 2007),
                     ("r2-", 4.0, 2007), ("off-r0-", 1.0, 7), ("off-r1-", 1.0, 1007), ("off-r2-", 1.0, 2007)]
    at4 = result.rows[1]
    assert at4.multiple == 4.0 and at4.goodput == pytest.approx((10.0 + 20.0 + 20.0) / 3)
    met, missed = 10 * 30 + 20 * 30 * 2, 3 * 30
    assert at4.attainment_admitted == pytest.approx(met / (met + missed))
    assert at4.reject_p99_ms > 100.0  # a third of the refusals were slow: the pooled tail keeps them
    assert [p.multiple for p in result.pieces] == [1.0, 4.0] * 3 and result.pieces[1].goodput == 10.0
    assert result.repeats == 3 and result.admission_cost_1x == 0.0 and "pooled over 3" in format_overload(result)
    # Control: one repeat is that one piece alone.
    calls.clear()
    one = measure_overload(base, slo, [4.0], 5.0, warmup_s=0.0, run=lambda *a, **k: run(*a, **k), repeats=1)
    assert one.rows[0].goodput == 20.0 and one.pieces == []
    with pytest.raises(ValueError, match="repeats"):
        measure_overload(base, slo, [1.0], 5.0, run=run, repeats=0)
