"""Shipped workloads: prompts per domain, cut from held-out text, with output-length settings.

Used by tests, benchmarks and load tests. `forespark models workloads` writes
them from the corpus; the committed files are what everything reads.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from pydantic import BaseModel, Field

from replicas.models.corpus import DOMAINS, Corpus

WORKLOADS_DIR = Path(__file__).parent / "workloads"
MAX_TOKENS = {"code": 128, "prose": 96}


class Prompt(BaseModel):
    domain: str
    prompt: str
    max_tokens: int = Field(ge=1)


def _code_prompts(docs: list[str], count: int, rng: np.random.Generator) -> list[str]:
    """The head of a function or class: from a `def`/`class` line up to its docstring or first lines."""
    out = []
    candidates = []
    for doc in docs:
        lines = doc.splitlines(keepends=True)
        for i, line in enumerate(lines):
            if line.lstrip().startswith(("def ", "class ")) and i + 3 < len(lines):
                candidates.append("".join(lines[max(0, i - 4) : i + 3]))
    for idx in rng.permutation(len(candidates))[:count]:
        out.append(candidates[idx])
    return out


def _prose_prompts(docs: list[str], count: int, rng: np.random.Generator) -> list[str]:
    """The opening of a help text: its first sentence or 200 characters, cut at a word."""
    out = []
    for idx in rng.permutation(len(docs)):
        text = " ".join(docs[idx].split())
        if len(text) < 120:
            continue
        cut = text.find(". ") + 2 if 40 < text.find(". ") < 200 else text.rfind(" ", 0, 200)
        out.append(text[:cut])
        if len(out) == count:
            break
    return out


def build_workloads(corpus: Corpus, per_domain: int = 64, seed: int = 0) -> dict[str, list[Prompt]]:
    rng = np.random.default_rng(seed)
    makers = {"code": _code_prompts, "prose": _prose_prompts}
    return {
        d: [Prompt(domain=d, prompt=p, max_tokens=MAX_TOKENS[d]) for p in makers[d](corpus.docs[d]["held_out"], per_domain, rng)]
        for d in DOMAINS
    }


def write_workloads(workloads: dict[str, list[Prompt]], out_dir: Path = WORKLOADS_DIR) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    for domain, prompts in workloads.items():
        (out_dir / f"{domain}.jsonl").write_text("".join(p.model_dump_json() + "\n" for p in prompts))


def load_workloads(out_dir: Path = WORKLOADS_DIR) -> dict[str, list[Prompt]]:
    return {
        d: [Prompt.model_validate(json.loads(line)) for line in (out_dir / f"{d}.jsonl").read_text().splitlines()]
        for d in DOMAINS
    }


def mixed_workload(count: int, seed: int = 0) -> list[Prompt]:
    """`count` prompts drawn evenly from every domain, shuffled."""
    rng = np.random.default_rng(seed)
    pools = load_workloads()
    out = []
    for n in range(count):
        pool = pools[DOMAINS[n % len(DOMAINS)]]
        out.append(pool[int(rng.integers(len(pool)))])
    return [out[i] for i in rng.permutation(len(out))]
