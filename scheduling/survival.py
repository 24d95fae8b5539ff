"""Survival curves: s_i(j) = P(the first j draft tokens of request i are all accepted).

Every estimator and allocator in this package speaks in survival curves of
shape (B, K). A curve is non-increasing in j; the global sorts rely on it
(sorting by gain then respects each request's prefix order).
"""

from __future__ import annotations

import numpy as np

EPS = 1e-6


def survival_from_hazards(accept_prob: np.ndarray) -> np.ndarray:
    """Turn per-position conditional acceptance P(accept j | 1..j-1 accepted) into survival."""
    p = np.clip(np.asarray(accept_prob, dtype=np.float64), 0.0, 1.0)
    return np.cumprod(p, axis=-1)


def logit(p: np.ndarray) -> np.ndarray:
    p = np.clip(p, EPS, 1.0 - EPS)
    return np.log(p) - np.log1p(-p)


def sigmoid(z: np.ndarray) -> np.ndarray:
    return 0.5 * (1.0 + np.tanh(0.5 * np.asarray(z, dtype=np.float64)))
