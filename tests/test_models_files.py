"""The shipped models: intact, small, better than a unigram model, and a drafter that drafts any width."""

import shutil

import numpy as np
import pytest
import torch

from replicas.models.build import WEIGHTS_DIR, BuildReport, compare_reports, verify_checksums
from replicas.models.corpus import load_corpus
from replicas.models.dflash import DFlashDrafter
from replicas.models.embedded import EmbeddedModels
from replicas.models.workloads import load_workloads


@pytest.fixture(scope="module")
def report() -> BuildReport:
    return BuildReport.model_validate_json((WEIGHTS_DIR / "build_report.json").read_text())


def test_weights_match_their_checksums():
    assert verify_checksums(WEIGHTS_DIR) == []


def test_a_changed_weight_file_is_detected(tmp_path):
    copy = tmp_path / "weights"
    shutil.copytree(WEIGHTS_DIR, copy)
    with open(copy / "drafter" / "model.safetensors", "r+b") as f:
        f.seek(-4, 2)
        f.write(b"\x00\x01\x02\x03")
    assert verify_checksums(copy) == ["drafter/model.safetensors"]


def test_weights_are_small_and_stored_as_their_spec_says(report):
    from safetensors import safe_open

    files = list(WEIGHTS_DIR.rglob("*.safetensors"))
    assert sum(p.stat().st_size for p in files) <= 40 * 2**20  # float16: 32 MiB for 16.8M parameters
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            assert {str(f.get_slice(k).get_dtype()) for k in f.keys()} == {"F16"}, path
    assert report.spec.weights_dtype == "float16"


def test_target_beats_unigram_on_held_out_text(report):
    for domain, q in report.domains.items():
        assert q.perplexity < 0.5 * q.unigram_perplexity, domain


def test_build_report_records_useful_offline_acceptance(report):
    """Offline (PyTorch) greedy acceptance on the target's continuations, as the build measured it."""
    for domain, q in report.domains.items():
        assert len(q.offline_acceptance) == report.spec.drafter.block
        assert np.all(np.diff(q.offline_acceptance) <= 1e-9), domain  # survival: non-increasing
        assert q.mean_accepted_length >= 2.5, domain


def test_compare_reports_flags_a_worse_rebuild(report):
    assert compare_reports(report, report) == []
    worse = report.model_copy(deep=True)
    worse.domains["code"].perplexity *= 1.5
    worse.domains["prose"].offline_acceptance = [0.0] * len(worse.domains["prose"].offline_acceptance)
    problems = compare_reports(report, worse)
    assert any("code perplexity" in p for p in problems) and any("prose mean accepted length" in p for p in problems)


def test_workload_prompts_are_held_out():
    corpus = load_corpus()
    train = {d: "\x00".join(corpus.docs[d]["train"]) for d in corpus.docs}
    for domain, prompts in load_workloads().items():
        assert len(prompts) >= 32
        for p in prompts[:16]:
            assert p.prompt not in train[domain], p.prompt[:60]


@pytest.fixture(scope="module")
def models() -> EmbeddedModels:
    return EmbeddedModels.load()


def variant(drafter: DFlashDrafter, **changes) -> DFlashDrafter:
    """The same weights under a changed spec (block width, causality)."""
    other = DFlashDrafter(drafter.spec.model_copy(update=changes), drafter.norm.weight.shape[0])
    other.load_state_dict(drafter.state_dict())
    return other.eval()


def first_block(models: EmbeddedModels) -> tuple[list[int], int]:
    ids = models.tokenizer.encode(load_workloads()["code"][0].prompt)
    return ids[:-1], ids[-1]


def test_drafting_fewer_positions_gives_the_same_first_drafts(models):
    """Width robustness by construction: with the causal block, slot j never sees slots after it."""
    context, bonus = first_block(models)
    full = models.draft_logits(context, bonus)
    for w in (1, 3, 5):
        short = models.draft_logits(context, bonus, variant(models.drafter, block=w))
        torch.testing.assert_close(short, full[:w], rtol=1e-5, atol=1e-5)


def test_non_causal_block_would_not_be_width_robust(models):
    """Negative control for the test above: a bidirectional block changes its first drafts with the width."""
    context, bonus = first_block(models)
    full = models.draft_logits(context, bonus, variant(models.drafter, causal=False))[:2]
    short = models.draft_logits(context, bonus, variant(models.drafter, causal=False, block=2))
    assert not torch.allclose(full, short, atol=1e-4)


def test_tokenizer_round_trip(models):
    tok = models.tokenizer
    text = "def f(x):\n    return x + 1\n"
    assert tok.decode(tok.encode(text)) == text
    assert np.all(np.array(tok.encode(text)) < 2048)


def test_install_constraints_pin_the_shipped_pairs_corpus_packages():
    """`make install` holds the CPU build to the versions the shipped pair's corpus is pinned to."""
    import json
    from pathlib import Path

    specs = Path(__file__).parent.parent / "replicas" / "models" / "specs"
    pins = [p for p in json.loads((specs / "shipped.json").read_text())["corpus"]["packages"] if not p.startswith("pip==")]
    lines = [line for line in (specs / "shipped.constraints.txt").read_text().splitlines() if line and not line.startswith("#")]
    assert lines == pins


def test_float16_storage_is_exact_for_rounded_weights_and_only_for_them(tmp_path):
    from safetensors.torch import load_file, save_file

    from replicas.models.build import round_weights, store_weights

    layer = torch.nn.Linear(8, 8)
    with torch.no_grad():
        layer.weight.add_(1e-5)  # float32 values float16 cannot hold
    path = tmp_path / "model.safetensors"
    save_file(dict(layer.state_dict()), str(path))
    store_weights(path, "float16")
    stored = load_file(str(path))
    assert stored["weight"].dtype == torch.float16
    assert not torch.equal(stored["weight"].float(), layer.weight)  # control: unrounded weights change on storing
    round_weights(layer, "float16")
    save_file(dict(layer.state_dict()), str(path))
    store_weights(path, "float16")
    assert torch.equal(load_file(str(path))["weight"].float(), layer.weight)
