"""`worker_cls` for engines with WCS: the platform's V1 worker, with the WCS runner installed.

Engine kwargs: `worker_cls="replicas.wcs.worker.WCSWorker"` and
`additional_config={"forespark": {...WCSConfig...}}`. The `wcs_*` methods are
reached through `collective_rpc` (one answer per rank).
"""

from __future__ import annotations

import io
import os

from vllm.logger import init_logger
from vllm.platforms import current_platform

from replicas.wcs.config import RUNNER_ENV, WCSConfig
from replicas.wcs.controller import StepController, fit_estimators
from replicas.wcs.runner import install
from scheduling.cost_model import StepCostModel
from scheduling.traces import Traces

if current_platform.is_cpu():
    from vllm.v1.worker.cpu_worker import CPUWorker as _PlatformWorker
else:
    from vllm.v1.worker.gpu_worker import Worker as _PlatformWorker

logger = init_logger(__name__)


def check_v1_runner(vllm_config) -> None:
    """WCS hooks into the V1 runner (`drafter`, `propose_draft_token_ids`); V2 has neither."""
    if vllm_config.use_v2_model_runner:
        raise RuntimeError(
            "WCS runs on vLLM's V1 model runner, but this engine selected Model Runner V2 "
            f"({RUNNER_ENV}={os.environ.get(RUNNER_ENV, 'unset')}). Set {RUNNER_ENV}=0 in the environment of every "
            "engine process before vLLM starts (replicas.engine.engine_environment does so for WCS engines unless "
            f"{RUNNER_ENV} is already set), or serve with wcs: null to run vLLM's own speculation on V2."
        )


class WCSWorker(_PlatformWorker):
    def init_device(self) -> None:
        check_v1_runner(self.vllm_config)
        super().init_device()
        config = WCSConfig.from_vllm(self.vllm_config.additional_config)
        spec = self.vllm_config.speculative_config
        if spec is None:
            raise ValueError("WCS needs a speculative_config with a DFlash drafter")
        if self.vllm_config.scheduler_config.async_scheduling:
            raise ValueError("WCS needs async_scheduling=False: it hands the scheduler each step's drafts synchronously")
        k = spec.num_speculative_tokens
        cost = None
        if config.cost_model is not None and config.cost_model.exists():
            cost = StepCostModel.load(config.cost_model)
        estimator, calibrator = fit_estimators(config, k)
        controller = StepController(
            config,
            k,
            estimator,
            calibrator,
            cost,
            token_budget=self.vllm_config.scheduler_config.max_num_batched_tokens,
        )
        install(self.model_runner, controller)

    @property
    def _wcs(self) -> StepController:
        return self.model_runner.wcs

    def wcs_runner_info(self) -> dict:
        """Which model runner this rank built, and the setting that chose it (this process's)."""
        return {
            "pid": os.getpid(),
            "rank": self.rank,
            "env": os.environ.get(RUNNER_ENV),
            "use_v2_model_runner": bool(self.vllm_config.use_v2_model_runner),
            "runner": [f"{c.__module__}.{c.__qualname__}" for c in type(self.model_runner).__mro__ if "ModelRunner" in c.__name__],
            "drafter_causal": bool(self.model_runner.drafter.dflash_causal),
        }

    def wcs_stats(self) -> dict:
        ctl = self._wcs
        ctl.stats.step_cost_offset_ms = ctl.cost_offset_ms
        ctl.stats.launch_offset_ms = ctl.launch_offset_ms
        return ctl.stats.model_dump()

    def wcs_batch_acceptance(self) -> float:
        return self._wcs.predicted_accept_len()

    def wcs_live_requests(self) -> list[str]:
        """Requests the controller still holds state for (acceptance history, pending draft features)."""
        return self._wcs.tracker.live()

    def wcs_set_policy(self, policy: str) -> None:
        self._wcs.set_policy(policy)

    def wcs_cost_model(self) -> str | None:
        return None if self._wcs.cost is None else self._wcs.cost.model_dump_json()

    def wcs_set_cost_model(self, cost_json: str) -> None:
        self._wcs.cost = StepCostModel.model_validate_json(cost_json)

    def wcs_set_online_cost(self, on: bool) -> None:
        """Turn the online step-cost correction on or off (`WCSConfig.online_cost`); off serves the profile."""
        ctl = self._wcs
        ctl.config.online_cost = on
        ctl.cost = ctl.cost  # a fresh correction from the profile

    def wcs_set_pace(self, tpot_ms: float | None) -> None:
        """Set or clear the planner's TPOT pace (`WCSConfig.pace_tpot_ms`)."""
        ctl = self._wcs
        ctl.config.pace_tpot_ms = tpot_ms
        ctl.limits = ctl.limits.model_copy(update={"pace_tpot_ms": tpot_ms})

    def wcs_profiling(self, seed: int | None, skip: float = 0.25) -> None:
        """Random widths (lossless: chosen without looking at drafts), a `skip` share of steps drafting
        nothing, while the step log fills; None stops."""
        import numpy as np

        self._wcs.profiling = None if seed is None else np.random.default_rng(seed)
        self._wcs.profiling_skip = skip

    def wcs_step_log(self, keep: bool) -> list[dict]:
        """The steps logged since the last call; `keep` turns logging on or off from now."""
        from dataclasses import asdict

        steps = [asdict(s) for s in (self.model_runner.wcs_log or [])]
        self.model_runner.wcs_log = [] if keep else None
        return steps

    def wcs_record(self, on: bool) -> bytes | None:
        """Start keeping verdict rows (`on`), or stop and return them as a `Traces` .npz."""
        ctl = self._wcs
        if on:
            ctl.recorded = []
            return None
        rows, ctl.recorded = ctl.recorded or [], None
        if not rows:
            return None
        buf = io.BytesIO()
        Traces.concatenate(rows).save(buf)
        return buf.getvalue()
