"""`forespark models bench`: acceptance of the embedded drafter through the real vLLM CPU engine.

For each draft width w it starts an engine with `num_speculative_tokens = w`,
generates the shipped workloads one domain at a time (greedily, or sampled at
`temperature` with a seed per request), and reads vLLM's
own speculative-decoding counters: per-position acceptance (the share of
drafts whose first j tokens were all accepted) and mean accepted length
(accepted drafts + the bonus token per verification step).

Greedy runs also continue every prompt for `LOOP_TOKENS` tokens and report the share of
repeated 4-grams in those continuations (`repeated_4gram_share`): a target that falls
into loops inflates acceptance on some prompts and deflates it on others.

Width robustness is judged at identical anchors: every width also drafts once
from the same prefixes of the greedy continuations, and its accepted drafts
are compared with the full block's truncated at w. Free-running numbers mix
the drafter with where steps happen to start (after a rejection, more often
for wide drafts), so they are reported beside it, not used for it.
"""

from __future__ import annotations

import gc
from collections.abc import Callable

import numpy as np
from pydantic import BaseModel

from replicas.engine import DrafterConfig, EngineConfig, make_llm
from replicas.models.corpus import DOMAINS
from replicas.models.unlikelihood import continuation_loop_share
from replicas.models.workloads import load_workloads


LOOP_TOKENS = 128


class SpecCounters(BaseModel):
    drafts: int = 0
    draft_tokens: int = 0
    accepted: int = 0
    accepted_per_pos: list[int] = []

    def minus(self, other: "SpecCounters") -> "SpecCounters":
        n = max(len(self.accepted_per_pos), len(other.accepted_per_pos))
        pad = lambda v: v + [0] * (n - len(v))  # noqa: E731
        return SpecCounters(
            drafts=self.drafts - other.drafts,
            draft_tokens=self.draft_tokens - other.draft_tokens,
            accepted=self.accepted - other.accepted,
            accepted_per_pos=[a - b for a, b in zip(pad(self.accepted_per_pos), pad(other.accepted_per_pos))],
        )


def read_spec_counters(llm) -> SpecCounters:
    out = SpecCounters()
    for metric in llm.get_metrics():
        if metric.name == "vllm:spec_decode_num_drafts":
            out.drafts = int(metric.value)
        elif metric.name == "vllm:spec_decode_num_draft_tokens":
            out.draft_tokens = int(metric.value)
        elif metric.name == "vllm:spec_decode_num_accepted_tokens":
            out.accepted = int(metric.value)
        elif metric.name == "vllm:spec_decode_num_accepted_tokens_per_pos":
            out.accepted_per_pos = [int(v) for v in metric.values]
    return out


class WidthResult(BaseModel):
    mean_accepted_length: float  # accepted drafts + bonus per verification step
    per_position: list[float]  # P(first j drafts accepted), j = 1..w
    drafts: int


class DomainBench(BaseModel):
    mean_accepted_full_width: float
    per_width: dict[str, WidthResult]
    # Same anchors for every width: accepted drafts of the first verification after prefill of
    # prefixes of the greedy continuations (free-running steps start at different places per width).
    anchored_accepted: dict[str, list[int]] = {}
    # Greedy only: repeated 4-grams among all of the domain's LOOP_TOKENS-token continuations (see unlikelihood.continuation_loop_share).
    repeated_4gram_share: float | None = None

    def anchored_gap(self, w: int, block: int) -> float:
        """Relative gap between drafting w and the full block truncated at w, at the same anchors."""
        narrow = 1.0 + np.mean(self.anchored_accepted[str(w)])
        truncated = 1.0 + np.mean(np.minimum(self.anchored_accepted[str(block)], w))
        return float(abs(narrow - truncated) / truncated)

    def truncated_full_width(self, w: int, block: int) -> float:
        """Mean accepted length the full block would give if only its first w drafts counted."""
        return 1.0 + sum(self.per_width[str(block)].per_position[:w])


class ModelsBench(BaseModel):
    block: int
    temperature: float = 0.0
    draft_sample_method: str = "greedy"  # vLLM's: the drafter's argmax, or sampled drafts with their probabilities
    prompts_per_domain: int
    domains: dict[str, DomainBench]
    width_robustness: dict[str, dict[str, float]]  # domain -> w -> anchored relative gap to the truncated full block
    free_running_gap: dict[str, dict[str, float]]  # the same, from free-running generation (different anchors)
    domain_gap: float  # relative difference of full-width mean accepted length between the domains


def run_models_bench(
    widths: list[int] | None = None,
    prompts_per_domain: int = 24,
    engine: EngineConfig | None = None,
    progress: Callable[[str], None] | None = None,
    temperature: float = 0.0,
    seed: int = 0,
) -> ModelsBench:
    from vllm import SamplingParams, TokensPrompt

    from replicas.models.verdicts import VerdictCounter

    engine = engine or EngineConfig(wcs=None)  # the drafter in plain vLLM
    block = engine.drafter.num_speculative_tokens if engine.drafter else DrafterConfig().num_speculative_tokens
    widths = sorted(set(widths or range(1, block + 1)) | {block})
    prompts = {d: load_workloads()[d][:prompts_per_domain] for d in DOMAINS}
    per_domain: dict[str, dict[str, WidthResult]] = {d: {} for d in DOMAINS}
    anchored: dict[str, dict[str, list[int]]] = {d: {} for d in DOMAINS}
    prefixes: dict[str, list[list[int]]] = {}
    loops: dict[str, float | None] = {d: None for d in DOMAINS}
    for w in widths:
        drafter = (engine.drafter or DrafterConfig()).model_copy(update={"num_speculative_tokens": w})
        config = engine.model_copy(update={"drafter": drafter})
        llm = make_llm(config)
        recorder = VerdictCounter(llm)
        for domain in DOMAINS:
            before = read_spec_counters(llm)
            params = [SamplingParams(temperature=temperature, max_tokens=p.max_tokens, seed=seed + i if temperature > 0 else None)
                      for i, p in enumerate(prompts[domain])]
            outs = llm.generate([p.prompt for p in prompts[domain]], params, use_tqdm=False)
            c = read_spec_counters(llm).minus(before)
            per_domain[domain][str(w)] = WidthResult(
                mean_accepted_length=1.0 + c.accepted / max(c.drafts, 1),
                per_position=[a / max(c.drafts, 1) for a in c.accepted_per_pos[:w]],
                drafts=c.drafts,
            )
            if temperature > 0:
                continue
            if loops[domain] is None:
                long = llm.generate([p.prompt for p in prompts[domain]], SamplingParams(temperature=0.0, max_tokens=LOOP_TOKENS),
                                    use_tqdm=False)
                loops[domain] = continuation_loop_share([list(o.outputs[0].token_ids) for o in long], llm.get_tokenizer().eos_token_id)
            if domain not in prefixes:  # greedy: every width continues the same way
                prefixes[domain] = [
                    list(o.prompt_token_ids) + list(o.outputs[0].token_ids)[:t]
                    for o in outs
                    for t in range(0, max(0, len(o.outputs[0].token_ids) - block - 1), 4)
                ]
            start = len(recorder.rows)
            llm.generate(
                [TokensPrompt(prompt_token_ids=ids) for ids in prefixes[domain]],
                SamplingParams(temperature=0.0, max_tokens=w + 2),
                use_tqdm=False,
            )
            anchored[domain][str(w)] = recorder.first_accepted(start)
        del llm, recorder
        gc.collect()  # tear this engine down now, not in the middle of the next one
        if progress:
            progress(f"width {w} done")
    domains = {
        d: DomainBench(mean_accepted_full_width=r[str(block)].mean_accepted_length, per_width=r, anchored_accepted=anchored[d],
                       repeated_4gram_share=loops[d])
        for d, r in per_domain.items()
    }
    robustness = {d: {str(w): domains[d].anchored_gap(w, block) for w in widths} for d in DOMAINS} if temperature == 0 else {}
    free_running = {
        d: {
            str(w): abs(domains[d].per_width[str(w)].mean_accepted_length - domains[d].truncated_full_width(w, block))
            / domains[d].truncated_full_width(w, block)
            for w in widths
        }
        for d in DOMAINS
    }
    full = [domains[d].mean_accepted_full_width for d in DOMAINS]
    return ModelsBench(
        block=block,
        temperature=temperature,
        draft_sample_method=(engine.drafter or DrafterConfig()).draft_sample_method,
        prompts_per_domain=prompts_per_domain,
        domains=domains,
        width_robustness=robustness,
        free_running_gap=free_running,
        domain_gap=(max(full) - min(full)) / min(full),
    )


def format_models_bench(result: ModelsBench) -> str:
    lines = [
        f"{'domain':>7} {'width':>5} {'mean acc len':>13} {'trunc. full':>12} {'gap':>6} {'anchored gap':>13}"
        "  per-position acceptance"
    ]
    for d, bench in result.domains.items():
        for w, r in sorted(bench.per_width.items(), key=lambda kv: int(kv[0])):
            trunc = bench.truncated_full_width(int(w), result.block)
            pos = " ".join(f"{p:.2f}" for p in r.per_position)
            lines.append(
                f"{d:>7} {w:>5} {r.mean_accepted_length:>13.2f} {trunc:>12.2f} "
                f"{result.free_running_gap[d][w]:>6.1%} {result.width_robustness.get(d, {}).get(w, float('nan')):>13.1%}  {pos}"
            )
    lines.append(f"domain gap at full width: {result.domain_gap:.1%} (temperature {result.temperature:g}, "
                 f"{result.draft_sample_method} drafts)")
    loops = {d: b.repeated_4gram_share for d, b in result.domains.items() if b.repeated_4gram_share is not None}
    if loops:
        lines.append(f"repeated 4-grams in {LOOP_TOKENS}-token greedy continuations: "
                     + ", ".join(f"{d} {share:.1%}" for d, share in loops.items()))
    lines.append(
        "gap: free-running generation (each width starts its steps elsewhere); "
        "anchored gap: the same prefixes for every width"
    )
    return "\n".join(lines)
