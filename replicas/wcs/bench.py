"""`forespark bench engine`: every policy on one WCS engine, same workload, at several concurrencies.

One engine is built once; policies are switched between runs through the
workers (`wcs_set_policy`), interleaved per concurrency level and repetition,
in reverse order every other repetition, so machine drift hits all of them
alike. Each concurrency starts with an untimed round of every policy
(`schedule`): on this CPU the first run of `dspark` at a load slowed every
run after it there by 2-6% for good (`ar` at 64 requests: 2,082-2,134 tok/s
before, 1,993-2,038 after; 2,123-2,128 in three runs beside `wcs` alone), so
without the round the policy that ran first at a load, `ar` in the first
repetition, was timed on a faster engine. A run keeps `c` requests in flight
(closed loop) from the mixed-domain workload until `requests_per_slot * c`
have finished, then aborts the rest. Throughput counts every token emitted
in the window; the per-request generation rate is each finished request's
(n - 1) / (E2E - TTFT), i.e. 1 / TPOT, its median over the run. A row
reports, per policy and concurrency, the median over `reps` runs.

Policies are compared at a matched per-request generation rate: each
policy's (rate, throughput) points form a curve, and throughput is
interpolated at the lowest rate both curves reach (the highest load the runs
cover).

`wcs` against the best other policy at each concurrency is reported two ways:
the ratio of the two medians, and the median of the ratios of the runs of
the same repetition (taken minutes apart, so the host's drift over the bench,
5-30% on this CPU, cancels out of each pair).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import numpy as np
from pydantic import BaseModel

from replicas.wcs.stats import WCSStats

POLICIES = ("ar", "static", "dspark", "wcs")
CONCURRENCY = (1, 4, 16, 64, 128)


class EngineRun(BaseModel):
    policy: str
    concurrency: int
    finished: int
    output_tokens: int
    seconds: float
    tokens_per_s: float
    per_request_rate: float  # median tokens/s seen by one request (1 / TPOT)
    mean_accepted_length: float
    draft_waste: float
    draft_share: float  # drafting's share of runner step time
    planner_share: float
    steps: int
    reps: int = 1  # runs whose medians these are
    runs_tokens_per_s: list[float] = []  # each run's tokens/s, in repetition order


class EngineBench(BaseModel):
    temperature: float = 0.0  # of every request (0: greedy)
    draft_sample_method: str = "greedy"  # vLLM's: the drafter's argmax, or sampled drafts with their probabilities
    ratios: dict[str, float | None]
    matched_rate: dict[str, float | None]  # the per-request rate each ratio is taken at
    rows: list[EngineRun]
    # Per concurrency: wcs's throughput over the best other policy's in the same run (< 1 is regret), as a ratio of
    # medians and as the median of the ratios of runs of the same repetition.
    wcs_vs_best: dict[str, float | None] = {}
    wcs_vs_best_paired: dict[str, float | None] = {}


def _wcs_and_best(rows: list[EngineRun]):
    """Per concurrency (as a string key): `wcs`'s row and the row of the other policy best in median (None where
    either is missing)."""
    for c in sorted({r.concurrency for r in rows}):
        at = {r.policy: r for r in rows if r.concurrency == c}
        others = [r for p, r in at.items() if p != "wcs"]
        yield str(c), at.get("wcs"), (max(others, key=lambda r: r.tokens_per_s) if others else None)


def wcs_vs_best(rows: list[EngineRun]) -> dict[str, float | None]:
    """{concurrency: wcs tokens/s / the best of the other policies' tokens/s at that concurrency}."""
    return {c: ours.tokens_per_s / best.tokens_per_s if ours and best and best.tokens_per_s > 0 else None
            for c, ours, best in _wcs_and_best(rows)}


def wcs_vs_best_paired(rows: list[EngineRun]) -> dict[str, float | None]:
    """{concurrency: the median over repetitions of wcs tokens/s over that of the policy best in median}."""
    out: dict[str, float | None] = {}
    for c, ours, best in _wcs_and_best(rows):
        pairs = [a / b for a, b in zip(ours.runs_tokens_per_s, best.runs_tokens_per_s) if b > 0] if ours and best else []
        out[c] = float(np.median(pairs)) if pairs and len(ours.runs_tokens_per_s) == len(best.runs_tokens_per_s) else None
    return out


def run_closed_loop(llm, prompts: list, concurrency: int, total: int, max_tokens: int | None, tag: str,
                    temperature: float = 0.0, seed: int = 0) -> dict:
    """Keep `concurrency` requests in flight until `total` finish, then abort the rest.

    At a temperature above 0 the n-th request of a run samples with seed `seed + n`, so every policy's run at a
    concurrency draws from the same seeds (their outputs still differ: speculation consumes the random stream
    differently, with the same distribution).

    Returns the window's seconds, tokens emitted in it, finished count, and per-request rates.
    """
    from vllm import SamplingParams

    engine = llm.llm_engine
    first: dict[str, float] = {}
    tokens: dict[str, int] = {}
    in_flight: set[str] = set()
    rates: list[float] = []
    submitted = finished = 0

    def submit() -> None:
        nonlocal submitted
        p = prompts[submitted % len(prompts)]
        rid = f"{tag}-{submitted}"
        params = SamplingParams(temperature=temperature, max_tokens=max_tokens or p.max_tokens,
                                seed=seed + submitted if temperature > 0 else None)
        engine.add_request(rid, p.prompt, params)
        in_flight.add(rid)
        submitted += 1

    start = time.perf_counter()
    for _ in range(concurrency):
        submit()
    while finished < total:
        for out in engine.step():
            now = time.perf_counter()
            n = len(out.outputs[0].token_ids)
            if n and out.request_id not in first:
                first[out.request_id] = now
            tokens[out.request_id] = n
            if out.finished:
                finished += 1
                in_flight.discard(out.request_id)
                if n > 1 and now > first[out.request_id]:
                    rates.append((n - 1) / (now - first[out.request_id]))
                submit()
    seconds = time.perf_counter() - start
    engine.abort_request(sorted(in_flight))
    while engine.has_unfinished_requests():
        engine.step()
    return {"seconds": seconds, "tokens": sum(tokens.values()), "finished": finished, "rates": rates}


def rotation(policies: Sequence[str], rep: int) -> list[str]:
    """The policies' order in a repetition: as given, reversed every other one (A B C D, D C B A, ...), so that a
    drift of the host within a concurrency's runs falls on every policy alike (in the given order `wcs` always ran
    last, a minute or more after `ar`). `forespark bench serve` orders its repeats so too; it talks to the system over
    HTTP only (DESIGN.md section 3), so the two do not share the function."""
    return list(policies) if rep % 2 == 0 else list(reversed(policies))


def schedule(policies: Sequence[str], concurrency: Sequence[int], reps: int) -> list[tuple[int, int | None, str]]:
    """The bench's runs in order, as (concurrency, repetition, policy): at each concurrency an untimed round of every
    policy (repetition None) puts the engine in the state the timed runs then share, and the timed repetitions follow
    in `rotation` order."""
    runs: list[tuple[int, int | None, str]] = []
    for c in concurrency:
        runs += [(c, None, p) for p in policies]
        runs += [(c, rep, p) for rep in range(reps) for p in rotation(policies, rep)]
    return runs


def matched_ratio(rows: list[EngineRun], ours: str, base: str) -> tuple[float | None, float | None]:
    """Throughput ratio ours/base at the lowest per-request rate both policies' runs reach."""

    def curve(policy: str) -> tuple[np.ndarray, np.ndarray]:
        pts = sorted((r.per_request_rate, r.tokens_per_s) for r in rows if r.policy == policy and r.per_request_rate > 0)
        return np.array([p[0] for p in pts]), np.array([p[1] for p in pts])

    (ro, to), (rb, tb) = curve(ours), curve(base)
    if not len(ro) or not len(rb):
        return None, None
    rate = max(ro.min(), rb.min())
    if rate > min(ro.max(), rb.max()):
        return None, None  # the curves do not overlap
    return float(np.interp(rate, ro, to) / np.interp(rate, rb, tb)), float(rate)


def bench_engine_config(base, concurrency: tuple[int, ...], draft_sampling: str | None = None):
    """`base` (an `EngineConfig`) sized for the bench: a slot and KV room for every request in flight at the highest
    concurrency (the workload's requests need about 200 tokens each; the default 512 MiB holds some 18k tokens of the embedded pair),
    and the drafts sampled as `draft_sampling` says (None: as `base` does)."""
    update: dict = {"max_num_seqs": max(concurrency), "kv_cache_memory_bytes": 1536 << 20}
    if draft_sampling and base.drafter is not None:
        update["drafter"] = base.drafter.model_copy(update={"draft_sample_method": draft_sampling})
    return base.model_copy(update=update)


def run_engine_bench(
    policies: tuple[str, ...] = POLICIES,
    concurrency: tuple[int, ...] = CONCURRENCY,
    requests_per_slot: int = 2,
    reps: int = 3,
    max_tokens: int | None = None,
    engine_config=None,
    progress: Callable[[str], None] | None = None,
    temperature: float = 0.0,
) -> EngineBench:
    from replicas.engine import EngineConfig, make_llm
    from replicas.models.workloads import mixed_workload

    config = engine_config or bench_engine_config(EngineConfig(), concurrency)
    llm = make_llm(config)
    prompts = mixed_workload(128, seed=config.seed)
    # Warm every code path once before timing.
    for policy in policies:
        llm.collective_rpc("wcs_set_policy", args=(policy,))
        run_closed_loop(llm, prompts, 2, 2, 8, tag=f"warm-{policy}")
    rows: list[EngineRun] = []
    for c in concurrency:
        runs: dict[str, list[EngineRun]] = {p: [] for p in policies}
        for _, rep, policy in schedule(policies, (c,), reps):
            llm.collective_rpc("wcs_set_policy", args=(policy,))  # also resets the counters
            if rep is None:
                run_closed_loop(llm, prompts, c, 2 * c, max_tokens, tag=f"settle-{policy}-{c}", temperature=temperature,
                                seed=config.seed + 999_999)
                continue
            out = run_closed_loop(llm, prompts, c, requests_per_slot * c, max_tokens, tag=f"{policy}-{c}-{rep}",
                                  temperature=temperature, seed=config.seed + 100_000 * rep)
            stats = WCSStats(**llm.collective_rpc("wcs_stats")[0])
            runs[policy].append(
                EngineRun(
                    policy=policy,
                    concurrency=c,
                    finished=out["finished"],
                    output_tokens=out["tokens"],
                    seconds=out["seconds"],
                    tokens_per_s=out["tokens"] / out["seconds"],
                    per_request_rate=float(np.median(out["rates"])) if out["rates"] else 0.0,
                    mean_accepted_length=stats.mean_accepted_length,
                    draft_waste=stats.draft_waste,
                    draft_share=stats.draft_share,
                    planner_share=stats.planner_ms / stats.step_ms if stats.step_ms else 0.0,
                    steps=stats.steps,
                )
            )
        for policy in policies:
            rows.append(median_run(runs[policy]))
            if progress:
                progress(format_rows([rows[-1]], header=len(rows) == 1))
    ratios, rates = {}, {}
    for base in ("dspark", "ar", "static"):
        if "wcs" in policies and base in policies:
            ratios[f"wcs_vs_{base}"], rates[f"wcs_vs_{base}"] = matched_ratio(rows, "wcs", base)
    drafter = config.drafter
    return EngineBench(temperature=temperature, draft_sample_method=drafter.draft_sample_method if drafter else "greedy",
                       ratios=ratios, matched_rate=rates, rows=rows, wcs_vs_best=wcs_vs_best(rows),
                       wcs_vs_best_paired=wcs_vs_best_paired(rows))


def median_run(runs: list[EngineRun]) -> EngineRun:
    """Per-field medians of repeated runs of one (policy, concurrency)."""
    fields = {
        name: float(np.median([getattr(r, name) for r in runs]))
        for name, value in runs[0]
        if isinstance(value, float)
    }
    counts = {name: int(np.median([getattr(r, name) for r in runs])) for name in ("finished", "output_tokens", "steps")}
    return runs[0].model_copy(
        update={**fields, **counts, "reps": len(runs), "runs_tokens_per_s": [r.tokens_per_s for r in runs]}
    )


def format_rows(rows: list[EngineRun], header: bool = True) -> str:
    lines = []
    if header:
        lines.append(
            f"{'policy':>7} {'conc':>5} {'tok/s':>8} {'tok/s/req':>9} {'acc len':>7} {'waste':>6} {'draft%':>6} {'plan%':>6}"
        )
    for r in rows:
        lines.append(
            f"{r.policy:>7} {r.concurrency:>5} {r.tokens_per_s:>8.1f} {r.per_request_rate:>9.2f} "
            f"{r.mean_accepted_length:>7.2f} {r.draft_waste:>6.1%} {r.draft_share:>6.1%} {r.planner_share:>6.1%}"
        )
    return "\n".join(lines)


def format_engine_bench(result: EngineBench) -> str:
    lines = [f"temperature {result.temperature:g}, {result.draft_sample_method} drafts", format_rows(result.rows)]
    best = ", ".join(f"c={c}: {v:.2f}" for c, v in result.wcs_vs_best.items() if v is not None)
    if best:
        lines.append(f"wcs over the best other policy per concurrency (ratio of medians): {best}")
    paired = ", ".join(f"c={c}: {v:.2f}" for c, v in result.wcs_vs_best_paired.items() if v is not None)
    if paired:
        lines.append(f"... (median of the repetitions' ratios): {paired}")
    for name, ratio in result.ratios.items():
        rate = result.matched_rate[name]
        lines.append(
            f"{name}: {ratio:.2f}x at {rate:.2f} tok/s per request" if ratio is not None else f"{name}: curves do not overlap"
        )
    return "\n".join(lines)
