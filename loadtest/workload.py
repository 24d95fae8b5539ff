"""The requests a load test sends: prompts of the shipped workload domains, drawn by the mix weights.

The prompts are the project's shipped workload files (data only; the load
test talks to the system over HTTP and imports none of it).
"""

from __future__ import annotations

import json
import random
from importlib.resources import files

from loadtest.config import LoadTestConfig


def shipped_prompts() -> dict[str, list[dict]]:
    """{domain: [{"domain", "prompt", "max_tokens"}, ...]} from `replicas/models/workloads/*.jsonl`."""
    folder = files("replicas.models").joinpath("workloads")
    out: dict[str, list[dict]] = {}
    for entry in sorted(folder.iterdir(), key=lambda e: e.name):
        if entry.name.endswith(".jsonl"):
            out[entry.name.removesuffix(".jsonl")] = [json.loads(line) for line in entry.read_text().splitlines() if line.strip()]
    return out


def with_context(prompt: str, same_domain: list[dict], tokens: int, chars_per_token: float, rng: random.Random) -> str:
    """`prompt` after a context of about `tokens` tokens: the domain's other shipped prompts, in a random
    rotation, cut to length (text of the request's own kind, so its predicted acceptance stays its domain's)."""
    if tokens <= 0:
        return prompt
    want = int(tokens * chars_per_token)
    start = rng.randrange(len(same_domain))
    parts, size, k = [], 0, start
    while size < want:
        text = same_domain[k % len(same_domain)]["prompt"]
        parts.append(text)
        size += len(text) + 2
        k += 1
    return "\n\n".join(parts)[:want] + "\n\n" + prompt


class Workload:
    """Draws request bodies for `/v1/completions` by the config's domain weights."""

    def __init__(self, config: LoadTestConfig, rng: random.Random) -> None:
        prompts = shipped_prompts()
        unknown = sorted(set(config.domains) - set(prompts))
        if unknown:
            raise ValueError(f"unknown workload domains {unknown}; shipped: {sorted(prompts)}")
        self.config = config
        self.rng = rng
        self.domains = [d for d, w in config.domains.items() if w > 0]
        self.weights = [config.domains[d] for d in self.domains]
        self.prompts = prompts

    def next(self) -> tuple[str, dict]:
        domain = self.rng.choices(self.domains, self.weights)[0]
        item = self.rng.choice(self.prompts[domain])
        c = self.config
        prompt = item["prompt"]
        if c.long_prompts is not None:
            lp = c.long_prompts
            prompt = with_context(prompt, self.prompts[domain], lp.tokens(self.rng), lp.chars_per_token, self.rng)
        body = {
            "model": c.model,
            "prompt": prompt,
            "max_tokens": c.max_tokens or item["max_tokens"],
            "temperature": c.temperature,
            "ignore_eos": c.ignore_eos,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        return domain, body
