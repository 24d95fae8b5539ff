"""`forespark simulate validate` end to end on a small case: a real `forespark serve` (one replica, real Ray
Serve, real HTTP, real Locust) against the simulator replaying the same requests. Short, so that the
real-vs-simulated path keeps working; the figures of the full run are in docs/results.md."""

from __future__ import annotations

import math

import pytest

from cluster.app import AppConfig
from cluster.sim.validate import METRICS, real_app_config, validate
from loadtest.config import LoadTestConfig, SLOConfig
from loadtest.run import free_port


def test_a_small_validation_runs_the_real_stack_and_the_simulator_on_the_same_requests(tmp_path):
    load = LoadTestConfig(url="http://127.0.0.1", rate=1.0, duration_s=8.0, drain_s=30.0, max_tokens=32, seed=3)
    slo = SLOConfig(ttft_ms=2000.0, tpot_ms=50.0)
    result = validate(["wcs"], [2.0], load, slo, replicas=1, port=free_port(), seed=3, work=tmp_path, log=lambda _: None)
    (case,) = result.cases
    assert case.requests >= 5
    assert all(case.real[k] is not None and case.sim[k] is not None for k in METRICS)
    assert all(math.isfinite(v) for v in case.error.values() if v is not None)
    # At light load both deliver what is offered: the simulated throughput cannot be far from the real one.
    assert case.error["throughput"] < 0.3
    assert result.host.rate == 2.0 and result.host.seed == 1003  # fitted on its own run, not on the case's
    # What the runs were measured with stays beside them: re-simulating them reads the same profile and gives the same
    # figures.
    assert result.profile == str(tmp_path / "profile.json") and (tmp_path / "profile.json").exists()
    again = validate(["wcs"], [2.0], load, slo, replicas=1, port=free_port(), seed=3, work=tmp_path, log=lambda _: None)
    assert again.cases[0].sim == case.sim and again.host == result.host
    other = validate(["wcs"], [2.0], load, slo, replicas=1, port=free_port(), seed=3, work=tmp_path, profile="cpu-embedded",
                     log=lambda _: None)
    assert other.profile == "cpu-embedded" and other.cases[0].sim != case.sim  # control: another profile, other figures
    with pytest.raises(ValueError, match="fresh-profile"):  # a fresh profile for runs measured with another: refused
        validate(["wcs"], [2.0], load, slo, replicas=1, seed=3, work=tmp_path, fresh_profile=True, log=lambda _: None)
    # Two repeats: the runs above are reused, one more of the case and of the calibration measured (seeds 4 and 1004).
    twice = validate(["wcs"], [2.0], load, slo, replicas=1, port=free_port(), seed=3, work=tmp_path, repeats=2, log=lambda _: None)
    (case2,) = twice.cases
    assert len(case2.repeats) == 2 and case2.repeats[0]["real"] == case.real and case2.requests > case.requests
    assert (tmp_path / "wcs" / "rate-2-seed-4").is_dir() and (tmp_path / "wcs" / "rate-2-seed-1004").is_dir()


def test_the_real_servers_run_the_policy_with_admission_off():
    """The simulator replays every request sent; a real server refusing some would be compared on others."""
    app = AppConfig.model_validate(real_app_config("dspark", 2, SLOConfig(ttft_ms=1000.0, tpot_ms=20.0)))
    assert not app.router.admission.enabled and app.replica.num_replicas == 2
    assert app.replica.engine.wcs.policy == "dspark" and app.replica.tpot_slo_ms == 20.0


def test_repeats_compare_medians_so_one_run_the_host_slowed_moves_the_case_no_further_than_the_next_run():
    from cluster.sim.validate import case_from_repeats

    def figures(tpot: float) -> dict:
        return {k: (tpot if k.startswith("tpot") else 1.0) for k in METRICS}

    sim = figures(5.0)
    runs = [(100, figures(5.2), sim), (100, figures(7.5), sim), (100, figures(4.9), sim)]  # the second run: a slow host
    case = case_from_repeats("ar", 5.0, runs)
    assert case.real["tpot_p50"] == 5.2 and case.requests == 300 and len(case.repeats) == 3
    assert case.error["tpot_p50"] == pytest.approx(0.2 / 5.2)
    # Control: the slow run alone, as one run compared, is 33% off.
    alone = case_from_repeats("ar", 5.0, runs[1:2])
    assert alone.error["tpot_p50"] == pytest.approx(2.5 / 7.5) and alone.repeats == []
    # Each side's median is taken apart: simulated figures from each repeat's own arrivals.
    mixed = case_from_repeats("ar", 5.0, [(1, figures(5.0), figures(4.0)), (1, figures(6.0), figures(9.0)), (1, figures(7.0), figures(5.0))])
    assert mixed.real["tpot_p90"] == 6.0 and mixed.sim["tpot_p90"] == 5.0
