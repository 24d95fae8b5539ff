"""Reference speculative-sampling verifier: exact rejection sampling with residual resampling and a bonus token.

Slow and plain on purpose; the tests measure every policy's output
distribution through it. Draft token j is accepted with probability
min(1, p_j(x_j) / q_j(x_j)); the first rejection is replaced by a sample from
norm(max(0, p_j - q_j)); if all verified drafts are accepted, a bonus token is
drawn from the target's next distribution.
"""

from __future__ import annotations

import numpy as np


def speculative_verify(
    draft_tokens: np.ndarray,
    draft_probs: np.ndarray,
    target_probs: np.ndarray,
    rng: np.random.Generator,
    uniforms: np.ndarray | None = None,
) -> list[int]:
    """Tokens emitted for one request: accepted drafts then one corrected or bonus token.

    draft_tokens (v,), draft_probs (v, V) with the distributions the drafts were
    sampled from, target_probs (v+1, V) with the target's distributions after
    each draft prefix. `uniforms` (>= v values) may be given to replay a
    pre-drawn acceptance test.
    """
    v = len(draft_tokens)
    if draft_probs.shape[0] != v or target_probs.shape[0] != v + 1:
        raise ValueError("need v draft distributions and v + 1 target distributions")
    u = rng.random(v) if uniforms is None else np.asarray(uniforms)[:v]
    out: list[int] = []
    for j, x in enumerate(draft_tokens.tolist()):
        p, q = target_probs[j], draft_probs[j]
        if u[j] * q[x] <= p[x]:  # accept with prob min(1, p/q) without dividing
            out.append(x)
            continue
        residual = np.maximum(p - q, 0.0)
        out.append(int(rng.choice(len(p), p=residual / residual.sum())))
        return out
    out.append(int(rng.choice(target_probs.shape[1], p=target_probs[v])))
    return out


def accepted_length(
    draft_tokens: np.ndarray, draft_probs: np.ndarray, target_probs: np.ndarray, uniforms: np.ndarray
) -> int:
    """How many leading drafts the acceptance test with these uniforms accepts (for the oracle policy)."""
    idx = np.arange(len(draft_tokens))
    ok = uniforms[: len(draft_tokens)] * draft_probs[idx, draft_tokens] <= target_probs[idx, draft_tokens]
    return int(np.argmin(ok)) if not ok.all() else len(draft_tokens)
