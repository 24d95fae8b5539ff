"""The V1 model runner with WCS: ragged draft widths before drafting, ragged verify lengths after.

`install` turns a live runner (CPU or GPU V1) into a subclass of its own
class with `WCSRunnerMixin` first, and its DFlash drafter into
`RaggedDFlashProposer`; neither adds constructor state, so swapping
`__class__` after the runner is built is safe. Each step:

1. `_sample`: the target's output distribution stats per sampled row (before
   the samplers edit the logits in place);
2. `propose_draft_token_ids`: verdicts of the last drafts -> controller;
   pre-draft features at each request's newest token -> widths d_i (shared
   from the first TP rank) -> ragged drafting -> verify lengths v_i; drafts
   past v_i become -1. When every d_i is 0 the drafter does not run: the
   step's context tokens wait for the next step that drafts;
3. `take_draft_token_ids`: the -1 tail is cut, so the scheduler schedules
   exactly 1 + v_i tokens for request i next step.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import torch
from vllm.logger import init_logger
from vllm.v1.outputs import DraftTokenIds
from vllm.v1.spec_decode.dflash import DFlashProposer

from replicas.wcs.controller import StepController
from replicas.wcs.features import FeatureExtractor, distribution_stats
from replicas.wcs.proposer import RaggedDFlashProposer
from replicas.wcs.sharing import failure_ends_other_ranks, share_from_first_rank

logger = init_logger(__name__)


@dataclass(slots=True)
class StepSample:
    """One runner step, for profiling the cost model and for the step log."""

    start: float  # perf_counter at execute_model
    requests: int  # R
    target_tokens: int  # N: tokens the target ran (R + verified drafts when no prefill)
    verified_tokens: int  # drafts verified this step
    drafted_tokens: int  # D: sum of d_i drafted this step
    drafter_rows: int  # query rows the drafter's forward pass ran (0 when it only stored context K/V)
    prefill: bool  # some request was prefilling: not a decode step
    runner_ms: float
    draft_ms: float
    planner_ms: float
    planned: tuple[str, ...]  # requests planned this step
    context_rows: int = 0  # deferred drafter context rows stored before drafting
    context_ms: float = 0.0  # ... and the time that took
    predicted_ms: float = 0.0  # the plan's predicted step time (0: no plan was made this step)
    expected_tokens: float = 0.0  # ... and the tokens it expected (requests + expected accepted drafts)
    accepted_tokens: int = 0  # drafts accepted this step (of the verified_tokens)


class _ProposeArgs(NamedTuple):
    """The arguments of vLLM 0.32's `GPUModelRunner.propose_draft_token_ids`, in order."""

    scheduler_output: Any
    sampled_token_ids: Any
    sampling_metadata: Any
    hidden_states: Any
    sample_hidden_states: Any
    aux_hidden_states: Any
    spec_decode_metadata: Any
    common_attn_metadata: Any
    slot_mappings: Any


class WCSRunnerMixin:
    wcs: StepController
    wcs_features: FeatureExtractor
    wcs_log: list[StepSample] | None = None  # set to a list to keep every step
    _wcs_logits: torch.Tensor | None = None  # the target's logits as sampling got them
    _wcs_step: StepSample | None = None
    _wcs_last: StepSample | None = None  # the last finished step that planned requests
    _wcs_fresh: bool = False
    _wcs_holding: bool = False  # this step keeps the last plan's "no drafts" (decided before sampling)

    @failure_ends_other_ranks
    def execute_model(self, scheduler_output, *args, **kwargs):
        counts = scheduler_output.num_scheduled_tokens
        spec = scheduler_output.scheduled_spec_decode_tokens
        start = time.perf_counter()
        self._wcs_time_last_step(start, counts)
        self._wcs_step = StepSample(
            start=start,
            requests=len(counts),
            target_tokens=scheduler_output.total_num_scheduled_tokens,
            verified_tokens=sum(len(t) for t in spec.values()),
            drafted_tokens=0,
            drafter_rows=0,
            prefill=any(n != 1 + len(spec.get(r, ())) for r, n in counts.items()),
            runner_ms=0.0,
            draft_ms=0.0,
            planner_ms=0.0,
            planned=(),
        )
        gone = set(scheduler_output.finished_req_ids) | set(scheduler_output.preempted_req_ids or ())
        self.wcs.finish(gone)
        if isinstance(self.drafter, RaggedDFlashProposer):
            self.drafter.drop_context(gone)
        out = super().execute_model(scheduler_output, *args, **kwargs)
        self._wcs_step.runner_ms += (time.perf_counter() - self._wcs_step.start) * 1e3
        return out

    @failure_ends_other_ranks
    def sample_tokens(self, grammar_output):
        self._wcs_fresh = False
        t0 = time.perf_counter()
        out = super().sample_tokens(grammar_output)
        step = self._wcs_step
        if step is not None and step.requests:
            step.runner_ms += (time.perf_counter() - t0) * 1e3
            stats = self.wcs.stats
            stats.step_ms += step.runner_ms
            stats.draft_ms += step.draft_ms
            stats.planner_ms += step.planner_ms
            stats.target_ms += step.runner_ms - step.draft_ms - step.planner_ms
            if self.wcs_log is not None:
                self.wcs_log.append(step)
            self._wcs_last = step if step.planned else None
        self._wcs_step = None
        return out

    def _wcs_time_last_step(self, now: float, scheduled: dict) -> None:
        """Hand the controller the last step's period when this step follows it directly (some of its
        requests run on), so that the period is all engine work and no idling."""
        last, self._wcs_last = self._wcs_last, None
        if last is not None and not scheduled.keys().isdisjoint(last.planned):
            planned = last.requests + last.verified_tokens
            period_ms = (now - last.start) * 1e3
            self.wcs.observe_step(
                last.requests,
                last.drafted_tokens,
                planned,
                period_ms,
                last.target_tokens - planned,
                last.context_rows,
                last.context_ms,
            )

    def _sample(self, logits, spec_decode_metadata):
        # The features need one row per request (its newest token), known only after sampling, which may
        # scale logits in place: keep a copy and summarise just those rows (a fraction of R + verified).
        # Decided once for the step: `observe` (in propose) may make a probe due, which counts from the next step.
        # Rank 0 decides for all: whether a probe round is affordable rests on each rank's own step timings, and a
        # rank that planned (broadcasting its plan) while another held (running the next step's collectives) hung both.
        holding = self.wcs.holds_no_drafts()
        self._wcs_holding = share_from_first_rank(holding) if self.wcs.needs_drafter() else holding
        plans = self.wcs.needs_drafter() and not self._wcs_holding
        self._wcs_logits = logits.clone() if logits is not None and plans else None
        return super()._sample(logits, spec_decode_metadata)

    def propose_draft_token_ids(self, *args):
        a = _ProposeArgs(*args)
        scheduler_output, sampled_token_ids, spec_decode_metadata = a.scheduler_output, a.sampled_token_ids, a.spec_decode_metadata
        sample_hidden_states = a.sample_hidden_states
        t0 = time.perf_counter()
        ctl = self.wcs
        req_ids = list(self.input_batch.req_ids)
        batch = len(req_ids)
        k = ctl.k
        sampled = sampled_token_ids if torch.is_tensor(sampled_token_ids) else None
        if sampled is None:
            raise RuntimeError("WCS needs the padded drafter batch (sampled token ids as a tensor)")
        verified = (
            np.asarray(spec_decode_metadata.num_draft_tokens, dtype=np.int64)
            if spec_decode_metadata is not None
            else np.zeros(batch, dtype=np.int64)
        )
        emitted = (sampled[:batch] != -1).sum(dim=1).cpu().numpy().astype(np.int64)
        accepted = np.clip(emitted - 1, 0, verified)
        ctl.observe(req_ids, verified, accepted)
        if self._wcs_step is not None:
            self._wcs_step.accepted_tokens = int(accepted.sum())

        states = [self.requests[r] for r in req_ids]
        generated = np.array([len(s.output_token_ids) for s in states]) + emitted
        max_width = self._wcs_max_width(states, generated, emitted, batch, k)
        if not ctl.needs_drafter():
            # No request ever drafts under this policy (`ar`): no features, no drafter, no context K/V.
            ctl.plan(req_ids, None, max_width, generated=generated)
            return self._wcs_no_drafts(req_ids, (time.perf_counter() - t0) * 1e3, 0.0, sample_hidden_states.device)
        if self._wcs_holding:
            draft = ctl.plan(req_ids, None, max_width, share=share_from_first_rank, generated=generated)
        else:
            # Pre-draft features at each request's newest token: row offset + accepted of its sampled rows.
            offsets = np.concatenate([[0], np.cumsum(verified + 1)[:-1]])
            rows = torch.from_numpy(offsets + accepted)
            logits, self._wcs_logits = self._wcs_logits, None
            features = self.wcs_features(sample_hidden_states[rows], distribution_stats(logits[rows]), generated)
            draft = ctl.plan(
                req_ids, features, max_width, share=share_from_first_rank, generated=generated,
                context_rows=self.drafter.pending_rows,
            )
        planner_ms = (time.perf_counter() - t0) * 1e3
        plan = ctl.last_plan
        if plan is not None and self._wcs_step is not None:
            self._wcs_step.predicted_ms, self._wcs_step.expected_tokens = float(plan.step_ms), float(plan.expected_tokens)
        drafter = self.drafter
        if not draft.any():
            t1 = time.perf_counter()
            self._wcs_defer_context(scheduler_output, a.hidden_states, a.aux_hidden_states, a.common_attn_metadata)
            return self._wcs_no_drafts(req_ids, planner_ms, (time.perf_counter() - t1) * 1e3, sample_hidden_states.device)
        t1 = time.perf_counter()
        rows = drafter.pending_rows
        if rows:
            _sync(self.device)
        drafter.flush_context()
        if rows and self._wcs_step is not None:
            _sync(self.device)  # the store is timed apart: the cost model prices it per row
            self._wcs_step.context_rows = rows
            self._wcs_step.context_ms = (time.perf_counter() - t1) * 1e3
        drafter.widths = torch.from_numpy(draft)
        drafter.forward_rows = 0
        try:
            out = super().propose_draft_token_ids(*args)
        finally:
            drafter.widths = None
        draft_ms = (time.perf_counter() - t1) * 1e3
        ctl.drafted(draft_ms)
        if drafter.forward_rows:
            ctl.stats.drafter_passes += 1
            ctl.stats.drafter_rows += drafter.forward_rows
            if self._wcs_step is not None:
                self._wcs_step.drafter_rows = drafter.forward_rows
        t2 = time.perf_counter()
        verify = ctl.verify(drafter.confidence.numpy())
        out[torch.arange(out.shape[1], device=out.device)[None, :] >= torch.from_numpy(verify).to(out.device)[:, None]] = -1
        planner_ms += (time.perf_counter() - t2) * 1e3
        self._wcs_record(planner_ms, draft_ms, int(draft.sum()), req_ids)
        self._wcs_fresh = True
        return out

    def _wcs_no_drafts(self, req_ids: list[str], planner_ms: float, draft_ms: float, device) -> torch.Tensor:
        self._wcs_record(planner_ms, draft_ms, 0, req_ids)
        self._wcs_fresh = True
        return torch.empty(len(req_ids), 0, dtype=torch.int64, device=device)

    def _wcs_defer_context(self, scheduler_output, hidden_states, aux_hidden_states, cad) -> None:
        """Hand this step's target hidden states, positions and slots to the drafter for a later flush (it keeps
        the step's first `total_num_scheduled_tokens` rows of each)."""
        self.drafter.defer_context(
            list(self.input_batch.req_ids),
            cad.query_start_loc_cpu.numpy(),
            aux_hidden_states if self.use_aux_hidden_state_outputs else hidden_states,
            self._get_positions(scheduler_output.total_num_scheduled_tokens),
            cad.slot_mapping,
        )

    def _wcs_max_width(self, states, generated: np.ndarray, emitted: np.ndarray, batch: int, k: int) -> np.ndarray:
        """Widest useful draft per request: 0 while prefilling or without drafter context, never past
        max_tokens or the context."""
        max_tokens = np.array([s.sampling_params.max_tokens or 0 for s in states], dtype=np.int64)
        context = np.array([s.num_tokens for s in states], dtype=np.int64) + emitted
        room = np.minimum(max_tokens - generated, self.max_model_len - context) - 1
        width = np.clip(room, 0, k)
        width[self.discard_request_mask.np[:batch].astype(bool)] = 0
        lost = self.drafter.context_lost
        if lost:
            width[[n for n, r in enumerate(self.input_batch.req_ids[:batch]) if r in lost]] = 0
        return width

    def _wcs_record(self, planner_ms: float, draft_ms: float, drafted: int, req_ids: list[str]) -> None:
        step = self._wcs_step
        if step is not None:
            step.planner_ms += planner_ms
            step.draft_ms += draft_ms
            step.drafted_tokens = drafted
            step.planned = tuple(req_ids)

    def take_draft_token_ids(self) -> DraftTokenIds | None:
        if not self._wcs_fresh:
            # The drafter did not run through WCS this step (e.g. the input did not fit it): no drafts.
            ids = super().take_draft_token_ids()
            return None if ids is None else DraftTokenIds(ids.req_ids, [[] for _ in ids.req_ids])
        ids = super().take_draft_token_ids()
        if ids is None:
            return None
        return DraftTokenIds(ids.req_ids, [_strip(x) for x in ids.draft_token_ids])


def _sync(device) -> None:
    if getattr(device, "type", None) == "cuda":
        torch.cuda.synchronize(device)


def _strip(tokens: list[int]) -> list[int]:
    for n, t in enumerate(tokens):
        if t < 0:
            return tokens[:n]
    return tokens


_RUNNER_CLASSES: dict[type, type] = {}


def install(runner, controller: StepController) -> None:
    """Turn a built V1 runner (before `load_model`) into a WCS runner with a ragged DFlash drafter."""
    drafter = getattr(runner, "drafter", None)
    if not isinstance(drafter, DFlashProposer):
        raise ValueError("WCS needs a DFlash drafter (speculative_config.method = 'dflash')")
    if runner.speculative_config.disable_padded_drafter_batch:
        raise ValueError("WCS needs the padded drafter batch (disable_padded_drafter_batch = False)")
    cls = type(runner)
    if cls not in _RUNNER_CLASSES:
        _RUNNER_CLASSES[cls] = type(f"WCS{cls.__name__}", (WCSRunnerMixin, cls), {})
    runner.__class__ = _RUNNER_CLASSES[cls]
    drafter.__class__ = RaggedDFlashProposer
    runner.wcs = controller
    runner.wcs_features = FeatureExtractor(runner.model_config.get_hidden_size(), controller.config.seed)
    logger.info("ForeSpark WCS installed: policy=%s, K=%d", controller.policy.name, controller.k)
