import numpy as np
import pytest
from scipy import stats

from scheduling.verifier import accepted_length, speculative_verify


def test_single_position_output_is_target_distribution():
    rng = np.random.default_rng(0)
    p = np.array([0.5, 0.3, 0.2])
    q = np.array([0.1, 0.2, 0.7])
    counts = np.zeros(3)
    n = 20000
    for _ in range(n):
        x = rng.choice(3, p=q)
        out = speculative_verify(np.array([x]), q[None, :], np.stack([p, p]), rng)
        counts[out[0]] += 1
    assert stats.chisquare(counts, p * n).pvalue > 1e-3
    # Negative control: taking the draft token unverified gives the draft's distribution, which the test rejects.
    drafted = np.bincount(rng.choice(3, size=n, p=q), minlength=3)
    assert stats.chisquare(drafted, p * n).pvalue < 1e-6


def test_accepted_drafts_then_bonus():
    rng = np.random.default_rng(0)
    q = np.tile([0.5, 0.5], (2, 1))
    p = np.tile([0.0, 1.0], (3, 1))
    p[2] = [1.0, 0.0]
    out = speculative_verify(np.array([1, 1]), q, p, rng, uniforms=np.array([0.9, 0.9]))
    assert out == [1, 1, 0]  # both drafts have p/q = 2 > u: accepted; bonus from p[2]


def test_rejection_resamples_from_residual():
    rng = np.random.default_rng(0)
    q = np.array([[0.9, 0.1]])
    p = np.array([[0.1, 0.9], [0.5, 0.5]])
    # u * q(0) = 0.45 > p(0) = 0.1: rejected, residual max(p - q, 0) = [0, 0.8] -> token 1.
    assert speculative_verify(np.array([0]), q, p, rng, uniforms=np.array([0.5])) == [1]
    assert accepted_length(np.array([0]), q, p, np.array([0.5])) == 0
    assert accepted_length(np.array([0]), q, p, np.array([0.05])) == 1


def test_shape_mismatch_is_an_error():
    with pytest.raises(ValueError):
        speculative_verify(np.array([0]), np.ones((1, 2)) / 2, np.ones((1, 2)) / 2, np.random.default_rng(0))
