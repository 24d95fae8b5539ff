import numpy as np
import pytest
from pydantic import ValidationError

from scheduling.cost_model import PiecewiseLinear, StepCostModel


def true_step_ms(r, d, n):
    """Separable and monotone, with knees: what a profiled engine step might look like."""
    return 3.0 + 0.02 * r + np.where(d < 64, 0.01 * d, 0.64 + 0.05 * (d - 64)) + np.sqrt(n) * 0.4


def grid_samples():
    r, d, n = np.meshgrid([1, 4, 16, 64], [0, 16, 32, 64, 128, 256], [1, 16, 64, 256, 512, 1024], indexing="ij")
    r, d, n = r.ravel(), d.ravel(), n.ravel()
    return r, d, n, true_step_ms(r, d, n)


def test_fit_interpolates_between_profiled_points():
    r, d, n, ms = grid_samples()
    model = StepCostModel.fit(r, d, n, ms)
    assert np.max(np.abs(model.predict(r, d, n) - ms)) < 0.05
    rng = np.random.default_rng(0)
    qr, qd, qn = rng.integers(1, 64, 200), rng.integers(0, 256, 200), rng.integers(1, 1024, 200)
    rel = np.abs(model.predict(qr, qd, qn) - true_step_ms(qr, qd, qn)) / true_step_ms(qr, qd, qn)
    assert np.max(rel) < 0.05


def test_fit_is_monotone_and_extrapolates_linearly():
    r, d, n, ms = grid_samples()
    model = StepCostModel.fit(r, d, n, ms)
    grid = np.arange(0, 3000)
    for values in (model.predict(8, grid, 100), model.predict(8, 10, grid), model.predict(grid, 10, 100)):
        assert np.all(np.diff(values) >= -1e-12)
    far = model.predict(8, 10, np.array([2000, 3000, 4000]))
    assert far[2] - far[1] == pytest.approx(far[1] - far[0])


def test_fit_recovers_an_exactly_linear_model():
    rng = np.random.default_rng(1)
    r, d, n = rng.integers(1, 64, 300), rng.integers(0, 512, 300), rng.integers(1, 2048, 300)
    truth = StepCostModel.linear(4.0, 0.03, 0.01, 0.02)
    model = StepCostModel.fit(r, d, n, truth.predict(r, d, n))
    q = (np.array([5, 50]), np.array([7, 700]), np.array([9, 3000]))
    np.testing.assert_allclose(model.predict(*q), truth.predict(*q), rtol=1e-6)


def test_json_round_trip(tmp_path):
    model = StepCostModel.fit(*grid_samples())
    model.save(tmp_path / "cost.json")
    back = StepCostModel.load(tmp_path / "cost.json")
    assert back == model
    np.testing.assert_array_equal(back.predict(3, 100, 400), model.predict(3, 100, 400))


def test_planner_tables_agree_with_predict():
    model = StepCostModel.fit(*grid_samples())
    curve = model.prefix_curve(10, 5000, None)  # beyond the first table size: grows
    k = np.arange(5001)
    np.testing.assert_allclose(curve, model.predict(10, k, 10 + k))
    fixed = model.prefix_curve(10, 50, 300)
    np.testing.assert_allclose(fixed, model.predict(10, 300, 10 + np.arange(51)))
    assert model.step_ms(3, 4, 5) == pytest.approx(float(model.predict(3, 4, 5)))


def test_invalid_models_are_rejected():
    with pytest.raises(ValidationError):
        PiecewiseLinear(knots=[0, 1], slopes=[-1.0])
    with pytest.raises(ValidationError):
        PiecewiseLinear(knots=[0, 2, 1], slopes=[1.0, 1.0])
    with pytest.raises(ValidationError):
        StepCostModel(intercept_ms=-1.0)
    with pytest.raises(ValueError):
        StepCostModel.fit([1], [1, 2], [1], [1.0])


def test_fit_separates_the_drafter_launch_cost_from_the_intercept():
    rng = np.random.default_rng(2)
    r = rng.integers(1, 64, 400)
    d = rng.integers(0, 8, 400) * r * (rng.random(400) > 0.3)
    n = r + d // 2
    base = 5.0 + 0.03 * r + 0.01 * d + 0.02 * n
    with_launch = StepCostModel.fit(r, d, n, base + 4.0 * (d > 0))
    assert with_launch.draft_launch_ms == pytest.approx(4.0, abs=0.05)
    assert with_launch.intercept_ms == pytest.approx(5.0, abs=0.1)
    # Negative control: no launch cost in the data, none fitted.
    assert StepCostModel.fit(r, d, n, base).draft_launch_ms < 0.05
    # The lookup tables (the planner's path) agree with predict.
    assert with_launch.step_ms(8, 0, 8) == pytest.approx(float(with_launch.predict(8, 0, 8)))
    assert with_launch.step_ms(8, 3, 11) == pytest.approx(float(with_launch.predict(8, 3, 11)))


def launch_per_request_truth(r, d, n):
    """A drafter whose launch costs 1 ms plus 0.2 ms per request in the batch, and drafted tokens with a knee."""
    r, d = np.asarray(r, float), np.asarray(d, float)
    return 5.0 + 0.03 * r + np.where(d < 64, 0.02 * d, 1.28 + 0.05 * (d - 64)) + 0.02 * np.asarray(n) + (1.0 + 0.2 * r) * (d > 0)


def test_fit_tells_a_launch_cost_per_request_from_the_drafted_tokens_when_some_of_the_batch_drafts():
    """Timings with 5% noise. Profiled as the profiler samples (a random share of the batch drafts, so D varies
    at each R), the fit prices a 64-request step that drafts 16 tokens within 2% on average over six profiles.
    Control: profiled with every request drafting (D ~ R K / 2), the per-request launch is confounded with the
    drafted tokens and the same step is mispriced more than twice as much."""

    def profiled(seed: int, share_drafts: bool) -> tuple[float, StepCostModel]:
        rng = np.random.default_rng(seed)
        r = 2 ** rng.integers(0, 8, 600)
        share = rng.random(600) if share_drafts else np.ones(600)
        d = np.array([(rng.integers(0, 9, ri) * (rng.random(ri) < q)).sum() for ri, q in zip(r, share)])
        d = d * (rng.random(600) > 0.25)
        n = r + d // 2
        model = StepCostModel.fit(r, d, n, launch_per_request_truth(r, d, n) * rng.normal(1.0, 0.05, 600))
        return abs(model.step_ms(64, 16, 72) / launch_per_request_truth(64, 16, 72) - 1), model

    shared = [profiled(seed, True) for seed in range(6)]
    everyone = [profiled(seed, False)[0] for seed in range(6)]
    assert np.mean([e for e, _ in shared]) < 0.02
    assert np.mean(everyone) > 2 * np.mean([e for e, _ in shared])
    model = shared[0][1]
    assert model.launch_ms(64) == pytest.approx(1.0 + 0.2 * 64, rel=0.15)
    assert model.step_ms(64, 16, 72) == pytest.approx(float(model.predict(64, 16, 72)))  # the planner's tables agree
    np.testing.assert_allclose(model.prefix_curve(64, 20, None), model.predict(64, np.arange(21), 64 + np.arange(21)))
    np.testing.assert_allclose(model.prefix_curve(64, 20, 0), model.predict(64, 0, 64 + np.arange(21)))


def test_a_copy_with_other_fields_prices_steps_with_them():
    """The lookup tables are cached per model: a copy must not inherit the original's."""
    model = StepCostModel.linear(intercept_ms=10.0, per_request_ms=0.5, per_draft_ms=0.3, per_target_ms=0.4)
    assert model.step_ms(4, 8, 10) == pytest.approx(float(model.predict(4, 8, 10)))  # builds the tables
    longer = model.model_copy(update={"intercept_ms": 70.0})
    assert longer.step_ms(4, 8, 10) == pytest.approx(model.step_ms(4, 8, 10) + 60.0)
    assert longer.prefix_curve(4, 3, None)[0] == pytest.approx(model.prefix_curve(4, 3, None)[0] + 60.0)


def test_engines_on_one_host_profile_one_at_a_time(tmp_path, monkeypatch):
    """The profiling lock is a real file lock, held here by another process for 1.5 s: this process waits for
    it, its event loop going on meanwhile. Control: with another cache (another host) there is no wait."""
    import asyncio
    import subprocess
    import sys
    import time

    from replicas.wcs.profiler import profiling_lock, profiling_lock_async

    monkeypatch.setenv("FORESPARK_CACHE", str(tmp_path / "host"))
    holder = subprocess.Popen(
        [sys.executable, "-c", "import time\nfrom replicas.wcs.profiler import profiling_lock\n"
         "with profiling_lock():\n    print('held', flush=True)\n    time.sleep(1.5)\n"],
        stdout=subprocess.PIPE, text=True, env={**__import__("os").environ, "FORESPARK_CACHE": str(tmp_path / "host")},
    )
    assert holder.stdout.readline().strip() == "held"

    async def wait_for_it() -> tuple[float, int]:
        ticks = 0

        async def tick():
            nonlocal ticks
            while True:
                await asyncio.sleep(0.05)
                ticks += 1

        ticker = asyncio.create_task(tick())
        start = time.perf_counter()
        async with profiling_lock_async():
            waited = time.perf_counter() - start
        ticker.cancel()
        return waited, ticks

    monkeypatch.setenv("FORESPARK_CACHE", str(tmp_path / "other-host"))  # control: held there, not here
    start = time.perf_counter()
    with profiling_lock():
        assert time.perf_counter() - start < 0.5
    monkeypatch.setenv("FORESPARK_CACHE", str(tmp_path / "host"))
    waited, ticks = asyncio.run(wait_for_it())
    holder.wait(timeout=10)
    assert waited > 0.8 and ticks >= 10, (waited, ticks)
