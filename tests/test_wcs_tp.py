"""Tensor parallelism on the CPU build: two ranks, one set of WCS decisions.

Rank 0 plans and every rank takes its widths (`replicas/wcs/sharing.py`). With identical inputs
the ranks would agree anyway, so rank 1's estimator is replaced by one that predicts very
differently: the ranks must still draft identically (or the drafter's collectives would not even
match in shape), and greedy outputs must equal `ar` on the same engine.

The engine runs in a subprocess: TP needs vLLM's multiprocess executor, one core bound per rank.
"""

import json
import os
import subprocess
import sys
import textwrap

import pytest

from replicas.wcs.config import RUNNER_ENV
from tests.test_wcs_engine import DRAFTING_PAYS, NEVER_PAYS

SCRIPT = textwrap.dedent(
    """
    import json, os, sys

    def perturb_rank_one(worker):
        from scheduling.estimators import ConstantEstimator
        if worker.rank == 1:
            worker.model_runner.wcs.estimator = ConstantEstimator(8, prior=0.99, prior_weight=1e6)
        return worker.rank

    def diverge_probe_rounds(worker):
        # Rank 0 never affords a probe round, rank 1 always does (each prices rounds from its own step timings).
        worker.model_runner.wcs.probes.affordable = (lambda cost_ms: worker.rank == 1)
        return worker.rank

    def break_rank_one(worker):
        # Rank 1's next step raises in WCS code (vLLM returns only rank 0's exceptions to the engine).
        if worker.rank == 1:
            def broken(gone):
                raise RuntimeError("planted failure on rank 1")
            worker.model_runner.wcs.finish = broken
        return worker.rank

    def main():
        import threading
        from vllm import LLM, SamplingParams
        from replicas.engine import EngineConfig, engine_environment
        from replicas.models.workloads import load_workloads

        config = EngineConfig(tensor_parallel_size=2)
        engine_environment(config)  # as every replica sets it up: the V1 runner for the engine core and workers
        llm = LLM(**config.vllm_kwargs())
        llm.collective_rpc("wcs_set_cost_model", args=(sys.argv[1],))
        ranks = llm.collective_rpc(perturb_rank_one)
        work = load_workloads()
        prompts = [p.prompt for d in work for p in work[d][:4]]
        params = SamplingParams(temperature=0.0, max_tokens=32)
        out = {"ranks": ranks, "runners": llm.collective_rpc("wcs_runner_info"), "driver_pid": os.getpid()}
        for policy in ("ar", "wcs"):
            llm.collective_rpc("wcs_set_policy", args=(policy,))
            outs = llm.generate(prompts, params, use_tqdm=False)
            out[policy] = [list(o.outputs[0].token_ids) for o in outs]
            out[policy + "_stats"] = llm.collective_rpc("wcs_stats")
        # Drafting never pays: wcs holds, requests fall due for probes, and only rank 1 would run a round.
        llm.collective_rpc("wcs_set_cost_model", args=(sys.argv[2],))
        llm.collective_rpc(diverge_probe_rounds)
        outs = llm.generate(prompts, params, use_tqdm=False)
        out["holding"] = [list(o.outputs[0].token_ids) for o in outs]
        out["holding_stats"] = llm.collective_rpc("wcs_stats")
        print("RESULT " + json.dumps(out), flush=True)
        llm.collective_rpc(break_rank_one)
        # Without the worker ending itself, rank 0 waits in the step's first collective for good.
        threading.Timer(180, lambda: (print("BROKEN_RANK hung", flush=True), os._exit(3))).start()
        try:
            llm.generate(prompts[:2], params, use_tqdm=False)
            print("BROKEN_RANK served", flush=True)
        except Exception as e:
            print("BROKEN_RANK " + type(e).__name__, flush=True)
        os._exit(0)

    if __name__ == "__main__":
        main()
    """
)


@pytest.fixture(scope="module")
def tp_run(tmp_path_factory):
    script = tmp_path_factory.mktemp("tp") / "tp_engine.py"
    script.write_text(SCRIPT)
    env = {
        **os.environ,
        "VLLM_ENABLE_V1_MULTIPROCESSING": "1",
        "VLLM_CPU_OMP_THREADS_BIND": "0|1",  # one core per rank (auto-binding wants a NUMA node per rank)
        "VLLM_HOST_IP": "127.0.0.1",
        "PYTHONPATH": os.getcwd(),
        "VLLM_ALLOW_INSECURE_SERIALIZATION": "1",  # the test ships a function to the workers
    }
    env.pop(RUNNER_ENV, None)  # the script's own engine_environment must set it
    proc = subprocess.run(
        [sys.executable, str(script), DRAFTING_PAYS.model_dump_json(), NEVER_PAYS.model_dump_json()],
        capture_output=True, text=True, env=env, timeout=900,
    )
    lines = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    out = json.loads(lines[-1][len("RESULT "):])
    out["broken_rank"] = [l.split(" ", 1)[1] for l in proc.stdout.splitlines() if l.startswith("BROKEN_RANK ")]
    out["stderr"] = proc.stderr
    return out


def test_both_ranks_run_wcs_and_rank_one_predicts_differently(tp_run):
    assert sorted(tp_run["ranks"]) == [0, 1]


def test_every_rank_has_the_v1_runner_setting_in_its_own_process(tp_run):
    runners = tp_run["runners"]
    assert sorted(r["rank"] for r in runners) == [0, 1]
    assert len({r["pid"] for r in runners} | {tp_run["driver_pid"]}) == 3  # two worker processes besides the driver
    for r in runners:
        assert r["env"] == "0" and r["use_v2_model_runner"] is False
        assert "vllm.v1.worker.gpu_model_runner.GPUModelRunner" in r["runner"], r["runner"]


def test_ranks_take_rank_zeros_widths(tp_run):
    rank0, rank1 = tp_run["wcs_stats"]
    assert sum(rank0["drafted_per_pos"]) > 0
    # Rank 1 alone would draft full blocks (prior 0.99): it drafted what rank 0 planned instead.
    assert rank0["drafted_per_pos"] == rank1["drafted_per_pos"]
    assert rank0["drafter_rows"] == rank1["drafter_rows"]


def test_greedy_outputs_under_tp_equal_ar(tp_run):
    assert tp_run["wcs"] == tp_run["ar"]


def test_ranks_hold_on_rank_zeros_decision_where_their_probe_budgets_differ(tp_run):
    """Whether a probe round is affordable rests on each rank's step timings; the ranks disagreed here on purpose
    (rank 0 never affords one, rank 1 always). Deciding to hold apart, a rank planning beside one holding hung both
    (a TP-2 replica timed out in its first minutes, `test_serve_mixed_tp.py`)."""
    (rank0, rank1), before = tp_run["holding_stats"], tp_run["wcs_stats"][0]
    assert rank0["held_steps"] - before["held_steps"] > 20 and rank0["held_steps"] == rank1["held_steps"]
    assert rank0["drafted_per_pos"] == rank1["drafted_per_pos"]
    assert tp_run["holding"] == tp_run["ar"]


def test_a_step_that_fails_on_rank_one_fails_the_engine_instead_of_hanging_it(tp_run):
    """vLLM's executor returns rank 0's exceptions only; rank 1's were logged and its ranks fell out of step (the
    controller's plan() raised there every held step, unseen, before ranks took rank 0's probes). The failing
    worker now ends itself and vLLM's worker monitor fails the engine (`replicas.wcs.sharing.failure_ends_other_ranks`)."""
    assert tp_run["broken_rank"] == ["EngineDeadError"], tp_run["stderr"][-3000:]
    assert "planted failure on rank 1" in tp_run["stderr"] and "ending this worker" in tp_run["stderr"]
