"""`forespark models bench` through the real vLLM CPU engine: greedy and sampled acceptance of the embedded pair."""

from replicas.engine import EngineConfig, cpu_engine_environment
from replicas.models.bench import format_models_bench, run_models_bench

cpu_engine_environment()


def test_sampled_bench_reports_its_temperature_and_differs_from_greedy():
    engine = EngineConfig(wcs=None)
    block = engine.drafter.num_speculative_tokens
    greedy = run_models_bench(widths=[block], prompts_per_domain=4, engine=engine)
    sampled = run_models_bench(widths=[block], prompts_per_domain=4, engine=engine, temperature=1.0)
    assert sampled.temperature == 1.0 and greedy.temperature == 0.0
    assert sampled.width_robustness == {} and greedy.width_robustness  # anchors need greedy continuations
    for bench in sampled.domains.values():
        assert bench.per_width[str(block)].drafts > 0
        assert 1.0 <= bench.mean_accepted_full_width <= 1.0 + block
    # Control: sampling is not greedy decoding under another name.
    assert any(sampled.domains[d].mean_accepted_full_width != greedy.domains[d].mean_accepted_full_width for d in greedy.domains)
    assert "temperature 1" in format_models_bench(sampled)
