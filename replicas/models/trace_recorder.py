"""`forespark models traces`: per-step, per-request acceptance traces recorded from the vLLM engine.

It hooks the in-process engine's model runner (an offline tool, not the
serving path): the target's `compute_logits` hands over the hidden states and
logits of every sampled position, and `_sample` the rejection sampler's
verdicts. For each request and step it keeps the pre-draft features of the
position the next draft starts from (target hidden-state summary, entropy and
max probability of the target's distribution there, acceptance history so far,
tokens generated so far), and when that draft is verified it writes one row
with the realised accepted length.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from scheduling.traces import AcceptanceHistory, PreDraftInputs, Traces

PROJECTIONS = 4
FEATURE_NAMES = ("hidden_norm", "entropy", "max_prob", "log_position") + tuple(f"hidden_proj{i}" for i in range(PROJECTIONS))


def step_features(hidden: torch.Tensor, logits: torch.Tensor, positions: np.ndarray, proj: torch.Tensor) -> np.ndarray:
    """[rows, F] pre-draft features from the target's hidden states and logits at the given rows."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    p = logp.exp()
    entropy = -(p * logp).sum(-1)
    h = hidden.float()
    norm = h.norm(dim=-1)
    cols = [norm, entropy, p.max(-1).values, torch.from_numpy(np.log1p(positions)).float()]
    cols += list(((h / norm[:, None].clamp_min(1e-6)) @ proj).T)
    return torch.stack(cols, dim=1).numpy()


@dataclass
class _Pending:
    features: np.ndarray
    history: float
    request: int


@dataclass
class TraceRecorder:
    """Attach to an in-process `vllm.LLM`; rows accumulate while it generates."""

    llm: object
    k: int
    seed: int = 0
    rows: list[tuple[np.ndarray, float, int, int, int]] = field(default_factory=list)

    def __post_init__(self) -> None:
        from replicas.engine import model_runner

        runner = model_runner(self.llm)
        self._runner = runner
        hidden = runner.model.config.hidden_size if hasattr(runner.model, "config") else runner.model_config.get_hidden_size()
        gen = torch.Generator().manual_seed(self.seed)
        self._proj = torch.randn(hidden, PROJECTIONS, generator=gen) / hidden**0.5
        self._history = AcceptanceHistory()
        self._pending: dict[str, _Pending] = {}
        self._generated: dict[str, int] = {}
        self._ids: dict[str, int] = {}
        self._last: tuple[torch.Tensor, torch.Tensor] | None = None
        model = runner.model
        compute_logits = model.compute_logits

        def capture(hidden_states, *args, **kwargs):
            logits = compute_logits(hidden_states, *args, **kwargs)
            self._last = (hidden_states.detach(), logits.detach())
            return logits

        model.compute_logits = capture
        sample = runner._sample

        def record(logits, spec_decode_metadata):
            out = sample(logits, spec_decode_metadata)
            self._observe(out.sampled_token_ids.cpu(), spec_decode_metadata)
            return out

        runner._sample = record

    def _observe(self, sampled: torch.Tensor, spec) -> None:
        if self._last is None:
            return
        hidden, logits = self._last
        req_ids = list(self._runner.input_batch.req_ids)[: sampled.shape[0]]
        n_draft = np.array(spec.num_draft_tokens if spec is not None else [0] * len(req_ids))
        rows_per_req = n_draft + 1
        offsets = np.concatenate([[0], np.cumsum(rows_per_req)[:-1]])
        valid = (sampled >= 0).sum(dim=1).numpy()
        accepted = np.where(n_draft > 0, valid - 1, 0)
        ints = np.array([self._ids.setdefault(r, len(self._ids)) for r in req_ids])
        for n, rid in enumerate(req_ids):
            pending = self._pending.get(rid)
            if pending is not None and n_draft[n] > 0:
                self.rows.append((pending.features, pending.history, int(n_draft[n]), int(accepted[n]), pending.request))
            self._generated[rid] = self._generated.get(rid, 0) + int(valid[n])
        self._history.observe(ints[n_draft > 0], n_draft[n_draft > 0], accepted[n_draft > 0])
        # The next draft starts after the last emitted token: its row is offset + accepted.
        rows = offsets + accepted
        positions = np.array([self._generated[r] for r in req_ids], dtype=np.float64)
        feats = step_features(hidden[rows], logits[rows], positions, self._proj)
        hist = self._history.rates(ints)
        for n, rid in enumerate(req_ids):
            self._pending[rid] = _Pending(feats[n], float(hist[n]), int(ints[n]))
        self._last = None

    def counters(self, since: int = 0):
        """vLLM-style speculative counters over rows[since:] (independent of the process-wide
        Prometheus registry, which only ever holds the newest engine's metrics)."""
        from replicas.models.bench import SpecCounters

        rows = self.rows[since:]
        k = max((r[2] for r in rows), default=0)
        accepted = np.array([r[3] for r in rows], dtype=np.int64)
        return SpecCounters(
            drafts=len(rows),
            draft_tokens=int(sum(r[2] for r in rows)),
            accepted=int(accepted.sum()),
            accepted_per_pos=[int((accepted >= j).sum()) for j in range(1, k + 1)],
        )

    def traces(self) -> Traces:
        if not self.rows:
            raise RuntimeError("no verification steps were recorded")
        feats, hist, drafted, accepted, req = zip(*self.rows)
        return Traces(
            PreDraftInputs(np.stack(feats), np.array(hist)),
            np.array(drafted),
            np.array(accepted),
            np.array(req),
            self.k,
            FEATURE_NAMES,
        )


def record_traces(prompts_per_domain: int = 64, repeats: int = 1, temperature: float = 0.0, seed: int = 0):
    """Run the shipped workloads through vLLM with the drafter; returns (traces, domain per row).

    Greedy by default: that is what the shipped drafter is distilled for.
    """
    from vllm import SamplingParams

    from replicas.engine import EngineConfig, make_llm
    from replicas.models.workloads import load_workloads

    config = EngineConfig()
    llm = make_llm(config)
    recorder = TraceRecorder(llm, config.drafter.num_speculative_tokens, seed)
    domains = []
    for domain, prompts in load_workloads().items():
        start = len(recorder.rows)
        chosen = prompts[:prompts_per_domain]
        params = [
            SamplingParams(temperature=temperature, max_tokens=p.max_tokens, seed=seed + 1000 * r + i)
            for r in range(repeats)
            for i, p in enumerate(chosen)
        ]
        llm.generate([p.prompt for _ in range(repeats) for p in chosen], params, use_tqdm=False)
        domains += [domain] * (len(recorder.rows) - start)
    return recorder.traces(), np.array(domains)
