"""WCS with drafts sampled from the drafter (vLLM's `draft_sample_method: probabilistic`) in the real vLLM CPU
engine: the drafter's probabilities reach vLLM's ratio test row for row, through ragged widths and cut
verify lengths, and the output distribution stays the target's.

The same sampled workload and two-sample test as `test_wcs_engine.py`. Its planted lossy verifier is no
control here: verification that treats a draft as one-hot is exact whatever proposed the draft. What sampled
drafts add is the drafter's probabilities, so the control hands the ratio test other ones.
"""

import pytest
import torch

from replicas.engine import cpu_engine_environment, model_runner
from replicas.models.workloads import load_workloads
from tests.test_wcs_engine import (
    ALPHA,
    DRAFTING_PAYS,
    VERIFYING_IS_CHEAP,
    homogeneity_pvalue,
    readme_engine,
    sampled_continuations,
)

cpu_engine_environment()


@pytest.fixture(scope="module")
def llm():
    return readme_engine(draft_sample_method="probabilistic")


@pytest.fixture(scope="module")
def ar_samples(llm):
    llm.collective_rpc("wcs_set_cost_model", args=(VERIFYING_IS_CHEAP.model_dump_json(),))
    yield sampled_continuations(llm, "ar")[0]
    llm.collective_rpc("wcs_set_cost_model", args=(DRAFTING_PAYS.model_dump_json(),))


def drafter_probs(llm, monkeypatch, change) -> None:
    """Pass the drafter's probabilities ([B, K, V], or None) through `change` on their way to the ratio test."""
    drafter = model_runner(llm).drafter
    take = drafter.take_last_draft_probs
    monkeypatch.setattr(drafter, "take_last_draft_probs", lambda: (lambda p: None if p is None else change(p))(take()))


@pytest.mark.parametrize("policy", ["static", "wcs"])
def test_sampled_drafts_keep_the_target_distribution(llm, ar_samples, policy):
    from vllm import SamplingParams

    # Greedy steps first, as in test_wcs_engine.py: from its fitted beliefs alone wcs would hardly draft for
    # this pair's sampled requests, and a test over steps that never draft would prove nothing.
    llm.collective_rpc("wcs_set_policy", args=(policy,))
    llm.generate([p.prompt for p in load_workloads()["code"][:16]], SamplingParams(temperature=0.0, max_tokens=64),
                 use_tqdm=False)
    samples, st = sampled_continuations(llm, policy)
    assert st.verified > 2000 and st.accepted > 300  # verification really decided tokens 2 and 3
    assert homogeneity_pvalue(samples, ar_samples) > ALPHA


def test_the_drafters_probabilities_reach_the_ratio_test(llm, ar_samples, monkeypatch):
    _, with_probs = sampled_continuations(llm, "static")
    drafter_probs(llm, monkeypatch, lambda p: None)  # vLLM then reads each sampled draft as certain
    _, without = sampled_continuations(llm, "static")
    assert with_probs.accepted / with_probs.verified > without.accepted / without.verified


def test_probabilities_other_than_the_drafters_are_caught(llm, ar_samples, monkeypatch):
    """Negative control, same sample size: each sampled draft judged against uniform probabilities instead of
    the distribution it was drawn from."""
    drafter_probs(llm, monkeypatch, lambda p: torch.full_like(p, 1.0 / p.shape[-1]))
    samples, _ = sampled_continuations(llm, "static")
    assert homogeneity_pvalue(samples, ar_samples) < 1e-6


def test_the_engine_bench_samples_at_its_temperature(llm):
    """`forespark bench engine --temperature 1`: its closed loop sends sampled requests. At T=1 this pair accepts
    far fewer drafts per verified one than greedy on the same prompts, so a loop that dropped the temperature
    (greedy at both) would give the same rate twice."""
    from replicas.models.workloads import mixed_workload
    from replicas.wcs.bench import run_closed_loop
    from replicas.wcs.stats import WCSStats

    prompts = mixed_workload(32, seed=0)
    rates = {}
    for temperature in (0.0, 1.0):
        llm.collective_rpc("wcs_set_policy", args=("static",))  # also resets the counters
        out = run_closed_loop(llm, prompts, 8, 16, 32, tag=f"t{temperature:g}", temperature=temperature, seed=0)
        st = WCSStats(**llm.collective_rpc("wcs_stats")[0])
        assert out["finished"] >= 16 and st.verified > 200
        rates[temperature] = st.accepted / st.verified
    assert rates[1.0] < 0.7 * rates[0.0]
