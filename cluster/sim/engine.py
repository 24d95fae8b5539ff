"""One simulated engine replica: vLLM-like continuous batching with the real WCS controller deciding each step.

Per step, as vLLM V1's scheduler and our runner do (`replicas/wcs/runner.py`):

1. schedule: running requests first (a decoding request takes 1 + the drafts it verifies, a prefilling one
   a chunk), then waiting ones, within `max_num_seqs`, the token budget and the KV blocks; a running
   request that cannot get a block preempts the newest one, which is recomputed later (vLLM's default);
2. the target pass: each verifying request accepts min(its drafts' true accepted length, verified);
3. the controller observes the verdicts, plans draft widths from the step's features (or holds), and
   after drafting picks verify lengths from the drafter's confidences: `StepController` itself;
4. the step takes the cost profile's time for (requests, drafted, target tokens), plus the drafter
   context store a drafting step makes first, times a lognormal noise; the controller's online cost model
   is fed the period as the runner feeds it.

The controller prices steps with its own cost model (the profile, corrected online); the engine is charged
`true_cost`, which may differ (the validation and sensitivity runs set it apart).
"""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np
from pydantic import BaseModel, Field

from cluster.sim.acceptance import AcceptanceProcess
from replicas.routing_stats import RoutingStats, StepMix, routing_stats, step_mix
from replicas.wcs.controller import StepController
from scheduling.cost_model import StepCostModel


class EngineSpec(BaseModel):
    max_num_seqs: int = Field(default=64, ge=1)
    max_num_batched_tokens: int = Field(default=8192, ge=1)
    kv_blocks: int = Field(default=65536, ge=1, description="KV cache blocks")
    block_size: int = Field(default=16, ge=1, description="tokens per KV block")
    noise_sd: float = Field(default=0.03, ge=0, description="lognormal step-time noise")
    tpot_slo_ms: float = Field(default=20.0, gt=0, description="the replica's TPOT SLO (its routing stats' cap)")


@dataclass(eq=False)  # a request is itself: `in` and `remove` on the batch compare identities
class SimRequest:
    id: str
    domain: str
    prompt_tokens: int
    max_tokens: int
    arrival_s: float
    key: int = 0  # its draws' key (`AcceptanceProcess`): the same request meets the same acceptance under every policy
    offset: float = 0.0  # its acceptance offset (`AcceptanceProcess.request_offset`)
    prompt: str = ""
    ticket: int | None = None
    ingress: int = 0  # the ingress replica that routes it
    sent_s: float | None = None  # when the router placed it
    prefilled: int = 0
    prefill_target: int = -1  # tokens its prefill covers: the prompt, after a preemption what it had generated too
    kv_tokens: int = 0
    generated: int = 0
    deferred: int = 0  # drafter context rows deferred by steps that did not draft (dropped when it leaves)
    verify: int = 0  # drafts to verify in its next step
    accept_len: int = 0  # ... and how many of them the target accepts
    blocks: int = 0
    first_token_s: float | None = None
    finished_s: float | None = None
    status: int = 0  # 200 served, 429 refused
    preemptions: int = 0

    def __post_init__(self) -> None:
        if self.prefill_target < 0:
            self.prefill_target = self.prompt_tokens

    @property
    def prefilling(self) -> bool:
        return self.prefilled < self.prefill_target


@dataclass
class StepResult:
    duration_s: float
    finished: list[SimRequest] = field(default_factory=list)
    decode_ms: float = 0.0  # the step's time summed over the requests that decoded tokens in it
    decode_tokens: int = 0  # what they decoded (as the ingress measures streams: `AdmissionLoop.decoded`)


class SimEngine:
    def __init__(self, name: str, spec: EngineSpec, controller: StepController, true_cost: StepCostModel,
                 context_ms_per_row: float, acceptance: AcceptanceProcess, seed: int = 0) -> None:
        self.name, self.spec, self.ctl, self.true_cost = name, spec, controller, true_cost
        self.context_ms_per_row = context_ms_per_row
        self.acceptance = acceptance
        self.rng = np.random.default_rng(seed)  # step-time noise
        self.k = controller.k
        self.waiting: deque[SimRequest] = deque()
        self.running: list[SimRequest] = []
        self.free_blocks = spec.kv_blocks
        self.decode_s = 0.0  # realised decoding, as vLLM's stat logger totals it (`LatestSchedulerStats`)
        self.decode_tokens = 0
        self.steps = 0
        self.plan_s = 0.0  # wall time in the controller's plan() calls (what `simulate bench` reports per step)
        self.emitted = 0  # tokens emitted so far
        self.outputs = 0  # output events so far: a request's tokens of one step, streamed as one message
        self._stats_before: tuple[dict, tuple[float, int]] | None = None
        self._mix = StepMix()

    @property
    def pending_rows(self) -> int:
        """Deferred drafter context of the requests still here (the real drafter drops a leaving request's)."""
        return sum(r.deferred for r in self.running)

    @property
    def load(self) -> int:
        return len(self.running) + len(self.waiting)

    def add(self, request: SimRequest) -> None:
        self.waiting.append(request)

    def _grow(self, r: SimRequest, tokens: int) -> bool:
        need = max(math.ceil((r.kv_tokens + tokens) / self.spec.block_size) - r.blocks, 0)
        if need > self.free_blocks:
            return False
        self.free_blocks -= need
        r.blocks += need
        return True

    def _release(self, r: SimRequest) -> None:
        self.free_blocks += r.blocks
        r.blocks = 0

    def _preempt(self, r: SimRequest) -> None:
        self.running.remove(r)
        self._release(r)
        self.ctl.finish([r.id])
        r.prefilled, r.kv_tokens, r.verify, r.accept_len, r.deferred = 0, 0, 0, 0, 0
        r.prefill_target = r.prompt_tokens + r.generated
        r.preemptions += 1
        self.waiting.appendleft(r)

    def _schedule(self) -> dict[str, int]:
        budget, tokens = self.spec.max_num_batched_tokens, {}
        running, i = self.running, 0
        while i < len(running):  # preemption takes the newest, so the requests before i stay where they are
            r = running[i]
            i += 1
            prefilling = r.prefilled < r.prefill_target
            want = min(r.prefill_target - r.prefilled if prefilling else 1 + r.verify, budget)
            while want and not self._grow(r, want):
                newest = running[-1]
                self._preempt(newest)
                if newest is r:
                    want = 0
            if want:
                if not prefilling:
                    r.verify = min(r.verify, want - 1)
                tokens[r.id] = want
                budget -= want
        while self.waiting and budget > 0 and len(self.running) < self.spec.max_num_seqs:
            r = self.waiting[0]
            want = min(r.prefill_target - r.prefilled, budget)
            if not self._grow(r, want):
                break
            self.waiting.popleft()
            self.running.append(r)
            tokens[r.id] = want
            budget -= want
        return tokens

    def step(self, now: float, speed: float = 1.0) -> StepResult:
        """Run one step from `now` at `speed` (the share of a CPU the host leaves the engine, `HostModel`); the
        caller schedules the next at `now + duration_s`."""
        tokens = self._schedule()
        batch = [r for r in self.running if r.id in tokens]
        if not batch:
            return StepResult(0.0)
        ctl, k = self.ctl, self.k
        n = len(batch)
        ids = [r.id for r in batch]
        verified_, accepted_, emitted_, prefilling_ = [0] * n, [0] * n, [0] * n, [False] * n
        for i, r in enumerate(batch):
            t = tokens[r.id]
            if r.prefilled < r.prefill_target:
                r.prefilled += t
                r.kv_tokens += t
                prefilling_[i] = still = r.prefilled < r.prefill_target
                e = int(not still)  # the prefill's last chunk samples a token
            else:
                verified_[i] = r.verify
                accepted_[i] = min(r.accept_len, r.verify)
                e = accepted_[i] + 1
            emitted_[i] = min(e, r.max_tokens - r.generated)
        verified = np.array(verified_, dtype=np.int64)
        accepted = np.array(accepted_, dtype=np.int64)
        ctl.observe(ids, verified, accepted)
        generated_ = [r.generated + e for r, e in zip(batch, emitted_)]
        generated = np.array(generated_, dtype=np.int64)
        max_width = np.array([0 if p else min(max(r.max_tokens - g - 1, 0), k)
                              for r, g, p in zip(batch, generated_, prefilling_)], dtype=np.int64)
        draw = None
        planning = time.perf_counter()
        if not ctl.needs_drafter():
            draft = ctl.plan(ids, None, max_width, generated=generated)
        elif ctl.holds_no_drafts():
            draft = ctl.plan(ids, None, max_width, generated=generated)
        else:
            draw = self.acceptance.step([r.domain for r in batch], np.array([r.offset for r in batch]), generated,
                                        np.array([r.key for r in batch], dtype=np.uint64))
            draft = ctl.plan(ids, draw.features, max_width, generated=generated, context_rows=self.pending_rows)
        self.plan_s += time.perf_counter() - planning
        drafted = int(draft.sum())
        target = sum(tokens.values())
        context_rows = context_ms = 0
        if drafted:
            context_rows = self.pending_rows
            context_ms = context_rows * self.context_ms_per_row
            for r in self.running:
                r.deferred = 0
            verify = ctl.verify(draw.confidence)
            launch = self.true_cost.step_ms(n, drafted, target) - self.true_cost.step_ms(n, 0, target)
            ctl.drafted(launch + context_ms)
        else:
            verify = np.zeros(n, dtype=np.int64)
            if ctl.needs_drafter():
                for r in batch:
                    r.deferred += tokens[r.id]
        noise = math.exp(self.rng.normal(0.0, self.spec.noise_sd)) if self.spec.noise_sd else 1.0
        period_ms = (self.true_cost.step_ms(n, drafted, target) + context_ms) * noise / speed
        planned = n + sum(verified_)
        ctl.observe_step(n, drafted, planned, period_ms, target - planned, context_rows, context_ms)
        end = now + period_ms / 1e3
        result = StepResult(period_ms / 1e3)
        verify_ = verify.tolist()
        accept_len = draw.accept_len.tolist() if draw is not None else None
        for r, e, p, v, i in zip(batch, emitted_, prefilling_, verify_, range(n)):
            if e:
                if r.first_token_s is None:
                    r.first_token_s = end
                elif not p:
                    self.decode_s += period_ms / 1e3
                    self.decode_tokens += e
                    result.decode_ms += period_ms
                    result.decode_tokens += e
                r.generated += e
                self.emitted += e
                self.outputs += 1
                r.kv_tokens += e if not p else 0
            r.verify = v
            r.accept_len = accept_len[i] if accept_len is not None and v else 0
            if r.generated >= r.max_tokens:
                r.finished_s, r.status = end, 200
                self.running.remove(r)
                self._release(r)
                ctl.finish([r.id])
                result.finished.append(r)
        self.steps += 1
        return result

    def routing_stats(self, now_s: float) -> RoutingStats:
        """What the replica reports to the router each stats period (`replicas/deployment.py`'s refresh)."""
        snapshot = self.ctl.stats.model_dump()
        before, decoded = self._stats_before or (None, (0.0, 0))
        self._mix = step_mix(snapshot, before) or self._mix
        tokens = self.decode_tokens - decoded[1]
        realised = 1000.0 * (self.decode_s - decoded[0]) / tokens if tokens >= 16 else None
        self._stats_before = (snapshot, (self.decode_s, self.decode_tokens))
        stats = routing_stats(
            cost=self.ctl.cost_model,
            running=len(self.running),
            waiting=len(self.waiting),
            kv_usage=1.0 - self.free_blocks / self.spec.kv_blocks,
            max_num_seqs=self.spec.max_num_seqs,
            token_budget=self.spec.max_num_batched_tokens,
            cap_ms=self.spec.tpot_slo_ms,
            mix=self._mix,
            predicted_accept_len=self.ctl.predicted_accept_len() if self.ctl.needs_drafter() else 1.0,
            realised_tpot_ms=realised,
        )
        return stats.model_copy(update={"timestamp": now_s})
