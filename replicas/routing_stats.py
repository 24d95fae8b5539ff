"""What a replica tells the cluster router (Serve's `record_routing_stats`), and how it is computed.

Serve polls each replica every `request_routing_stats_period_s` and hands the
dict to every router, so the numbers are stale by up to a period: the router
adds its own in-flight accounting on top (`cluster/router.py`). Everything
here is in step terms, from the replica's own profiled cost model:

- `step_ms`: predicted step time of the batch the engine runs now;
- `cap_ms`: the step-time cap implied by the TPOT SLO (a step emits at least
  one token per request, so steps under the cap keep every TPOT under it);
- `headroom_tokens`: how many more target tokens per step fit under the cap;
- `request_ms`: what one more request of the batch's average kind adds to a step (the mean over
  the next `REQUEST_SECANT`);
- `base_step_ms`, `base_request_ms`: the same without any speculation (every request one token a
  step): the part of a step that WCS cannot shrink, where the rest is speculation it sizes to the
  cap and gives up first when more requests arrive;
- `token_ms`: what one more verified draft token adds to a step;
- `prefill_token_ms`: what a prompt token costs in a chunk of prefill that fills the step's token budget
  (on a GPU a few tokens more are nearly free below the knee, a long prompt's chunks are not);
- `tokens_per_step`: tokens each request gets per step (1 + accepted drafts);
- `predicted_accept_len`: the estimator's mean accepted length for the running batch (what the router
  goes by until `mix_measured`: the replica has run steps, so `tokens_per_step` is measured);
- `realised_tpot_ms`: the engine's measured time per decoded token over the last period
  (None when too little was decoded): what `step_ms / tokens_per_step` predicted, as it came out.
"""

from __future__ import annotations

import time

from pydantic import BaseModel

from scheduling.cost_model import StepCostModel

REQUEST_SECANT = 4  # `request_ms` is the mean step cost of this many more requests


class RoutingStats(BaseModel):
    timestamp: float
    running: int
    waiting: int
    kv_usage: float
    max_num_seqs: int
    cap_ms: float
    step_ms: float | None = None  # None: no cost model (an engine without WCS)
    headroom_tokens: float | None = None
    request_ms: float | None = None
    base_step_ms: float | None = None  # the step without speculation (every request one token)
    base_request_ms: float | None = None  # what one more request adds to it
    token_ms: float | None = None  # what one more verified token adds to a step
    prefill_token_ms: float | None = None  # per prompt token, in a prefill chunk that fills the token budget
    tokens_per_step: float = 1.0
    verified_per_step: float = 0.0  # verified drafts per request-step
    mix_measured: bool = False  # tokens_per_step and verified_per_step come from steps the engine ran
    predicted_accept_len: float = 1.0
    realised_tpot_ms: float | None = None

    @property
    def load(self) -> int:
        return self.running + self.waiting


def autoscaling_metrics(stats: RoutingStats) -> dict[str, float]:
    """The stats as Serve's custom autoscaling metrics take them: numbers only (NaN for a missing one)."""
    return {k: float("nan") if v is None else float(v) for k, v in stats.model_dump().items()}


class StepMix(BaseModel):
    """Per request-step averages over the last stats period (from WCS counter deltas)."""

    drafted: float = 0.0
    verified: float = 0.0
    accepted: float = 0.0
    measured: bool = False  # from steps the engine ran (the default mix is a guess)


def step_mix(now: dict, before: dict | None) -> StepMix | None:
    """Averages between two `wcs_stats` snapshots; None when no request ran a step in between."""
    if before is None:
        return None
    steps = now["planned_requests"] - before["planned_requests"]
    if steps <= 0:
        return None

    def delta(name: str) -> float:
        return (sum(now[name]) - sum(before[name])) / steps

    return StepMix(
        drafted=delta("drafted_per_pos"), verified=delta("verified_per_pos"), accepted=delta("accepted_per_pos"), measured=True
    )


def headroom_tokens(
    cost: StepCostModel, requests: int, drafted: float, target: float, cap_ms: float, token_budget: int
) -> float:
    """The largest t >= 0 with T(R, D, N + t) <= cap and N + t <= the engine's token budget
    (0 when the batch already exceeds either); T is monotone in N."""
    d, n = round(drafted), round(target)
    most = token_budget - n
    if most <= 0 or cost.step_ms(requests, d, n) > cap_ms:
        return 0.0
    if cost.step_ms(requests, d, n + most) <= cap_ms:
        return float(most)
    lo, hi = 0, most
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if cost.step_ms(requests, d, n + mid) <= cap_ms:
            lo = mid
        else:
            hi = mid
    return float(lo)


def routing_stats(
    *,
    cost: StepCostModel | None,
    running: int,
    waiting: int,
    kv_usage: float,
    max_num_seqs: int,
    token_budget: int,
    cap_ms: float,
    mix: StepMix,
    predicted_accept_len: float,
    realised_tpot_ms: float | None = None,
) -> RoutingStats:
    stats = RoutingStats(
        timestamp=time.time(),
        running=running,
        waiting=waiting,
        kv_usage=kv_usage,
        max_num_seqs=max_num_seqs,
        cap_ms=cap_ms,
        tokens_per_step=1.0 + mix.accepted,
        verified_per_step=mix.verified,
        mix_measured=mix.measured,
        predicted_accept_len=predicted_accept_len,
        realised_tpot_ms=realised_tpot_ms,
    )
    if cost is None:
        return stats
    r = running
    drafted, target = r * mix.drafted, r * (1.0 + mix.verified)
    step = cost.step_ms(r, round(drafted), round(target))
    # Over the next REQUEST_SECANT requests, not the next one: from an idle or near-idle batch the first
    # request also pays the step's one-off drafting launch, which extrapolated per request overstates
    # what the several requests a router sends between two stats add.
    k = REQUEST_SECANT
    more = cost.step_ms(r + k, round(drafted + k * mix.drafted), round(target + k * (1.0 + mix.verified)))
    base = cost.step_ms(r, 0, r)
    stats.step_ms = step
    stats.request_ms = max((more - step) / k, 0.0)
    stats.base_step_ms = min(base, step)
    stats.base_request_ms = min(max((cost.step_ms(r + k, 0, r + k) - base) / k, 0.0), stats.request_ms)
    stats.token_ms = max((cost.step_ms(r, round(drafted), round(target) + 8) - step) / 8.0, 1e-3)
    chunk = max(token_budget - round(target), 1)
    stats.prefill_token_ms = max((cost.step_ms(r, round(drafted), round(target) + chunk) - step) / chunk, 1e-4)
    stats.headroom_tokens = headroom_tokens(cost, r, drafted, target, cap_ms, token_budget)
    return stats
