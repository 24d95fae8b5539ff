"""What a model build reports (`build_report.json`): the corpus, each domain's held-out quality, timings.

Kept apart from `build.py` so that readers of a report (the router's prompt model in the ingress, the CLI) do
not import torch: in the ingress that import blocked the event loop for seconds on the first request.
"""

from __future__ import annotations

from pydantic import BaseModel

from replicas.models.corpus import CorpusSource
from replicas.models.spec import BuildSpec


class DomainQuality(BaseModel):
    perplexity: float
    unigram_perplexity: float
    offline_acceptance: list[float]  # P(first j drafts match the target's greedy tokens), j = 1..block
    bits_per_char: float | None = None  # held-out, so that vocabularies compare
    chars_per_token: float | None = None  # of the held-out text
    # E[first j greedy drafts accepted] by vLLM's rejection sampler at T=1 after the target's sampled text
    offline_acceptance_t1: list[float] = []
    # share of repeated 4-grams in the target's greedy continuations of held-out prompts (loops)
    greedy_repeated_4grams: float | None = None

    @property
    def mean_accepted_length(self) -> float:
        """Accepted drafts + the bonus token, greedy, full width."""
        return 1.0 + float(sum(self.offline_acceptance))

    @property
    def mean_accepted_length_t1(self) -> float | None:
        return 1.0 + float(sum(self.offline_acceptance_t1)) if self.offline_acceptance_t1 else None


class BuildReport(BaseModel):
    spec: BuildSpec
    python: str
    torch: str
    corpus_chars: dict[str, dict[str, int]]
    domains: dict[str, DomainQuality]
    target_loss_last: float
    drafter_loss_last: float
    seconds: dict[str, float]
    corpus_tokens: dict[str, dict[str, int]] = {}
    corpus_sources: list[CorpusSource] = []  # per pinned package: version, licence, what was used or why not
    resumes: int = 0
