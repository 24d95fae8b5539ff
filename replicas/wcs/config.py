"""WCS settings: what a user puts in the engine kwargs (`additional_config["forespark"]`) or a config file."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from replicas.models.build import WEIGHTS_DIR
from scheduling.policies import PolicyName

CONFIG_KEY = "forespark"  # key under vLLM's `additional_config`
WORKER_CLS = "replicas.wcs.worker.WCSWorker"


class WCSConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    policy: PolicyName = Field(default=PolicyName.WCS, description="ar | static | dspark | wcs")
    estimator: Literal["context", "ewma", "constant"] = "context"
    traces: Path = Field(default=WEIGHTS_DIR / "traces.npz", description="acceptance traces the estimator is fitted on")
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
        description="after a plan that chose to draft nothing, plan again only every this many steps (1: every step)",
    )
    history_decay: float = Field(default=0.7, ge=0.0, lt=1.0)
    seed: int = 0

    def additional_config(self) -> dict:
        return {CONFIG_KEY: self.model_dump(mode="json")}

    @classmethod
    def from_vllm(cls, additional_config: dict | None) -> "WCSConfig":
        return cls.model_validate((additional_config or {}).get(CONFIG_KEY, {}))
