"""A small-vocabulary world where the target's exact output distribution is known.

Target and drafter are Markov chains over V tokens. Each trial runs one
speculative step for a batch of requests (one per context token) under a
policy, then continues with plain target sampling until every request has
`horizon` tokens. The empirical joint distribution of those tokens is compared
with the exact one by a chi-square test (DESIGN.md section 6).

The drafter here is Markov-conditioned (draft token j depends on token j-1),
so the post-draft confidence max_v q(v | x_{j-1}) of position j depends on the
earlier draft tokens: the hard case for losslessness.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from scipy import stats

from scheduling.cost_model import StepCostModel
from scheduling.policies import Policy, StepLimits
from scheduling.slots import rank_slots
from scheduling.survival import survival_from_hazards
from scheduling.verifier import accepted_length, speculative_verify

TARGET = np.array([[0.60, 0.30, 0.10], [0.20, 0.50, 0.30], [0.25, 0.25, 0.50]])
DRAFT = np.array([[0.80, 0.10, 0.10], [0.34, 0.33, 0.33], [0.10, 0.20, 0.70]])
K = 3
HORIZON = 3
COST = StepCostModel.linear(intercept_ms=1.0, per_request_ms=0.05, per_draft_ms=0.05, per_target_ms=0.25)
LIMITS = StepLimits(token_budget=3 + 5)  # 3 requests, 5 of the 9 possible verify slots


@dataclass
class StepDraft:
    """One step's drafts for B requests, drawn at full width (a policy may use a prefix)."""

    contexts: np.ndarray  # (B,)
    tokens: np.ndarray  # (B, K)
    draft_probs: np.ndarray  # (B, K, V): distribution each draft token was drawn from
    target_probs: np.ndarray  # (B, K+1, V): target's distribution after each draft prefix
    uniforms: np.ndarray  # (B, K) acceptance-test uniforms, drawn up front so the oracle can replay them

    def accepted(self, width: int | None = None) -> np.ndarray:
        w = K if width is None else width
        return np.array(
            [
                accepted_length(self.tokens[i, :w], self.draft_probs[i, :w], self.target_probs[i, : w + 1], self.uniforms[i])
                for i in range(len(self.contexts))
            ]
        )

    def max_prob_confidence(self) -> np.ndarray:
        """max_v q_j(v): built from tokens before j only (allowed)."""
        return self.draft_probs.max(axis=2)

    def own_token_confidence(self) -> np.ndarray:
        """q_j(x_j): the judged token's own draft probability (forbidden; the negative control)."""
        b = np.arange(len(self.contexts))[:, None]
        return self.draft_probs[b, np.arange(K)[None, :], self.tokens]


def draw_step(contexts: np.ndarray, rng: np.random.Generator) -> StepDraft:
    b = len(contexts)
    tokens = np.empty((b, K), dtype=np.int64)
    dprobs = np.empty((b, K, TARGET.shape[0]))
    tprobs = np.empty((b, K + 1, TARGET.shape[0]))
    prev = contexts.copy()
    for j in range(K):
        dprobs[:, j] = DRAFT[prev]
        tprobs[:, j] = TARGET[prev]
        u = rng.random(b)[:, None]
        tokens[:, j] = (u > np.cumsum(dprobs[:, j], axis=1)).sum(axis=1)
        prev = tokens[:, j]
    tprobs[:, K] = TARGET[prev]
    return StepDraft(contexts, tokens, dprobs, tprobs, rng.random((b, K)))


# A decision rule: (step, rng) -> (draft widths, verify lengths). It may look at anything in
# `step`; the losslessness test finds out whether what it looked at was allowed.
Decide = Callable[[StepDraft, np.random.Generator], tuple[np.ndarray, np.ndarray]]


def policy_rule(policy: Policy) -> Decide:
    """A scheduling policy as the engine runs it: pre-draft plan, then post-draft verify distribution."""

    def decide(step: StepDraft, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        b = len(step.contexts)
        # Pre-draft estimates: never look at draft tokens (random here, as a stand-in for an estimator).
        pre = survival_from_hazards(rng.uniform(0.3, 0.95, (b, K)))
        oracle = step.accepted() if policy.name == "oracle" else None
        plan = policy.plan(pre, COST, LIMITS, np.full(b, K), oracle)
        post = survival_from_hazards(step.max_prob_confidence())
        return plan.draft, policy.verify(post, plan, COST, LIMITS)

    return decide


def retrospective_argmax_rule(step: StepDraft, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """The planted lossy allocator: full-width drafts, confidences from the judged token itself,
    and the best prefix of the sort chosen after looking at every slot."""
    b = len(step.contexts)
    drafted = np.full(b, K)
    survival = survival_from_hazards(step.own_token_confidence())
    ranking = rank_slots(
        survival, COST, lo=None, hi=None, drafted_tokens=int(drafted.sum()), token_budget=LIMITS.token_budget, time_cap_ms=None,
    )
    best = int(np.argmax(ranking.scaled_ratio(ranking.feasible_upto)))
    return drafted, ranking.widths(best)


def run_trials(decide: Decide, trials: int, seed: int) -> np.ndarray:
    """Counts (B, V**HORIZON) of each context's first HORIZON emitted tokens."""
    v = TARGET.shape[0]
    contexts = np.arange(v)
    counts = np.zeros((v, v**HORIZON), dtype=np.int64)
    rng = np.random.default_rng(seed)
    for _ in range(trials):
        step = draw_step(contexts, rng)
        draft, verify = decide(step, rng)
        if np.any(verify > draft):
            raise AssertionError("verified more than drafted")
        for i, c in enumerate(contexts.tolist()):
            n = int(verify[i])
            out = speculative_verify(
                step.tokens[i, :n], step.draft_probs[i, :n], step.target_probs[i, : n + 1], rng, step.uniforms[i]
            )
            prev = out[-1]
            while len(out) < HORIZON:
                prev = int(rng.choice(v, p=TARGET[prev]))
                out.append(prev)
            counts[c, np.ravel_multi_index(out[:HORIZON], (v,) * HORIZON)] += 1
    return counts


def exact_distribution() -> np.ndarray:
    """(B, V**HORIZON): the target's probability of each token sequence after each context."""
    v = TARGET.shape[0]
    probs = np.zeros((v, v**HORIZON))
    for c in range(v):
        for seq in itertools.product(range(v), repeat=HORIZON):
            p, prev = 1.0, c
            for t in seq:
                p *= TARGET[prev, t]
                prev = t
            probs[c, np.ravel_multi_index(seq, (v,) * HORIZON)] = p
    return probs


def chi_square_pvalue(counts: np.ndarray) -> float:
    """Pooled chi-square over every context's sequence frequencies against the exact target."""
    expected = exact_distribution() * counts.sum(axis=1, keepdims=True)
    statistic = float(((counts - expected) ** 2 / expected).sum())
    dof = counts.shape[0] * (counts.shape[1] - 1)
    return float(stats.chi2.sf(statistic, dof))
