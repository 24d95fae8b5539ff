"""WCS settings: what a user puts in the engine kwargs (`additional_config["forespark"]`) or a config file."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from replicas.models import WEIGHTS_DIR
from scheduling.policies import PolicyName

CONFIG_KEY = "forespark"  # key under vLLM's `additional_config`
WORKER_CLS = "replicas.wcs.worker.WCSWorker"
# WCS is built on vLLM's V1 model runner. vLLM picks V2 on CUDA hosts with Triton unless told otherwise, and reads
# this variable in every process: the engine core's scheduler branches on it too. The engine core inherits it
# from the replica, and vLLM's Ray executor copies every VLLM_* variable to its TP workers.
RUNNER_ENV = "VLLM_USE_V2_MODEL_RUNNER"


class WCSConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    policy: PolicyName = Field(default=PolicyName.WCS, description="ar | static | dspark | wcs")
    estimator: Literal["context", "ewma", "constant"] = "context"
    traces: Path | None = Field(
        default=None,
        description="acceptance traces the estimator is fitted on; None: the calibration's, or for the embedded pair its "
        "shipped traces",
    )
    calibration: Path | None = Field(
        default=None,
        description="a `forespark calibrate` folder for this model pair: its traces, step-cost profiles and draft-width mode",
    )
    draft_widths: Literal["ragged", "whole_blocks"] = Field(
        default="ragged",
        description="ragged: any width per request; whole_blocks: each step drafts every request's full block or nothing "
        "(for non-causal drafters whose truncated blocks lose acceptance; `forespark calibrate` measures it)",
    )
    cost_model: Path | None = Field(
        default=None, description="profiled step-cost JSON; None: profile at start and cache per engine config"
    )
    max_step_ms: float | None = Field(
        default=None,
        gt=0,
        description="caps predicted step time (an inter-token latency bound); a TPOT SLO needs no cap: see planner.py",
    )
    pace_tpot_ms: float | None = Field(
        default=None,
        gt=0,
        description="keep requests' time per output token within this, counting how far ahead of it each is so far: "
        "the planner takes the best plan that keeps on pace every request a step can keep (scheduling/planner.py); None: off",
    )
    online_cost: bool = Field(
        default=True,
        description="correct the profiled step cost by measured step periods while serving (scheduling/online_cost.py)",
    )
    replan_every: int = Field(
        default=8,
        ge=1,
        description="after a plan that chose to draft nothing, plan again only every this many steps "
        "(1, with replan_max 1: every step)",
    )
    replan_max: int = Field(
        default=64,
        ge=1,
        description="each further plan in a row without drafts doubles that hold, up to this many steps",
    )
    explore_every: int | None = Field(
        default=16,
        ge=1,
        description="a request with no verified draft for this many of its steps gets a one-token probe (its interval "
        "doubles after each rejected probe, up to 8x; scheduling/exploration.py); None: no exploration",
    )
    explore_budget: float = Field(
        default=0.02,
        gt=0.0,
        lt=1.0,
        description="share of step time that steps drafting only to probe may cost; each round after which the next "
        "plan still drafts nothing halves it, down to an eighth, and a plan that drafts restores it (scheduling/exploration.py)",
    )
    recalibrate: bool = Field(
        default=True,
        description="move the estimator's per-position predictions to the acceptance realised while serving "
        "(scheduling/recalibration.py)",
    )
    draft_margin: float = Field(
        default=0.05,
        ge=0.0,
        description="wcs drafts in a step only when the plan's predicted tokens per ms beat drafting nothing by "
        "this share (scheduling/policies.py): near break-even, what a step model misses decides the sign",
    )
    advantage_feedback: bool = Field(
        default=False,
        description="wcs's margin is at least how far drafting plans realised less, against their prediction, than "
        "steps drafting nothing near the load (scheduling/realised_advantage.py; docs/design/closed-loop-wcs.md says "
        "why it is off by default)",
    )
    mode_gate: bool = Field(
        default=False,
        description="wcs serves each load in blocks of steps, speculating or holding (drafting nothing, as `ar`), "
        "whichever realised more tokens per ms there, and serves the other again now and then "
        "(scheduling/mode_gate.py; docs/design/closed-loop-wcs.md says why it is off by default)",
    )
    mode_block_steps: int = Field(default=64, ge=1, description="steps per block of the mode gate")
    history_decay: float = Field(default=0.7, ge=0.0, lt=1.0)
    seed: int = 0

    def check_pair(self, model: Path, drafter: Path) -> None:
        """Refuse a pair this config has no acceptance traces for (reads no files: a calibration folder may exist
        only on the serving hosts). A pair other than the embedded one needs its own (`forespark calibrate`),
        unless the estimator is the constant prior, which reads none: a toy model's features would steer it."""
        if self.traces is not None or self.calibration is not None or self.estimator == "constant" or _embedded(model, drafter):
            return
        raise ValueError(
            f"WCS has no acceptance traces for the model pair {model} + {drafter}: run "
            f"`forespark calibrate --model {model} --drafter {drafter} --out DIR` and set engine.wcs.calibration: DIR "
            "(or engine.wcs.estimator: constant to serve without one)"
        )

    def for_pair(self, model: Path, drafter: Path, k: int) -> "WCSConfig":
        """This config with its traces and draft-width mode resolved for the (target, drafter) pair it serves,
        drafting `k` tokens."""
        self.check_pair(model, drafter)
        if self.traces is not None or self.estimator == "constant":
            return self
        if self.calibration is not None:
            from replicas.wcs.calibration import Calibration

            return Calibration.load(self.calibration).apply(self.calibration, self, k)
        if _embedded(model, drafter):
            return self.model_copy(update={"traces": WEIGHTS_DIR / "traces.npz"})
        return self

    def additional_config(self) -> dict:
        return {CONFIG_KEY: self.model_dump(mode="json")}

    @classmethod
    def from_vllm(cls, additional_config: dict | None) -> "WCSConfig":
        return cls.model_validate((additional_config or {}).get(CONFIG_KEY, {}))


def _embedded(model: Path, drafter: Path) -> bool:
    return Path(model).resolve() == (WEIGHTS_DIR / "target").resolve() and Path(drafter).resolve() == (WEIGHTS_DIR / "drafter").resolve()
