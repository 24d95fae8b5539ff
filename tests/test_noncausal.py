"""A non-causal DFlash drafter under WCS: what every public DFlash checkpoint is.

The drafter is the embedded one with `dflash_config.causal: false` (same weights): each block position
attends to the whole block, so a truncated block computes other drafts than the full one. The pair is
calibrated as a user would (`forespark calibrate`, which measures truncated blocks against full ones),
then served: greedy outputs equal `ar`, drafts are verified, and sampled outputs keep the target's
distribution, with the planted lossy verifier caught on the same engine as the negative control.
"""

import time

import httpx
import pytest

from replicas.engine import DrafterConfig, EngineConfig, cpu_engine_environment, model_runner
from replicas.models.build import WEIGHTS_DIR
from replicas.models.dflash import drafter_variant
from replicas.wcs.calibration import TRUNCATION_TOLERANCE
from replicas.wcs.config import WCSConfig
from tests.test_calibrate import run_calibrate
from tests.test_serve_cli import forespark_serve
from tests.test_wcs_engine import (
    ALPHA,
    DRAFTING_PAYS,
    POLICIES,
    VERIFYING_IS_CHEAP,
    assert_greedy_identical_and_verified,
    greedy_policy_runs,
    homogeneity_pvalue,
    plant_lossy_verifier,
    sampled_continuations,
)

cpu_engine_environment()


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("noncausal")
    drafter = drafter_variant(WEIGHTS_DIR / "drafter", tmp / "drafter", causal=False)
    summary, folder = run_calibrate(
        tmp, "--model", str(WEIGHTS_DIR / "target"), "--drafter", str(drafter),
        "--prompts-per-domain", "8", "--truncation-prompts", "6",
    )
    return drafter, summary, folder, tmp


def test_calibration_measures_truncated_blocks_and_keeps_ragged_widths(calibrated):
    _, summary, _, _ = calibrated
    assert summary.causal is False and summary.k == 8
    assert sorted(summary.truncation_gap, key=int) == ["2", "4"]
    # Measured: this drafter's truncated blocks accept like full ones at the same anchors (0-0.2%).
    assert max(summary.truncation_gap.values()) <= TRUNCATION_TOLERANCE
    assert summary.draft_widths == "ragged"


@pytest.fixture(scope="module")
def llm(calibrated):
    from replicas.engine import make_llm

    drafter, _, folder, tmp = calibrated
    pays = tmp / "drafting_pays.json"
    DRAFTING_PAYS.save(pays)
    engine = EngineConfig(drafter=DrafterConfig(path=drafter), wcs=WCSConfig(calibration=folder, cost_model=pays, online_cost=False))
    return make_llm(engine)


def test_the_engine_drafts_with_a_non_causal_block(llm):
    drafter = model_runner(llm).drafter
    assert drafter.dflash_causal is False


@pytest.fixture(scope="module")
def greedy_runs(llm):
    return greedy_policy_runs(llm)


@pytest.mark.parametrize("policy", POLICIES[1:])
def test_greedy_outputs_equal_ar_and_drafts_are_verified(greedy_runs, policy):
    assert_greedy_identical_and_verified(greedy_runs, policy)


def test_wcs_drafts_ragged_widths_with_the_non_causal_drafter(greedy_runs):
    wcs = greedy_runs["wcs"][1]
    assert wcs.drafted_per_pos[-1] < 0.8 * wcs.drafted_per_pos[0]


@pytest.fixture(scope="module")
def ar_samples(llm):
    llm.collective_rpc("wcs_set_cost_model", args=(VERIFYING_IS_CHEAP.model_dump_json(),))
    return sampled_continuations(llm, "ar")[0]


def test_sampled_continuations_keep_the_target_distribution(llm, ar_samples):
    samples, st = sampled_continuations(llm, "wcs")
    # Verification decided tokens 2 and 3 (wcs drafts fewer of them at temperature 1 than with greedy traces'
    # beliefs: its realised-gain and recalibration loops see the low acceptance; 1591 verified in one run).
    assert st.verified > 1000 and st.accepted > 300
    assert homogeneity_pvalue(samples, ar_samples) > ALPHA


def test_a_planted_lossy_verifier_is_rejected(llm, ar_samples, monkeypatch):
    """Negative control on this engine, same sample size."""
    plant_lossy_verifier(llm, monkeypatch)
    samples, _ = sampled_continuations(llm, "static")
    assert homogeneity_pvalue(samples, ar_samples) < 1e-6


def test_forespark_serve_serves_the_non_causal_pair_and_verifies_its_drafts(calibrated):
    drafter, _, folder, tmp = calibrated
    config = tmp / "serve.yaml"
    config.write_text(
        "replica:\n  num_replicas: 1\n  num_cpus: 1\n  stats_period_s: 0.5\n  engine:\n"
        f"    drafter:\n      path: {drafter}\n    wcs:\n      policy: static\n      calibration: {folder}\n"
    )
    url = "http://127.0.0.1:8767"
    first = {"model": "forespark", "prompt": "def f(x):", "max_tokens": 24, "temperature": 0}
    with forespark_serve(config, 8767, first) as (proc, r):
        assert r.json()["usage"]["completion_tokens"] == 24
        verified = 0.0
        for _ in range(30):  # Ray exports the replica's counters every few seconds
            text = httpx.get(f"{url}/metrics", timeout=30).text
            verified = sum(float(l.rsplit(" ", 1)[1]) for l in text.splitlines() if l.startswith("ray_forespark_wcs_verified_tokens_total"))
            if verified > 0:
                break
            time.sleep(1)
        assert verified > 0
    assert proc.returncode == 0, proc.output[-3000:]
