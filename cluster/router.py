"""The cluster's request router: places each request by predicted acceptance and SLO headroom.

A Ray Serve `RequestRouter` running in the ingress (the handle's owner), so
it sees each request's body. Per request it

1. predicts the request's acceptance from its prompt (`PromptModel`), relative to the workload's;
2. takes each replica's last `RoutingStats` and corrects them with its own
   in-flight accounting: requests it routed there since those stats were
   taken, minus those that finished since (the stats are up to a period old),
   times the number of ingress replicas: each routes its share of the traffic
   on the same stats and sees only its own (`ingresses`; counting only its own
   cost 20 points of SLO attainment at 16-64 ingresses in `forespark simulate`);
3. scores each replica by the TPOT slack left after placing the request
   there (`placement_slack`), and returns the replicas ranked by it.

Serve then takes the first rank whose replica is below
`max_ongoing_requests` (ties share a rank; Serve picks the shorter queue).
With admission on (`cluster/admission.py`), only replicas predicted to meet
the request's SLOs are ranked; with none, the request is refused at once
(its future gets `AdmissionRejected`, which the ingress answers with 429).
Its predictions are corrected by what the ingress measured of the requests
it admitted (`SLOFeedback`, shared with the ingress in this process: the
router records each request's prediction under the ingress's ticket), and a
refusal for a full fleet closes the ingress's gate until a request completes.
A request waiting for a free replica is decided again at every attempt, with
the time it has waited, so one past its TTFT deadline never reaches an engine.
Replicas without fresh stats (cold start) make the decision fall back to
power-of-two choices, as Serve's default router does. Requests back off when
every replica is full, and a replica that died is dropped at once.
"""

from __future__ import annotations

import math
import operator
import random
import time
from collections import defaultdict
from typing import Any

import numpy as np
from ray.serve.request_router import FIFOMixin, PendingRequest, ReplicaID, ReplicaResult, RequestRouter, RunningReplica

from cluster import admission as admission_module, router_metrics, router_registry  # by module: Serve pickles this module by value, metric objects cannot be
from cluster.placement import FleetArrays
from cluster.route import Route, route
from cluster.prompt_model import PromptModel, prompt_text
from replicas.routing_stats import RoutingStats

ROUTER_NAME = "acceptance_headroom"


class _FleetView:
    """One candidate list's stats as arrays, built once per list: Serve hands the router a new list
    whenever any replica's stats or the replica set change.

    `routed` follows the router's in-flight count per replica; `baseline` is that count when each
    replica's stats were taken (kept across lists while a replica's stats timestamp is unchanged),
    so `routed - baseline` is what the router added since the stats saw it. `prompts` sums the
    (estimated) prompt tokens it routed to each replica since those stats.
    """

    def __init__(self, candidates: list[RunningReplica], previous: "_FleetView | None", in_flight: dict) -> None:
        self.candidates = candidates
        self.ids = [r.replica_id for r in candidates]
        self.position = {rid: i for i, rid in enumerate(self.ids)}
        raws = [r.routing_stats for r in candidates]
        self.arrays: FleetArrays | None = None
        self.oldest = 0.0
        self.stamps = [raw.get("timestamp") if raw else None for raw in raws]
        self.routed = np.array([in_flight.get(rid, 0) for rid in self.ids], dtype=np.float64)
        self.baseline = self.routed.copy()
        self.prompts = np.zeros(len(self.ids))
        if not all(raws):
            return
        stats = [RoutingStats.model_validate(raw) for raw in raws]
        self.arrays = FleetArrays(stats)
        self.oldest = min(s.timestamp for s in stats)
        if previous is not None:
            for i, (rid, stamp) in enumerate(zip(self.ids, self.stamps)):
                j = previous.position.get(rid)
                if j is not None and previous.stamps[j] == stamp:
                    self.baseline[i] = previous.baseline[j]
                    self.prompts[i] = previous.prompts[j]

    def count(self, replica_id: ReplicaID, delta: int, prompt_tokens: float = 0.0) -> None:
        i = self.position.get(replica_id)
        if i is not None:
            self.routed[i] = max(self.routed[i] + delta, 0.0)
            self.prompts[i] += prompt_tokens


class AcceptanceHeadroomRouter(FIFOMixin, RequestRouter):
    def initialize_state(
        self, stale_after_s: float = 10.0, tie_ms: float = 1.0, top_ranks: int = 3, admission: dict | None = None,
        ingresses: int = 1, **_: Any
    ) -> None:
        """`stale_after_s`: stats older than this count as missing; `tie_ms`: slack differences that count as ties;
        `admission`: an `AdmissionConfig` (None: admission off); `ingresses`: routers sharing the fleet, each with
        an even share of the traffic (its own routing since the stats counts this many times)."""
        self.stale_after_s = stale_after_s
        self.ingresses = max(int(ingresses), 1)
        self.tie_ms = tie_ms
        self.top_ranks = top_ranks
        self.admission = admission_module.AdmissionConfig.model_validate(admission) if admission else None
        if self.admission is not None and not self.admission.enabled:
            self.admission = None
        self.loop = admission_module.admission_loop(self._deployment_id.name, self.admission) if self.admission else None
        self._prompts = self.admission or admission_module.AdmissionConfig()  # prompt tokens from characters, as admission counts them
        self.drain = admission_module.DrainMeter()
        self.model = PromptModel.shipped()
        self.in_flight: dict[ReplicaID, int] = defaultdict(int)
        # ticket -> per replica (TTFT, TPOT, requests in flight with it, its TPOT SLO)
        self._predictions: dict[int, tuple[dict, np.ndarray, np.ndarray, np.ndarray, np.ndarray]] = {}
        self._view: _FleetView | None = None
        self._decisions = router_metrics.DECISIONS.labels(ROUTER_NAME, "ranked")
        self._fallbacks = router_metrics.DECISIONS.labels(ROUTER_NAME, "fallback")
        self._refusals = router_metrics.DECISIONS.labels(ROUTER_NAME, "refused")
        self._holds = router_metrics.DECISIONS.labels(ROUTER_NAME, "held")
        self._timer = router_metrics.DECISION_SECONDS.labels(ROUTER_NAME)
        self._ttft_correction = router_metrics.ADMISSION_CORRECTION.labels("ttft")
        self._tpot_correction = router_metrics.ADMISSION_CORRECTION.labels("tpot")
        self._tpot_slope = router_metrics.ADMISSION_CORRECTION.labels("tpot_slope")
        router_registry.ROUTERS[self._deployment_id.name] = self

    def _fleet(self, candidates: list[RunningReplica]) -> _FleetView | None:
        view = self._view
        if view is None or view.candidates is not candidates:
            view = self._view = _FleetView(candidates, view, self.in_flight)
        if view.arrays is None or time.time() - view.oldest > self.stale_after_s:
            return None
        return view

    def rank(
        self,
        candidates: list[RunningReplica],
        body: dict | None,
        waited_ms: float = 0.0,
        slo: dict | None = None,
        ticket: int | None = None,
    ) -> list[list[RunningReplica]]:
        """Replicas in rank order; raises `AdmissionRejected` when admission finds none that meets the SLOs, or
        returns none while the request waits to be decided again (`AdmissionLoop.hold`)."""
        view = self._fleet(candidates)
        if view is None:  # cold start or a silent replica: power of two choices, Serve picks the shorter queue
            self._fallbacks.inc()
            return [random.sample(candidates, min(2, len(candidates)))]
        loop, config = self.loop, self.admission
        routed = self._route(
            view,
            body,
            loop=loop,
            config=config,
            drain_rates=self.drain.rates(view.ids) if config else None,
            replicas=view.ids,
            waited_ms=waited_ms,
            slo=admission_module.RequestSLO.model_validate(slo) if slo and config else None,
        )
        decision, correction = routed.decision, routed.correction
        if decision is not None:
            self._ttft_correction.set(correction.ttft_ms)
            self._tpot_correction.set(correction.tpot_ms)
            self._tpot_slope.set(correction.tpot_slope)
            if not decision.admit:
                if ticket is not None and loop.hold(ticket, decision, waited_ms, len(view.ids)):
                    self._holds.inc()
                    return []  # Serve's routing loop asks again after its backoff
                raise self.refuse(decision)  # (`hold` let go of its hold, if it had one)
            loop.release(ticket)
            loop.decided(refused=False)
            loop.gate.admitted()
            if ticket is not None:  # kept uncorrected: the feedback compares the model's own predictions
                self._predictions[ticket] = (
                    view.position, *correction.undo(decision.ttft_ms, decision.tpot_ms), decision.level, decision.tpot_slo_ms
                )
                while len(self._predictions) > admission_module.MAX_PENDING:
                    self._predictions.pop(next(iter(self._predictions)))
        order = routed.order.tolist()
        ranked = list(operator.itemgetter(*order)(candidates)) if len(order) > 1 else [candidates[i] for i in order]
        tied = routed.tied
        self._decisions.inc()
        singles = [[r] for r in ranked[tied : tied + self.top_ranks - 1]]
        tail = ranked[tied + self.top_ranks - 1 :]
        return [ranked[:tied], *singles, *([tail] if tail else [])]

    def refuse(self, decision: admission_module.Decision) -> admission_module.AdmissionRejected:
        """Counts a refusal (one for a full fleet counts towards shutting the ingress's gate) and returns what the
        caller raises."""
        self._refusals.inc()
        self.loop.decided(refused=True)
        if decision.full:
            self.loop.gate.refused_full(self.admission.gate_s, decision.retry_after_s)
        return admission_module.AdmissionRejected(decision.retry_after_s, float(decision.ttft_ms.min()), float(decision.tpot_ms.min()))

    def refusal_for_any_body(self, slo: dict | None = None) -> admission_module.Decision | None:
        """Admission's refusal of every request now, whatever its body, or None: the decision `rank` would make
        for the most favourable one (an empty prompt of the best-accepting domain, nothing waited). A prompt's
        length only adds to its TTFT and a lower acceptance only to its TPOT (`placement_forecast`), so no body
        would be admitted where this one is refused; the ingress asks before it reads the body. Looks only:
        nothing is counted, no gate shut, the probe's clock kept (`refuse` commits it)."""
        replicas = list(self.curr_replicas.values())
        view = self._fleet(replicas) if replicas and self.loop is not None else None
        if view is None:
            return None
        routed = self._route(
            view,
            None,
            acceptance=self.model.best_relative_acceptance,
            prompt_tokens=0.0,
            loop=self.loop,
            config=self.admission,
            drain_rates=self.drain.rates(view.ids),
            replicas=view.ids,
            slo=admission_module.RequestSLO.model_validate(slo) if slo else None,
            commit=False,
        )
        decision = routed.decision
        return None if decision.admit or (decision.waitable and self.loop.hold_room(len(view.ids))) else decision

    def best_slack(self, body: dict | None) -> float | None:
        """The TPOT slack (ms) of this deployment's best replica for `body`, as `rank` would place it now (admission
        aside); None without fresh stats from every replica."""
        replicas = list(self.curr_replicas.values())
        view = self._fleet(replicas) if replicas else None
        return None if view is None else self._route(view, body).best

    def capacity(self) -> float:
        """Requests this deployment's replicas run at once (their `max_ongoing_requests`); more wait in its queue."""
        return sum(getattr(r, "max_ongoing_requests", math.inf) for r in self.curr_replicas.values())

    def _route(
        self, view: _FleetView, body: dict | None, acceptance: float | None = None, prompt_tokens: float | None = None,
        **admission: Any,
    ) -> Route:
        """`route` over `view` for `body`; `acceptance` and `prompt_tokens` in place of the body's when given."""
        if acceptance is None:
            acceptance = self.model.relative_acceptance(body) if body else 1.0
        added, prompts = view.routed - view.baseline, view.prompts
        if self.ingresses > 1:
            added, prompts = added * self.ingresses, prompts * self.ingresses
        return route(
            view.arrays,
            added,
            acceptance,
            prompt_tokens=self._prompt_tokens(body) if prompt_tokens is None else prompt_tokens,
            pending_prompt_tokens=prompts,
            tie_ms=self.tie_ms,
            **admission,
        )

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        body, waited_ms, slo, ticket = None, 0.0, None, None
        if pending_request is not None:
            if pending_request.future.done():  # refused below on an earlier attempt: let Serve's loop end
                return [candidate_replicas]
            pending_request.routing_context.should_backoff = True  # otherwise Serve busy-loops while all are full
            args = pending_request.args
            if len(args) > 1 and isinstance(args[1], dict):
                body = args[1]
            waited_ms = max(time.time() - pending_request.created_at, 0.0) * 1000.0
            slo = pending_request.kwargs.get("slo")
            ticket = pending_request.kwargs.get("ticket")
        start = time.perf_counter()
        try:
            ranks = self.rank(candidate_replicas, body, waited_ms, slo, ticket)
        except admission_module.AdmissionRejected as refusal:
            if pending_request is None:
                raise
            # The caller's await on this future raises the refusal; Serve's routing loop sees it done and stops.
            pending_request.future.set_exception(refusal)
            self._remove_pending_request_from_indices(pending_request)
            return [candidate_replicas]
        finally:
            self._timer.observe(time.perf_counter() - start)
        return ranks

    def _prompt_tokens(self, body: dict | None) -> float:
        return admission_module.estimated_prompt_tokens(len(prompt_text(body)) if body else 0, self._prompts)

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: ReplicaResult) -> None:
        self.in_flight[replica_id] += 1
        ticket = pending_request.kwargs.get("ticket")
        if self.loop is not None:  # (Serve hands a free replica to the oldest request waiting: one held, maybe)
            self.loop.release(ticket)
        predicted = self._predictions.pop(ticket, None)
        if predicted is not None and replica_id in predicted[0]:
            i = predicted[0][replica_id]
            ttft, tpot, level, slo_ms = (float(p[i]) for p in predicted[1:])
            self.loop.routed(ticket, replica_id, ttft, tpot, level=level, tpot_slo_ms=slo_ms)
        if self._view is not None:
            args = pending_request.args
            body = args[1] if len(args) > 1 and isinstance(args[1], dict) else None
            self._view.count(replica_id, 1, self._prompt_tokens(body))
        if self.loop is not None:
            self.loop.changed()

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        self.drain.completed(replica_id)
        if self.loop is not None:
            self.loop.gate.open()
        if self.in_flight.get(replica_id, 0) > 0:
            self.in_flight[replica_id] -= 1
            if self._view is not None:
                self._view.count(replica_id, -1)
        if self.loop is not None:
            self.loop.changed()

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)  # Serve stops offering it as a candidate at once
        self.in_flight.pop(replica_id, None)
        self.drain.forget(replica_id)
        if self.loop is not None:
            self.loop.forget(replica_id)
        self._view = None
