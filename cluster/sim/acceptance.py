"""Simulated draft acceptance: per domain, per request and per step, with the inputs the estimators see.

A request's conditional acceptance at draft position j in one step is

    h_j = sigmoid(logit(curve_j) + u + e)

where `curve` is its domain's per-position acceptance for the median request, u ~ N(0, request_sd) is the
request's own offset (prompt, topic: drawn once) and e ~ N(0, step_sd) the step's context (drawn each step,
shared by the step's positions). The accepted length of a full block is the first rejection. Each step also
yields what a real engine hands the controller: pre-draft features (a noisy reading of u + e, and the output
position), and after drafting the drafter's per-position confidences (a noisy reading of each h_j). The
estimators are fitted on traces drawn from the same process (`synthetic_traces`), as the real ones are
fitted on recorded traces.

Curves: DSpark (Fig. 2) measured DFlash's conditional acceptance for Qwen3-8B falling 0.87 -> 0.78 over
positions 1-7 on code and 0.72 -> 0.63 on chat; extended here at the same slope to the block. At block 7
the medians give 4.8 (code) and 3.1 (chat) tokens per step, against DSpark Table 1's HumanEval 4.64 and
MT-Bench 3.11 (Qwen3-8B, T=1).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from scheduling.survival import logit, sigmoid
from scheduling.traces import AcceptanceHistory, PreDraftInputs, Traces

FEATURE_NAMES = ("context_signal", "log_position")


class DomainAcceptance(BaseModel):
    model_config = ConfigDict(frozen=True)

    first: float = Field(gt=0, lt=1, description="conditional acceptance at position 1 (median request)")
    slope: float = Field(le=0, description="change per further position")
    floor: float = Field(default=0.05, gt=0, lt=1)
    request_sd: float = Field(default=0.5, ge=0, description="logit spread across requests")
    step_sd: float = Field(default=0.4, ge=0, description="logit spread across one request's steps")

    def curve(self, k: int) -> np.ndarray:
        return np.clip(self.first + self.slope * np.arange(k), self.floor, 0.99)


class AcceptanceModel(BaseModel):
    """A named set of domains (workload domains map onto them: `prose` is chat-like)."""

    name: str
    domains: dict[str, DomainAcceptance]
    feature_sd: float = Field(default=0.5, description="noise of the pre-draft context signal (logit units)")
    confidence_sd: float = Field(default=0.7, description="noise of the drafter's confidence (logit units)")
    source: str


ACCEPTANCE_MODELS = {
    "dflash-qwen3-8b": AcceptanceModel(
        name="dflash-qwen3-8b",
        domains={
            "code": DomainAcceptance(first=0.87, slope=-0.015),
            "prose": DomainAcceptance(first=0.72, slope=-0.015),
        },
        source="DSpark Fig. 2 (DFlash conditional acceptance, Qwen3-8B: code 0.87->0.78, chat 0.72->0.63 over "
        "positions 1-7), extended at the same slope; checked against DSpark Table 1 (T=1)",
    ),
}


@dataclass
class StepDraw:
    """One step's acceptance for a batch: what the controller sees, and the truth it does not."""

    features: np.ndarray  # (B, F) pre-draft features
    hazards: np.ndarray  # (B, K) true conditional acceptance
    accept_len: np.ndarray  # (B,) accepted drafts of a full block
    confidence: np.ndarray  # (B, K) the drafter's confidences


class AcceptanceProcess:
    def __init__(self, model: AcceptanceModel, k: int, seed: int = 0) -> None:
        self.model, self.k = model, k
        self.rng = np.random.default_rng(seed)
        self._curves = {d: logit(a.curve(k)) for d, a in model.domains.items()}

    def domain(self, name: str) -> DomainAcceptance:
        if name not in self.model.domains:
            raise ValueError(f"acceptance model {self.model.name} has no domain {name!r}; it has {sorted(self.model.domains)}")
        return self.model.domains[name]

    def request_offset(self, domain: str) -> float:
        return float(self.rng.normal(0.0, self.domain(domain).request_sd))

    def step(self, domains: list[str], offsets: np.ndarray, generated: np.ndarray) -> StepDraw:
        b, k, rng, m = len(domains), self.k, self.rng, self.model
        step_sd = np.array([self.domain(d).step_sd for d in domains])
        z = np.asarray(offsets, dtype=np.float64) + rng.normal(0.0, 1.0, b) * step_sd
        base = np.stack([self._curves[d] for d in domains]) if b else np.zeros((0, k))
        hazards = sigmoid(base + z[:, None])
        accepted = rng.random((b, k)) < hazards
        accept_len = np.cumprod(accepted, axis=1).sum(axis=1).astype(np.int64)
        features = np.column_stack([z + rng.normal(0.0, m.feature_sd, b), np.log1p(np.asarray(generated, dtype=np.float64))])
        confidence = sigmoid(logit(np.clip(hazards, 1e-4, 1 - 1e-4)) + rng.normal(0.0, m.confidence_sd, (b, k)))
        return StepDraw(features, hazards, accept_len, confidence)


def synthetic_traces(model: AcceptanceModel, k: int, domains: dict[str, float], requests: int = 400, steps: int = 24,
                     seed: int = 0) -> Traces:
    """Full-width trace rows drawn from `model` (what `forespark models traces` records from a real engine):
    `requests` requests of the weighted `domains`, `steps` drafting steps each."""
    process = AcceptanceProcess(model, k, seed)
    names = [d for d, w in domains.items() if w > 0]
    weights = np.array([domains[d] for d in names], dtype=np.float64)
    rng = np.random.default_rng(seed + 1)
    picked = [names[i] for i in rng.choice(len(names), requests, p=weights / weights.sum())]
    offsets = np.array([process.request_offset(d) for d in picked])
    history = AcceptanceHistory()
    ids = np.arange(requests)
    rows: list[tuple] = []
    generated = np.zeros(requests)
    for _ in range(steps):
        draw = process.step(picked, offsets, generated)
        rows.append((draw.features, history.rates(ids), draw.accept_len, draw.confidence))
        history.observe(ids, np.full(requests, k), draw.accept_len)
        generated += draw.accept_len + 1
    features, hist, accepted, confidence = (np.concatenate(x) for x in zip(*rows))
    return Traces(
        PreDraftInputs(features, hist),
        np.full(len(accepted), k, dtype=np.int64),
        accepted,
        np.tile(ids, steps),
        k,
        FEATURE_NAMES,
        confidence,
    )
