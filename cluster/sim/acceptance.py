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

from scheduling.survival import clip, logit, sigmoid
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


_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser: a well-spread 64-bit hash of each element."""
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def _point(request: np.ndarray, position: np.ndarray) -> np.ndarray:
    """The (request, position) part of `keyed_uniforms`' key, shared by every seed."""
    with np.errstate(over="ignore"):
        return (_mix(np.asarray(request, dtype=np.uint64) + _GOLDEN)
                + _mix(np.asarray(position, dtype=np.uint64) * np.uint64(0xD1B54A32D192ED03)))


def keyed_uniforms(seed: int, request: np.ndarray, position: np.ndarray, n: int, point: np.ndarray | None = None) -> np.ndarray:
    """(B, n) uniforms in (0, 1) that depend only on (seed, request, position): every policy simulated with a
    seed meets the same acceptance at the same point of the same request (common random numbers), however
    differently it drafts. `point`: `_point(request, position)`, when the caller has it already."""
    with np.errstate(over="ignore"):
        base = _mix(np.uint64(seed) * _GOLDEN + (_point(request, position) if point is None else point))
        x = _mix(base[:, None] + (np.arange(1, n + 1, dtype=np.uint64) * _GOLDEN)[None, :])
    return _unit(x)


def _unit(x: np.ndarray) -> np.ndarray:
    """64-bit hashes as uniforms in (0, 1) (their top 53 bits, centred)."""
    return ((x >> np.uint64(11)).astype(np.float64) + 0.5) * 2.0**-53


def keyed_normals(seed: int, request: np.ndarray, position: np.ndarray, n: int, point: np.ndarray | None = None) -> np.ndarray:
    return _box_muller(keyed_uniforms(seed, request, position, 2 * n, point), n)


def _box_muller(u: np.ndarray, n: int) -> np.ndarray:
    return np.sqrt(-2.0 * np.log(u[:, :n])) * np.cos(2.0 * np.pi * u[:, n:])


def _keyed_normals_and_uniforms(seed: int, point: np.ndarray, n: int, m: int) -> tuple[np.ndarray, np.ndarray]:
    """`keyed_normals(seed, ..., n)` and `keyed_uniforms(seed + 1, ..., m)` at the same points, hashed together
    (a drafting step of the simulator draws both)."""
    with np.errstate(over="ignore"):
        base = _mix(np.array([seed, seed + 1], dtype=np.uint64)[:, None] * _GOLDEN + point[None, :])  # (2, B)
        steps = np.arange(1, max(2 * n, m) + 1, dtype=np.uint64) * _GOLDEN
        x = _mix(np.concatenate([base[0][:, None] + steps[None, : 2 * n], base[1][:, None] + steps[None, :m]], axis=1))
    u = _unit(x)
    return _box_muller(u[:, : 2 * n], n), u[:, 2 * n :]


class AcceptanceProcess:
    """Draws keyed by (seed, request, output position): see `keyed_uniforms`."""

    def __init__(self, model: AcceptanceModel, k: int, seed: int = 0) -> None:
        self.model, self.k, self.seed = model, k, seed
        self._names = list(model.domains)
        self._index = {d: i for i, d in enumerate(self._names)}
        self._curve_rows = np.stack([logit(model.domains[d].curve(k)) for d in self._names])  # (domains, K)
        self._step_sd = np.array([model.domains[d].step_sd for d in self._names])

    def domain(self, name: str) -> DomainAcceptance:
        if name not in self.model.domains:
            raise ValueError(f"acceptance model {self.model.name} has no domain {name!r}; it has {sorted(self.model.domains)}")
        return self.model.domains[name]

    def request_offset(self, domain: str, request: int) -> float:
        z = keyed_normals(self.seed, np.array([request]), np.array([2**40]), 1)[0, 0]
        return float(z * self.domain(domain).request_sd)

    def step(self, domains: list[str], offsets: np.ndarray, generated: np.ndarray, requests: np.ndarray | None = None) -> StepDraw:
        """One drafting step of a batch; `requests` (B,) are the requests' keys (default 0..B-1)."""
        b, k, m = len(domains), self.k, self.model
        keys = np.arange(b) if requests is None else np.asarray(requests)
        normals, uniforms = _keyed_normals_and_uniforms(self.seed, _point(keys, np.asarray(generated)), 2 + k, k)
        try:
            at = np.array([self._index[d] for d in domains], dtype=np.int64)
        except KeyError as missing:
            self.domain(missing.args[0])  # raises, naming the model's domains
            raise
        z = np.asarray(offsets, dtype=np.float64) + normals[:, 0] * self._step_sd[at]
        hazards = sigmoid(self._curve_rows[at] + z[:, None])
        accept_len = np.cumprod(uniforms < hazards, axis=1).sum(axis=1).astype(np.int64)
        features = np.column_stack([z + normals[:, 1] * m.feature_sd, np.log1p(np.asarray(generated, dtype=np.float64))])
        confidence = sigmoid(logit(clip(hazards, 1e-4, 1 - 1e-4)) + normals[:, 2:] * m.confidence_sd)
        return StepDraw(features, hazards, accept_len, confidence)


def synthetic_traces(model: AcceptanceModel, k: int, domains: dict[str, float], requests: int = 400, steps: int = 24,
                     seed: int = 0) -> Traces:
    """Full-width trace rows drawn from `model` (what `forespark models traces` records from a real engine):
    `requests` requests of the weighted `domains`, `steps` drafting steps each."""
    process = AcceptanceProcess(model, k, seed + 7919)  # keyed apart from the simulated requests' draws
    names = [d for d, w in domains.items() if w > 0]
    weights = np.array([domains[d] for d in names], dtype=np.float64)
    rng = np.random.default_rng(seed + 1)
    picked = [names[i] for i in rng.choice(len(names), requests, p=weights / weights.sum())]
    offsets = np.array([process.request_offset(d, i) for i, d in enumerate(picked)])
    history = AcceptanceHistory()
    ids = np.arange(requests)
    rows: list[tuple] = []
    generated = np.zeros(requests)
    for _ in range(steps):
        draw = process.step(picked, offsets, generated, ids)
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
        np.tile(np.array(picked), steps),
    )
