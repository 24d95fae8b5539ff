"""Survival curves: s_i(j) = P(the first j draft tokens of request i are all accepted).

Every estimator and allocator in this package speaks in survival curves of
shape (B, K). A curve is non-increasing in j; the global sorts rely on it
(sorting by gain then respects each request's prefix order).
"""

from __future__ import annotations

import numpy as np

EPS = 1e-6


def clip(x, lo, hi):
    """`np.clip`'s values at a third of its cost on small arrays (the controller clips many times a step)."""
    return np.minimum(np.maximum(x, lo), hi)


def survival_from_hazards(accept_prob: np.ndarray) -> np.ndarray:
    """Turn per-position conditional acceptance P(accept j | 1..j-1 accepted) into survival."""
    return clip(np.asarray(accept_prob, dtype=np.float64), 0.0, 1.0).cumprod(axis=-1)


def logit(p: np.ndarray) -> np.ndarray:
    p = clip(p, EPS, 1.0 - EPS)
    return np.log(p) - np.log1p(-p)


def sigmoid(z: np.ndarray) -> np.ndarray:
    t = np.multiply(np.asarray(z, dtype=np.float64), 0.5)
    np.tanh(t, out=t)
    t += 1.0
    t *= 0.5
    return t


def hazards_from_survival(survival: np.ndarray) -> np.ndarray:
    """Inverse of `survival_from_hazards` (hazard 0 past a zero survival)."""
    s = np.asarray(survival, dtype=np.float64)
    prev = np.empty_like(s)
    prev[..., :1] = 1.0
    prev[..., 1:] = s[..., :-1]
    return np.divide(s, prev, out=np.zeros_like(s), where=prev > 0)


def fit_logistic(x: np.ndarray, y: np.ndarray, l2: float = 1.0, steps: int = 12) -> np.ndarray:
    """L2-regularised logistic regression by Newton steps; the last column of x is the (unpenalised) bias."""
    w = np.zeros(x.shape[1])
    w[-1] = float(logit(np.array(y.mean())))
    reg = np.full(x.shape[1], l2)
    reg[-1] = 0.0
    for _ in range(steps):
        p = sigmoid(x @ w)
        grad = x.T @ (p - y) + reg * w
        hess = (x * (p * (1 - p))[:, None]).T @ x + np.diag(reg) + 1e-9 * np.eye(len(w))
        step = np.linalg.solve(hess, grad)
        w -= step
        if np.max(np.abs(step)) < 1e-6:
            break
    return w
