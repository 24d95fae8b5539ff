"""The `vllm-adaptive` baseline: vLLM 0.32's adaptive verification, run on vLLM's own code.

vLLM drafts every request's full block and then picks how many drafts to verify
(`vllm/v1/worker/gpu/spec_decode/adaptive_verification.py`):

- the budget: `AdaptiveVerificationManager.get_num_tokens`, the global argmax over k of
  (sampling requests + top-k survivals) / (draft_ms[requests] + verify_ms[tokens + k]), no early stop, with
  survivals the cumulative products of *stale* confidences (each request's previous draft round's; 1.0 for a
  request that has not drafted before);
- the allocation: `_assign_draft_token_budget`, the top `budget` slots by the current round's survivals;
- the costs: tables from `build_cost_tables_from_curves` over a draft curve keyed by the number of requests
  (every request drafting its full block) and a verify curve keyed by target tokens, here read off the
  profile the engine is charged with.

The simulator calls those three functions themselves: the manager is built without a GPU (only the fields
`get_num_tokens` reads are set), so no part of the rule is re-implemented here.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import torch

from replicas.wcs.config import WCSConfig
from replicas.wcs.controller import StepController
from scheduling.cost_model import StepCostModel


def _vllm():
    from vllm.v1.worker.gpu.spec_decode import adaptive_verification

    return adaptive_verification


def capture_sizes(max_size: int = 512) -> list[int]:
    """vLLM's default CUDA graph capture sizes: steps at or below the largest are padded up to the next one."""
    sizes = [1, 2, 4, *range(8, 256, 8), *range(256, max_size + 1, 16)]
    return [s for s in sizes if s <= max_size]


def cost_curves(cost: StepCostModel, k: int, max_num_seqs: int, max_tokens: int) -> tuple[list, list]:
    """vLLM's profiled curves, read off `cost` at the sizes vLLM profiles (`batches_to_profile`: the capture
    sizes, then 1.5x and doublings of the largest up to the token budget): drafter ms per request count (full
    blocks), target forward ms per token count (a decode batch of N / (1 + K) requests verifying full blocks)."""
    sizes = capture_sizes(min(512, max_tokens))
    tail, size = {min(sizes[-1] + sizes[-1] // 2, max_tokens)}, sizes[-1]
    while size < max_tokens:
        size = min(size * 2, max_tokens)
        tail.add(size)
    tokens = sorted(set(sizes) | tail)
    draft = [(r, cost.launch_ms(r) + float(cost.drafted(r * k))) for r in tokens if r <= max_num_seqs]
    verify = [(n, cost.step_ms(max(1, -(-n // (1 + k))), 0, n)) for n in tokens]
    return draft, verify


class AdaptiveRule:
    """vLLM's budget and allocation for one engine, over its own request slots."""

    def __init__(self, cost: StepCostModel, k: int, max_num_seqs: int, max_tokens: int) -> None:
        av = _vllm()
        self.k = k
        manager = object.__new__(av.AdaptiveVerificationManager)
        manager.num_speculative_steps = k
        manager.num_bonus_tokens = 1
        manager._max_total_logits = max_tokens
        manager._stale_idx = 0
        manager.cost_tables = av.build_cost_tables_from_curves(
            *cost_curves(cost, k, max_num_seqs, max_tokens), max_num_seqs, max_tokens, capture_sizes(min(512, max_tokens))[-1]
        )
        self.manager = manager

    def budget(self, stale: np.ndarray, drafts: np.ndarray, sampling: np.ndarray) -> int:
        """`get_num_tokens` for a batch: `stale` (B, K) confidences of each request's previous round,
        `drafts` (B,) scheduled drafts, `sampling` (B,) whether each request samples this step. Returns the
        draft budget (the tokens it returns, less the non-draft ones)."""
        b = len(drafts)
        ids = [f"s{i}" for i in range(b)]
        self.manager._stale_confidences = [SimpleNamespace(np=np.asarray(stale, dtype=np.float32))]
        self.manager.req_states = SimpleNamespace(
            req_id_to_index={r: i for i, r in enumerate(ids)},
            num_computed_tokens_np=np.zeros(b, dtype=np.int64),  # each schedules one non-draft token: sampling
            prefill_len=SimpleNamespace(np=np.where(sampling, 1, 2).astype(np.int64)),  # ... when it reaches this
        )
        per_req = {r: 1 + int(d) for r, d in zip(ids, drafts)}
        tokens = self.manager.get_num_tokens(per_req, {r: [0] * int(d) for r, d in zip(ids, drafts)})
        return tokens - b

    def allocate(self, confidence: np.ndarray, drafts: np.ndarray, budget: int) -> np.ndarray:
        """`_assign_draft_token_budget`: verified drafts per request from the current round's confidences."""
        capacities = torch.as_tensor(np.asarray(drafts), dtype=torch.int64).clone()
        if budget <= 0:
            return np.zeros(len(drafts), dtype=np.int64)
        if budget < int(capacities.sum()):
            probs = torch.as_tensor(np.asarray(confidence), dtype=torch.float32)
            _vllm()._assign_draft_token_budget(probs, torch.arange(len(drafts)), capacities, budget, self.k)
        return capacities.numpy().astype(np.int64)


class VLLMAdaptiveController(StepController):
    """The `dspark` policy's drafting (every request's full block) with vLLM's verification rule in place of
    WCS's post-draft allocator; its cost tables come from the start-up profile only (no online correction)."""

    def __init__(self, k: int, estimator, calibrator, cost: StepCostModel, max_num_seqs: int, token_budget: int,
                 seed: int = 0) -> None:
        super().__init__(WCSConfig(policy="dspark", online_cost=False, seed=seed), k, estimator, calibrator, cost=cost,
                         token_budget=token_budget)
        self.rule = AdaptiveRule(cost, k, max_num_seqs, token_budget)
        self._stale: dict[str, np.ndarray] = {}

    def verify(self, confidence: np.ndarray) -> np.ndarray:
        draft = self._draft
        if not draft.any():
            return np.zeros_like(draft)
        ones = np.ones(self.k, dtype=np.float32)
        stale = np.stack([self._stale.get(r, ones) for r in self._req_ids])
        budget = self.rule.budget(stale, draft, draft > 0)
        for r, c in zip(self._req_ids, np.asarray(confidence, dtype=np.float32)):
            self._stale[r] = c
        return self.rule.allocate(confidence, draft, budget)

    def finish(self, req_ids) -> None:
        super().finish(req_ids)
        for r in req_ids:
            self._stale.pop(r, None)
