"""`forespark models bench` through the real vLLM CPU engine: greedy and sampled acceptance of the embedded pair."""

from replicas.engine import EngineConfig, cpu_engine_environment
from replicas.models.bench import format_models_bench, run_models_bench
from replicas.models.unlikelihood import repeated_ngram_share

cpu_engine_environment()


def test_sampled_bench_reports_its_temperature_and_differs_from_greedy():
    engine = EngineConfig(wcs=None)
    block = engine.drafter.num_speculative_tokens
    greedy = run_models_bench(widths=[block], prompts_per_domain=4, engine=engine)
    sampled = run_models_bench(widths=[block], prompts_per_domain=8, engine=engine, temperature=1.0)
    assert sampled.temperature == 1.0 and greedy.temperature == 0.0
    assert sampled.width_robustness == {} and greedy.width_robustness  # anchors need greedy continuations
    for bench in sampled.domains.values():
        assert bench.per_width[str(block)].drafts > 0
        assert 1.0 <= bench.mean_accepted_full_width <= 1.0 + block
    # Speculation works at T=1 (drafts sampled from the drafter, the default): on these 8 prompts a domain this
    # pair accepted 1.97 (code) and 1.89 (prose) a verification, the first pair 1.40 and 1.38 (1.04 with argmax drafts).
    assert min(b.mean_accepted_full_width for b in sampled.domains.values()) >= 1.6
    # Control: sampling is not greedy decoding under another name.
    assert any(sampled.domains[d].mean_accepted_full_width != greedy.domains[d].mean_accepted_full_width for d in greedy.domains)
    assert "temperature 1" in format_models_bench(sampled)
    # Greedy runs measure loops in their long continuations; sampled ones do not claim to.
    assert all(0.0 <= b.repeated_4gram_share <= 1.0 for b in greedy.domains.values())
    assert all(b.repeated_4gram_share is None for b in sampled.domains.values())
    assert "repeated 4-grams" in format_models_bench(greedy)


def test_repeated_ngram_share_counts_repeats_not_length():
    assert repeated_ngram_share(list(range(40))) == 0.0  # control: nothing repeats
    assert repeated_ngram_share([1, 2, 3, 4, 5] * 8) == 1.0 - 5 / 37  # a loop: every 4-gram after the first cycle repeats
    assert repeated_ngram_share([7, 7, 7]) == 0.0  # shorter than one 4-gram
