"""`forespark calibrate`: what WCS needs to serve a model pair of one's own, in one folder.

WCS plans on three things that belong to a (target, drafter) pair and to the
machine: acceptance traces that the pre-draft estimator and post-draft
calibrator are fitted on, the step-cost profile, and whether the drafter may
draft truncated blocks. The shipped traces describe the embedded pair only,
so any other pair is calibrated first:

    DIR/calibration.json     this summary (pair, K, estimator quality, truncation gap, draft-width mode)
    DIR/traces.npz           verdict rows recorded through vLLM under the `static` policy
    DIR/step_cost/<key>.json the step-cost profile of the engine config it ran, keyed like the profile cache

`engine.wcs.calibration: DIR` points an engine at it (`WCSConfig.for_pair`).

A causal drafter's first w positions are exactly those of its full block, so
any width is exact. A non-causal drafter's (every public DFlash checkpoint)
are not: each position attends to the whole block. Calibration measures the
acceptance of a truncated block against the full block truncated at the same
anchors (`forespark models bench`'s anchored gap); past `TRUNCATION_TOLERANCE`
the pair is served with whole blocks (`draft_widths: whole_blocks`).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, Field

from scheduling.evaluation import EstimatorReport

if TYPE_CHECKING:
    from replicas.engine import EngineConfig
    from replicas.models.workloads import Prompt
    from replicas.wcs.config import WCSConfig

SUMMARY_FILE = "calibration.json"
TRACES_FILE = "traces.npz"
STEP_COST_DIR = "step_cost"
TRUNCATION_TOLERANCE = 0.05  # relative loss of mean accepted length a truncated block may have


class Calibration(BaseModel):
    model: str
    drafter: str
    k: int = Field(description="draft positions per pass the pair was calibrated for")
    causal: bool
    machine: str
    prompts: int = Field(description="prompts recorded")
    temperature: float
    rows: int = Field(description="verification steps recorded")
    estimators: dict[str, EstimatorReport] = Field(description="held-out quality of each pre-draft estimator")
    truncation_gap: dict[str, float] = Field(
        default_factory=dict, description="width -> relative gap of a truncated block (non-causal drafters only)"
    )
    draft_widths: Literal["ragged", "whole_blocks"]

    @classmethod
    def load(cls, folder: Path) -> "Calibration":
        path = Path(folder) / SUMMARY_FILE
        if not path.is_file():
            raise ValueError(f"{folder} is not a calibration folder (no {SUMMARY_FILE}): `forespark calibrate` writes one")
        return cls.model_validate_json(path.read_text())

    def apply(self, folder: Path, wcs: "WCSConfig", k: int) -> "WCSConfig":
        """`wcs` with this calibration's traces and, unless set there, its draft-width mode."""
        if k != self.k:
            raise ValueError(
                f"the calibration in {folder} is for K={self.k} draft tokens; the engine drafts K={k}: "
                f"calibrate again with --k {k}"
            )
        update: dict = {"traces": Path(folder) / TRACES_FILE}
        if "draft_widths" not in wcs.model_fields_set:
            update["draft_widths"] = self.draft_widths
        return wcs.model_copy(update=update)


def load_prompts(path: Path, default_max_tokens: int = 128) -> dict[str, list["Prompt"]]:
    """Prompts per domain from JSON lines `{"prompt": ..., "max_tokens"?: ..., "domain"?: ...}`."""
    from replicas.models.workloads import Prompt

    out: dict[str, list[Prompt]] = {}
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            raw = json.loads(line)
            prompt = Prompt(domain=raw.get("domain", "custom"), prompt=raw["prompt"], max_tokens=raw.get("max_tokens", default_max_tokens))
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"{path}:{n}: not a prompt line ({e})") from e
        out.setdefault(prompt.domain, []).append(prompt)
    if not out:
        raise ValueError(f"{path} holds no prompts")
    return out


def truncation_gaps(engine: "EngineConfig", prompts_per_domain: int) -> dict[str, float]:
    """Width -> anchored relative gap between drafting w positions and the full block truncated at w."""
    from replicas.models.bench import run_models_bench

    k = engine.drafter.num_speculative_tokens
    widths = sorted({max(1, k // 4), max(1, k // 2)} - {k})
    if not widths:
        return {}
    # One rank: the bench reads verdicts from the in-process runner (a TP pair is assumed to truncate alike).
    plain = engine.model_copy(update={"wcs": None, "tensor_parallel_size": 1, "distributed_executor_backend": None})
    bench = run_models_bench(widths=widths, prompts_per_domain=prompts_per_domain, engine=plain)
    return {str(w): max(r[str(w)] for r in bench.width_robustness.values()) for w in widths}


def calibrate(
    engine: "EngineConfig",
    out: Path,
    prompts: dict[str, list["Prompt"]],
    temperature: float = 0.0,
    truncation_prompts: int = 12,
    progress: Callable[[str], None] = lambda _m: None,
) -> Calibration:
    """Profile, record and fit for `engine`'s (target, drafter) pair; writes `out` and returns its summary."""
    import gc

    from replicas.engine import make_llm
    from replicas.models.trace_recorder import record_on
    from replicas.wcs.config import WCSConfig
    from replicas.wcs.profiler import machine, profile_name
    from scheduling.evaluation import compare_estimators

    out = Path(out)
    (out / STEP_COST_DIR).mkdir(parents=True, exist_ok=True)
    drafter = engine.drafter
    if drafter is None:
        raise ValueError("calibration needs a drafter")
    base = engine.wcs or WCSConfig()
    # The constant prior reads no traces: this engine only records them.
    recording = base.model_copy(update={"policy": "static", "estimator": "constant", "traces": None, "calibration": None})
    engine = engine.model_copy(update={"wcs": recording})
    engine.wcs.cost_model = out / STEP_COST_DIR / profile_name(engine)
    progress("starting the engine (profiling its step cost the first time)")
    llm = make_llm(engine)
    causal = llm.collective_rpc("wcs_runner_info")[0]["drafter_causal"]  # as vLLM resolved it from the checkpoint
    progress(f"recording acceptance traces ({sum(map(len, prompts.values()))} prompts, temperature {temperature:g})")
    traces = record_on(llm, prompts, temperature=temperature, seed=engine.seed)
    del llm
    gc.collect()
    traces.save(out / TRACES_FILE)
    gaps: dict[str, float] = {}
    if not causal:
        progress("measuring truncated blocks against full blocks (non-causal drafter)")
        gaps = truncation_gaps(engine, truncation_prompts)
    summary = Calibration(
        model=str(engine.model),
        drafter=str(drafter.path),
        k=drafter.num_speculative_tokens,
        causal=causal,
        machine=machine(),
        prompts=sum(map(len, prompts.values())),
        temperature=temperature,
        rows=len(traces),
        estimators=compare_estimators(traces),
        truncation_gap=gaps,
        draft_widths="whole_blocks" if gaps and max(gaps.values()) > TRUNCATION_TOLERANCE else "ragged",
    )
    (out / SUMMARY_FILE).write_text(summary.model_dump_json(indent=2) + "\n")
    return summary


def format_calibration(summary: Calibration) -> str:
    lines = [
        f"pair: {summary.model} + {summary.drafter} (K={summary.k}, {'causal' if summary.causal else 'non-causal'})",
        f"recorded {summary.rows} verification steps from {summary.prompts} prompts at temperature {summary.temperature:g}",
        "held-out pre-draft estimator quality (mean over positions):",
    ]
    for name, r in summary.estimators.items():
        lines.append(f"  {name:>9}: AUC {r.mean_auc:.3f}  Brier {r.mean_brier:.4f}  ECE {r.mean_ece:.4f}")
    if summary.truncation_gap:
        gaps = ", ".join(f"w={w}: {g:.1%}" for w, g in summary.truncation_gap.items())
        lines.append(f"truncated blocks against full blocks (anchored gap): {gaps}; tolerance {TRUNCATION_TOLERANCE:.0%}")
    lines.append(f"draft widths: {summary.draft_widths}")
    return "\n".join(lines)
