"""Acceptance traces recorded from the real vLLM engine, and the estimators trained on them."""

import gc

import numpy as np
import pytest

from replicas.engine import EngineConfig, cpu_engine_environment, make_llm
from replicas.models.bench import read_spec_counters
from replicas.models.trace_recorder import TraceRecorder
from replicas.models.workloads import load_workloads
from scheduling.evaluation import compare_estimators

cpu_engine_environment()


@pytest.fixture(scope="module")
def recorded():
    from vllm import SamplingParams

    config = EngineConfig()
    llm = make_llm(config)
    recorder = TraceRecorder(llm, config.drafter.num_speculative_tokens)
    before = read_spec_counters(llm)
    work = load_workloads()
    prompts = [p for d in work for p in work[d][:48]]
    params = [SamplingParams(temperature=0.0, max_tokens=p.max_tokens) for p in prompts]
    llm.generate([p.prompt for p in prompts], params, use_tqdm=False)
    result = recorder.traces(), read_spec_counters(llm).minus(before)
    del llm, recorder
    gc.collect()  # tear the engine down before the next module starts its own
    return result


def test_one_row_per_verified_draft_matching_vllm_counters(recorded):
    traces, counters = recorded
    assert len(traces) == counters.drafts
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


def test_context_estimator_beats_constant_on_held_out_traces(recorded):
    traces, _ = recorded
    reports = compare_estimators(traces)
    assert reports["context"].mean_auc > reports["constant"].mean_auc + 0.05
    assert reports["context"].mean_brier < reports["constant"].mean_brier
