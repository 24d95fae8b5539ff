"""The embedded models in the real vLLM CPU engine: with and without the DFlash drafter.

One engine of each kind per module (engine start is ~15 s here).
"""

import os
import subprocess
import sys
import textwrap
import types

import pytest
import torch

from replicas.engine import EngineConfig, cpu_engine_environment, make_llm, model_runner
from replicas.models.workloads import load_workloads

cpu_engine_environment()


@pytest.fixture(scope="module")
def spec_llm():
    # Plain vLLM speculation (no WCS): these tests are about the models inside vLLM.
    return make_llm(EngineConfig(wcs=None))


def recorder_of(llm):
    """One VerdictCounter per engine: acceptance counted from the engine's own verdicts (vLLM's
    Prometheus counters only follow the newest engine in a process)."""
    from replicas.models.verdicts import VerdictCounter

    if not hasattr(llm, "_forespark_recorder"):
        llm._forespark_recorder = VerdictCounter(llm)
    return llm._forespark_recorder


@pytest.fixture(scope="module")
def plain_llm():
    return make_llm(EngineConfig(drafter=None))


@pytest.fixture(scope="module")
def narrow_llm():
    # Engines live as long as the module: dropping one tears down vLLM's process-wide parallel state.
    from replicas.engine import DrafterConfig

    return make_llm(EngineConfig(drafter=DrafterConfig(num_speculative_tokens=3), wcs=None))


def greedy_tokens(llm, prompts, max_tokens=48):
    from vllm import SamplingParams

    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens), use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def test_greedy_outputs_are_identical_with_and_without_speculation(spec_llm, plain_llm):
    work = load_workloads()
    prompts = [p.prompt for d in work for p in work[d][:8]]
    recorder = recorder_of(spec_llm)
    start = len(recorder.rows)
    with_spec = greedy_tokens(spec_llm, prompts)
    ran = recorder.counters(start)
    assert with_spec == greedy_tokens(plain_llm, prompts)
    assert ran.drafts > 0 and ran.accepted > 0  # speculation really ran, and drafts were accepted


def domain_acceptance(llm, prompts_per_domain=24):
    """Mean accepted length (accepted drafts + bonus) per domain, greedy, from vLLM's own counters."""
    from vllm import SamplingParams

    recorder = recorder_of(llm)
    out = {}
    for domain, prompts in load_workloads().items():
        chosen = prompts[:prompts_per_domain]
        start = len(recorder.rows)
        llm.generate(
            [p.prompt for p in chosen], [SamplingParams(temperature=0.0, max_tokens=p.max_tokens) for p in chosen],
            use_tqdm=False,
        )
        c = recorder.counters(start)
        out[domain] = (1.0 + c.accepted / c.drafts, [a / c.drafts for a in c.accepted_per_pos])
    return out


@pytest.fixture(scope="module")
def full_width_acceptance(spec_llm):
    return domain_acceptance(spec_llm)


def test_code_accepts_long_drafts_and_domains_differ(full_width_acceptance):
    code, prose = full_width_acceptance["code"][0], full_width_acceptance["prose"][0]
    assert code >= 3.0
    # Measured 12% apart (code 3.36, prose 3.00); the 20% is not reached by this pair.
    assert (code - prose) / prose >= 0.06


def test_a_narrower_draft_is_the_full_blocks_prefix(spec_llm, narrow_llm):
    """Width robustness in the engine: vLLM drafting 3 positions produces exactly the logits of the
    first 3 positions of the full block (the causal block never looks ahead)."""
    prompt = load_workloads()["prose"][5].prompt
    narrow, _, bonus_n = _first_draft_logits(narrow_llm, prompt)
    full, _, bonus_f = _first_draft_logits(spec_llm, prompt)
    assert bonus_n == bonus_f and narrow.shape[0] == 3
    torch.testing.assert_close(narrow, full[:3], rtol=1e-4, atol=1e-4)


def _drafter_model(llm):
    return model_runner(llm).drafter.model


def _first_draft_logits(llm, prompt):
    """Logits of vLLM's drafter for the first block after prefill, and the tokens that framed it."""
    from vllm import SamplingParams

    model = _drafter_model(llm)
    recorded = []
    original = model.compute_logits

    def compute_logits(hidden, *args, **kwargs):
        out = original(hidden, *args, **kwargs)
        recorded.append(out.detach().clone())
        return out

    model.compute_logits = compute_logits
    try:
        out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=2), use_tqdm=False)[0]
    finally:
        model.compute_logits = original
    return recorded[0], list(out.prompt_token_ids), out.outputs[0].token_ids[0]


@pytest.fixture(scope="module")
def reference():
    from replicas.models.embedded import EmbeddedModels

    return EmbeddedModels.load()


def test_pytorch_drafter_matches_vllm_drafter_logits(spec_llm, reference):
    prompt = load_workloads()["code"][3].prompt
    vllm_logits, prompt_ids, bonus = _first_draft_logits(spec_llm, prompt)
    ours = reference.draft_logits(prompt_ids, bonus)
    torch.testing.assert_close(vllm_logits, ours, rtol=1e-3, atol=2e-3)
    assert torch.equal(vllm_logits.argmax(-1), ours.argmax(-1))


def test_without_the_plugins_k_norm_fix_vllm_logits_diverge(spec_llm, reference):
    """Negative control: put vLLM's grouped CPU k-norm back and the same comparison fails."""
    from replicas import vllm_plugin

    inner = _drafter_model(spec_llm).model
    original = vllm_plugin.ORIGINALS["DFlashQwen3Model._normalize_context_k"]
    inner._normalize_context_k = types.MethodType(original, inner)
    try:
        prompt = load_workloads()["code"][3].prompt
        vllm_logits, prompt_ids, bonus = _first_draft_logits(spec_llm, prompt)
    finally:
        del inner._normalize_context_k
    ours = reference.draft_logits(prompt_ids, bonus)
    assert (vllm_logits - ours).abs().max() > 1e-2


DUMMY_LOAD = textwrap.dedent(
    """
    from replicas.engine import EngineConfig, cpu_engine_environment
    cpu_engine_environment()
    from vllm import LLM, SamplingParams
    llm = LLM(**EngineConfig().vllm_kwargs(), load_format="dummy")
    out = llm.generate(["x = 1"], SamplingParams(max_tokens=4, temperature=0.0), use_tqdm=False)
    print("GENERATED", len(out[0].outputs[0].token_ids))
    """
)


@pytest.mark.parametrize("plugins, works", [(None, True), ("none-of-ours", False)])
def test_plugin_keeps_the_drafters_qkv_weight_on_cpu(plugins, works):
    """A DFlash engine whose drafter builds its context projection lazily (dummy weights) needs the
    plugin's fix; with plugins limited to other names the same engine fails."""
    env = dict(os.environ)
    if plugins is not None:
        env["VLLM_PLUGINS"] = plugins
    proc = subprocess.run([sys.executable, "-c", DUMMY_LOAD], capture_output=True, text=True, env=env, timeout=600)
    assert ("GENERATED 4" in proc.stdout) == works, proc.stderr[-3000:]


def _position_one_acceptance(llm, temperature):
    from vllm import SamplingParams

    recorder = recorder_of(llm)
    start = len(recorder.rows)
    prompts = [p.prompt for p in load_workloads()["code"][:16]]
    params = [SamplingParams(temperature=temperature, max_tokens=48, seed=i) for i in range(len(prompts))]
    llm.generate(prompts, params, use_tqdm=False)
    c = recorder.counters(start)
    return c.accepted_per_pos[0] / c.drafts


def test_sampled_verification_accepts_like_greedy_at_low_temperature(spec_llm):
    """At temperature 1e-3 the target is all but greedy, so drafts must be accepted about as often."""
    greedy = _position_one_acceptance(spec_llm, 0.0)
    assert _position_one_acceptance(spec_llm, 1e-3) >= 0.8 * greedy > 0.2


def test_without_the_plugins_expand_fix_sampled_drafts_are_rejected(spec_llm):
    """Negative control: vLLM's CPU expand kernel garbles per-token temperatures (it leaves its output
    unwritten, so how badly varies from run to run; compared with greedy acceptance in the same engine)."""
    from vllm.v1.sample import rejection_sampler

    from replicas import vllm_plugin

    greedy = _position_one_acceptance(spec_llm, 0.0)
    patched = rejection_sampler.expand_batch_to_tokens
    rejection_sampler.expand_batch_to_tokens = vllm_plugin.ORIGINALS["rejection_sampler.expand_batch_to_tokens"]
    try:
        broken = _position_one_acceptance(spec_llm, 1e-3)
    finally:
        rejection_sampler.expand_batch_to_tokens = patched
    # Fixed, the same temperature accepts at least 0.8 x greedy (the test above); broken runs have given
    # from about 0.1 to 0.27 x greedy, so the line sits between the two.
    assert broken < 0.5 * greedy


SEEDED_CHUNKED = textwrap.dedent(
    """
    from replicas.engine import EngineConfig, cpu_engine_environment
    cpu_engine_environment()
    from vllm import LLM, SamplingParams
    from replicas.models.workloads import load_workloads
    # A small token budget per step: the long prompts' prefills are chunked.
    llm = LLM(**EngineConfig(drafter=None).vllm_kwargs(), max_num_batched_tokens=256)
    prompts = [p.prompt * 3 for p in load_workloads()["code"][:12]]
    params = [SamplingParams(temperature=1.0, max_tokens=8, seed=i) for i in range(len(prompts))]
    runs = [[o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)] for _ in range(2)]
    print("SEEDED", runs[0] == runs[1])
    """
)


@pytest.mark.parametrize("plugins, works", [(None, True), ("none-of-ours", False)])
def test_seeded_requests_survive_chunked_prefills(plugins, works):
    """Per-request seeds with chunked prefills: the plugin rewinds the CPU generators, so the engine
    keeps running and seeded outputs repeat; without the plugin vLLM's rewind crashes the engine."""
    env = dict(os.environ)
    if plugins is not None:
        env["VLLM_PLUGINS"] = plugins
    proc = subprocess.run([sys.executable, "-c", SEEDED_CHUNKED], capture_output=True, text=True, env=env, timeout=600)
    assert ("SEEDED True" in proc.stdout) == works, proc.stderr[-3000:]
    if not works:
        assert "CPU Generator does not use offset" in proc.stderr


def test_top_k_requests_survive_steps_without_draft_tokens(spec_llm):
    """A step whose requests have no draft tokens (prefill, or width 0) still masks top-k over zero rows:
    the plugin returns them; vLLM's CPU top-k path raised on that empty batch and killed the engine."""
    from vllm import SamplingParams
    from vllm.v1.sample import rejection_sampler

    from replicas import vllm_plugin

    for top_k in (1, 40):
        out = spec_llm.generate(["def f(x):"], SamplingParams(top_k=top_k, max_tokens=8, ignore_eos=True), use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 8
    logits, k = torch.zeros(0, 32), torch.zeros(0, dtype=torch.long)
    assert rejection_sampler.apply_top_k_top_p(logits, k, None).shape == (0, 32)
    with pytest.raises(RuntimeError):  # negative control: vLLM's own function on the same empty batch
        vllm_plugin.ORIGINALS["rejection_sampler.apply_top_k_top_p"](logits, k, None)
