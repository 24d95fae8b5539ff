"""WCS inside the real vLLM CPU engine: the plugin loads from engine kwargs, every policy keeps the
output distribution, drafting is really ragged, and steps without drafts keep the drafter's context.

One engine for the module, built from the engine kwargs exactly as the README documents them;
policies are switched through the workers. Its step-cost model is set to a synthetic one under
which drafting pays (named `DRAFTING_PAYS` below): on this CPU the profiled model makes `wcs`
draft little, and a greedy-identity test over steps that never draft would prove nothing. The online
step-cost correction is off but in its own test: it would learn this CPU's drafting costs back.
"""

import numpy as np
import pytest
import torch
from scipy.stats import chi2_contingency

from replicas.engine import cpu_engine_environment, model_runner
from replicas.models.build import WEIGHTS_DIR
from replicas.models.workloads import load_workloads
from replicas.wcs.config import WCSConfig
from replicas.wcs.stats import WCSStats
from scheduling.cost_model import StepCostModel

cpu_engine_environment()

POLICIES = ("ar", "static", "dspark", "wcs")
DRAFTING_PAYS = StepCostModel.linear(intercept_ms=10.0, per_request_ms=0.05, per_draft_ms=0.01, per_target_ms=0.05)
ALPHA = 1e-3


def readme_engine(**speculative):
    """The README's "WCS in a vLLM engine" snippet, verbatim but for the path prefix (and `speculative`, more
    speculative_config keys), under the DRAFTING_PAYS step costs without their online correction."""
    from vllm import LLM

    engine = LLM(
        model=str(WEIGHTS_DIR / "target"),
        dtype="float32",
        speculative_config={"method": "dflash", "model": str(WEIGHTS_DIR / "drafter"), "num_speculative_tokens": 8,
                            **speculative},
        worker_cls="replicas.wcs.worker.WCSWorker",
        additional_config={"forespark": {"policy": "wcs"}},
        async_scheduling=False,
        max_num_seqs=64,
        kv_cache_memory_bytes=512 << 20,
        enforce_eager=True,
    )
    engine.collective_rpc("wcs_set_cost_model", args=(DRAFTING_PAYS.model_dump_json(),))
    engine.collective_rpc("wcs_set_online_cost", args=(False,))
    return engine


@pytest.fixture(scope="module")
def llm():
    return readme_engine()


def stats(llm) -> WCSStats:
    return WCSStats.model_validate(llm.collective_rpc("wcs_stats")[0])


def run(llm, policy, prompts, params):
    llm.collective_rpc("wcs_set_policy", args=(policy,))
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs], stats(llm)


def test_documented_engine_kwargs_load_the_plugin(llm):
    from replicas.wcs.runner import WCSRunnerMixin

    assert isinstance(model_runner(llm), WCSRunnerMixin)
    assert stats(llm).policy == "wcs"  # from additional_config
    with pytest.raises(Exception, match="oracle"):
        llm.collective_rpc("wcs_set_policy", args=("oracle",))


def greedy_policy_runs(llm) -> dict[str, tuple[list, WCSStats]]:
    """Every policy's greedy outputs and stats on the same prompts (what each engine test compares to `ar`)."""
    from vllm import SamplingParams

    work = load_workloads()
    prompts = [p.prompt for d in work for p in work[d][:6]]
    params = SamplingParams(temperature=0.0, max_tokens=48)
    return {policy: run(llm, policy, prompts, params) for policy in POLICIES}


def assert_greedy_identical_and_verified(greedy_runs, policy: str) -> None:
    tokens, st = greedy_runs[policy]
    assert tokens == greedy_runs["ar"][0]
    assert st.verified > 0 and st.accepted > 0  # speculation really ran and drafts were accepted


@pytest.fixture(scope="module")
def greedy_runs(llm):
    return greedy_policy_runs(llm)


@pytest.mark.parametrize("policy", POLICIES[1:])
def test_greedy_outputs_are_token_identical_to_ar(greedy_runs, policy):
    assert_greedy_identical_and_verified(greedy_runs, policy)


def test_policies_differ_only_in_widths_and_verify_lengths(greedy_runs):
    ar, static, dspark, wcs = (greedy_runs[p][1] for p in POLICIES)
    assert ar.drafted == 0 and ar.drafter_passes == 0
    # static verifies every drafted token (waste only from requests that ended with drafts in hand);
    # dspark drafts full blocks and verifies fewer; wcs drafts ragged widths. Full blocks still thin out at the
    # last positions where a request has fewer than 8 tokens left (no draft passes max_tokens).
    assert static.draft_waste < 0.03 and static.drafted_per_pos[-1] > 0.8 * static.drafted_per_pos[0]
    assert dspark.draft_waste > 0.2 and dspark.drafted_per_pos[-1] > 0.8 * dspark.drafted_per_pos[0]
    assert wcs.drafted_per_pos[-1] < 0.8 * wcs.drafted_per_pos[0]


def test_ragged_widths_shrink_the_drafters_work(llm):
    """The drafter's forward pass runs 1 + d_i query rows per request, not 1 + K masked afterwards,
    and not at all in a step where nobody drafts."""
    from vllm import SamplingParams

    prompts = [p.prompt for p in load_workloads()["code"][:8]]
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    logged = {}
    for policy in ("static", "wcs"):
        llm.collective_rpc("wcs_set_policy", args=(policy,))
        llm.collective_rpc("wcs_step_log", args=(True,))
        llm.generate(prompts, params, use_tqdm=False)
        logged[policy] = [s for s in llm.collective_rpc("wcs_step_log", args=(False,))[0] if not s["prefill"]]
    k = 8
    for policy, steps in logged.items():
        for s in steps:
            expected = s["requests"] + s["drafted_tokens"] if s["drafted_tokens"] else 0
            assert s["drafter_rows"] == expected, (policy, s)
    full = [s for s in logged["static"] if s["drafted_tokens"] == s["requests"] * k]
    assert len(full) > 5 and all(s["drafter_rows"] == s["requests"] * (1 + k) for s in full)
    ragged = [s for s in logged["wcs"] if 0 < s["drafted_tokens"] < s["requests"] * k]
    assert len(ragged) > 5
    # The step log keeps each plan's prediction beside what the step took.
    assert all(s["predicted_ms"] > 0 and s["expected_tokens"] > s["requests"] for s in ragged)


def test_a_tpot_pace_keeps_greedy_outputs_and_gives_way_where_it_cannot_bind(llm, greedy_runs):
    """`pace_tpot_ms` in the engine (which steps it shortens is tested on the controller): at a pace no
    step can keep (a microsecond per token) every request is left to the argmax, and at one every step
    keeps (a second) none binds, so wcs drafts either way; 12 ms, near the synthetic profile's step, is
    between the two (whether it binds there depends on this machine's step times, so it is not asserted).
    Greedy outputs stay AR's at every pace."""
    from vllm import SamplingParams

    work = load_workloads()
    prompts = [p.prompt for d in work for p in work[d][:6]]
    params = SamplingParams(temperature=0.0, max_tokens=48)
    try:
        for pace in (1e-3, 12.0, 1e3):
            llm.collective_rpc("wcs_set_pace", args=(pace,))
            tokens, st = run(llm, "wcs", prompts, params)
            assert tokens == greedy_runs["ar"][0], pace
            assert st.drafted > 0, pace
    finally:
        llm.collective_rpc("wcs_set_pace", args=(None,))


def test_plans_without_drafts_hold_for_the_next_steps(llm):
    """Where drafting never pays, `wcs` plans at most one step in `replan_every` (the default; holds double
    in a row) and holds the plan without drafts in between, skipping the features and the planner, drafting
    only its one-token probes; where it pays (the module's cost model), it plans every step (negative control)."""
    from vllm import SamplingParams

    prompts = [p.prompt for p in load_workloads()["code"][:8]]
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    llm.collective_rpc("wcs_set_cost_model", args=(NEVER_PAYS.model_dump_json(),))
    try:
        _, held = run(llm, "wcs", prompts, params)
    finally:
        llm.collective_rpc("wcs_set_cost_model", args=(DRAFTING_PAYS.model_dump_json(),))
    assert held.drafted == held.probes and held.steps > 40
    every = WCSConfig().replan_every
    assert held.held_steps / held.steps >= (every - 1) / every - 0.1
    _, planned = run(llm, "wcs", prompts, params)
    assert planned.drafted > 0 and planned.held_steps < 0.1 * planned.steps


def test_served_steps_correct_the_step_cost_online(llm):
    """Steps that run back to back feed the online correction (`scheduling/online_cost.py`): the
    offsets the engine reports are those of a correction fed, here, with the step log's rows (R, D,
    planned target tokens, period, prefill tokens, stored context rows and their time). The profile is off by
    some 200 ms (steps here take 10-50 ms), so the correction must move it down whatever this machine's speed
    or load (a profile off by less is within reach of a contended machine's steps); drafting still pays
    under it. Negative control: with the correction off the profile is served as it is."""
    from vllm import SamplingParams

    from scheduling.online_cost import OnlineCostModel

    profile = DRAFTING_PAYS.model_copy(update={"intercept_ms": 200.0})
    prompts = [p.prompt for p in load_workloads()["code"][:8]]
    params = SamplingParams(temperature=0.0, max_tokens=96, ignore_eos=True)
    llm.collective_rpc("wcs_set_policy", args=("wcs",))
    llm.collective_rpc("wcs_set_cost_model", args=(profile.model_dump_json(),))  # a fresh correction
    llm.collective_rpc("wcs_set_online_cost", args=(True,))
    try:
        llm.collective_rpc("wcs_step_log", args=(True,))
        llm.generate(prompts, params, use_tqdm=False)
        steps = llm.collective_rpc("wcs_step_log", args=(False,))[0]
        reported = stats(llm)
    finally:
        llm.collective_rpc("wcs_set_online_cost", args=(False,))  # the module's setting, whatever fails
    replay = OnlineCostModel(profile)
    for s, nxt in zip(steps, steps[1:]):
        if s["planned"] and set(s["planned"]) & set(nxt["planned"]):
            planned = s["requests"] + s["verified_tokens"]
            period_ms = (nxt["start"] - s["start"]) * 1e3
            replay.observe(
                s["requests"], s["drafted_tokens"], planned, period_ms, s["target_tokens"] - planned,
                s["context_rows"], s["context_ms"],
            )
    assert replay.seen >= 32 and sum(s["drafted_tokens"] for s in steps) > 0
    assert replay.offset_ms < -50.0  # corrected towards what the steps took
    assert reported.step_cost_offset_ms == pytest.approx(replay.offset_ms, abs=1e-6)
    assert reported.launch_offset_ms == pytest.approx(replay.launch_offset_ms, abs=1e-6)

    llm.generate(prompts, params, use_tqdm=False)
    assert stats(llm).step_cost_offset_ms == 0.0 and stats(llm).launch_offset_ms == 0.0
    llm.collective_rpc("wcs_set_cost_model", args=(DRAFTING_PAYS.model_dump_json(),))


def _later_position_acceptance(llm, policy, profiling_seed=None):
    """Mean over draft positions 2..4 of P(first j drafts accepted | position j verified), greedy."""
    from vllm import SamplingParams

    work = load_workloads()
    prompts = [p.prompt for d in work for p in work[d][:12]]
    llm.collective_rpc("wcs_set_policy", args=(policy,))
    llm.collective_rpc("wcs_profiling", args=(profiling_seed, 0.75))
    try:
        llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=64), use_tqdm=False)
    finally:
        llm.collective_rpc("wcs_profiling", args=(None,))
    st = stats(llm)
    return float(np.mean([st.accepted_per_pos[j] / st.verified_per_pos[j] for j in (1, 2, 3)])), st


@pytest.fixture(scope="module")
def full_block_acceptance(llm):
    return _later_position_acceptance(llm, "static")[0]


@pytest.fixture(scope="module")
def random_width_run(llm):
    return _later_position_acceptance(llm, "wcs", profiling_seed=5)


def test_random_widths_and_draft_free_steps_accept_like_full_blocks(random_width_run, full_block_acceptance):
    """Random widths, three steps in four drafting nothing (the drafter does not run; their context
    K/V is stored by the next step that drafts): drafts are accepted as often as with full blocks."""
    acceptance, st = random_width_run
    assert st.drafter_passes < 0.7 * st.steps  # many steps really skipped the drafter's forward pass
    assert acceptance > 0.9 * full_block_acceptance > 0.1


def test_without_the_context_kv_of_draft_free_steps_drafts_degrade(llm, random_width_run, monkeypatch):
    """Negative control: the same run, with the deferred context K/V of draft-free steps dropped."""
    drafter = model_runner(llm).drafter
    monkeypatch.setattr(drafter, "flush_context", lambda: drafter._deferral.empty())
    broken, _ = _later_position_acceptance(llm, "wcs", profiling_seed=5)
    assert broken < 0.7 * random_width_run[0]


# Sampled outputs. The first token comes from the prefill step; with max_tokens=4 the next step
# drafts up to 2 positions, so tokens 2 and 3 are where verification acts.
SAMPLES_PER_PROMPT = 400
TEMPERATURE = 0.5
# Short prompts whose first drafts the target often accepts at this temperature (scanned once).
SAMPLED_PROMPTS = (("code", 26), ("prose", 26), ("code", 0))
# Sampled drafts are accepted less than greedy ones, and the estimator learns it online: with verification
# this cheap every policy still drafts and verifies most of the two positions it may, wcs not all of them.
VERIFYING_IS_CHEAP = StepCostModel.linear(intercept_ms=10.0, per_request_ms=0.05, per_draft_ms=0.001, per_target_ms=0.001)


def sampled_continuations(llm, policy: str) -> tuple[list[tuple], WCSStats]:
    """Samples from the engine's seeded global generator."""
    from vllm import SamplingParams

    work = load_workloads()
    prompts = [work[domain][i].prompt[-120:] for domain, i in SAMPLED_PROMPTS]
    batch = [(n, p) for n, p in enumerate(prompts) for _ in range(SAMPLES_PER_PROMPT)]
    params = SamplingParams(temperature=TEMPERATURE, max_tokens=4, ignore_eos=True)
    llm.collective_rpc("wcs_set_policy", args=(policy,))
    outs = llm.generate([p for _, p in batch], params, use_tqdm=False)
    return [(n, *o.outputs[0].token_ids[1:3]) for (n, _), o in zip(batch, outs)], stats(llm)


def homogeneity_pvalue(a: list[tuple], b: list[tuple], min_count: int = 10) -> float:
    """Two-sample chi-square over (prompt, token 2, token 3), rare outcomes pooled per prompt."""
    from collections import Counter

    ca, cb = Counter(a), Counter(b)
    keys = set(ca) | set(cb)
    pooled = lambda key: key if ca[key] + cb[key] >= min_count else (key[0], "rare")  # noqa: E731
    table: dict = {}
    for key in keys:
        row = table.setdefault(pooled(key), [0, 0])
        row[0] += ca[key]
        row[1] += cb[key]
    return float(chi2_contingency(np.array(list(table.values())).T)[1])


@pytest.fixture(scope="module")
def ar_samples(llm):
    llm.collective_rpc("wcs_set_cost_model", args=(VERIFYING_IS_CHEAP.model_dump_json(),))
    yield sampled_continuations(llm, "ar")[0]
    llm.collective_rpc("wcs_set_cost_model", args=(DRAFTING_PAYS.model_dump_json(),))


@pytest.mark.parametrize("policy", POLICIES[1:])
def test_sampled_continuations_keep_the_target_distribution(llm, ar_samples, policy):
    samples, st = sampled_continuations(llm, policy)
    assert st.verified > 2000 and st.accepted > 300  # verification really decided tokens 2 and 3
    assert homogeneity_pvalue(samples, ar_samples) > ALPHA


def test_a_planted_lossy_verifier_is_rejected(llm, ar_samples, monkeypatch):
    """Negative control, same sample size: a verifier that keeps a rejected draft instead of the
    corrected token. (A width or verify-length rule alone cannot be lossy here: the drafter is
    greedy, so its drafts are a function of the context, never of the target's samples.)"""
    plant_lossy_verifier(llm, monkeypatch)
    samples, _ = sampled_continuations(llm, "static")
    assert homogeneity_pvalue(samples, ar_samples) < 1e-6


def plant_lossy_verifier(llm, monkeypatch) -> None:
    """Make the engine's verifier keep each rejected draft instead of the corrected token."""
    runner = model_runner(llm)
    sample = runner._sample

    def keep_rejected_drafts(logits, meta):
        out = sample(logits, meta)
        if meta is not None:
            ids = out.sampled_token_ids
            ends = meta.cu_num_draft_tokens.cpu().tolist()
            for i, v in enumerate(meta.num_draft_tokens):
                emitted = int((ids[i] >= 0).sum())
                if v and emitted <= v:  # draft `emitted - 1` was rejected and replaced
                    ids[i, emitted - 1] = meta.draft_token_ids[ends[i] - v + emitted - 1]
        return out

    monkeypatch.setattr(runner, "_sample", keep_rejected_drafts)


def test_cached_profiles_are_kept_apart_by_cpu_threads(tmp_path, monkeypatch):
    """A serving replica runs on its `num_cpus` threads (Ray sets OMP_NUM_THREADS), a benchmark on all
    cores: one profile must not price the other's steps."""
    from replicas.engine import EngineConfig
    from replicas.wcs.profiler import with_cost_model

    monkeypatch.setenv("FORESPARK_CACHE", str(tmp_path))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    one = with_cost_model(EngineConfig()).wcs.cost_model
    monkeypatch.delenv("OMP_NUM_THREADS")
    every = with_cost_model(EngineConfig()).wcs.cost_model
    assert with_cost_model(EngineConfig()).wcs.cost_model == every  # the same setting finds the same profile
    assert one != every and one.parent == every.parent == tmp_path / "step_cost"


# A prompt whose greedy continuation repeats itself: the drafter's blocks are mostly accepted.
REPETITIVE = "values = [" + "1, 2, 3, " * 24
TRAP_COST = DRAFTING_PAYS.model_copy(update={"draft_launch_ms": 1.0})  # pays at 0.7+, not at a believed 0.05


def plant_wrong_belief(worker, closed_loop: bool):
    """An estimator sure that 0.05 of drafts are accepted; probes and recalibration as asked."""
    from scheduling.estimators import ConstantEstimator
    from scheduling.exploration import ProbeSchedule
    from scheduling.recalibration import OnlineRecalibrator

    ctl = worker.model_runner.wcs
    ctl.estimator = ConstantEstimator(ctl.k, prior=0.05, prior_weight=1e6)
    ctl.recalibrator = OnlineRecalibrator(ctl.k) if closed_loop else None
    ctl.probes = ProbeSchedule(16) if closed_loop else None
    return True


def verified_per_step(llm, policy: str, closed_loop: bool = True) -> tuple[list[int], WCSStats]:
    from vllm import SamplingParams

    llm.collective_rpc("wcs_set_policy", args=(policy,))
    llm.collective_rpc(plant_wrong_belief, args=(closed_loop,))
    llm.collective_rpc("wcs_step_log", args=(True,))
    llm.generate([REPETITIVE] * 4, SamplingParams(temperature=0.0, max_tokens=480, ignore_eos=True), use_tqdm=False)
    steps = llm.collective_rpc("wcs_step_log", args=(False,))[0]
    return [s["verified_tokens"] for s in steps if not s["prefill"] and s["requests"] == 4], stats(llm)


@pytest.fixture(scope="module")
def trap_runs(llm):
    llm.collective_rpc("wcs_set_cost_model", args=(TRAP_COST.model_dump_json(),))
    try:
        yield {name: verified_per_step(llm, policy, closed) for name, policy, closed in (
            ("static", "static", True), ("wcs", "wcs", True), ("wcs_open_loop", "wcs", False),
        )}
    finally:
        llm.collective_rpc("wcs_set_cost_model", args=(DRAFTING_PAYS.model_dump_json(),))
        llm.collective_rpc(restore_estimators)


def restore_estimators(worker):
    worker.model_runner.wcs.forget_learning()  # every policy: the planted beliefs went to static's and wcs's
    return True


def test_probes_and_recalibration_get_wcs_out_of_a_wrong_belief_within_64_steps(trap_runs):
    static_steps, static = trap_runs["static"]
    assert static.accepted >= 0.7 * static.verified  # the prompt this test needs
    wcs, _ = trap_runs["wcs"]
    assert len(wcs) >= 64
    assert np.mean(wcs[48:64]) >= 0.8 * np.mean(static_steps), (wcs[:64], np.mean(static_steps))


def test_without_probes_and_recalibration_wcs_stays_trapped(trap_runs):
    """Negative control: the same engine and belief, open loop."""
    static_steps, _ = trap_runs["static"]
    trapped, _ = trap_runs["wcs_open_loop"]
    assert np.mean(trapped[48:64]) < 0.2 * np.mean(static_steps)


NEVER_PAYS = StepCostModel.linear(intercept_ms=10.0, per_request_ms=0.05, per_draft_ms=100.0, per_target_ms=0.05)


def no_draft_step_ms(llm, policy: str, prompts: list[str], batch: int) -> list[float]:
    from vllm import SamplingParams

    llm.collective_rpc("wcs_set_policy", args=(policy,))
    llm.collective_rpc("wcs_step_log", args=(True,))
    llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True), use_tqdm=False)
    steps = llm.collective_rpc("wcs_step_log", args=(False,))[0]
    return [
        s["runner_ms"] for s in steps
        if s["requests"] == batch and not s["prefill"] and not s["drafted_tokens"] and not s["verified_tokens"]
    ]


def draft_free_step_ratio(llm, prompts: list[str], pairs: int = 6) -> float:
    """wcs's draft-free step over `ar`'s at the same batch, where drafting never pays: a discarded warm-up run
    of each, then `pairs` pairs of runs in ABBA order, each pair's ratio of median steps, and the median of
    those. A slow spell of this shared host moves a pair, not the figure (pooling every step did not hold:
    1.11 on a slow CI run where the pairs here give 0.98-1.08)."""
    batch = len(prompts)
    llm.collective_rpc("wcs_set_cost_model", args=(NEVER_PAYS.model_dump_json(),))
    try:
        for policy in ("ar", "wcs"):
            no_draft_step_ms(llm, policy, prompts, batch)
        ratios = []
        for n in range(pairs):
            order = ("ar", "wcs") if n % 2 == 0 else ("wcs", "ar")
            med = {policy: np.median(no_draft_step_ms(llm, policy, prompts, batch)) for policy in order}
            ratios.append(med["wcs"] / med["ar"])
    finally:
        llm.collective_rpc("wcs_set_cost_model", args=(DRAFTING_PAYS.model_dump_json(),))
    return float(np.median(ratios))


def test_a_step_that_drafts_nothing_costs_what_an_ar_step_costs(llm, monkeypatch):
    """The autoregressive mode: wcs's draft-free steps (holds, drafter context kept for a return) against `ar`'s.
    The target is 1.05; the bound leaves room for this shared machine's noise. Control: the same measurement
    with a planted 20% of an `ar` step added to each stored context is over the bound."""
    import time

    prompts = [p.prompt for p in load_workloads()["code"][:16]]
    steps = no_draft_step_ms(llm, "ar", prompts, 16)
    assert len(steps) > 40
    ratio = draft_free_step_ratio(llm, prompts)
    print(f"draft-free wcs step / ar step: {ratio:.3f}")
    assert ratio <= 1.10

    drafter, planted_s = model_runner(llm).drafter, 0.2 * float(np.median(steps)) / 1e3
    defer = drafter.defer_context

    def slow_defer(*args):
        until = time.perf_counter() + planted_s
        while time.perf_counter() < until:
            pass
        defer(*args)

    monkeypatch.setattr(drafter, "defer_context", slow_defer)
    planted = draft_free_step_ratio(llm, prompts)
    print(f"... with a planted 20% upkeep: {planted:.3f}")
    assert planted > 1.10
