"""The router's score: TPOT slack a replica keeps after one more request is placed on it.

With a replica's stats (`replicas/routing_stats.py`) and the requests the
router added there since they were taken (n of them, the new one included):

    prefill      = (prompt tokens routed there since the stats + the new one's) * prefill_token_ms
    stretch      = 1 / max(1 - prefill / 1 s, 0.1)         (those prefills take that much of the engine's next
                   stats period from decoding: every step the batch decodes in it is that much longer)

    base after   = base_step_ms + n * base_request_ms       (the step with no speculation: WCS cannot shrink it)
    demand       = (step_ms - base_step_ms) + n * (request_ms - base_request_ms)   (speculation at today's mix)
    kept         = min(1, (cap_ms - base after) / demand)   (the share of it that still fits under the cap)
    step after   = base after + kept * demand
    TPOT after   = stretch * step after / (1 + kept * accepted per step)   (for the new request and for the batch)
    TPOT seen    = TPOT after * realised TPOT / modelled TPOT of the last period, beyond a band of 1.25 either way
                   (clipped to [1/4, 4])
    slack        = cap_ms - TPOT seen - queued * cap_ms     (a request past the engine's batch waits)

WCS sizes each step's speculation to the cap, so a replica whose step is at
the cap is not full: one more request there takes its share of the budget and
every request's drafts shrink a little (`kept`), which the forecast prices as
fewer accepted tokens a step rather than as a step past the cap. Accepted
tokens are each replica's own (`expected_tokens_per_step`: its drafter's
measured acceptance, or none, scaled by the request's predicted acceptance),
as are the costs, so a fleet may mix GPUs, tensor-parallel sizes and
drafters. Slack is in milliseconds; larger is better.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from replicas.routing_stats import RoutingStats
from scheduling.survival import clip

class FleetArrays:
    """The stats of a fleet as columns, so that one decision scores every replica in a few numpy operations."""

    FIELDS = ("running", "load", "max_num_seqs", "cap_ms", "step_ms", "request_ms", "base_step_ms", "base_request_ms", "token_ms",
              "prefill_token_ms", "tokens_per_step", "realised_tpot_ms")

    def __init__(self, fleet: list[RoutingStats]) -> None:
        for name in self.FIELDS:
            values = [getattr(s, name) for s in fleet]
            setattr(self, name, np.array([np.nan if v is None else v for v in values], dtype=np.float64))
        self.has_cost = ~np.isnan(self.step_ms)
        # Speculation's share of a step, now and per request (zero for a replica that reports no base step).
        self.base_step_ms = np.where(np.isnan(self.base_step_ms), self.step_ms, self.base_step_ms)
        self.base_request_ms = np.where(np.isnan(self.base_request_ms), self.request_ms, self.base_request_ms)
        self.spec_ms = np.maximum(self.step_ms - self.base_step_ms, 0.0)
        self.spec_request_ms = np.maximum(self.request_ms - self.base_request_ms, 0.0)
        # Per replica, measured tokens per step, even at 1.0 (its engine drafts nothing that is accepted at this
        # load or temperature, or it has no drafter); the estimator's prediction only for a replica that has not
        # run yet. (Taking the prediction wherever nothing was accepted forecast TPOTs 2-4x under the realised
        # ones, served at temperature 1; one fleet-wide figure sent every request to the replicas without a
        # drafter, whose cheaper steps it credited with the others' accepted tokens.)
        ref = np.array([s.tokens_per_step if s.mix_measured else s.predicted_accept_len for s in fleet], dtype=np.float64)
        self.reference_tokens = np.maximum(ref, 1.0)
        # Realised over modelled TPOT for the batch each replica ran (NaN where nothing compares: no cost model,
        # nothing decoded in the last period, or an idle batch now): what the model does not see, such as the
        # prefill chunks of long prompts in its steps or a host's CPU taken by others.
        modelled = self.step_ms / np.maximum(self.tokens_per_step, 1.0)
        ok = self.has_cost & (self.running > 0) & np.isfinite(self.realised_tpot_ms) & (modelled > 0)
        self.realised_ratio = np.where(ok, self.realised_tpot_ms / np.where(ok, modelled, 1.0), np.nan)
        # What each decision reads of the two (computed here once per stats, not per decision).
        self.prefill_ms_per_token = np.nan_to_num(self.prefill_token_ms)
        self.neg_running, self.over_batch = -self.running, self.load - self.max_num_seqs
        self.all_cost = bool(self.has_cost.all())
        self.batch_gain = np.where(self.running > 0, np.maximum(self.tokens_per_step - 1.0, 0.0), np.nan)
        ratio = np.clip(np.nan_to_num(self.realised_ratio, nan=1.0), 1.0 / MAX_REALISED_RATIO, MAX_REALISED_RATIO)
        self.realised_scale = ratio / np.clip(ratio, 1.0 / REALISED_BAND, REALISED_BAND)


def expected_tokens_per_step(fleet: FleetArrays, relative_acceptance: float) -> np.ndarray:
    """Per replica, tokens per step a request gets there where there is room to verify its drafts: that
    replica's measured tokens per request-step (the estimator's prediction where none was measured),
    scaled by the request's predicted acceptance relative to the workload's."""
    return 1.0 + (fleet.reference_tokens - 1.0) * relative_acceptance


class Forecast(NamedTuple):
    """What placing one more request on each replica predicts (arrays over the fleet)."""

    n_new: np.ndarray  # requests the router has on it after placement, beyond those its stats saw running
    queued: np.ndarray  # requests past the engine's batch (they wait for a slot)
    step_after: np.ndarray  # predicted step time (ms) with the request in the batch
    tpot: np.ndarray  # predicted TPOT (ms): the worse of the new request's and the batch's


MAX_REALISED_RATIO = 4.0  # a replica's realised over modelled TPOT scales its forecast within [1/4, 4]
# ... by what it has beyond this band either way. The ratio is there for what the model cannot see (a host's CPU
# taken by others: 2-3x); within the band it is the forecast's own bias, which differs by replica kind: WCS replicas
# read 1.10-1.15 at their cap and replicas without a drafter about 1.0 (simulated), and taken as it was, it moved
# load onto the replicas without a drafter until they ran past the SLO (quarter-no-drafter, 64 replicas at 7,500
# req/s: 90.2% attainment, 97.0% with the band; at 512 replicas 0.93x power of two's sustainable rate).
REALISED_BAND = 1.25
PREFILL_HORIZON_MS = 1000.0  # prefills routed since the stats run within about a stats period (Serve's default 1 s)


def placement_forecast(
    fleet: FleetArrays, added: np.ndarray, tokens_if_room: np.ndarray | float, prompt_tokens: float = 0.0,
    pending_prompt_tokens: np.ndarray | float = 0.0,
) -> Forecast:
    """Step time, TPOT and queue per replica after placing one more request there (the module's formulas).

    `added`: requests routed to each replica since its stats were taken, net of those finished since.
    `tokens_if_room`: tokens per step the request is expected to get on each replica where the budget covers
    its drafts (`expected_tokens_per_step`). `prompt_tokens`: the request's; `pending_prompt_tokens`: those of
    the requests routed to each replica since its stats (both 0 leave prefill out, as the autoscaler's supply
    search does).
    """
    # (Written for the router's decision time: numpy's per-call overhead, not the arithmetic, is its cost at any
    # fleet size, so each line is as few calls as it can be.)
    f = fleet
    n_new = np.maximum(added, f.neg_running)
    n_new += 1.0
    queued = np.maximum(f.over_batch + n_new, 0.0)
    base_after = f.base_step_ms + n_new * f.base_request_ms
    # Speculation's demand at the new batch; never negative: forecast below the running batch (fewer requests, as the
    # autoscaler's supply search and a replica whose requests finished since its stats ask), a measured speculation
    # share smaller than the per-request slope times the requests removed would otherwise make the step negative.
    demand = np.maximum(f.spec_ms + n_new * f.spec_request_ms, 0.0)
    kept = clip((f.cap_ms - base_after) / np.maximum(demand, 1e-9), 0.0, 1.0)
    step_after = base_after + kept * demand
    gain = np.maximum(np.asarray(tokens_if_room, dtype=np.float64) - 1.0, 0.0)
    tpot_new = step_after / (1.0 + gain * kept)
    # The batch's TPOT (an idle replica's is NaN, which `fmax` passes over).
    tpot = np.fmax(tpot_new, step_after / (1.0 + f.batch_gain * kept))
    prefill_ms = f.prefill_ms_per_token * (np.asarray(pending_prompt_tokens, dtype=np.float64) + prompt_tokens)
    if prompt_tokens > 0 or (prefill_ms > 0).any():
        stretch = 1.0 / np.maximum(1.0 - prefill_ms / PREFILL_HORIZON_MS, 0.1)
        step_after, tpot = step_after * stretch, tpot * stretch
    return Forecast(n_new, queued, step_after, tpot)


def placement_slack(
    fleet: FleetArrays, added: np.ndarray, tokens_if_room: np.ndarray | float, prompt_tokens: float = 0.0,
    pending_prompt_tokens: np.ndarray | float = 0.0,
) -> np.ndarray:
    """TPOT slack (ms) per replica after placing one more request there (see `placement_forecast`)."""
    f = fleet
    fc = placement_forecast(fleet, added, tokens_if_room, prompt_tokens, pending_prompt_tokens)
    queued_ms = fc.queued * f.cap_ms
    slack = f.cap_ms - fc.tpot * f.realised_scale - queued_ms
    if f.all_cost:
        return slack
    # No cost model (an engine without WCS): fewer requests is all that can be said.
    return np.where(f.has_cost, slack, -(f.load + fc.n_new) - queued_ms)
