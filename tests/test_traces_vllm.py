"""Acceptance traces recorded by a WCS engine, and the estimators trained on them.

The engine runs the `static` policy (every request drafts and verifies the
full block) and keeps the verdict rows its controller builds for the
estimator's online update; the rejection sampler's own verdicts, counted by a
hook on the same engine, must agree with them row for row.
"""

import io

import numpy as np
import pytest

from replicas.engine import EngineConfig, cpu_engine_environment, make_llm
from replicas.models.verdicts import VerdictCounter
from replicas.models.workloads import load_workloads
from replicas.wcs.config import WCSConfig
from scheduling.evaluation import compare_estimators
from scheduling.traces import Traces

cpu_engine_environment()


@pytest.fixture(scope="module")
def recorded():
    from vllm import SamplingParams

    llm = make_llm(EngineConfig(wcs=WCSConfig(policy="static")))
    counter = VerdictCounter(llm)
    work = load_workloads()
    prompts = [p for d in work for p in work[d][:48]]
    params = [SamplingParams(temperature=0.0, max_tokens=p.max_tokens) for p in prompts]
    llm.collective_rpc("wcs_record", args=(True,))
    llm.generate([p.prompt for p in prompts], params, use_tqdm=False)
    blob = llm.collective_rpc("wcs_record", args=(False,))[0]
    return Traces.load(io.BytesIO(blob)), counter.counters()


def test_one_row_per_verified_draft_matching_the_rejection_sampler(recorded):
    traces, counters = recorded
    assert len(traces) == counters.drafts > 0
    assert int(traces.accepted.sum()) == counters.accepted
    assert int(traces.drafted.sum()) == counters.draft_tokens


def test_rows_are_well_formed(recorded):
    traces, _ = recorded
    assert np.all((traces.accepted >= 0) & (traces.accepted <= traces.drafted))
    assert np.isfinite(traces.inputs.features).all()
    # Each request's first verified draft has no history yet; later ones do.
    first = np.unique(traces.request_id, return_index=True)[1]
    assert np.isnan(traces.inputs.history[first]).all()
    assert np.isfinite(np.delete(traces.inputs.history, first)).mean() > 0.9
    # The drafter's confidences are logged for exactly the drafted positions.
    drafted = np.arange(traces.k)[None, :] < traces.drafted[:, None]
    assert np.isfinite(traces.confidence[drafted]).all() and np.isnan(traces.confidence[~drafted]).all()
    assert np.all((traces.confidence[drafted] > 0) & (traces.confidence[drafted] <= 1))


def test_context_estimator_beats_constant_on_held_out_traces(recorded):
    traces, _ = recorded
    reports = compare_estimators(traces)
    assert reports["context"].mean_auc > reports["constant"].mean_auc + 0.05
    assert reports["context"].mean_brier < reports["constant"].mean_brier


def test_post_draft_calibration_beats_the_prior_and_the_raw_confidences(recorded):
    from scheduling.evaluation import compare_post_draft

    traces, _ = recorded
    scores = compare_post_draft(traces)
    assert scores["calibrated"] < scores["pre-draft"] - 0.005
    assert scores["calibrated"] < scores["raw confidence"]
    # Negative control: confidences shuffled across rows carry no information about these rows.
    rng = np.random.default_rng(0)
    shuffled = Traces(
        traces.inputs, traces.drafted, traces.accepted, traces.request_id, traces.k, traces.feature_names,
        traces.confidence[rng.permutation(len(traces))],
    )
    assert compare_post_draft(shuffled)["calibrated"] > scores["calibrated"] + 0.005
