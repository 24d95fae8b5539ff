"""The router's score: TPOT slack a replica keeps after one more request is placed on it.

With a replica's stats (`replicas/routing_stats.py`) and the requests the
router added there since they were taken:

    step after = step_ms + (added + 1) * request_ms    (each request adds its share of a step)
    TPOT after = step after / tokens per step           (for the new request and for the batch)
    slack      = cap_ms - TPOT after - queued * cap_ms  (a request past the engine's batch waits)

The new request gets its expected tokens per step (`expected_tokens_per_step`)
only as far as the headroom left after placement pays for verifying its
drafts; otherwise it runs nearer one token per step. So a request predicted
to accept well goes where there is budget to verify it, one predicted to
accept poorly costs about the same anywhere, and the requests already on a
replica keep their own TPOT within the cap. Slack is in milliseconds; larger
is better.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from replicas.routing_stats import RoutingStats

DEFAULT_VERIFIED_PER_ACCEPTED = 2.0  # verified drafts per accepted one, before a replica has measured its own


class FleetArrays:
    """The stats of a fleet as columns, so that one decision scores every replica in a few numpy operations."""

    FIELDS = ("running", "load", "max_num_seqs", "cap_ms", "step_ms", "request_ms", "token_ms", "tokens_per_step", "verified_per_step",
              "realised_tpot_ms")

    def __init__(self, fleet: list[RoutingStats]) -> None:
        for name in self.FIELDS:
            values = [getattr(s, name) for s in fleet]
            setattr(self, name, np.array([np.nan if v is None else v for v in values], dtype=np.float64))
        self.has_cost = ~np.isnan(self.step_ms)
        accepted = self.tokens_per_step - 1.0
        self.per_accepted = np.where(accepted > 0.05, self.verified_per_step / np.maximum(accepted, 0.05), DEFAULT_VERIFIED_PER_ACCEPTED)
        # Measured tokens per step, even at 1.0 (the engine drafts nothing that is accepted at this load or this
        # temperature); the estimator's prediction only for a replica that has not run yet. (Taking the prediction
        # wherever nothing was accepted forecast TPOTs 2-4x under the realised ones, served at temperature 1.)
        ref = np.array([s.tokens_per_step if s.mix_measured else s.predicted_accept_len for s in fleet])
        self.reference_tokens = float(ref.mean()) if len(ref) else 1.0


def expected_tokens_per_step(fleet: FleetArrays, relative_acceptance: float) -> float:
    """Tokens per step a request gets where there is room to verify its drafts: the fleet's measured
    tokens per request-step (the estimator's prediction where none was measured), scaled by the
    request's predicted acceptance relative to the workload's."""
    return 1.0 + max(fleet.reference_tokens - 1.0, 0.0) * relative_acceptance


class Forecast(NamedTuple):
    """What placing one more request on each replica predicts (arrays over the fleet)."""

    n_new: np.ndarray  # requests the router has on it after placement, beyond those its stats saw running
    queued: np.ndarray  # requests past the engine's batch (they wait for a slot)
    step_after: np.ndarray  # predicted step time (ms) with the request in the batch
    tpot: np.ndarray  # predicted TPOT (ms): the worse of the new request's and the batch's


def placement_forecast(fleet: FleetArrays, added: np.ndarray, tokens_if_room: float) -> Forecast:
    """Step time, TPOT and queue per replica after placing one more request there.

    `added`: requests routed to each replica since its stats were taken, net of those finished since.
    `tokens_if_room`: tokens per step the request is expected to get where there is budget to verify its drafts.
    """
    f = fleet
    n_new = np.maximum(added, -f.running) + 1.0
    queued = np.maximum(0.0, f.load + n_new - f.max_num_seqs)
    step_after = f.step_ms + n_new * f.request_ms
    headroom_after = (f.cap_ms - step_after) / f.token_ms  # verified tokens that still fit under the cap
    gain = max(tokens_if_room - 1.0, 0.0)
    share = np.clip(headroom_after / (gain * f.per_accepted), 0.0, 1.0) if gain > 0 else 1.0
    tpot_new = step_after / (1.0 + gain * share)
    tpot_batch = np.where(f.running > 0, step_after / np.maximum(f.tokens_per_step, 1.0), 0.0)
    return Forecast(n_new, queued, step_after, np.maximum(tpot_new, tpot_batch))


def placement_slack(fleet: FleetArrays, added: np.ndarray, tokens_if_room: float) -> np.ndarray:
    """TPOT slack (ms) per replica after placing one more request there (see `placement_forecast`)."""
    f = fleet
    fc = placement_forecast(fleet, added, tokens_if_room)
    slack = f.cap_ms - fc.tpot - fc.queued * f.cap_ms
    # No cost model (an engine without WCS): fewer requests is all that can be said.
    return np.where(f.has_cost, slack, -(f.load + fc.n_new) - fc.queued * f.cap_ms)
