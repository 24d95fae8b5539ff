"""One routing decision, free of Serve: what the cluster router (`cluster/router.py`) and the fleet simulator
(`cluster/sim/`) both run per request.

Given the fleet's stats as arrays, the requests routed to each replica since they were taken, and the
request (its acceptance relative to the workload's and its prompt length), it scores every replica by the
TPOT slack left after placing the request there (`placement_slack`), and with admission on keeps only the
replicas predicted to meet the request's SLOs (`AdmissionLoop.decide`), or refuses it.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from cluster.admission import AdmissionConfig, AdmissionLoop, Corrections, Decision, RequestSLO
from cluster.placement import FleetArrays, expected_tokens_per_step, placement_slack


class Route(NamedTuple):
    order: np.ndarray  # replica indices by slack, best first; only the feasible ones when admission is on
    tied: int  # the first `tied` of `order` share the best slack (within `tie_ms`): the caller picks among them
    decision: Decision | None  # admission's (None: admission off); refused when `order` is empty
    correction: Corrections  # what the feedback added to admission's predictions
    best: float  # the best replica's TPOT slack (ms; -inf when refused): how deployments compare (`cluster/fleet_backend.py`)


def route(
    fleet: FleetArrays,
    added: np.ndarray,
    relative_acceptance: float,
    *,
    loop: AdmissionLoop | None = None,
    config: AdmissionConfig | None = None,
    prompt_tokens: float = 0.0,
    pending_prompt_tokens: np.ndarray | float = 0.0,
    drain_rates: np.ndarray | None = None,
    replicas: list | None = None,
    waited_ms: float = 0.0,
    slo: RequestSLO | None = None,
    tie_ms: float = 1.0,
    now: float | None = None,
    commit: bool = True,
) -> Route:
    """`added`: requests routed to each replica since its stats were taken, net of those finished since;
    `prompt_tokens`: the request's (estimated from its text); `pending_prompt_tokens`: those routed to each replica
    since its stats (as `added`);
    `drain_rates`: each replica's measured completions per second and `replicas` their keys in the admission loop
    (admission only); `now`: the admission
    loop's clock (None: the monotonic clock; a simulator passes its own); `commit` False: admission only looks
    (`AdmissionLoop.decide`)."""
    tokens = expected_tokens_per_step(fleet, relative_acceptance)
    slack = placement_slack(fleet, added, tokens, prompt_tokens, pending_prompt_tokens)
    decision, correction = None, Corrections()
    if loop is not None and config is not None:
        rates = np.zeros(len(slack)) if drain_rates is None else drain_rates
        decision, correction = loop.decide(
            fleet, added, tokens, prompt_tokens, rates, config, waited_ms=waited_ms, slo=slo, now=now, commit=commit,
            replicas=replicas,
        )
        if not decision.admit:
            return Route(np.zeros(0, dtype=np.int64), 0, decision, correction, -np.inf)
        slack = np.where(decision.feasible, slack, -np.inf)
    order = np.argsort(-slack, kind="stable")
    if decision is not None:
        order = order[: int(decision.feasible.sum())]  # infeasible replicas are never offered
    best = slack[order[0]]
    tied = int(np.count_nonzero(slack >= best - tie_ms))  # (the head of `order`: it sorts by slack, stably)
    return Route(order, tied, decision, correction, float(best))
