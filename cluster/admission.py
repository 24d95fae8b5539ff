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
  tokenizer) and cost the replica's `prefill_token_ms` each (a prompt token's
  price in a chunk that fills the step's token budget: on a GPU a verified
  token's `token_ms` below the knee is nearly free, a long prompt is not).

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

The predictions are open-loop; `SLOFeedback` closes the loop. The ingress
tags each request with a ticket; the router keeps what it predicted for the
replica the request went to (`AdmissionLoop`), and the ingress, which relays
the response, measures its TTFT (to the first streamed chunk) and TPOT (over
the rest). The recent errors correct the next predictions (TTFT by a quantile
of the difference, TPOT by a line fitted to measured over predicted). What
the model does not see (the HTTP stack and the load generator taking the
engine's CPU, prompts longer than their characters suggest) is then paid for
by admitting less, not by missing. The errors are a property of the stack,
not of how much is admitted, so the correction does not chase its own effect
as a controller on the SLO attainment would (one that shrank the limits on
each miss and grew them on each hit oscillated here: admitted attainment
0.80-0.84 at 2-4x in `tests/test_admission.py`'s harness).

The corrections lag what admitting more does (a request's life passes before its
measurement), and the forecast barely grows with the batch where WCS is taken to
shed speculation to hold its TPOT cap. What each replica's requests measured
settles most decisions instead (`AdmissionLoop.proven_levels`): its proven level
is the most requests in flight (averaged over a request's life) at which a
recent request there met its SLOs, with at most `proven_miss_share` of those at
that level or fewer missing theirs; a miss takes back what was proven at or
above its level, so the level follows a host or traffic that changed. A replica
is admitted to up to one request past its proven level whatever the forecast
says (the forecast's margins are for what was not measured), and past that
only where the forecast admits, up to (1 + `trust`) times its proven level (or
`trust_burst` of its batch while none of its recent requests missed): in the CPU
deployment's simulated twin at 4x its capacity, admission on the forecast alone
alternated between bursts that missed together and spells that refused nearly
everything. And a replica whose streams, as the ingress relays them, ran over
the TPOT limit in the last `live_window_s` takes no request: one more only slows
them further, and the live measurement sees a host that slowed down a request's
life before the outcomes do. Measured TPOTs (live, or proving a level) pass within
`measured_tpot_share` of the SLO: proven at the SLO itself, a level is one where
about half the requests miss. Under overload (refusals, and arrivals at
`pace_demand` times the completions) each replica is paced to what it completes
(`pace_*`): a replica drained below its proven level was otherwise refilled at
the arrival rate, and the burst missed together.

`AdmissionGate` refuses at the ingress, before the handle is called, while
the router's last two decisions were refusals for a full fleet (no replica's TPOT
fits the application's SLO, whatever the request: a refusal for a request's
own tighter SLO, or for a long prompt's TTFT, leaves it open) and nothing has
completed since. Under overload most arrivals are refused, and each refusal
through the handle costs CPU that the admitted requests need.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from typing import Hashable, NamedTuple

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from cluster.placement import FleetArrays, placement_forecast

TRACE_ENV = "FORESPARK_ADMISSION_TRACE"  # a path: each process's AdmissionLoop appends its events there (JSON lines)
TTFT_HEADER = "x-slo-ttft-ms"
TPOT_HEADER = "x-slo-tpot-ms"


DEFAULT_CHARS_PER_TOKEN = 3.5  # of the usual 32k-128k-token vocabularies on English text and code


class AdmissionConfig(BaseModel):
    """The application's SLOs as admission enforces them (`router.admission` in the app config)."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool = Field(default=True, description="refuse requests predicted to miss their SLOs (429)")
    ttft_ms: float = Field(default=1000.0, gt=0, description="TTFT SLO (ms)")
    tpot_ms: float | None = Field(default=None, gt=0, description="TPOT SLO (ms); None: each replica's tpot_slo_ms")
    chars_per_token: float | None = Field(default=None, gt=0, description="prompt characters per token, for the prefill "
                                          "estimate; None: the served model's tokenizer's, measured when the application "
                                          f"is built (`cluster.prompt_model.chars_per_token`), else {DEFAULT_CHARS_PER_TOKEN}")
    min_drain_rate: float = Field(default=0.2, gt=0, description="completions/s assumed of a replica before any was measured")
    max_retry_after_s: int = Field(default=30, ge=1, description="cap on the Retry-After of a refusal")
    tpot_share: float = Field(default=0.75, gt=0, le=1.0, description="admit while the predicted TPOT is under this "
                              "share of the SLO: the rest is for what the batch's later arrivals and the HTTP stack add")
    max_calibration: float = Field(default=4.0, ge=1.0, description="bound on realised over modelled TPOT (both ways)")
    feedback_window: int = Field(default=32, ge=0, description="admitted requests whose measured TTFT and TPOT "
                                 "correct the predictions (SLOFeedback; 0: no feedback)")
    feedback_max_age_s: float = Field(default=10.0, gt=0, description="measurements older than this are dropped")
    feedback_min_tokens: int = Field(default=16, ge=2, description="a request's TPOT is measured only when it "
                                     "generated at least this many tokens: over a few tokens the stream's start "
                                     "and end dominate, and corrections learned from them refused a light load")
    feedback_quantile: float = Field(default=0.9, gt=0, lt=1, description="the correction is this quantile of "
                                     "the recent errors: the predictions are held to the SLOs with it added")
    probe_s: float = Field(default=1.0, gt=0, description="while the corrected predictions refuse everything, "
                           "one request this often is admitted on the model's own, so that measurements go on")
    proven_miss_share: float = Field(default=0.1, ge=0, lt=1, description="a replica's proven level is the most requests "
                                     "in flight at which a recent request there met its SLOs, with at most this share of those "
                                     "at that level or fewer missing theirs")
    measured_tpot_share: float = Field(default=0.9, gt=0, le=1, description="a measured TPOT (a finished request's, "
                                       "which proves its level, or a replica's live streams') passes within this share "
                                       "of the SLO: a level proven at the SLO itself is one where half the requests miss")
    admit_proven: bool = Field(default=True, description="admit up to one request past a replica's proven level whatever "
                               "the TPOT forecast says (False: the forecast decides every level)")
    trust: float | None = Field(default=0.25, ge=0, description="past that, the forecast admits up to (1 + trust) times "
                                "the proven level plus one (None: no bound)")
    trust_burst: float = Field(default=0.25, gt=0, le=1, description="the share of a replica's batch (max_num_seqs) the "
                               "forecast admits to while none of its recent requests missed their SLOs")
    live_window_s: float = Field(default=0.5, ge=0, description="a replica whose streams took more than "
                                 "`measured_tpot_share` of the TPOT SLO per token over this last window, as the ingress "
                                 "relayed them, takes no new request (0: not measured)")
    pace_window_s: float = Field(default=1.0, ge=0, description="under overload (`pace_refused_share`, `pace_demand`), a replica takes "
                                 "no more requests over this last window than it completes in as long (its measured "
                                 "rate) plus `pace_burst` (0: not paced)")
    pace_burst: float = Field(default=2.0, ge=0, description="requests a paced replica may take past its completions")
    pace_growth: float = Field(default=0.25, ge=0, description="and this share of them: paced to its completions alone, "
                               "a replica that lost requests (a stall) could take back no more than the burst a window")
    pace_refused_share: float = Field(default=0.25, ge=0, lt=1, description="replicas are paced while more than this "
                                      "share of the last `feedback_window` decided were refused (the proxy's included)")
    pace_demand: float = Field(default=2.0, ge=0, description="and while requests arrive (admitted or refused, over the "
                               "last 5 s) at more than this times the fleet's completions: at the sustainable rate refusals "
                               "alone (for TPOT forecasts, and pacing's own) turned it on")
    hold_ms: float = Field(default=300.0, ge=0, description="a request refused only for its TPOT (its TTFT fits a "
                           "replica) waits in the router's queue up to this long, decided again at each routing attempt, "
                           "before it is refused (0: refused at once)")
    hold_per_replica: float = Field(default=1.0, ge=0, description="requests waiting so at once, per replica; "
                                    "the rest are refused at once")
    hold_refused_share: float = Field(default=0.0, ge=0, le=1, description="requests wait so only while at most this "
                                      "share of the last `feedback_window` decided were refused (the proxy's from the board "
                                      "included): under overload a request held would mostly wait to be refused, late")
    hold_demand: float = Field(default=1.5, ge=0, description="and only while requests arrive (admitted or refused, over "
                               "the last 5 s) at no more than this times the fleet's completions: at 2x, in the lulls "
                               "between refusals, requests held waited 20-145 ms for the next refusal to close the room, "
                               "and were refused that late (traced)")
    gate_s: float = Field(default=0.5, ge=0, description="after two refusals in a row for a full fleet, the ingress refuses at once "
                          "for up to this long, until a request completes (0: every request reaches the router)")
    board: bool = Field(default=True, description="the ingress posts what admission would answer any request now where its "
                        "node's HTTP proxy reads it, and the proxy refuses while it says so (cluster/admission_board.py)")


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
    full: bool = False  # refused, and no replica's TPOT fits the application's SLO: nor would another request's
    level: np.ndarray | None = None  # per replica: requests in flight there with this one (`AdmissionConfig.trust`)
    tpot_slo_ms: np.ndarray | None = None  # per replica: the request's TPOT SLO there (before the margin)
    waitable: bool = False  # refused, but its TTFT fits a replica: only TPOT keeps it out now (`AdmissionLoop.hold`)


def calibration(fleet: FleetArrays, config: AdmissionConfig) -> np.ndarray:
    """Per replica: realised TPOT over the model's TPOT for the batch it ran (`step_ms / tokens_per_step`),
    clipped to [1 / max_calibration, max_calibration]; NaN where there is nothing to compare (no cost model,
    nothing decoded in the last period, or an idle batch now, whose model TPOT says nothing of the period)."""
    return np.clip(fleet.realised_ratio, 1.0 / config.max_calibration, config.max_calibration)


def estimated_prompt_tokens(text_chars: int, config: AdmissionConfig) -> float:
    return text_chars / (config.chars_per_token or DEFAULT_CHARS_PER_TOKEN)


def decide(
    fleet: FleetArrays,
    added: np.ndarray,
    tokens_if_room: np.ndarray | float,
    prompt_tokens: float,
    drain_rate: np.ndarray,
    config: AdmissionConfig,
    waited_ms: float = 0.0,
    slo: RequestSLO | None = None,
    corrections: "Corrections | None" = None,
    proven: np.ndarray | None = None,
    missed: np.ndarray | None = None,
    live: np.ndarray | None = None,
    taken: np.ndarray | None = None,
    demand: float = math.inf,
) -> Decision:
    """Admission over one fleet view: `drain_rate` is each replica's measured completions per second;
    `corrections` (`SLOFeedback.corrections`) are applied to the predictions (None: the model alone);
    `proven`, `missed` and `live`: what `AdmissionLoop._measured` finds of each replica (None: the model alone);
    `taken`: each replica's admissions over the last `pace_window_s`, where they are paced (None: not paced), while
    `demand` (requests arriving per second) exceeds `pace_demand` times the fleet's completions."""
    f = fleet
    fc = placement_forecast(fleet, added, tokens_if_room)
    ttft_slo = min(config.ttft_ms, slo.ttft_ms) if slo and slo.ttft_ms else config.ttft_ms
    app_tpot_slo = f.cap_ms if config.tpot_ms is None else np.full_like(f.cap_ms, config.tpot_ms)
    rate = np.maximum(drain_rate, config.min_drain_rate)
    wait_ms = fc.queued * 1000.0 / rate
    has_cost = f.has_cost
    prefill = np.where(has_cost, prompt_tokens * f.prefill_ms_per_token, 0.0)
    # The requests that replace those finishing bring their prefills into the steps of the batch: at the
    # measured rate, each step carries rate * step of them, which stretches every step by that share.
    stretch = 1.0 / np.maximum(1.0 - drain_rate * prefill / 1000.0, 0.1)
    # A realised TPOT already holds those prefills (and whatever else took the engine's CPU): it replaces the stretch.
    scale = calibration(f, config)
    stretch = np.where(np.isfinite(scale), scale, stretch)
    step = np.where(has_cost, fc.step_after * stretch, 0.0)
    ttft = waited_ms + wait_ms + step + prefill * np.where(np.isfinite(scale), scale, 1.0)
    tpot = np.where(has_cost, fc.tpot * stretch, 0.0)
    if corrections is not None:
        ttft, tpot = corrections.ttft(ttft), np.where(has_cost, corrections.tpot(tpot), 0.0)
    # A replica that cannot meet the application's TPOT SLO with one request alone (a slow host, or a profile
    # taken under contention until the realised TPOT corrects it) keeps the SLO's headroom above that instead:
    # refusing every request would protect nothing, and with nothing admitted nothing would ever be measured.
    # A request's own tighter SLO still holds as asked.
    alone = np.where(has_cost, np.maximum(f.base_step_ms + (1.0 - f.running) * f.base_request_ms, 0.0) * stretch, 0.0)
    floor = alone / config.tpot_share

    def limits(share: float) -> tuple[np.ndarray, np.ndarray]:
        """TPOT limits at `share` of the SLO: the application's (at least the floor), and this request's."""
        app = np.maximum(app_tpot_slo * share, floor)
        return app, (np.minimum(app, slo.tpot_ms * share) if slo and slo.tpot_ms else app)

    app_limit, tpot_slo = limits(config.tpot_share)
    level = f.load + fc.n_new
    # The application's SLO was measured to hold at this level (a request's own tighter one is left to the forecast).
    measured = np.zeros(len(level), dtype=bool)
    if proven is not None and config.admit_proven and not (slo and slo.tpot_ms):
        measured = level <= proven + 1.0  # (NaN: nothing measured there)
    live = np.full(len(level), np.nan) if live is None else live
    request_tpot_slo = np.minimum(app_tpot_slo, slo.tpot_ms) if slo and slo.tpot_ms else app_tpot_slo
    # A live TPOT is measured, HTTP stack included: it is held to the measured share, not the forecast's margin
    # (at the sustainable rate a fifth of the requests ran over the forecast's 15 ms and none over 20).
    app_live_limit, live_limit = limits(config.measured_tpot_share)
    # Under overload a replica takes what it completes: a burst admitted at once into a replica below its limit
    # ran together over its TPOT (at 4x, traced: 2 s windows of 35-62 admitted, most missing, against 20-30).
    paced = np.zeros(len(level), dtype=bool)
    if taken is not None and demand > config.pace_demand * float(np.sum(drain_rate)):
        paced = taken >= drain_rate * config.pace_window_s * (1.0 + config.pace_growth) + config.pace_burst
    feasible = (ttft <= ttft_slo) & ((tpot <= tpot_slo) | measured) & ~(live > live_limit) & ~paced
    if config.trust is not None and proven is not None:
        bound = np.nan_to_num(proven * (1.0 + config.trust) + 1.0, nan=0.0)
        burst = np.maximum(config.trust_burst * f.max_num_seqs, 1.0)  # where nothing has shown a limit yet
        limited = np.zeros(len(level), dtype=bool) if missed is None else missed
        bound = np.where(limited, bound, np.maximum(bound, burst))
        feasible &= level <= bound
    # A replica with nothing in flight takes the request whatever the forecast says (a calibration or correction
    # learnt under load refused a warm-up request on an idle fleet): refusing protects no one, and what is never
    # admitted is never measured. A request's own tighter SLO and a deadline already past still hold.
    if not (slo and (slo.tpot_ms or slo.ttft_ms)):
        feasible |= (level <= 1.0) & (waited_ms <= ttft_slo)
    if feasible.any():
        return Decision(True, feasible, ttft, tpot, 0, level=level, tpot_slo_ms=request_tpot_slo)
    # Requests that must leave each replica before it is feasible, and how long that takes.
    per_request = np.where(has_cost & (f.request_ms > 0), f.request_ms / np.maximum(f.tokens_per_step, 1.0), np.inf)
    tpot_excess = np.where(tpot > tpot_slo, np.ceil((tpot - tpot_slo) / per_request), 0.0)
    excess = np.maximum(fc.queued, np.nan_to_num(tpot_excess, posinf=0.0)) + 1.0
    drain_s = float(np.min(excess / rate))
    retry = int(min(max(math.ceil(drain_s), 1), config.max_retry_after_s))
    full = not (((tpot <= app_limit) | measured) & ~(live > app_live_limit) & ~paced).any()
    waitable = bool((ttft <= ttft_slo).any())
    return Decision(False, feasible, ttft, tpot, retry, full, level=level, tpot_slo_ms=request_tpot_slo, waitable=waitable)


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


class SLOFeedback:
    """What admitted requests measured against what admission predicted for them, over the last
    `feedback_window` of them within `feedback_max_age_s`, as corrections for the next predictions:

    - TTFT: plus the `feedback_quantile` of (measured - predicted): the HTTP path adds time, whatever the queue;
    - TPOT: a line, measured ~ a + b * predicted, fitted by least squares with the slope shrunk towards 1
      (and at least 1), plus the quantile of its residuals. The model's TPOT misses both a fixed part per
      token (the stream's relay) and a part that grows with the batch (the engine's CPU taken by the HTTP
      stack and the load generator). A ratio alone, learned at light load, refused half the requests at
      10 req/s while the admitted ones ran at half the SLO. A slope below 1 came only from bursts whose
      first requests were predicted low: it sloped the line down and raised the intercept past the SLO.

    (The age limit lets a correction that refuses everything, so that nothing new is measured, lapse.)"""

    PRIOR = 0.2  # the slope's shrinkage: as if a batch of requests had been measured at +-20% around the mean, on y = x

    def __init__(self, config: AdmissionConfig) -> None:
        self.config = config
        n = max(config.feedback_window, 1)
        self._ttft: deque[tuple[float, float]] = deque(maxlen=n)  # (when, realised - predicted ms)
        self._tpot: deque[tuple[float, float, float]] = deque(maxlen=n)  # (when, predicted, realised ms)
        self._cached: Corrections | None = None

    def observe(
        self,
        predicted: tuple[float, float],
        ttft_ms: float,
        tpot_ms: float | None,
        now: float | None = None,
        tokens: int | None = None,
    ) -> None:
        """One admitted request: its predicted (TTFT, TPOT) and its measured ones (TPOT None: one token),
        over `tokens` generated tokens (None: unknown, taken as enough)."""
        if self.config.feedback_window == 0:
            return
        now = time.monotonic() if now is None else now
        self._ttft.append((now, ttft_ms - predicted[0]))
        enough = tokens is None or tokens >= self.config.feedback_min_tokens
        if tpot_ms is not None and predicted[1] > 0 and enough:
            self._tpot.append((now, predicted[1], tpot_ms))
        self._cached = None

    def corrections(self, now: float | None = None) -> "Corrections":
        """What the next predictions get; `Corrections()` (none) without recent measurements."""
        oldest = (time.monotonic() if now is None else now) - self.config.feedback_max_age_s
        for measured in (self._ttft, self._tpot):
            while measured and measured[0][0] < oldest:
                measured.popleft()
                self._cached = None
        if self._cached is None:
            q = self.config.feedback_quantile
            ttft = float(np.quantile([e for _, e in self._ttft], q)) if self._ttft else 0.0
            self._cached = Corrections(ttft, *self._line(q))
        return self._cached

    def _line(self, q: float) -> tuple[float, float]:
        """(intercept + residual quantile, slope) of measured TPOT over predicted."""
        if not self._tpot:
            return 0.0, 1.0
        _, x, y = (np.array(c) for c in zip(*self._tpot))
        xm, ym = x.mean(), y.mean()
        prior = len(x) * (self.PRIOR * xm) ** 2
        slope = float(np.clip((((x - xm) * (y - ym)).sum() + prior) / (((x - xm) ** 2).sum() + prior),
                              1.0, self.config.max_calibration))
        intercept = ym - slope * xm
        return float(intercept + np.quantile(y - intercept - slope * x, q)), slope


class Corrections(NamedTuple):
    """Corrected TTFT = predicted + ttft_ms; corrected TPOT = tpot_ms + tpot_slope * predicted."""

    ttft_ms: float = 0.0
    tpot_ms: float = 0.0
    tpot_slope: float = 1.0

    def ttft(self, predicted):
        return predicted + self.ttft_ms

    def tpot(self, predicted):
        return self.tpot_ms + self.tpot_slope * predicted

    def undo(self, ttft, tpot) -> tuple:
        """The model's own predictions from corrected ones."""
        return ttft - self.ttft_ms, (tpot - self.tpot_ms) / self.tpot_slope


class AdmissionGate:
    """Open until the router refuses for a full fleet (`Decision.full`) twice with no admission between; then
    closed (the ingress answers 429 at once) until a request completes or `gate_s` passes. `retry_after_s` is
    the router's last refusal's. (Shut at the first, on a 2-core host, admitted attainment at 2x and 4x the
    sustainable rate was 41-90% in two runs; at the second, 67-99% in two alternating runs: docs/results.md.)"""

    def __init__(self) -> None:
        self.closed_until = 0.0
        self.retry_after_s = 1
        self._full_refusals = 0  # in a row, since the last admission

    def refused_full(self, seconds: float, retry_after_s: int, now: float | None = None) -> None:
        """The router refused for a full fleet: the second such refusal in a row closes the gate for `seconds`."""
        self.retry_after_s = retry_after_s
        self._full_refusals += 1
        if self._full_refusals >= 2:
            self.closed_until = (time.monotonic() if now is None else now) + seconds

    def admitted(self) -> None:
        self._full_refusals = 0

    def open(self) -> None:
        self.closed_until = 0.0

    def closed(self, now: float | None = None) -> bool:
        return (time.monotonic() if now is None else now) < self.closed_until

    def remaining_s(self, now: float | None = None) -> float:
        return max(self.closed_until - (time.monotonic() if now is None else now), 0.0)


DEMAND_WINDOW_S = 5.0  # as `DrainMeter`'s: arrivals and completions over the same span
MAX_PENDING = 4096  # tickets whose predictions are kept at most (requests the ingress never reported are let go)


class AdmissionLoop:
    """What the ingress and its router share in one process (Serve runs the router in the handle's owner):
    the feedback, the gate, and the predictions of requests under way, by ticket.

    A request's TPOT is its batch's over its life, and requests admitted after it grow that batch: its
    prediction is therefore the batch TPOT forecast at each placement on its replica (the batch's TPOT after
    that placement), from its own admission to its end, averaged over time. (Against its own alone, the first
    requests into an idle replica under overload were measured at 3x their prediction, and the correction then
    refused everything; averaged over placements rather than time, the first of a burst looked better
    predicted than the last, and the fitted line sloped down.)"""

    def __init__(self, config: AdmissionConfig) -> None:
        self.config = config
        self.feedback = SLOFeedback(config)
        self.gate = AdmissionGate()
        self.last_admitted = -math.inf
        # ticket -> (replica, TTFT, when, requests in flight there with it, its TPOT SLO)
        self._routed: OrderedDict[int, tuple[Hashable, float, float, float | None, float | None]] = OrderedDict()
        # replica -> (when, batch TPOT forecast, requests in flight there) at each placement
        self._forecasts: dict[Hashable, deque[tuple[float, float, float]]] = {}
        self._tickets = itertools.count()
        self._outcomes: dict[Hashable, deque[tuple[float, bool]]] = {}  # replica -> (level, met) of its recent requests
        self._levels: dict[Hashable, tuple[float, bool]] = {}  # replica -> (proven level, a recent request missed)
        self._live: dict[Hashable, _Window] = {}  # replica -> ms and tokens of its streams relayed lately
        self._last_chunk: dict[int, float] = {}  # ticket -> when its stream's last chunk was relayed
        self._chunking: dict[Hashable, deque[tuple[int, int]]] = {}  # replica -> (tokens, chunks) of its recent streams
        self._per_chunk: dict[Hashable, float] = {}  # replica -> tokens per relayed chunk over those
        self._held: dict[Hashable, float] = {}  # request -> when it was first held (`hold`)
        self._taken: dict[Hashable, deque[float]] = {}  # replica -> when its requests of the last `pace_window_s` were placed
        self._first_placed: dict[Hashable, float] = {}  # replica -> when a request was first placed there
        self._refused: deque[bool] = deque(maxlen=max(config.feedback_window, 1))  # the last decided: refused?
        self._arrivals: deque[tuple[float, int]] = deque()  # (when, how many) decided over the last DEMAND_WINDOW_S
        self._arrived = 0
        self._completions: float | None = None  # the fleet's completions per second at the last decision (None: none yet)
        self.listeners: list[Callable[[], None]] = []  # told when a request is placed or completes (`changed`)
        trace = os.environ.get(TRACE_ENV)
        self._trace = open(f"{trace}.{os.getpid()}", "a", buffering=1) if trace else None

    def _log(self, event: str, now: float, **fields) -> None:
        """A diagnostic trace of decisions, placements and measurements (`FORESPARK_ADMISSION_TRACE`): what
        admission predicted and what was measured, per request, to study its misses offline."""
        if self._trace is not None:
            self._trace.write(json.dumps({"e": event, "t": round(now, 4), **fields}, default=str) + "\n")

    def ticket(self) -> int:
        return next(self._tickets)

    def decide(
        self, *args, now: float | None = None, commit: bool = True, replicas: list | None = None, **kwargs
    ) -> tuple[Decision, Corrections]:
        """`decide` with the feedback's corrections, and the corrections it used, over `replicas` (their keys here,
        for what was measured of them, `_measured`; None: the model alone). When the
        corrections refuse a request that the model alone admits and nothing was admitted for `probe_s`, it is admitted uncorrected: a
        correction that refuses everything would otherwise be measured again only when its measurements age
        out (`feedback_max_age_s`; one learned from the burst that opens an overload refused everything while
        they lived, the load gone or not). `commit` False: a look ahead that admits nothing (the probe's clock
        stays as it was)."""
        now = time.monotonic() if now is None else now
        corrections = self.feedback.corrections(now)
        drain = kwargs.get("drain_rate", args[4] if len(args) > 4 else None)
        if drain is not None:
            self._completions = float(np.sum(drain))
        if replicas is not None:
            kwargs.update(zip(("proven", "missed", "live"), self._measured(replicas, now)))
            if self.config.pace_window_s > 0 and self._refused_share() > self.config.pace_refused_share:
                kwargs.update(taken=self._taken_recently(replicas, now), demand=self.demand(now))
        decision = decide(*args, corrections=corrections, **kwargs)
        if not decision.admit and corrections != Corrections() and now - self.last_admitted >= self.config.probe_s:
            probe = decide(*args, **kwargs)
            if probe.admit:
                decision, corrections = probe, Corrections()
        if decision.admit and commit:
            self.last_admitted = now
        if self._trace is not None and (commit or not decision.admit):
            self._log("decide" if commit else "look", now, admit=bool(decision.admit), full=bool(decision.full),
                      ttft=float(np.min(decision.ttft_ms, initial=np.inf)), tpot=float(np.min(decision.tpot_ms, initial=np.inf)),
                      correction=list(corrections), **({} if decision.admit else {
                          "ttfts": decision.ttft_ms.round(1).tolist(), "tpots": decision.tpot_ms.round(2).tolist(),
                          "levels": None if decision.level is None else decision.level.tolist(),
                          "proven": None if kwargs.get("proven") is None else kwargs["proven"].tolist(),
                          "live": None if kwargs.get("live") is None else np.round(kwargs["live"], 2).tolist(),
                          "taken": None if kwargs.get("taken") is None else kwargs["taken"].tolist(),
                          "demand": kwargs.get("demand"),
                          "drain": None if drain is None else np.round(drain, 2).tolist()}))
        return decision, corrections

    def _taken_recently(self, replicas: list, now: float) -> np.ndarray:
        """Per replica, the requests placed there over the last `pace_window_s`; NaN (not paced) until a request was
        placed there `DEMAND_WINDOW_S` ago: before that its completion rate is measured over part of its window, too
        low (a cold fleet under overload, or a replica just added, would be held to a trickle)."""
        out = np.zeros(len(replicas))
        for i, r in enumerate(replicas):
            first = self._first_placed.get(r)
            if first is None or now - first < DEMAND_WINDOW_S:
                out[i] = np.nan
                continue
            out[i] = len(self._recent(r, now))
        return out

    def _recent(self, replica: Hashable, now: float) -> deque[float]:
        """When the requests placed on `replica` over the last `pace_window_s` were placed."""
        marks = self._taken.setdefault(replica, deque())
        while marks and marks[0] < now - self.config.pace_window_s:
            marks.popleft()
        return marks

    def hold(self, key: Hashable, decision: Decision, waited_ms: float, replicas: int, now: float | None = None) -> bool:
        """Whether the refused request `key` waits in the router's queue to be decided again (True) rather than be
        refused now: only TPOT kept it out (`Decision.waitable`), it has waited under `hold_ms`, and there is
        room (`hold_room`). A replica's TPOT comes back under its limit as requests
        finish: decided again then, it is admitted a little later instead of refused (in a traced run at the
        sustainable rate, most refusals came while one replica's live TPOT was over its limit, spells that a
        request's TTFT SLO can wait out)."""
        now = time.monotonic() if now is None else now
        since = self._held.pop(key, None)
        why = ("ttft" if not decision.waitable else "expired" if waited_ms >= self.config.hold_ms
               else None if self.hold_room(replicas, now) else "no room")
        if self._trace is not None and (why is None) != (since is not None):  # a hold begins, or ends refused
            self._log("hold", now, key=key, held=why is None, why=why, waited=round(waited_ms, 1),
                      refused_share=round(self._refused_share(), 3), holding=len(self._held))
        if why is not None:
            return False
        self._held[key] = now if since is None else since
        return True

    def hold_room(self, replicas: int, now: float | None = None) -> bool:
        """Whether another request may wait (`hold`): under `hold_per_replica` x `replicas` wait, at most
        `hold_refused_share` of the last requests decided were refused, and requests arrive at most `hold_demand`
        times as fast as the fleet completes them (as of the last decision; unconstrained before one). Requests
        held past twice `hold_ms` (their callers gone) are let go."""
        config = self.config
        now = time.monotonic() if now is None else now
        stale = now - 2.0 * config.hold_ms / 1000.0
        for key in [k for k, since in self._held.items() if since < stale]:
            del self._held[key]
        overloaded = self._completions is not None and self.demand(now) > config.hold_demand * self._completions
        return (config.hold_ms > 0 and self._refused_share() <= config.hold_refused_share and not overloaded
                and len(self._held) < math.ceil(config.hold_per_replica * replicas))

    def _refused_share(self) -> float:
        return sum(self._refused) / len(self._refused) if self._refused else 0.0

    def release(self, key: Hashable) -> None:
        """The request `key` no longer waits (`hold`)."""
        since = self._held.pop(key, None)
        if since is not None and self._trace is not None:
            self._log("hold", time.monotonic(), key=key, held=False, why="placed", waited=None)

    def changed(self) -> None:
        """A request was placed or completed: what admission answers may have changed."""
        for listener in self.listeners:
            listener()

    def decided(self, refused: bool, count: int = 1, now: float | None = None) -> None:
        """`count` requests were admitted or refused for good (not held)."""
        self._refused.extend([refused] * min(count, self._refused.maxlen or 1))
        now = time.monotonic() if now is None else now
        self._arrivals.append((now, count))
        self._arrived += count
        self.demand(now)  # (trims the window, so it stays bounded where pacing never asks)

    def demand(self, now: float) -> float:
        """Requests decided per second over the last `DEMAND_WINDOW_S` (what arrives, admitted or not)."""
        while self._arrivals and self._arrivals[0][0] < now - DEMAND_WINDOW_S:
            self._arrived -= self._arrivals.popleft()[1]
        return self._arrived / DEMAND_WINDOW_S

    def routed(self, ticket: int, replica: Hashable, ttft_ms: float, tpot_ms: float, now: float | None = None,
               level: float | None = None, tpot_slo_ms: float | None = None) -> None:
        """The router's prediction for the replica the request went to (before the feedback's correction); `level`:
        the requests in flight there with it, and `tpot_slo_ms` its TPOT SLO (`AdmissionConfig.trust`)."""
        now = time.monotonic() if now is None else now
        self._forecasts.setdefault(replica, deque(maxlen=MAX_PENDING)).append((now, tpot_ms, math.nan if level is None else level))
        self._routed[ticket] = (replica, ttft_ms, now, level, tpot_slo_ms)
        if self.config.pace_window_s > 0:
            self._first_placed.setdefault(replica, now)
            self._recent(replica, now).append(now)
        if self._trace is not None:
            self._log("routed", now, ticket=ticket, replica=replica, ttft=ttft_ms, tpot=tpot_ms, level=level,
                      proven=float(self.proven_levels([replica])[0]))
        while len(self._routed) > MAX_PENDING:
            self._routed.popitem(last=False)

    def finished(
        self,
        ticket: int,
        ttft_ms: float | None = None,
        tpot_ms: float | None = None,
        now: float | None = None,
        tokens: int | None = None,
        chunks: int | None = None,
    ) -> None:
        """The ingress's measurement over `tokens` generated tokens, relayed in `chunks` (`ttft_ms` None: none to
        report, the ticket is let go)."""
        routed = self._routed.pop(ticket, None)
        self._last_chunk.pop(ticket, None)
        if routed is None or ttft_ms is None:
            return
        now = time.monotonic() if now is None else now
        replica, ttft_predicted, since, level, tpot_slo_ms = routed
        if tokens and chunks:
            counted = self._chunking.setdefault(replica, deque(maxlen=self.config.feedback_window or 1))
            counted.append((tokens, chunks))
            self._per_chunk[replica] = sum(t for t, _ in counted) / sum(c for _, c in counted)
        life, lived = self._life_forecast(replica, since, now)
        self.feedback.observe((ttft_predicted, life), ttft_ms, tpot_ms, now, tokens)
        met = ttft_ms <= self.config.ttft_ms and (
            tpot_ms is None or tpot_slo_ms is None or tpot_ms <= self.config.measured_tpot_share * tpot_slo_ms
        )
        if level is not None:
            level = lived if math.isfinite(lived) else level  # what it lived through, not only what it joined
            window = self.config.feedback_window or 1
            outcomes = self._outcomes.setdefault(replica, deque(maxlen=window))
            if not met:  # what met its SLOs at this level or above proves nothing now (the host, or the traffic, changed)
                kept = [o for o in outcomes if not o[1] or o[0] < level]
                outcomes.clear()
                outcomes.extend(kept)
            outcomes.append((level, met))
            self._levels[replica] = self._prove(outcomes)
        self._log("finished", now, ticket=ticket, ttft=ttft_ms, tpot=tpot_ms, tokens=tokens, tpot_life=life, level_life=lived)

    def streamed(self, ticket: int, chunks: int = 1, now: float | None = None) -> None:
        """The ingress relayed `chunks` more of the request's stream (SSE events: one per engine step that
        produced tokens for it, whatever their number): the time since its previous ones is what its replica took
        to decode them, in tokens as many as its recent streams had per chunk (none before one was measured)."""
        routed = self._routed.get(ticket)
        if routed is None or chunks <= 0:
            return
        now = time.monotonic() if now is None else now
        last = self._last_chunk.get(ticket)
        self._last_chunk[ticket] = now
        per_chunk = self._per_chunk.get(routed[0])
        if last is not None and per_chunk is not None:
            self.decoded(routed[0], (now - last) * 1000.0, chunks * per_chunk, now)

    def decoded(self, replica: Hashable, ms: float, tokens: float, now: float) -> None:
        """`tokens` of one or more of the replica's streams took `ms` (per stream) up to `now`."""
        if self.config.live_window_s:
            self._live.setdefault(replica, _Window(self.config.live_window_s)).add(now, ms, tokens)

    def _measured(self, replicas: list, now: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Per replica: `proven_levels`, whether one of its recent requests missed its SLOs, `live_tpot` (one pass:
        the router asks for every decision)."""
        out = np.full((3, len(replicas)), np.nan)
        for i, r in enumerate(replicas):
            out[0, i], out[1, i] = self._levels.get(r, (np.nan, False))
            window = self._live.get(r)
            if window is not None:
                out[2, i] = window.per_token(now)
        return out[0], out[1].astype(bool), out[2]

    def live_tpot(self, replicas: list, now: float | None = None) -> np.ndarray:
        """Per replica, its streams' time per token over the last `live_window_s` (NaN: none relayed)."""
        return self._measured(replicas, time.monotonic() if now is None else now)[2]

    def proven_levels(self, replicas: list) -> np.ndarray:
        """Per replica, the most requests in flight (over a request's life) at which one of its last `feedback_window`
        requests met its SLOs, with at most `proven_miss_share` of those at that level or fewer missing theirs (0: none
        met; NaN: none measured). Not aged as the feedback is: a level proven before a quiet spell still was."""
        return self._measured(replicas, time.monotonic())[0]

    def _prove(self, outcomes) -> tuple[float, bool]:
        """(proven level, whether any missed) of a replica's recent (level, met) outcomes."""
        proven, missed = 0.0, 0
        for n, (level, met) in enumerate(sorted(outcomes), 1):
            missed += not met
            if met and missed <= self.config.proven_miss_share * n:
                proven = level
        return proven, missed > 0

    def _life_forecast(self, replica: Hashable, since: float, until: float) -> tuple[float, float]:
        """The replica's batch TPOT forecast and its requests in flight at placements, averaged over [since, until],
        each holding until the next placement (a request admitted first in a burst lives through the whole of it)."""
        marks = [m for m in self._forecasts.get(replica, ()) if m[0] >= since]
        if not marks:
            return 0.0, math.nan
        ends = [m[0] for m in marks[1:]] + [max(until, marks[-1][0])]
        spans = np.array([e - m[0] for m, e in zip(marks, ends)])
        values = np.array([m[1:] for m in marks])
        averaged = values.T @ spans / spans.sum() if spans.sum() > 0 else values.mean(axis=0)
        return float(averaged[0]), float(averaged[1])

    def forget(self, replica: Hashable) -> None:
        self._forecasts.pop(replica, None)
        self._outcomes.pop(replica, None)
        self._levels.pop(replica, None)
        self._live.pop(replica, None)
        self._chunking.pop(replica, None)
        self._per_chunk.pop(replica, None)
        self._taken.pop(replica, None)
        self._first_placed.pop(replica, None)


class _Window:
    """Milliseconds and tokens of a replica's streams over the last `span_s`, with their running sums."""

    def __init__(self, span_s: float) -> None:
        self.span_s = span_s
        self._marks: deque[tuple[float, float, float]] = deque()  # (when, ms, tokens)
        self._ms = self._tokens = 0.0

    def add(self, now: float, ms: float, tokens: float) -> None:
        self._marks.append((now, ms, tokens))
        self._ms += ms
        self._tokens += tokens
        self._trim(now)

    def _trim(self, now: float) -> None:
        while self._marks and self._marks[0][0] < now - self.span_s:
            _, ms, tokens = self._marks.popleft()
            self._ms -= ms
            self._tokens -= tokens
        if not self._marks:  # (no drift left behind by the running sums)
            self._ms = self._tokens = 0.0

    def per_token(self, now: float) -> float:
        """ms per token over the window (NaN: nothing in it)."""
        self._trim(now)
        return self._ms / self._tokens if self._marks and self._tokens > 0 else math.nan


_LOOPS: dict[str, AdmissionLoop] = {}


def admission_loop(deployment: str, config: AdmissionConfig) -> AdmissionLoop:
    """This process's loop for requests to `deployment` (created with the first caller's config)."""
    if deployment not in _LOOPS:
        _LOOPS[deployment] = AdmissionLoop(config)
    return _LOOPS[deployment]
