"""`forespark models traces`: per-step, per-request acceptance traces recorded from the vLLM engine.

The engine runs WCS with the `static` policy (every request drafts and
verifies the full block, as plain vLLM does) and keeps the verdict rows its
controller builds anyway: the pre-draft features of the position each draft
starts from (replicas/wcs/features.py) and the realised accepted length. The
estimator is trained on exactly the features the engine computes when it
serves. `forespark calibrate` records a user's own model pair the same way.
"""

from __future__ import annotations

import dataclasses
import io

import numpy as np

from replicas.models.workloads import Prompt
from scheduling.traces import Traces


def record_on(llm, prompts: dict[str, list[Prompt]], repeats: int = 1, temperature: float = 0.0, seed: int = 0):
    """Run `prompts` (per domain) through a built WCS `vllm.LLM` under the `static` policy; the traces carry
    each row's domain."""
    from vllm import SamplingParams

    llm.collective_rpc("wcs_set_policy", args=("static",))
    parts = []
    for domain, chosen in prompts.items():
        params = [
            SamplingParams(temperature=temperature, max_tokens=p.max_tokens, seed=seed + 1000 * r + i)
            for r in range(repeats)
            for i, p in enumerate(chosen)
        ]
        llm.collective_rpc("wcs_record", args=(True,))
        llm.generate([p.prompt for _ in range(repeats) for p in chosen], params, use_tqdm=False)
        blob = llm.collective_rpc("wcs_record", args=(False,))[0]
        if blob is None:
            raise RuntimeError(f"no verification steps were recorded for {domain}")
        part = Traces.load(io.BytesIO(blob))
        parts.append(dataclasses.replace(part, domain=np.full(len(part), domain)))
    return Traces.concatenate(parts)


def record_traces(prompts_per_domain: int = 64, repeats: int = 1, temperature: float = 0.0, seed: int = 0):
    """The shipped workloads through the embedded pair. Greedy by default: that is what the shipped
    drafter is distilled for."""
    from replicas.engine import EngineConfig, make_llm
    from replicas.models.workloads import load_workloads
    from replicas.wcs.config import WCSConfig

    llm = make_llm(EngineConfig(wcs=WCSConfig(policy="static", seed=seed)))
    prompts = {d: p[:prompts_per_domain] for d, p in load_workloads().items()}
    return record_on(llm, prompts, repeats, temperature, seed)
