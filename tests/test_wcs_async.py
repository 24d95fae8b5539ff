"""WCS under vLLM's AsyncLLM (what the serving layer runs): streaming, concurrent requests, aborts.

The engine core runs in its own process, as in serving; the WCS workers are reached through
`collective_rpc`. Its step-cost model is the synthetic `DRAFTING_PAYS` of test_wcs_engine, so
that `wcs` drafts (the profiled CPU model makes it draft little).
"""

import asyncio

import pytest

from replicas.engine import EngineConfig, cpu_engine_environment
from replicas.models.workloads import load_workloads
from tests.test_wcs_engine import DRAFTING_PAYS

cpu_engine_environment()


async def stream(engine, request_id, prompt, params, on_chunk=None):
    """Tokens of one streamed request, and how many chunks they came in."""
    tokens, chunks = [], 0
    async for out in engine.generate(prompt, params, request_id=request_id):
        chunks += 1
        tokens = list(out.outputs[0].token_ids)
        if on_chunk is not None:
            await on_chunk(tokens)
        if out.finished:
            break
    return tokens, chunks


async def scenario():
    from vllm import SamplingParams
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    engine = AsyncLLM.from_engine_args(AsyncEngineArgs(**EngineConfig().vllm_kwargs()))
    result = {}
    try:
        await engine.collective_rpc("wcs_set_cost_model", args=(DRAFTING_PAYS.model_dump_json(),))
        await engine.collective_rpc("wcs_set_online_cost", args=(False,))  # it would learn this CPU's drafting costs back
        work = load_workloads()
        prompts = [p.prompt for d in work for p in work[d][:3]]
        greedy = SamplingParams(temperature=0.0, max_tokens=40)
        for policy in ("ar", "wcs"):
            await engine.collective_rpc("wcs_set_policy", args=(policy,))
            runs = await asyncio.gather(*(stream(engine, f"{policy}-{n}", p, greedy) for n, p in enumerate(prompts)))
            result[policy] = runs
        result["wcs_stats"] = (await engine.collective_rpc("wcs_stats"))[0]

        # Abort one of two long requests after it has streamed a few tokens.
        long = SamplingParams(temperature=0.0, max_tokens=300, ignore_eos=True)
        await engine.collective_rpc("wcs_step_log", args=(True,))
        started = asyncio.Event()

        async def note(tokens):
            if len(tokens) >= 8:
                started.set()

        victim = asyncio.create_task(stream(engine, "victim", prompts[0], long, note))
        survivor = asyncio.create_task(stream(engine, "survivor", prompts[1], long))
        await started.wait()
        await engine.abort("victim")
        result["survivor"] = await survivor
        result["victim"] = await asyncio.wait_for(victim, 30)
        result["steps"] = (await engine.collective_rpc("wcs_step_log", args=(False,)))[0]
        result["live"] = (await engine.collective_rpc("wcs_live_requests"))[0]
    finally:
        engine.shutdown()
    return result


@pytest.fixture(scope="module")
def ran():
    return asyncio.run(scenario())


def test_concurrent_streams_under_wcs_equal_ar(ran):
    assert [t for t, _ in ran["wcs"]] == [t for t, _ in ran["ar"]]
    assert all(chunks > 1 for _, chunks in ran["wcs"])  # streamed, not delivered at once
    stats = ran["wcs_stats"]
    assert sum(stats["verified_per_pos"]) > 0 and sum(stats["accepted_per_pos"]) > 0


def test_an_aborted_request_leaves_the_plan(ran):
    victim_tokens, _ = ran["victim"]
    survivor_tokens, _ = ran["survivor"]
    assert 8 <= len(victim_tokens) < 300 and len(survivor_tokens) == 300
    planned = [any("victim" in r for r in s["planned"]) for s in ran["steps"] if s["planned"]]
    last = max(i for i, p in enumerate(planned) if p)
    # The victim was planned while it ran, then never again; the survivor went on for many steps alone.
    assert last >= 2 and not any(planned[last + 1 :]) and len(planned) - last > 20
    assert not any("victim" in r for r in ran["live"])
