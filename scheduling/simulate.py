"""A synthetic step simulator: every policy's decisions on the same drawn acceptances.

No model runs here. Each step draws per-request, per-position true acceptance
probabilities, the accepted length under full-width drafting, and noisy
pre- and post-draft estimates of those probabilities; each policy plans and
verifies through the same planner and allocator, emits min(accepted, v) + 1
tokens per request, and is charged the cost model's step time. It shows what
the planner decides and why, not what an engine measures.
"""

from __future__ import annotations

import numpy as np
from pydantic import BaseModel

from scheduling.cost_model import PiecewiseLinear, StepCostModel
from scheduling.policies import Policy, PolicyName, StepLimits
from scheduling.survival import survival_from_hazards


def gpu_like_cost() -> StepCostModel:
    """A decode step with a fixed 12 ms and small per-request / per-token costs, steeper past 2048 tokens."""
    return StepCostModel(
        intercept_ms=12.0,
        requests=PiecewiseLinear(knots=[0.0, 1.0], slopes=[0.004]),
        drafted=PiecewiseLinear(knots=[0.0, 1.0], slopes=[0.0015]),
        target=PiecewiseLinear(knots=[0.0, 2048.0, 4096.0], slopes=[0.004, 0.012]),
    )


class PolicyOutcome(BaseModel):
    policy: PolicyName
    tokens_per_ms: float
    tokens_per_step: float  # per request
    mean_draft: float
    mean_verify: float
    draft_waste: float  # drafted tokens never verified / drafted
    speedup_vs_ar: float = 1.0
    regret_vs_oracle: float | None = None  # 1 - tokens_per_ms / the oracle's (when the oracle ran)


def simulate(
    policies: list[PolicyName],
    *,
    batch: int = 64,
    k: int = 8,
    steps: int = 200,
    seed: int = 0,
    cost: StepCostModel | None = None,
    limits: StepLimits | None = None,
) -> list[PolicyOutcome]:
    cost = cost or gpu_like_cost()
    limits = limits or StepLimits(token_budget=8192)
    rng = np.random.default_rng(seed)
    base = rng.uniform(0.45, 0.95, batch)  # requests differ persistently (domain, prompt)
    totals = {p: np.zeros(5) for p in policies}  # tokens, ms, drafted, verified, requests
    for _ in range(steps):
        rate = np.clip(base + rng.normal(0.0, 0.1, batch), 0.05, 0.99)
        hazards = np.clip(rate[:, None] - 0.02 * np.arange(k)[None, :], 0.0, 1.0)
        accepted = np.cumprod(rng.random((batch, k)) < hazards, axis=1).sum(axis=1)
        pre = survival_from_hazards(np.clip(hazards + rng.normal(0.0, 0.08, hazards.shape), 0.0, 1.0))
        post = survival_from_hazards(np.clip(hazards + rng.normal(0.0, 0.04, hazards.shape), 0.0, 1.0))
        for name in policies:
            policy = Policy(name=name, k=k)
            plan = policy.plan(pre, cost, limits, np.full(batch, k), accepted)
            verify = policy.verify(post, plan, cost, limits)
            emitted = np.minimum(accepted, verify) + 1
            ms = float(cost.predict(batch, plan.draft.sum(), batch + verify.sum()))
            totals[name] += [emitted.sum(), ms, plan.draft.sum(), verify.sum(), batch]
    rows = []
    for name in policies:
        tokens, ms, drafted, verified, requests = totals[name]
        rows.append(
            PolicyOutcome(
                policy=name,
                tokens_per_ms=tokens / ms,
                tokens_per_step=tokens / requests,
                mean_draft=drafted / requests,
                mean_verify=verified / requests,
                draft_waste=(drafted - verified) / drafted if drafted else 0.0,
            )
        )
    ar = next((r.tokens_per_ms for r in rows if r.policy == PolicyName.AR), None)
    oracle = next((r.tokens_per_ms for r in rows if r.policy == PolicyName.ORACLE), None)
    for r in rows:
        if ar:
            r.speedup_vs_ar = r.tokens_per_ms / ar
        if oracle:
            r.regret_vs_oracle = 1.0 - r.tokens_per_ms / oracle
    return rows


def format_outcomes(rows: list[PolicyOutcome]) -> str:
    lines = [f"{'policy':>8} {'tok/ms':>8} {'vs ar':>6} {'regret':>7} {'tok/step':>9} {'draft':>6} {'verify':>7} {'waste':>6}"]
    for r in rows:
        regret = f"{r.regret_vs_oracle:>7.1%}" if r.regret_vs_oracle is not None else f"{'-':>7}"
        lines.append(
            f"{r.policy.value:>8} {r.tokens_per_ms:>8.2f} {r.speedup_vs_ar:>6.2f} {regret} {r.tokens_per_step:>9.2f} "
            f"{r.mean_draft:>6.2f} {r.mean_verify:>7.2f} {r.draft_waste:>6.1%}"
        )
    return "\n".join(lines)
