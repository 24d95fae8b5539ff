"""Autoscaling on budget headroom (`cluster/autoscale.py`): per-replica SLO capacity from the router's forecast,
the policy's hysteresis, and the policy as Serve runs it (a real `AutoscalingContext` and `AutoscalingConfig`)."""

import numpy as np
import pytest

from cluster.autoscale import HeadroomPolicy, HeadroomScaling, desired_replicas, replica_capacity, stats_from_metrics, utilisation
from cluster.placement import FleetArrays, expected_tokens_per_step, placement_forecast
from replicas.routing_stats import StepMix, autoscaling_metrics, routing_stats
from scheduling.cost_model import StepCostModel

GPU_LIKE = StepCostModel.linear(intercept_ms=8.0, per_request_ms=0.08, per_draft_ms=0.01, per_target_ms=0.01, draft_launch_ms=1.0)
MIX = StepMix(drafted=6.0, verified=4.0, accepted=2.0, measured=True)


def stats(running, *, cost=GPU_LIKE, mix=MIX, waiting=0, cap_ms=20.0, max_num_seqs=256):
    return routing_stats(cost=cost, running=running, waiting=waiting, kv_usage=0.1, max_num_seqs=max_num_seqs, token_budget=8192,
                         cap_ms=cap_ms, mix=mix, predicted_accept_len=3.0)


def test_capacity_is_where_the_forecast_reaches_the_cap_and_is_the_same_from_any_load():
    fleet = FleetArrays([stats(10), stats(60)])
    cap = replica_capacity(fleet, 0.9)
    assert cap[0] == pytest.approx(cap[1], abs=2)  # same replica, same cost model: the load it is at does not matter
    tokens = expected_tokens_per_step(fleet, 1.0)
    extra = cap - fleet.running
    at = placement_forecast(fleet, extra - 1.0, tokens).tpot
    past = placement_forecast(fleet, extra, tokens).tpot
    assert (at <= 0.9 * 20.0).all() and (past > 0.9 * 20.0).all()
    # A replica without a drafter (one token a step) carries fewer requests within the same cap.
    plain = FleetArrays([stats(10, mix=StepMix(measured=True))])
    assert replica_capacity(plain, 0.9)[0] < cap[0]
    # Control: the engine's batch bounds it.
    assert replica_capacity(FleetArrays([stats(10, max_num_seqs=16)]), 0.9)[0] == 16


def test_load_is_decode_work_so_a_fleet_is_full_before_its_batches_are():
    config = HeadroomScaling()
    loads = [utilisation([stats(n)] * 4, config) for n in (1, 2, 4, 8, 16, 24, 48)]
    assert loads == sorted(loads) and loads[0] < 0.05
    # With WCS the decode rate flattens early: 48 requests are most of what this replica can serve within the cap,
    # although the forecast would let it carry several times as many (each waiting longer).
    assert loads[-1] > 0.85 and replica_capacity(FleetArrays([stats(48)]), config.tpot_share)[0] > 2 * 48


def test_a_replica_forecast_below_its_batch_keeps_a_positive_step_so_its_load_counts():
    """Stats a simulated replica reported at 48 requests, its measured step a third speculation: the supply search
    forecasts it at fewer requests than it runs, where the speculation's per-request slope once took the step below
    zero, the supply to millions of tokens per ms and the utilisation to 0 (the fleet then never scaled up)."""
    from replicas.routing_stats import RoutingStats

    loaded = RoutingStats(timestamp=1.0, running=48, waiting=1, kv_usage=0.005, max_num_seqs=256, cap_ms=20.0, step_ms=15.91,
                          headroom_tokens=135.0, request_ms=0.485, base_step_ms=10.92, base_request_ms=0.057, token_ms=0.03,
                          tokens_per_step=3.15, verified_per_step=4.57, mix_measured=True, predicted_accept_len=4.3, realised_tpot_ms=4.0)
    fleet = FleetArrays([loaded])
    tokens = expected_tokens_per_step(fleet, 1.0)
    for added in range(-48, 1):
        assert placement_forecast(fleet, np.array([float(added)]), tokens).step_after[0] >= 0.5 * loaded.base_step_ms
    assert utilisation([loaded], HeadroomScaling()) > 0.3
    assert utilisation([loaded.model_copy(update={"running": 2, "waiting": 0})], HeadroomScaling()) < 0.1  # control: light load


def test_policy_scales_up_past_the_band_down_under_it_and_holds_inside():
    config = HeadroomScaling()

    def fleet_at(running, n=4, waiting=0):
        return [stats(running, waiting=waiting) for _ in range(n)]

    assert desired_replicas(4, fleet_at(48), config) > 5
    assert desired_replicas(4, fleet_at(4), config) < 2
    assert config.scale_down_below < utilisation(fleet_at(20), config) < config.scale_up_above
    assert desired_replicas(4, fleet_at(20), config) == 4  # inside the band: no change
    # Requests waiting past full batches, or queued before any replica, are load too.
    assert desired_replicas(4, fleet_at(256, waiting=200), config) > 8
    assert desired_replicas(4, fleet_at(20), config, queued=400) > 4


def test_serve_runs_the_policy_from_the_replicas_custom_metrics():
    from ray.serve._private.common import DeploymentID, ReplicaID
    from ray.serve.config import AutoscalingConfig, AutoscalingContext

    from cluster.app import replica_count_options
    from replicas.deployment import AutoscalingBounds, ReplicaConfig

    options = replica_count_options(ReplicaConfig(autoscaling=AutoscalingBounds(min_replicas=1, max_replicas=8)))
    config = AutoscalingConfig.model_validate(options["autoscaling_config"])
    config.policy.serialize_policy()  # what Serve does with it: the import path resolves
    assert config.policy.policy_function == "cluster.autoscale:HeadroomPolicy"
    dep = DeploymentID(name="EngineReplica", app_name="forespark")
    ids = [ReplicaID(unique_id=f"r{i}", deployment_id=dep) for i in range(2)]
    def ctx(running):
        reports = [autoscaling_metrics(stats(running)) for _ in ids]
        metrics = {name: {rid: r[name] for rid, r in zip(ids, reports)} for name in reports[0]}
        return AutoscalingContext(
            deployment_id=dep, deployment_name=dep.name, app_name=dep.app_name, current_num_replicas=2, target_num_replicas=2,
            running_replicas=ids, total_num_requests=2.0 * running, total_queued_requests=0.0, aggregated_metrics=metrics,
            raw_metrics=None, capacity_adjusted_min_replicas=1, capacity_adjusted_max_replicas=8, policy_state={},
            last_scale_up_time=None, last_scale_down_time=None, current_time=0.0, config=config)

    policy = HeadroomPolicy(**config.policy.policy_kwargs)
    assert len(stats_from_metrics(ctx(10).aggregated_metrics)) == 2
    assert policy(ctx(48))[0] > 2
    assert policy(ctx(4))[0] < 1
    assert policy(ctx(20))[0] == 2
    # Serve's default policy remains one setting away.
    default = replica_count_options(ReplicaConfig(autoscaling=AutoscalingBounds(policy="ongoing_requests")))
    assert "policy" not in default["autoscaling_config"]
    assert np.isnan(autoscaling_metrics(stats(0))["realised_tpot_ms"])
