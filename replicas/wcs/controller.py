"""One engine step's WCS decisions, free of vLLM: verdicts in, draft widths d_i and verify lengths v_i out.

The runner calls, every step and in this order: `observe` (what the last
step's drafts turned into), `plan` (pre-draft widths from the estimator and
the planner), `verify` (post-draft verify lengths from the drafter's
confidences). Every policy goes through these same calls; a policy only
changes the bounds and floors `scheduling.policies.Policy` hands the planner
and the allocator.

A plan that drafts nothing holds for the next `replan_every - 1` steps
(`holds_no_drafts`): the runner then skips the features and the planner,
which cost a step without drafts about a seventh of its time on CPU (measured
in an engine at 12 requests: 0.5 ms of a 3.5 ms step), exactly the steps a
loaded engine runs most. Each further plan in a row that drafts nothing
doubles the hold, up to `replan_max` steps, so an engine where drafting does
not pay runs as `ar` does but for the drafter context it keeps for a return;
a plan that drafts starts again from `replan_every`. Probes
(`scheduling.exploration`) end a hold when they fall due, so a belief that
drafting does not pay keeps being checked. Above all this, the mode gate
(`scheduling.mode_gate`, `mode_gate`, off by default) serves `wcs` in blocks of steps, speculating or
holding throughout, by which of the two realised more tokens per ms at the
load.
"""

from __future__ import annotations

import copy
import logging
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from replicas.wcs.config import WCSConfig
from replicas.wcs.features import AcceptanceTracker
from replicas.wcs.stats import WCSStats
from scheduling.calibration import PostDraftCalibrator
from scheduling.cost_model import StepCostModel
from scheduling.estimators import ESTIMATORS, ConstantEstimator, SurvivalEstimator
from scheduling.exploration import ProbeSchedule
from scheduling.mode_gate import ModeGate
from scheduling.online_cost import OnlineCostModel
from scheduling.planner import DraftPlan
from scheduling.policies import Policy, PolicyName, StepLimits
from scheduling.realised_advantage import DRAFT, PLAIN, RealisedAdvantage
from scheduling.recalibration import OnlineRecalibrator, RealisedGain
from scheduling.survival import hazards_from_survival
from scheduling.traces import PreDraftInputs, Traces

logger = logging.getLogger(__name__)

# What a controller learns while it serves, kept per policy (`StepController.set_policy`).
LEARNED = ("estimator", "calibrator", "_online", "recalibrator", "gain", "probes", "advantage", "gate")

# Used only until the engine's own profile is loaded (`replicas.wcs.profiler`); logged when used.
UNPROFILED_COST = StepCostModel.linear(intercept_ms=10.0, per_request_ms=0.05, per_draft_ms=0.02, per_target_ms=0.05)


def fit_estimators(config: WCSConfig, k: int) -> tuple[SurvivalEstimator, PostDraftCalibrator]:
    """The configured pre-draft estimator and the post-draft calibrator, fitted on the traces file.

    Without traces (recording them needs none): a constant prior and the raw drafter confidences.
    """
    calibrator = PostDraftCalibrator(k)
    if config.traces is None or not config.traces.exists():
        logger.warning("no acceptance traces at %s: the estimator starts from a constant prior", config.traces)
        return ConstantEstimator(k), calibrator
    traces = Traces.load(config.traces)
    if traces.k != k:
        raise ValueError(f"traces at {config.traces} have K={traces.k}; the drafter drafts K={k}")
    estimator = ESTIMATORS[config.estimator](k).fit(traces)
    if traces.confidence is not None:
        prior = hazards_from_survival(estimator.predict(traces.inputs))
        calibrator.fit(traces.confidence, prior, traces.drafted, traces.accepted)
    return estimator, calibrator


class StepController:
    def __init__(
        self,
        config: WCSConfig,
        k: int,
        estimator: SurvivalEstimator,
        calibrator: PostDraftCalibrator | None = None,
        cost: StepCostModel | None = None,
        token_budget: int | None = None,
    ) -> None:
        self.config = config
        self.k = k
        self.limits = StepLimits(token_budget=token_budget, time_cap_ms=config.max_step_ms, pace_tpot_ms=config.pace_tpot_ms)
        self.tracker = AcceptanceTracker(k, config.history_decay)
        calibrator = calibrator if calibrator is not None else PostDraftCalibrator(k)
        self._fitted = copy.deepcopy((estimator, calibrator))  # what every policy starts learning from
        self._learned: dict[PolicyName, dict[str, Any]] = {}  # other policies' learned state, while not served
        self.estimator, self.calibrator = estimator, calibrator
        self.cost = cost
        self.recalibrator = OnlineRecalibrator(k) if config.recalibrate else None
        self.gain = RealisedGain(k) if config.recalibrate else None
        self.probes = ProbeSchedule(config.explore_every, budget=config.explore_budget) if config.explore_every else None
        self.advantage = RealisedAdvantage() if config.advantage_feedback else None
        self.gate = ModeGate(config.mode_block_steps) if config.mode_gate else None
        self._probes_due = False  # some request is due for a probe: do not hold
        self._round_verify_ms: float | None = None  # this step is a probe round: its predicted verification
        self.set_policy(config.policy)
        self.profiling: np.random.Generator | None = None  # random widths while the cost model is profiled
        self.profiling_skip = 0.25  # ... and this share of those steps drafting nothing
        self.recorded: list[Traces] | None = None  # verdict rows, when recording traces
        self._plan: DraftPlan | None = None
        self._req_ids: list[str] = []
        self._inputs: PreDraftInputs | None = None
        self._survival = np.zeros((0, k))  # pre-draft survival the plan was made on
        self._draft = np.zeros(0, dtype=np.int64)
        self._paced_from: dict[str, tuple[float, int]] = {}  # request -> (when it was first planned, tokens it had then)

    def set_policy(self, name: PolicyName | str) -> None:
        """Serve `name` from the next step. What the controller learned while serving the last policy (estimator
        updates, online step cost, recalibration, probe schedule) is kept for it, and `name` resumes from its own,
        or from the fitted estimators and the profile: each policy learns only from its own steps, as if it were
        served alone. (Sharing made the engine bench compare policies on each other's evidence: `wcs` at 64
        requests priced its drafting from `static`'s 500-token drafting steps and drafted at a loss.)"""
        policy = Policy(
            name=PolicyName(name),
            k=self.k,
            whole_blocks=self.config.draft_widths == "whole_blocks",
            margin=self.config.draft_margin,
        )
        if policy.name == PolicyName.ORACLE:
            raise ValueError("the oracle policy needs true acceptances: replay and simulation only")
        last = getattr(self, "policy", None)
        if last is not None and last.name != policy.name:
            self._learned[last.name] = {a: getattr(self, a) for a in LEARNED}
            for a, v in (self._learned.pop(policy.name, None) or self._fresh_learning()).items():
                setattr(self, a, v)
            self._probes_due = False
            if self.gate is not None:
                self.gate.interrupt()
        self.policy = policy
        self.stats = WCSStats(policy=self.policy.name.value, k=self.k)
        self._held = 0  # steps held without planning since the last plan
        self._drafted_nothing = False  # the last plan chose to draft nothing
        self._hold = self.config.replan_every  # steps a plan without drafts is kept for (doubling in a row)
        lo, hi = self.policy.draft_bounds(np.full(1, self.k))
        self._ever_drafts = bool(hi.any())
        self._chooses = self._ever_drafts and not lo.any()  # it may draft nothing where drafting does not pay (`wcs`)

    @property
    def cost(self) -> StepCostModel | None:
        """The profiled step-cost model (None until the engine has one)."""
        return None if self._online is None else self._online.profiled

    @cost.setter
    def cost(self, profiled: StepCostModel | None) -> None:
        """A new profile: every policy's online correction starts again from it."""
        self._online = None if profiled is None else OnlineCostModel(profiled)
        for learned in self._learned.values():
            learned["_online"] = None if profiled is None else OnlineCostModel(profiled)

    def _fresh_learning(self) -> dict[str, Any]:
        """The learned state of a policy not served yet: fitted estimators, the profile, nothing observed."""
        config, k = self.config, self.k
        estimator, calibrator = copy.deepcopy(self._fitted)
        return {
            "estimator": estimator,
            "calibrator": calibrator,
            "_online": None if self.cost is None else OnlineCostModel(self.cost),
            "recalibrator": OnlineRecalibrator(k) if config.recalibrate else None,
            "gain": RealisedGain(k) if config.recalibrate else None,
            "probes": ProbeSchedule(config.explore_every, budget=config.explore_budget) if config.explore_every else None,
            "advantage": RealisedAdvantage() if config.advantage_feedback else None,
            "gate": ModeGate(config.mode_block_steps) if config.mode_gate else None,
        }

    def forget_learning(self) -> None:
        """Every policy starts learning again from the fitted estimators and the profile."""
        self._learned.clear()
        for a, v in self._fresh_learning().items():
            setattr(self, a, v)

    @property
    def cost_model(self) -> StepCostModel:
        """What the planner and the allocator price steps with: the profile, corrected by measured steps."""
        return self._online.model if self._online is not None else UNPROFILED_COST

    @property
    def cost_offset_ms(self) -> float:
        """What the online correction adds to the profiled intercept now."""
        return 0.0 if self._online is None else self._online.offset_ms

    @property
    def launch_offset_ms(self) -> float:
        """What the online correction adds to the profiled drafter launch cost now."""
        return 0.0 if self._online is None else self._online.launch_offset_ms

    def margin(self, requests: int) -> float:
        """The predicted gain a `wcs` plan must show at this load: `draft_margin`, or more where drafting steps
        near this load ran longer than the served cost model predicted (`OnlineCostModel.drafting_error`; at 64
        requests on this CPU they ran 10-35% longer, against 5% of margin), or where drafting plans realised less
        against their prediction than steps drafting nothing (`RealisedAdvantage.overstatement`). Both only
        while the online correction keeps predictions in measured milliseconds: a synthetic cost model, as
        tests set to make drafting pay, would otherwise be overruled."""
        if self._online is None or not self.config.online_cost:  # the model is taken as it is (a synthetic one, or `dspark`)
            return self.config.draft_margin
        realised = self.advantage.overstatement(requests) if self.advantage is not None else 0.0
        return max(self.config.draft_margin, self._online.drafting_error(requests), realised)

    def switch_ms(self, rows: int) -> float:
        """What returning to drafting adds to a plan's step: storing `rows` deferred context rows, spread over the
        `replan_max` steps a return is expected to last at least."""
        return self.context_ms(rows) / self.config.replan_max

    def context_ms(self, rows: int) -> float:
        """What storing `rows` deferred drafter context rows is measured to cost."""
        return 0.0 if self._online is None else self._online.context_ms_per_row * rows

    def observe_step(
        self,
        requests: int,
        drafted: int,
        target: int,
        period_ms: float,
        prefill: int = 0,
        context_rows: int = 0,
        context_ms: float = 0.0,
    ) -> None:
        """A served step (see `OnlineCostModel.observe`). Profiling steps are not fed: the profile is fitted on
        them. Without `config.online_cost` the profile alone prices steps."""
        if self.advantage is not None:
            self.advantage.ran(period_ms, prefill)
        if self._gated():
            self.gate.ran(period_ms)
        online = self._online
        if online is not None and self.profiling is None and self.config.online_cost:
            online.observe(requests, drafted, target, period_ms, prefill, context_rows, context_ms)
            if online.seen % 1024 == 0:
                logger.info(
                    "step cost online: %+.1f ms on the profiled intercept, %+.1f ms on the drafter launch",
                    online.offset_ms,
                    online.launch_offset_ms,
                )

    def observe(self, req_ids: list[str], verified: np.ndarray, accepted: np.ndarray) -> None:
        """The scheduler verified `verified[i]` of request i's last drafts and `accepted[i]` were accepted."""
        self.stats.add_positions("verified_per_pos", verified)
        self.stats.add_positions("accepted_per_pos", accepted)
        self.stats.verify_steps += int((verified > 0).sum())
        if self.advantage is not None:
            self.advantage.emitted(len(req_ids) + int(np.sum(accepted)))
        if self._gated():
            self.gate.emitted(len(req_ids) + int(np.sum(accepted)))
        if self.gain is not None and self.profiling is None and self._draft.any():
            self._observe_gain(req_ids, verified, accepted)
        if self.probes is not None and self._ever_drafts:
            self._probes_due = self.probes.observe(req_ids, verified, accepted)
        verdicts = self.tracker.verdicts(req_ids, verified, accepted)
        if verdicts is None:
            return
        rows = verdicts.rows
        if self.recalibrator is not None:
            # Against the estimator's own predictions for these rows, before it learns from them.
            raw = hazards_from_survival(self.estimator.predict(rows.inputs))
            self.recalibrator.update(raw, rows.drafted, rows.accepted)
        self.estimator.update(rows.inputs, rows.drafted, rows.accepted)
        self.calibrator.update(rows.confidence, verdicts.prior, rows.drafted, rows.accepted)
        if self.recorded is not None:
            self.recorded.append(rows)

    def _observe_gain(self, req_ids: list[str], verified: np.ndarray, accepted: np.ndarray) -> None:
        """The last plan's drafted slots against what became of them (`RealisedGain`)."""
        if len(self._survival) != len(self._req_ids):
            return
        if req_ids == self._req_ids:  # the batch planned last step, as it was (most steps)
            last = now = np.flatnonzero(self._draft > 0)
        else:
            where = {r: n for n, r in enumerate(req_ids)}
            rows = [(m, where[r]) for m, r in enumerate(self._req_ids) if self._draft[m] > 0 and r in where]
            last, now = (np.array(x, dtype=np.int64) for x in zip(*rows)) if rows else (np.zeros(0, np.int64),) * 2
        if len(last):
            self.gain.update(self._survival[last], self._draft[last], accepted[now], verified[now])

    def plan(
        self,
        req_ids: list[str],
        features: np.ndarray | None,
        max_width: np.ndarray,
        share: Callable[[Any], Any] | None = None,
        generated: np.ndarray | None = None,
        context_rows: int = 0,
    ) -> np.ndarray:
        """Draft widths d_i <= max_width_i (0 for requests that cannot use a draft now).

        `generated` (B,): each request's output tokens so far, which the TPOT pace needs (`pace_tpot_ms`).
        `context_rows`: deferred drafter context a drafting step would store first. A probe round pays for it
        in full. A plan pays for it spread over `replan_max` steps (`switch_ms`): returning to drafting after a
        hold is one store for the drafting steps that follow, not for one step. Priced in full into plans, it made
        an engine that held for a while ever less willing to draft again (at one request, a launch priced at
        10 ms of a 3.5 ms step kept it holding where drafting paid 1.25x); left out, an engine at 64 requests
        returned to drafting for a plan 5-10% ahead and stored 60-80 ms of context for it, 6-8 steps' worth
        (wcs 0.86-0.89 of `ar` where it drafted such plans, 0.94-0.95 where it only probed).

        `features` may be None only when `needs_drafter()` is False or `holds_no_drafts()` is True.
        `share` makes every tensor-parallel rank take the first rank's decision (`replicas.wcs.sharing`);
        ranks hold the same steps, since they hold on the shared decision.
        """
        self._plan = None
        self._inputs = None
        self._req_ids = req_ids
        self._round_verify_ms = None
        slack = self.slack_ms(req_ids, generated) if self.limits.pace_tpot_ms and generated is not None else None
        if features is None:
            if self.needs_drafter():
                if not (self._may_hold() or self._gate_holds()):  # (a probe that fell due since the runner decided to hold waits a step)
                    raise ValueError("plan needs features unless the policy never drafts or a plan without drafts holds")
                self._held += 1
                self.stats.held_steps += 1
            draft = np.zeros(len(req_ids), dtype=np.int64)
        else:
            self._inputs = self.tracker.pre_draft(req_ids, features)
            survival = self.estimator.predict(self._inputs)
            if self.recalibrator is not None:
                survival = self.recalibrator.apply(survival)
            self._survival = survival
            if self.gain is not None:
                survival = self.gain.apply(survival)
            probes = None
            if self.profiling is not None:
                # Some profiled steps draft nothing: the drafter's launch cost is then visible. In the others a
                # random share of the batch drafts, so that D varies at every R and the launch's part per
                # request is told apart from the drafted tokens' cost (with every request drafting, D ~ R K / 2).
                rng, width = self.profiling, np.asarray(max_width)
                drafts = rng.random(len(width)) < rng.random()
                draft = rng.integers(0, width + 1) * drafts * (rng.random() >= self.profiling_skip)
            else:
                # Estimator curves are products of hazards: monotone by construction, no need to check.
                cost = self.cost_model
                margin = self.margin(len(req_ids))
                switch = self.switch_ms(context_rows)
                if switch > 0.01:  # (a copy rebuilds the planner's tables: not for a store of a few rows)
                    cost = cost.model_copy(update={"draft_launch_ms": cost.draft_launch_ms + switch})
                else:
                    switch = 0.0

                def plan(probes: np.ndarray | None, widths: np.ndarray = max_width) -> DraftPlan:
                    return self.policy.plan(
                        survival, cost, self.limits, widths, validate=False, slack_ms=slack, probes=probes, margin=margin
                    )

                # Probes ride on a plan that drafts anyway, or wait for a probe round (scheduling/exploration.py),
                # which drafts the probes and nothing else: drafts added around them because the launch is paid
                # anyway were near break-even and mostly cut after drafting (half the drafts at 128 requests).
                self._plan = plan(None)
                if self.probes is not None:
                    due = np.minimum(self.probes.due(req_ids), max_width)
                    if due.any():
                        alone = not self._plan.draft.any()
                        with_probes = plan(due, due if alone else max_width)
                        # A round pays the store in full; its plan's step time holds the switch share of it already.
                        extra = max(with_probes.step_ms - self._plan.step_ms - alone * switch, 0.0)
                        extra += alone * self.context_ms(context_rows)
                        if alone:
                            self.probes.round_ms = extra
                        if not alone or self.probes.affordable(extra):
                            if alone:
                                self.probes.probed(extra)
                                r = len(req_ids)
                                self._round_verify_ms = cost.step_ms(r, 0, r + int(due.sum())) - cost.step_ms(r, 0, r)
                            probes, self._plan = due, with_probes
                            self.stats.probes += int(due.sum())
                draft = self._plan.draft
            if share is not None:
                # The probes too: whether a plan chose to draft nothing (and so whether the next steps hold) counts
                # the forced probes out, and each rank forces its own (its timings price the rounds). A rank that took
                # rank 0's plan but judged it by its own probes could be told to hold where its own count did not
                # allow it, and its plan() then refused every held step.
                self._plan, draft, probes = share((self._plan, draft, probes))
            # Only a plan that chose to draft nothing holds, not one where no request could draft (prefill).
            # Drafting only the forced probes is still a choice to draft nothing: the hold goes on doubling.
            chosen = draft if probes is None else np.asarray(draft) > probes
            nothing = not np.any(chosen) and bool(np.any(max_width))
            if self.probes is not None and self.profiling is None and self._round_verify_ms is None and np.any(max_width):
                self.probes.planned(bool(np.any(chosen)))
            self._hold = min(2 * self._hold, self.config.replan_max) if nothing and self._drafted_nothing else self.config.replan_every
            self._held, self._drafted_nothing = 0, nothing
        self._draft = np.asarray(draft, dtype=np.int64)
        if self.advantage is not None:
            self._count_advantage(len(req_ids), features is None or probes is None)
        if self.probes is not None:
            self.probes.earn(self.cost_model.step_ms(len(req_ids), 0, len(req_ids)))
        if self._gated() and self.gate.planned(len(req_ids)) and share is not None:
            self.gate.mode = share(self.gate.mode)
        self.stats.steps += 1
        self.stats.planned_requests += len(req_ids)
        self.stats.add_positions("drafted_per_pos", self._draft)
        return self._draft

    def _count_advantage(self, requests: int, counted: bool) -> None:
        """This step for `RealisedAdvantage`: a plan that drafts, or a step drafting nothing (held or planned so);
        not probe rounds or plans carrying probes, profiling steps, or steps no request could draft in."""
        kind = None
        if counted and self.profiling is None:
            if self._draft.any():
                if self._plan is not None and self._plan.draft.any():
                    kind, predicted = DRAFT, self._plan.tokens_per_ms
            elif self.needs_drafter():
                kind, predicted = PLAIN, requests / max(self.cost_model.step_ms(requests, 0, requests), 1e-6)
        self.advantage.planned(kind, requests, predicted if kind is not None else 0.0)

    @property
    def last_plan(self) -> DraftPlan | None:
        """This step's plan (None when it held, or no policy plan was made): the step log keeps its prediction."""
        return self._plan

    def drafted(self, draft_ms: float) -> None:
        """This step's drafter time as measured (the deferred context store included): a probe round is paid at
        that plus its predicted verification (`ProbeSchedule.settle`). Only while the online correction keeps
        predictions in measured milliseconds: rounds are priced, and credit earned, in predicted ones (a
        synthetic cost model, as tests set, would otherwise price rounds out of reach for good)."""
        verify_ms, self._round_verify_ms = self._round_verify_ms, None
        if verify_ms is not None and self.probes is not None and self.config.online_cost and self._online is not None:
            self.probes.settle(draft_ms + verify_ms)

    def slack_ms(self, req_ids: list[str], generated: np.ndarray, now: float | None = None) -> np.ndarray:
        """How far ahead of `pace_tpot_ms` per token each request is (negative: behind), counted from the
        first step it was planned in with a token out (about its first token, where TPOT starts) to `now`;
        infinite (never binding) while it has none."""
        now = time.perf_counter() if now is None else now
        pace, since = self.limits.pace_tpot_ms or 0.0, self._paced_from
        slack = np.full(len(req_ids), np.inf)
        for n, (r, g) in enumerate(zip(req_ids, generated.tolist())):
            if g > 0:
                t0, g0 = since.setdefault(r, (now, g))
                slack[n] = pace * (g - g0) - (now - t0) * 1e3
        return slack

    def holds_no_drafts(self) -> bool:
        """True when this step keeps the last plan's decision to draft nothing without planning (see the
        module docstring), or the mode gate serves this block holding; never while profiling."""
        return self._gate_holds() or (self._may_hold() and not self._probes_due)

    def _gated(self) -> bool:
        """The mode gate runs: a policy that chooses whether to draft, served (not profiled), while the online
        correction keeps the plans in measured milliseconds (as `margin` says: a synthetic cost model, as tests set
        to make drafting pay, is taken as it is)."""
        return self.gate is not None and self._chooses and self.profiling is None and self.config.online_cost

    def _gate_holds(self) -> bool:
        return self._gated() and self.gate.holding

    def _may_hold(self) -> bool:
        return self._drafted_nothing and self.profiling is None and self._held + 1 < self._hold

    def needs_drafter(self) -> bool:
        """False when no request ever drafts under this policy (`ar`): the drafter need not run at all,
        not even to store context K/V for later drafts."""
        return self.profiling is not None or self._ever_drafts

    def verify(self, confidence: np.ndarray) -> np.ndarray:
        """Verify lengths v_i <= d_i from the drafter's per-position max probabilities (B, K).

        The confidences are the draft distribution's maxima, computed without
        the drafted token itself, so admission in sorted order with an early
        stop is a stopping rule (DESIGN.md, Losslessness).
        """
        draft = self._draft
        if self._inputs is None or not draft.any():
            return np.zeros_like(draft)
        prior = hazards_from_survival(self._survival)
        self.tracker.drafted(self._req_ids, self._inputs, prior, confidence, draft)
        if self.profiling is not None:
            return self.profiling.integers(0, draft + 1)
        if self._plan is None:
            return np.zeros_like(draft)
        post = self.calibrator.survival(confidence, prior, draft)
        return self.policy.verify(post, self._plan, self.cost_model, self.limits)

    def predicted_accept_len(self) -> float:
        """Mean predicted accepted length (1 + expected accepted drafts at full width) over the last
        planned batch; 1 when nothing was predicted (no drafter, or an idle engine) or nothing is drafted (`ar`:
        the survival left from the profiling steps is not this engine's)."""
        if not len(self._survival) or not self.needs_drafter():
            return 1.0
        return float(1.0 + self._survival.sum(axis=1).mean())

    def finish(self, req_ids) -> None:
        self.tracker.forget(req_ids)
        if self.probes is not None:
            self.probes.forget(req_ids)
        for r in req_ids:
            self._paced_from.pop(r, None)
