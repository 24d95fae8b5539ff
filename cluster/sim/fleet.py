"""A simulated fleet: arrivals, ingresses with the real routing decision and admission, N simulated engines.

Discrete events on one clock: request arrivals (Poisson, the load test's shapes and domain mix, the
shipped prompts), engine steps (`SimEngine.step`), and the replicas' routing-stats refresh every
`stats_period_s` (the router sees stats up to a period old and adds its own in-flight accounting, as
`cluster/router.py` does). With `ingresses` > 1 each ingress counts only what it routed itself, as
each of Serve's routers does; admission's feedback is shared. Routers:

- `headroom`: `cluster.route.route` (the router's own score and admission), falling back to power of two
  before every replica has reported stats;
- `pow2`: Serve's default, two random replicas, the one with fewer requests in flight;
- `lor`: least outstanding requests.

A replica takes at most `max_ongoing_requests`; a request no replica can take, or that admission holds
(`AdmissionLoop.hold`), waits at the ingress and is decided again (with the time it waited, first come first
served) whenever a request completes, and with admission also whenever one arrives. A refused
request is answered 429 at once. With `autoscaling`, only the replicas the autoscaler has serving take
requests (`cluster/sim/autoscaler.py`). Each request becomes a `loadtest.report.RequestRow`, so reports
are the load test's own.
"""

from __future__ import annotations

import copy
import heapq
import math
import itertools
import random
import time
from pathlib import Path
from collections.abc import Iterator
from typing import Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, model_validator
from tqdm import tqdm

from cluster.admission import DEFAULT_CHARS_PER_TOKEN, AdmissionConfig, AdmissionLoop, DrainMeter, estimated_prompt_tokens
from cluster.fleets import FleetDescription, ReplicaGroup  # noqa: F401 (FleetDescription: for the simulator's callers)
from cluster.placement import FleetArrays
from cluster.prompt_model import PromptModel
from cluster.route import route
from cluster.sim.acceptance import ACCEPTANCE_MODELS, AcceptanceProcess, synthetic_traces
from cluster.sim.autoscaler import SimAutoscaler, SimAutoscaling
from cluster.sim.engine import EngineSpec, SimEngine, SimRequest
from cluster.sim.parallel import EngineShards
from cluster.sim.profiles import DEFAULT_PROFILE, load_profile
from cluster.sim.replay import TraceReplay
from loadtest.config import LongPrompts, Shape
from loadtest.report import RequestRow
from loadtest.workload import shipped_prompts, with_context
from replicas.wcs.config import WCSConfig
from replicas.wcs.controller import StepController, fit_estimators
from scheduling.calibration import PostDraftCalibrator
from scheduling.estimators import ESTIMATORS
from scheduling.policies import PolicyName
from scheduling.survival import hazards_from_survival

RouterName = Literal["headroom", "pow2", "lor"]
VLLM_ADAPTIVE = "vllm-adaptive"  # vLLM's own adaptive verification (cluster/sim/vllm_adaptive.py)


class HostModel(BaseModel):
    """Engines that share their host's CPUs with the serving path (CPU replicas). Each output event (a
    request's tokens of one step, one streamed message) costs the replica's output processing, the
    ingress's relay, the proxy and the load generator `event_cpu_ms` of CPU, and each refused request
    (429) the proxy, the ingress and the load generator `refusal_cpu_ms`. While the busy engines (a core
    each at most) and the serving path together want more than the cores, every process gets its share of
    the overload (the kernel's fair scheduler), and each engine's step runs that much slower. A GPU
    replica's engine does not share: no host model."""

    cores: float = Field(gt=0, description="CPUs the engines and the serving path share")
    event_cpu_ms: float = Field(default=0.0, ge=0, description="serving-path CPU per output event")
    refusal_cpu_ms: float = Field(default=0.0, ge=0, description="serving-path CPU per refused request (not fitted by "
                                  "`simulate validate`, whose runs refuse nothing: measured, docs/overload.md)")
    window_s: float = Field(default=1.0, gt=0, description="the event and refusal rates are averaged over about this long")

    def speed(self, busy_engines: int, events_per_s: float, refusals_per_s: float = 0.0) -> float:
        demand = busy_engines + (events_per_s * self.event_cpu_ms + refusals_per_s * self.refusal_cpu_ms) / 1000.0
        return min(1.0, self.cores / max(demand, 1e-9))


class FleetConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    replicas: int = Field(default=2, ge=1)
    profile: str = DEFAULT_PROFILE
    efficiency: dict[str, float] | None = Field(default=None, description="roofline Efficiency overrides (sensitivity runs)")
    acceptance: str = "dflash-qwen3-8b"
    traces: Path | None = Field(default=None, description="replay these recorded traces instead (cluster/sim/replay.py)")
    policy: PolicyName | Literal["vllm-adaptive"] = PolicyName.WCS
    router: RouterName = "headroom"
    online_cost: bool = Field(default=True, description="the engines correct their profiled step cost from measured steps")
    engine: EngineSpec = Field(default_factory=EngineSpec)
    max_ongoing_requests: int = Field(default=64, ge=1)
    stats_period_s: float = Field(default=1.0, gt=0)
    ingresses: int = Field(default=1, ge=1, description="ingress replicas routing at once, each with its own in-flight "
                           "accounting (arrivals spread evenly over them, as behind Serve's proxies)")
    extrapolate_in_flight: bool = Field(default=True, description="each ingress counts what it routed since the stats "
                                        "times the number of ingresses (`RouterConfig.extrapolate_in_flight`)")
    groups: list[ReplicaGroup] | None = Field(default=None, description="a heterogeneous fleet (replaces `replicas` and "
                                                "`profile`: `FleetDescription.groups`)")
    admission: AdmissionConfig | None = Field(default=None, description="None: admission off")
    chars_per_token: float = Field(default=DEFAULT_CHARS_PER_TOKEN, gt=0, description="prompt tokens from the shipped prompts' characters")
    request_ms: float = Field(default=0.0, ge=0, description="what the HTTP path adds to a request's TTFT (proxy, ingress, "
                              "tokenizing, the first chunk's way back; `simulate validate` fits it)")
    host: HostModel | None = Field(default=None, description="engines sharing the host's CPUs (None: each has its own)")
    autoscaling: SimAutoscaling | None = Field(default=None, description="None: every replica serves throughout")
    workers: int = Field(default=0, ge=0, description="processes the engines step in, beside the fleet's own "
                         "(`cluster/sim/parallel.py`; the same results); 0: the fleet's process steps them")

    @model_validator(mode="after")
    def _groups(self) -> "FleetConfig":
        if self.groups:
            self.replicas = sum(g.count for g in self.groups)
            self.profile = self.groups[0].profile
        return self

    def replica_groups(self) -> list[ReplicaGroup]:
        return self.groups or [ReplicaGroup(profile=self.profile, count=self.replicas)]


class LoadConfig(BaseModel):
    """The arrival side, with the load test's meaning (`loadtest/config.py`)."""

    model_config = ConfigDict(extra="forbid")

    rate: float = Field(gt=0)
    duration_s: float = Field(gt=0)
    drain_s: float = Field(default=60.0, ge=0)
    shape: Shape = Field(default_factory=Shape)
    domains: dict[str, float] = Field(default_factory=lambda: {"code": 1.0, "prose": 1.0})
    max_tokens: int | None = Field(default=None, ge=1)
    seed: int = 0
    arrivals: Literal["poisson", "closed"] = Field(
        default="poisson", description="poisson: open loop at `rate`; closed: `users` requests always in flight"
    )
    users: int = Field(default=1, ge=1, description="closed loop: requests kept in flight across the fleet")
    long_prompts: LongPrompts | None = None


def prompts(load: LoadConfig, chars_per_token: float, rng: random.Random) -> Iterator[SimRequest]:
    """Requests with the shipped prompts, drawn by the domain weights (arrival times set by the caller)."""
    shipped = shipped_prompts()
    names = [d for d, w in load.domains.items() if w > 0]
    weights = [load.domains[d] for d in names]
    for n in itertools.count():
        domain = rng.choices(names, weights)[0]
        item = rng.choice(shipped[domain])
        prompt = item["prompt"]
        if load.long_prompts is not None:
            lp = load.long_prompts
            prompt = with_context(prompt, shipped[domain], lp.tokens(rng), lp.chars_per_token, rng)
        yield SimRequest(
            id=f"r{n}",
            key=n,
            domain=domain,
            prompt=prompt,
            prompt_tokens=max(1, round(len(prompt) / chars_per_token)),
            max_tokens=load.max_tokens or item["max_tokens"],
            arrival_s=0.0,
        )


def arrivals(load: LoadConfig, chars_per_token: float) -> Iterator[SimRequest]:
    """Poisson arrivals at the shape's rate (thinning against its peak)."""
    rng = random.Random(load.seed)
    stream = prompts(load, chars_per_token, rng)
    grid = np.linspace(0.0, load.duration_s, 1001)
    peak = max(max(load.shape.rate_at(load.rate, float(t)) for t in grid), load.shape.burst_rate, load.rate)
    t = 0.0
    while True:
        t += rng.expovariate(peak)
        if t >= load.duration_s:
            return
        if rng.random() * peak > load.shape.rate_at(load.rate, t):
            continue
        r = next(stream)
        r.arrival_s = t
        yield r


def fitted_estimators(config: FleetConfig, k: int, seed: int) -> tuple:
    """The configured estimator and the post-draft calibrator, fitted on traces drawn from the acceptance model
    (as a real engine's are fitted on its recorded traces), or on the replayed traces by the engine's own
    `replicas.wcs.controller.fit_estimators`."""
    if config.traces is not None:
        return fit_estimators(WCSConfig(traces=config.traces), k)
    model = ACCEPTANCE_MODELS[config.acceptance]
    traces = synthetic_traces(model, k, {d: 1.0 for d in model.domains}, seed=seed)
    estimator = ESTIMATORS[WCSConfig().estimator](k).fit(traces)
    calibrator = PostDraftCalibrator(k)
    calibrator.fit(traces.confidence, hazards_from_survival(estimator.predict(traces.inputs)), traces.drafted, traces.accepted)
    return estimator, calibrator


def make_controller(config: FleetConfig, k: int, fitted: tuple, seed: int, group: ReplicaGroup | None = None) -> StepController:
    """The real controller, pricing steps with its group's profile (its online correction then learns the engine);
    a group without a drafter runs `ar`."""
    estimator, calibrator = copy.deepcopy(fitted)
    group = group or config.replica_groups()[0]
    profile = load_profile(group.profile, efficiency=config.efficiency)
    policy = config.policy if group.drafter else PolicyName.AR
    if policy == VLLM_ADAPTIVE:
        from cluster.sim.vllm_adaptive import VLLMAdaptiveController

        return VLLMAdaptiveController(k, estimator, calibrator, profile.cost, config.engine.max_num_seqs,
                                      config.engine.max_num_batched_tokens, seed)
    wcs = WCSConfig(policy=policy, seed=seed, online_cost=config.online_cost)
    return StepController(wcs, k, estimator, calibrator, cost=profile.cost, token_budget=config.engine.max_num_batched_tokens)


class Fleet:
    def __init__(self, config: FleetConfig, seed: int = 0) -> None:
        self.config = config
        profile = load_profile(config.profile, efficiency=config.efficiency)
        if config.traces is not None:
            self.acceptance = TraceReplay(config.traces, seed)
            if self.acceptance.k != profile.k:
                raise ValueError(f"traces at {config.traces} have K={self.acceptance.k}; profile {profile.name} drafts K={profile.k}")
        else:
            self.acceptance = AcceptanceProcess(ACCEPTANCE_MODELS[config.acceptance], profile.k, seed)
        fitted = fitted_estimators(config, profile.k, seed)
        self.engines = []
        for group in config.replica_groups():
            own = load_profile(group.profile, efficiency=config.efficiency)
            if own.k != profile.k:
                raise ValueError(f"every group must draft the same block: {group.profile} drafts {own.k}, {profile.name} {profile.k}")
            for _ in range(group.count):
                i = len(self.engines)
                self.engines.append(SimEngine(f"replica-{i}", config.engine, make_controller(config, profile.k, fitted, seed, group),
                                              own.cost, own.context_ms_per_row, self.acceptance, seed=seed * 1000 + i))
        shipped = PromptModel.shipped()  # the router's own, fitted on the embedded pair
        if config.traces is None:  # the acceptance model's domains, not the embedded pair's
            model = ACCEPTANCE_MODELS[config.acceptance]
            means = [1.0 + float(np.cumprod(model.domains[d].curve(profile.k)).sum()) if d in model.domains else 1.0
                     for d in shipped.domains]
            shipped = shipped.model_copy(update={"accept_len": means})
        self.prompt_model = shipped
        # Prompt tokens from characters, as the router estimates them (admission's setting when it is on).
        self._prompts = config.admission or AdmissionConfig(chars_per_token=config.chars_per_token)
        self.rng = random.Random(seed)
        self.loop = AdmissionLoop(config.admission) if config.admission and config.admission.enabled else None
        self.drain = DrainMeter()
        n = config.replicas
        self.in_flight = np.zeros(n)  # all ingresses together: what the replicas enforce max_ongoing_requests on
        self.routed = np.zeros((config.ingresses, n))  # each ingress's own in-flight count per replica
        self.baseline = np.zeros((config.ingresses, n))  # ... when the replicas' stats were taken
        self.prompts_routed = np.zeros((config.ingresses, n))  # each ingress's prompt tokens routed since the stats
        self.arrays: FleetArrays | None = None
        self.autoscaler = SimAutoscaler(config.autoscaling, n) if config.autoscaling else None
        # The replicas taking requests (all, unless autoscaling), in `arrays`' order.
        self.serving = np.flatnonzero(self.autoscaler.routable) if self.autoscaler else np.arange(n)
        self.stats: list = []
        self.decisions = {"ranked": 0, "fallback": 0, "refused": 0, "held": 0, "gated": 0}  # as the router counts them
        self.route_s = 0.0  # wall time in routing and admission decisions (what `simulate bench` reports)
        self.emitted_by_end = 0
        self._event_rate, self._rate_at, self._emitted_seen = 0.0, 0.0, 0
        self._refusal_rate, self._refused_seen = 0.0, 0

    # -- routing -------------------------------------------------------------------------------------------
    def _refresh_stats(self, now: float, shards: EngineShards | None = None) -> None:
        self.stats = [e.routing_stats(now) for e in self.engines] if shards is None else shards.routing_stats(now)
        self.serving = np.flatnonzero(self.autoscaler.routable) if self.autoscaler else np.arange(len(self.engines))
        self.arrays = FleetArrays([self.stats[i] for i in self.serving]) if len(self.serving) else None
        self.baseline = self.routed.copy()
        self.prompts_routed[:] = 0.0

    def _choose(self, r: SimRequest, now: float) -> int | None | Literal["refused"]:
        """A replica index, None (every replica is full: wait), or "refused"."""
        cap = self.config.max_ongoing_requests
        serving = self.serving
        free = np.zeros(len(self.engines), dtype=bool)
        free[serving] = self.in_flight[serving] < cap
        waited_ms = (now - r.arrival_s) * 1000.0
        if self.loop is not None and waited_ms == 0.0 and self.loop.gate.closed(now):  # (a waiting request passed it)
            self.decisions["gated"] += 1
            self.loop.decided(refused=True, now=now)
            return "refused"
        if self.config.router in ("lor", "pow2") or self.arrays is None:
            if not free.any():
                return None
            least = int(serving[np.argmin(self.in_flight[serving])])
            if self.config.router == "lor":
                return least
            if self.config.router != "pow2":
                self.decisions["fallback"] += 1
            pair = [int(serving[j]) for j in self.rng.sample(range(len(serving)), min(2, len(serving)))]
            pick = min(pair, key=lambda i: self.in_flight[i])
            return pick if free[pick] else least
        admission = self.config.admission if self.loop is not None else None
        ids = [int(i) for i in serving]
        scale = self.config.ingresses if self.config.extrapolate_in_flight else 1
        decided = route(
            self.arrays,
            (self.routed[r.ingress, serving] - self.baseline[r.ingress, serving]) * scale,
            self.prompt_model.relative_acceptance({"prompt": r.prompt}),
            loop=self.loop,
            config=admission,
            prompt_tokens=estimated_prompt_tokens(len(r.prompt), self._prompts),
            pending_prompt_tokens=self.prompts_routed[r.ingress, serving] * scale,
            drain_rates=self.drain.rates(ids, now) if admission else None,
            replicas=ids,
            waited_ms=waited_ms,
            now=now,
        )
        if decided.decision is not None and not decided.decision.admit:
            if self.loop.hold(r.id, decided.decision, waited_ms, len(ids), now):
                self.decisions["held"] += 1
                return None
            self.loop.decided(refused=True, now=now)
            self.decisions["refused"] += 1
            if decided.decision.full:
                self.loop.gate.refused_full(admission.gate_s, decided.decision.retry_after_s, now)
            return "refused"
        if decided.decision is not None:
            self.loop.release(r.id)
            self.loop.decided(refused=False, now=now)
            self.loop.gate.admitted()
        self.decisions["ranked"] += 1
        order = serving[decided.order]  # positions in `arrays` to replica indices
        tied = order[: decided.tied]
        tied = tied[free[tied]]
        if len(tied):
            pick = int(tied[np.argmin(self.in_flight[tied])])  # the first of the least loaded, in rank order
        else:
            rest = order[decided.tied :]
            rest = rest[free[rest]]
            if not len(rest):
                return None
            pick = int(rest[0])
        if self.loop is not None:
            at = int(np.searchsorted(serving, pick))
            r.ticket = self.loop.ticket()
            correction = decided.correction
            ttft, tpot = correction.undo(decided.decision.ttft_ms, decided.decision.tpot_ms)
            d = decided.decision
            self.loop.routed(r.ticket, pick, float(ttft[at]), float(tpot[at]), now, float(d.level[at]), float(d.tpot_slo_ms[at]))
        return pick

    def _count_outputs(self, now: float) -> None:
        """The fleet's output-event and refusal rates, exponential averages over `host.window_s` (for the host model)."""
        if self.config.host is None:
            return
        emitted = sum(e.outputs for e in self.engines)
        dt = now - self._rate_at
        if dt > 0:
            w = math.exp(-dt / self.config.host.window_s)
            refused = self.decisions["refused"] + self.decisions["gated"]
            self._event_rate = w * self._event_rate + (1 - w) * (emitted - self._emitted_seen) / dt
            self._refusal_rate = w * self._refusal_rate + (1 - w) * (refused - self._refused_seen) / dt
            self._rate_at, self._emitted_seen, self._refused_seen = now, emitted, refused

    def _speed(self, stepping: list[bool], now: float) -> float:
        if self.config.host is None:
            return 1.0
        return self.config.host.speed(sum(stepping), self._event_rate, self._refusal_rate)

    def _shards(self) -> EngineShards | None:
        if not self.config.workers:
            return None
        if self.config.host is not None:
            raise ValueError("a host model makes each engine's speed depend on the others: simulate it with workers 0")
        return EngineShards(self.engines, self.config.workers)

    # -- the run -------------------------------------------------------------------------------------------
    def run(self, load: LoadConfig, progress: bool = False, requests: list[SimRequest] | None = None) -> list[RequestRow]:
        """Simulate `load` (or replay `requests`, with their own arrival times and lengths); `emitted_by_end`
        holds the tokens the fleet emitted within the arrival window."""
        events: list[tuple[float, int, str, object]] = []
        seq = itertools.count()
        closed = load.arrivals == "closed" and requests is None
        stream = prompts(load, self.config.chars_per_token, random.Random(load.seed)) if closed else None

        def arrive(r: SimRequest, t: float) -> None:
            r.arrival_s = t
            r.ingress = r.key % self.config.ingresses
            r.offset = self.acceptance.request_offset(r.domain, r.key)
            heapq.heappush(events, (t, next(seq), "arrive", r))

        if closed:
            for _ in range(load.users):
                arrive(next(stream), 0.0)
        else:
            for r in requests if requests is not None else arrivals(load, self.config.chars_per_token):
                arrive(r, r.arrival_s)
        heapq.heappush(events, (0.0, next(seq), "stats", None))
        if self.autoscaler is not None:
            heapq.heappush(events, (0.0, next(seq), "scale", None))
        heapq.heappush(events, (load.duration_s, next(seq), "mark", None))
        total = load.users if closed else sum(1 for e in events if e[2] == "arrive")
        stepping = [False] * len(self.engines)
        waiting: list[SimRequest] = []
        done: list[SimRequest] = []
        end = load.duration_s + load.drain_s
        bar = tqdm(total=total, desc=f"simulate {self.config.policy}/{self.config.router}", unit="req", disable=not progress)
        load_of = [e.load for e in self.engines]  # requests routed to each engine and not finished

        def start(i: int, now: float) -> None:
            if not stepping[i] and load_of[i]:
                stepping[i] = True
                heapq.heappush(events, (now, next(seq), "step", i))

        def place(r: SimRequest, now: float) -> bool:
            routing = time.perf_counter()
            choice = self._choose(r, now)
            self.route_s += time.perf_counter() - routing
            if choice is None:
                return False
            if choice == "refused":
                r.status, r.finished_s = 429, now
                done.append(r)
                bar.update()
                return True
            r.sent_s = now
            self.in_flight[choice] += 1
            self.routed[r.ingress, choice] += 1
            self.prompts_routed[r.ingress, choice] += estimated_prompt_tokens(len(r.prompt), self._prompts)
            load_of[choice] += 1
            if shards is None:
                self.engines[choice].add(r)
            else:
                shards.add(choice, r)
            start(choice, now)
            return True

        shards = self._shards()
        now = 0.0
        try:
            while events and events[0][0] <= end:
                now, _, kind, payload = heapq.heappop(events)
                if kind == "arrive":
                    # A request that admission holds is decided again at each arrival and completion, before the
                    # newcomer (Serve hands a free replica to the oldest request waiting).
                    placed = 0
                    while placed < len(waiting) and self.loop is not None and place(waiting[placed], now):
                        placed += 1
                    del waiting[:placed]
                    if not place(payload, now):
                        waiting.append(payload)
                elif kind == "mark":
                    self.emitted_by_end = sum(e.emitted for e in self.engines) if shards is None else shards.emitted()
                elif kind == "stats":
                    self._refresh_stats(now, shards)
                    if now + self.config.stats_period_s <= end and (closed or len(done) < total):
                        heapq.heappush(events, (now + self.config.stats_period_s, next(seq), "stats", None))
                elif kind == "scale":
                    if self.autoscaler.tick(now, self.stats, self.in_flight, len(waiting)):
                        self._refresh_stats(now, shards)  # Serve hands the routers the new replica set
                    if now + self.autoscaler.config.control_period_s <= end and (closed or len(done) < total):
                        heapq.heappush(events, (now + self.autoscaler.config.control_period_s, next(seq), "scale", None))
                elif kind == "step":
                    i, token = payload, next(seq)  # the step's end takes its place among same-time events now, in either mode
                    if shards is not None:
                        shards.step(i, now, token)
                        heapq.heappush(events, (now + shards.lower_bound_s[i], next(seq), "collect", (i, now, token)))
                        continue
                    result = self.engines[i].step(now, self._speed(stepping, now))
                    if result.duration_s <= 0:
                        stepping[i] = False
                        continue
                    heapq.heappush(events, (now + result.duration_s, token, "stepped", (i, result)))
                elif kind == "collect":
                    i, started, token = payload
                    result = shards.result(token)
                    heapq.heappush(events, (started + result.duration_s, token, "stepped", (i, result)))
                elif kind == "stepped":
                    i, result = payload
                    finished = result.finished
                    if self.loop is not None and result.decode_tokens:
                        self.loop.decoded(i, result.decode_ms, result.decode_tokens, now)
                    self._count_outputs(now)
                    stepping[i] = False
                    for r in finished:
                        load_of[i] -= 1
                        self.in_flight[i] -= 1
                        self.routed[r.ingress, i] -= 1
                        self.drain.completed(i, now)
                        done.append(r)
                        bar.update()
                        if closed and now < load.duration_s:
                            arrive(next(stream), now)
                            bar.total += 1
                        if self.loop is not None:
                            self.loop.gate.open()
                            if r.ticket is not None:
                                self.loop.finished(
                                    r.ticket, _ttft_ms(r, self.config.request_ms), _tpot_ms(r), now, r.generated
                                )
                    start(i, now)
                    # Waiting requests are placed first come, first served (Serve's FIFO pending queue): the first
                    # that finds no replica ends the pass (retrying every one of them made overload quadratic).
                    placed = 0
                    while finished and placed < len(waiting) and place(waiting[placed], now):
                        placed += 1
                    del waiting[:placed]
            # Steps that end after the run's end: what they finished did not finish within it (504, as unfinished).
            late = [r for _, _, kind, payload in events if kind == "stepped" for r in payload[1].finished]
            if shards is not None:
                late += [r for _, _, kind, payload in events if kind == "collect" for r in shards.result(payload[2]).finished]
                self.engines = shards.close()
            for r in late:
                r.status, r.finished_s = 0, None
        finally:
            if shards is not None:
                shards.stop()
        bar.close()
        if self.autoscaler is not None:
            self.autoscaler.settle_accounts(min(now, end))
        unfinished = [r for e in self.engines for r in (*e.running, *e.waiting)] + waiting + late
        return [_row(r, self.config.request_ms) for r in sorted(done + unfinished, key=lambda r: r.arrival_s)]


def _ttft_ms(r: SimRequest, request_ms: float = 0.0) -> float | None:
    return None if r.first_token_s is None else (r.first_token_s - r.arrival_s) * 1000.0 + request_ms


def _tpot_ms(r: SimRequest) -> float | None:
    if r.first_token_s is None or r.finished_s is None or r.generated < 2:
        return None
    return (r.finished_s - r.first_token_s) * 1000.0 / (r.generated - 1)


def _row(r: SimRequest, request_ms: float = 0.0) -> RequestRow:
    """The load test's row for a simulated request (one never finished by the end is a 504, as a timeout);
    `request_ms` of HTTP path is added to its TTFT and end."""
    status = r.status or 504
    end = (r.finished_s if r.finished_s is not None else r.arrival_s) + (request_ms / 1000.0 if r.status == 200 else 0.0)
    return RequestRow(
        request_id=r.id,
        domain=r.domain,
        status=status,
        scheduled_s=r.arrival_s,
        lag_ms=0.0,
        start_s=r.arrival_s,
        end_s=end,
        first_token_s=r.first_token_s,
        prompt_tokens=r.prompt_tokens,
        output_tokens=r.generated if status == 200 else None,
        ttft_ms=_ttft_ms(r, request_ms) if status == 200 else None,
        tpot_ms=_tpot_ms(r) if status == 200 else None,
        e2e_ms=(end - r.arrival_s) * 1000.0,
    )
