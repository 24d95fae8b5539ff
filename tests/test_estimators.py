"""Pre-draft estimators: the context model beats the constant and history baselines when the
features carry signal, and does not pretend to when they carry none."""

import dataclasses

import numpy as np
import pytest

from scheduling.estimators import ConstantEstimator, ContextEstimator, EWMAEstimator
from scheduling.evaluation import auc, brier, compare_estimators, ece, evaluate
from scheduling.survival import sigmoid
from scheduling.traces import AcceptanceHistory, PreDraftInputs, Traces, synthetic_traces


def test_context_model_beats_constant_and_history_baselines():
    reports = compare_estimators(synthetic_traces(feature_strength=2.0, request_spread=0.5, seed=1))
    ctx = reports["context"]
    for baseline in ("constant", "ewma"):
        assert ctx.mean_auc > reports[baseline].mean_auc + 0.1
        assert ctx.mean_brier < 0.9 * reports[baseline].mean_brier
    assert all(p.auc is not None and p.auc > 0.75 for p in ctx.positions)


def test_negative_control_no_signal_no_gain():
    """Features and history carry nothing: the context model must not look better than the constant."""
    reports = compare_estimators(synthetic_traces(feature_strength=0.0, request_spread=0.0, seed=2))
    assert abs(reports["context"].mean_auc - 0.5) < 0.05
    assert reports["context"].mean_brier > 0.98 * reports["constant"].mean_brier


def test_history_baseline_sees_persistent_request_effects():
    reports = compare_estimators(synthetic_traces(feature_strength=0.0, request_spread=1.5, seed=3))
    assert reports["ewma"].mean_auc > reports["constant"].mean_auc + 0.1


def test_censored_positions_are_not_counted_as_rejections():
    """With no per-request signal the constant estimator recovers the true per-position hazards,
    although most rows drafted fewer than K tokens."""
    traces = synthetic_traces(num_requests=600, feature_strength=0.0, request_spread=0.0, random_widths=True, seed=4)
    est = ConstantEstimator(traces.k).fit(traces)
    truth = sigmoid(1.5 - 0.15 * np.arange(1, traces.k + 1))
    assert np.max(np.abs(est.hazards - truth)) < 0.03
    # The naive reading (a position not drafted counts as not accepted) is far off.
    naive = np.array([(traces.accepted >= j).sum() / (traces.accepted >= j - 1).sum() for j in range(1, traces.k + 1)])
    assert np.max(np.abs(naive - truth)) > 0.1


def test_online_recalibration_follows_a_drift():
    before = synthetic_traces(feature_strength=1.0, base_logit=1.5, seed=5)
    after = synthetic_traces(feature_strength=1.0, base_logit=-0.5, seed=6)
    frozen = ContextEstimator(before.k).fit(before)
    online = ContextEstimator(before.k).fit(before)
    warm, held = after.split_by_request(0.3, seed=0)
    for rows in np.array_split(np.arange(len(warm)), 200):
        part = warm.subset(rows)
        online.update(part.inputs, part.drafted, part.accepted)
    assert evaluate(online, held).mean_ece < 0.5 * evaluate(frozen, held).mean_ece
    assert evaluate(online, held).mean_brier < evaluate(frozen, held).mean_brier


def test_predictions_are_survival_curves():
    traces = synthetic_traces(seed=7)
    for cls in (ConstantEstimator, EWMAEstimator, ContextEstimator):
        s = cls(traces.k).fit(traces).predict(traces.inputs)
        assert s.shape == (len(traces), traces.k)
        assert np.all((s >= 0) & (s <= 1)) and np.all(np.diff(s, axis=1) <= 1e-12)


def test_context_estimator_must_be_fitted():
    with pytest.raises(RuntimeError):
        ContextEstimator(4).predict(PreDraftInputs(np.zeros((1, 2)), np.array([np.nan])))


def test_metrics():
    y = np.array([0, 0, 1, 1])
    assert auc(np.array([0.1, 0.2, 0.8, 0.9]), y) == 1.0
    assert auc(np.array([0.9, 0.8, 0.2, 0.1]), y) == 0.0
    assert auc(np.full(4, 0.5), y) == 0.5
    assert auc(np.ones(3), np.ones(3)) is None
    assert brier(np.array([1.0, 0.0]), np.array([1, 0])) == 0.0
    rng = np.random.default_rng(0)
    p = rng.random(20000)
    assert ece(p, rng.random(20000) < p) < 0.02  # calibrated
    assert ece(p, rng.random(20000) < p**3) > 0.1  # overconfident


def test_history_tracker_counts_one_rejection_per_short_step():
    h = AcceptanceHistory(decay=0.5)
    ids = np.array([7])
    assert np.isnan(h.rates(ids)[0])
    h.observe(ids, np.array([4]), np.array([1]))  # 1 accept, then a rejection
    assert h.rates(ids)[0] == pytest.approx(0.5)
    h.observe(ids, np.array([2]), np.array([2]))  # both accepted, nothing rejected
    assert h.rates(ids)[0] == pytest.approx((0.5 * 1 + 2) / (0.5 * 2 + 2))
    h.forget(7)
    assert np.isnan(h.rates(ids)[0])


def test_traces_round_trip(tmp_path):
    traces = synthetic_traces(num_requests=10, steps_per_request=5, seed=8)
    traces.save(tmp_path / "t.npz")
    back = Traces.load(tmp_path / "t.npz")
    assert back.k == traces.k and back.feature_names == traces.feature_names
    np.testing.assert_array_equal(back.accepted, traces.accepted)
    np.testing.assert_array_equal(back.inputs.history, traces.inputs.history)
    assert back.domain is None and back.mean_accepted_length() == {}
    # With each row's domain: kept, and the mean accepted length per domain over the rows at full width.
    domain = np.where(traces.request_id % 2 == 0, "code", "prose")
    dataclasses.replace(traces, domain=domain).save(tmp_path / "d.npz")
    back = Traces.load(tmp_path / "d.npz")
    np.testing.assert_array_equal(back.domain, domain)
    full = traces.drafted == traces.k
    assert back.mean_accepted_length()["code"] == pytest.approx(1 + traces.accepted[full & (domain == "code")].mean())
    assert back.subset(np.flatnonzero(domain == "prose")).mean_accepted_length().keys() == {"prose"}


def test_traces_reject_inconsistent_rows():
    inputs = PreDraftInputs(np.zeros((2, 1)), np.zeros(2))
    with pytest.raises(ValueError):
        Traces(inputs, np.array([1, 1]), np.array([2, 0]), np.array([0, 1]), k=4)


def test_distribution_stats_are_each_rows_softmax_entropy_and_max_probability():
    import torch

    from replicas.wcs.features import distribution_stats

    rng = np.random.default_rng(0)
    logits = rng.normal(scale=3.0, size=(7, 50))
    logits[0] = 0.0  # uniform: entropy log(50), max probability 1/50
    logits[1, 3] = 100.0  # all mass on one token: entropy 0, max probability 1
    p = np.exp(logits - logits.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    expected = np.stack([-(p * np.log(np.maximum(p, 1e-300))).sum(axis=1), p.max(axis=1)], axis=1)
    got = distribution_stats(torch.tensor(logits, dtype=torch.float32)).numpy()
    np.testing.assert_allclose(got, expected, atol=1e-4)
    assert abs(got[0, 0] - np.log(50)) < 1e-4 and abs(got[1, 1] - 1.0) < 1e-5
    # Rows are summarised independently: a subset gives the same rows.
    np.testing.assert_allclose(distribution_stats(torch.tensor(logits[[2, 5]], dtype=torch.float32)).numpy(), got[[2, 5]], atol=1e-6)
