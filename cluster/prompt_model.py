"""Predicted acceptance of a request from its prompt, for the router: a domain-level signal.

A softmax classifier over a handful of character statistics (each one
`str.count` over the prompt's head, so a prediction costs microseconds)
tells the shipped workload domains apart; a request's predicted mean accepted
length is the domains' measured accepted lengths weighted by the classifier's
probabilities. Both come from what the project ships: the labelled workload
prompts (`replicas/models/workloads/`) and the drafter's per-domain
acceptance, as served on those prompts (`traces.npz`, recorded through the
engine, when its rows carry their domain) or else as measured at build time
(`build_report.json`, offline on held-out text).
"""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence
from functools import cached_property, lru_cache
from pathlib import Path

import numpy as np
from pydantic import BaseModel

HEAD_CHARS = 2048  # only the prompt's head is looked at: the cost stays flat in prompt length
_GROUPS = ("\n", " ", "()[]{}", ":=", "\"'", ",.", "#_", "0123456789")
# Each group's characters (all ASCII) as one byte code, every other byte as 0: one `bytes.translate` and a count
# per group in place of a count per character (UTF-8 never puts an ASCII byte inside another character).
_CODES = [bytes([g + 1]) for g in range(len(_GROUPS))]
_TABLE = bytes(next((g + 1 for g, group in enumerate(_GROUPS) if chr(b) in group), 0) for b in range(256))


def prompt_features(text: str) -> list[float]:
    head = text[:HEAD_CHARS]
    n = max(len(head), 1)
    coded = head.encode("utf-8", "surrogatepass").translate(_TABLE)
    counts = [coded.count(code) / n for code in _CODES]
    return [1.0, math.log1p(len(text)) / 8.0, head.count("\n    ") / n, *counts]


def prompt_text(body: dict) -> str:
    """The text a completion or chat request conditions on (prompt, or the messages' contents)."""
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
        return prompt[0]
    messages = body.get("messages")
    if isinstance(messages, list):
        return "\n".join(m["content"] for m in messages if isinstance(m, dict) and isinstance(m.get("content"), str))
    return ""


class PromptModel(BaseModel):
    domains: list[str]
    accept_len: list[float]  # per domain: mean accepted length (accepted drafts + 1, full width)
    weights: list[list[float]]  # (features, domains) softmax weights

    def domain_probs(self, text: str) -> list[float]:
        # Plain Python: for ten features, numpy's call overhead would dominate the router's decision time.
        x = prompt_features(text)
        z = [sum(map(operator.mul, x, col)) for col in self._columns]
        top = max(z)
        e = [math.exp(v - top) for v in z]
        total = sum(e)
        return [v / total for v in e]

    @cached_property
    def _columns(self) -> list[tuple[float, ...]]:
        return list(zip(*self.weights))

    def predict(self, body: dict) -> float:
        """Predicted mean accepted length for an OpenAI request body."""
        return sum(p * a for p, a in zip(self.domain_probs(prompt_text(body)), self.accept_len))

    @property
    def best_relative_acceptance(self) -> float:
        """The most `relative_acceptance` gives any body (all its mass on the best-accepting domain)."""
        return self.relative(max(self.accept_len))

    def relative_acceptance(self, body: dict) -> float:
        """`predict` over the domains' mean: above 1 for requests expected to accept better than most."""
        return self.relative(self.predict(body))

    def relative(self, accept_len: float) -> float:
        """A mean accepted length over the domains' mean."""
        return accept_len * len(self.accept_len) / sum(self.accept_len)

    def accuracy(self, texts: Sequence[str], labels: Sequence[str]) -> float:
        hits = [self.domains[int(np.argmax(self.domain_probs(t)))] == y for t, y in zip(texts, labels)]
        return float(np.mean(hits))

    @classmethod
    def fit(
        cls, texts: Sequence[str], labels: Sequence[str], accept_len: dict[str, float], steps: int = 500, l2: float = 1e-3
    ) -> "PromptModel":
        """Softmax regression by gradient descent (tiny data: a few hundred prompts, ten features)."""
        domains = sorted(accept_len)
        x = np.array([prompt_features(t) for t in texts])
        mu, sd = x[:, 1:].mean(axis=0), x[:, 1:].std(axis=0) + 1e-9
        xs = x.copy()
        xs[:, 1:] = (x[:, 1:] - mu) / sd
        y = np.eye(len(domains))[[domains.index(lab) for lab in labels]]
        w = np.zeros((x.shape[1], len(domains)))
        for _ in range(steps):
            z = xs @ w
            p = np.exp(z - z.max(axis=1, keepdims=True))
            p /= p.sum(axis=1, keepdims=True)
            w -= 0.5 * (xs.T @ (p - y) / len(xs) + l2 * w)
        # Fold the standardisation into the weights, so prediction uses raw features.
        raw = w.copy()
        raw[1:] = w[1:] / sd[:, None]
        raw[0] = w[0] - (mu / sd) @ w[1:]
        return cls(domains=domains, accept_len=[accept_len[d] for d in domains], weights=raw.tolist())

    @classmethod
    def shipped(cls) -> "PromptModel":
        """Fitted on the shipped workloads and the pair's served (else build-time) acceptance (milliseconds; done
        once per router)."""
        from replicas.models import WEIGHTS_DIR
        from replicas.models.report import BuildReport
        from replicas.models.workloads import load_workloads
        from scheduling.traces import Traces

        workloads = load_workloads()
        traces = WEIGHTS_DIR / "traces.npz"
        accept_len = Traces.load(traces).mean_accepted_length() if traces.is_file() else {}
        if set(accept_len) != set(workloads):
            report = BuildReport.model_validate_json((WEIGHTS_DIR / "build_report.json").read_text())
            accept_len = {d: q.mean_accepted_length for d, q in report.domains.items()}
        texts = [p.prompt for d in workloads for p in workloads[d]]
        labels = [d for d in workloads for _ in workloads[d]]
        return cls.fit(texts, labels, accept_len)


@lru_cache(maxsize=8)
def chars_per_token(model: str | Path) -> float | None:
    """Characters per token of `model`'s tokenizer (`tokenizer.json` in its folder or in the Hugging Face cache) on
    the shipped workload prompts, or None where this machine has none. Admission and the router estimate a prompt's
    tokens from its characters; the embedded pair's 1,024-token vocabulary takes about 2.5 characters a token, a
    128k one about 4."""
    from tokenizers import Tokenizer

    from replicas.models.workloads import load_workloads

    path = Path(model) / "tokenizer.json"
    if not path.is_file():
        from huggingface_hub import try_to_load_from_cache

        cached = try_to_load_from_cache(str(model), "tokenizer.json") if str(model).count("/") == 1 else None
        if not isinstance(cached, str):
            return None
        path = Path(cached)
    tokenizer = Tokenizer.from_file(str(path))
    texts = [p.prompt for prompts in load_workloads().values() for p in prompts]
    tokens = sum(len(e.ids) for e in tokenizer.encode_batch(texts, add_special_tokens=False))
    return sum(map(len, texts)) / tokens if tokens else None
