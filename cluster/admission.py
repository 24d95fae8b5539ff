"""SLO-aware admission: admit a request only where it is predicted to meet its TTFT and TPOT SLOs.

The decision is a pure function of the replicas' routing stats (`FleetArrays`),
the router's in-flight accounting and the request, so the router runs it per
request (`cluster/router.py`) and a simulator can run it over modelled
replicas. Per replica, after placing the request there (`placement_forecast`):

    TTFT = waited + queued * drain interval + step after + prompt tokens * token_ms
    TPOT = the worse of the new request's and the batch's (the router's headroom model)

with every step priced by the replica's cost model and then calibrated by what
its engine realised: the replica reports its measured time per decoded token
over the last stats period (`realised_tpot_ms`), and the ratio of that to the
model's TPOT for the batch it was running (`step_ms / tokens_per_step`)
scales every predicted step (`calibration`, clipped to [1/4, 4]). The profiled
model sees the engine alone; on a shared machine the HTTP stack, the other
replicas and the load generator take CPU from it, and under overload the
realised TPOT runs 3-5x the model's (measured on the 2-core CPU host). Where
nothing was realised (an idle replica), every step is stretched instead by the
prefills that arrive into it: at the replica's measured completion rate (in
steady state, its arrival rate) each step carries `rate * step` prefills of
about this request's length.

- `waited`: time the request already spent in the router's queue (a request
  that waits there is decided again at every routing attempt, so one whose
  deadline has passed is dropped before it reaches an engine);
- `queued`: requests past the engine's batch, the new one included: each waits
  for a request to finish, at the replica's measured completion rate
  (`DrainMeter`);
- prompt tokens are estimated from the prompt's characters (the router has no
  tokenizer) and cost a verified token's `token_ms` each in the prefill step.

A replica is feasible when both predictions fit the request's SLOs, the TPOT
one with a margin (`tpot_share` of the SLO): admitted at exactly the SLO, a
request's TPOT then grows with the requests admitted after it and with what
the HTTP stack adds (measured: admitted at the SLO, half the admitted
requests missed it under overload). With none
feasible the request is refused (429) with `Retry-After` = the predicted time
for the least loaded replica to drain what stands between it and feasibility
(its queue, or the requests whose leaving brings its TPOT under the SLO).
Replicas without a cost model (engines without WCS) are feasible while their
batch has room: nothing more can be predicted for them.
"""

from __future__ import annotations

import math
import time
from collections import deque
from typing import Hashable, NamedTuple

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from cluster.placement import FleetArrays, placement_forecast

TTFT_HEADER = "x-slo-ttft-ms"
TPOT_HEADER = "x-slo-tpot-ms"


class AdmissionConfig(BaseModel):
    """The application's SLOs as admission enforces them (`router.admission` in the app config)."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool = Field(default=True, description="refuse requests predicted to miss their SLOs (429)")
    ttft_ms: float = Field(default=1000.0, gt=0, description="TTFT SLO (ms)")
    tpot_ms: float | None = Field(default=None, gt=0, description="TPOT SLO (ms); None: each replica's tpot_slo_ms")
    chars_per_token: float = Field(default=3.5, gt=0, description="prompt characters per token, for the prefill estimate")
    min_drain_rate: float = Field(default=0.2, gt=0, description="completions/s assumed of a replica before any was measured")
    max_retry_after_s: int = Field(default=30, ge=1, description="cap on the Retry-After of a refusal")
    tpot_share: float = Field(default=0.75, gt=0, le=1.0, description="admit while the predicted TPOT is under this "
                              "share of the SLO: the rest is for what the batch's later arrivals and the HTTP stack add")
    max_calibration: float = Field(default=4.0, ge=1.0, description="bound on realised over modelled TPOT (both ways)")


class RequestSLO(BaseModel):
    """A request's own, tighter SLOs (headers `X-SLO-TTFT-Ms`, `X-SLO-TPOT-Ms`): the tighter of these and
    the application's apply."""

    model_config = ConfigDict(extra="forbid")

    ttft_ms: float | None = Field(default=None, gt=0)
    tpot_ms: float | None = Field(default=None, gt=0)

    @classmethod
    def from_headers(cls, headers) -> "RequestSLO | None":
        """None when neither header is set; raises ValueError on a value that is not a positive number."""
        ttft, tpot = headers.get(TTFT_HEADER), headers.get(TPOT_HEADER)
        if ttft is None and tpot is None:
            return None
        return cls(ttft_ms=None if ttft is None else float(ttft), tpot_ms=None if tpot is None else float(tpot))


class AdmissionRejected(Exception):
    """Raised to the handle's caller for a refused request (the ingress answers 429 with Retry-After)."""

    def __init__(self, retry_after_s: int, ttft_ms: float, tpot_ms: float) -> None:
        super().__init__(
            f"no replica can serve the request within its SLOs now (predicted TTFT {ttft_ms:.0f} ms, "
            f"TPOT {tpot_ms:.1f} ms at best); retry in {retry_after_s} s"
        )
        self.retry_after_s = retry_after_s
        self.ttft_ms = ttft_ms
        self.tpot_ms = tpot_ms


class Decision(NamedTuple):
    admit: bool
    feasible: np.ndarray  # per replica
    ttft_ms: np.ndarray  # predicted, per replica
    tpot_ms: np.ndarray  # predicted, per replica
    retry_after_s: int  # when refused: predicted drain time (0 when admitted)


def calibration(fleet: FleetArrays, config: AdmissionConfig) -> np.ndarray:
    """Per replica: realised TPOT over the model's TPOT for the batch it ran (`step_ms / tokens_per_step`),
    clipped to [1 / max_calibration, max_calibration]; NaN where there is nothing to compare (no cost model,
    nothing decoded in the last period, or an idle batch now, whose model TPOT says nothing of the period)."""
    f = fleet
    modelled = f.step_ms / np.maximum(f.tokens_per_step, 1.0)
    ok = f.has_cost & (f.running > 0) & np.isfinite(f.realised_tpot_ms) & (modelled > 0)
    ratio = np.where(ok, f.realised_tpot_ms / np.where(ok, modelled, 1.0), np.nan)
    return np.clip(ratio, 1.0 / config.max_calibration, config.max_calibration)


def estimated_prompt_tokens(text_chars: int, config: AdmissionConfig) -> float:
    return text_chars / config.chars_per_token


def decide(
    fleet: FleetArrays,
    added: np.ndarray,
    tokens_if_room: float,
    prompt_tokens: float,
    drain_rate: np.ndarray,
    config: AdmissionConfig,
    waited_ms: float = 0.0,
    slo: RequestSLO | None = None,
) -> Decision:
    """Admission over one fleet view: `drain_rate` is each replica's measured completions per second."""
    f = fleet
    fc = placement_forecast(fleet, added, tokens_if_room)
    ttft_slo = min(config.ttft_ms, slo.ttft_ms) if slo and slo.ttft_ms else config.ttft_ms
    tpot_slo = f.cap_ms if config.tpot_ms is None else np.full_like(f.cap_ms, config.tpot_ms)
    if slo and slo.tpot_ms:
        tpot_slo = np.minimum(tpot_slo, slo.tpot_ms)
    rate = np.maximum(drain_rate, config.min_drain_rate)
    wait_ms = fc.queued * 1000.0 / rate
    has_cost = f.has_cost
    prefill = np.where(has_cost, prompt_tokens * np.nan_to_num(f.token_ms), 0.0)
    # The requests that replace those finishing bring their prefills into the steps of the batch: at the
    # measured rate, each step carries rate * step of them, which stretches every step by that share.
    stretch = 1.0 / np.maximum(1.0 - drain_rate * prefill / 1000.0, 0.1)
    # A realised TPOT already holds those prefills (and whatever else took the engine's CPU): it replaces the stretch.
    scale = calibration(f, config)
    stretch = np.where(np.isfinite(scale), scale, stretch)
    step = np.where(has_cost, fc.step_after * stretch, 0.0)
    ttft = waited_ms + wait_ms + step + prefill * np.where(np.isfinite(scale), scale, 1.0)
    tpot = np.where(has_cost, fc.tpot * stretch, 0.0)
    tpot_slo = tpot_slo * config.tpot_share
    feasible = (ttft <= ttft_slo) & (tpot <= tpot_slo)
    if feasible.any():
        return Decision(True, feasible, ttft, tpot, 0)
    # Requests that must leave each replica before it is feasible, and how long that takes.
    per_request = np.where(has_cost & (f.request_ms > 0), f.request_ms / np.maximum(f.tokens_per_step, 1.0), np.inf)
    tpot_excess = np.where(tpot > tpot_slo, np.ceil((tpot - tpot_slo) / per_request), 0.0)
    excess = np.maximum(fc.queued, np.nan_to_num(tpot_excess, posinf=0.0)) + 1.0
    drain_s = float(np.min(excess / rate))
    retry = int(min(max(math.ceil(drain_s), 1), config.max_retry_after_s))
    return Decision(False, feasible, ttft, tpot, retry)


class DrainMeter:
    """Completions per second per replica over a sliding window (the router feeds it `on_request_completed`)."""

    def __init__(self, window_s: float = 5.0) -> None:
        self.window_s = window_s
        self._done: dict[Hashable, deque[float]] = {}

    def completed(self, key: Hashable, now: float | None = None) -> None:
        q = self._done.setdefault(key, deque())
        q.append(time.monotonic() if now is None else now)
        self._trim(q, q[-1])

    def _trim(self, q: deque, now: float) -> None:
        while q and q[0] < now - self.window_s:
            q.popleft()

    def rate(self, key: Hashable, now: float | None = None) -> float:
        q = self._done.get(key)
        if not q:
            return 0.0
        now = time.monotonic() if now is None else now
        self._trim(q, now)
        return len(q) / self.window_s

    def rates(self, keys: list, now: float | None = None) -> np.ndarray:
        now = time.monotonic() if now is None else now
        return np.array([self.rate(k, now) for k in keys], dtype=np.float64)

    def forget(self, key: Hashable) -> None:
        self._done.pop(key, None)
