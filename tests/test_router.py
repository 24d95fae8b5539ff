"""The cluster router's parts without a cluster: routing stats, the placement score, the prompt model,
the router's ranking and in-flight accounting, and GPU placement options.

Replicas here are stand-ins for Serve's `RunningReplica` (which needs live actors): they carry the
id and routing stats the router reads. `tests/test_serve.py` runs the same router inside real Serve.
"""

import asyncio
import random
import time

import numpy as np
import pytest

from cluster.bench_router import BenchReplica
from cluster.placement import FleetArrays, expected_tokens_per_step, placement_slack
from replicas.routing_stats import StepMix, headroom_tokens, routing_stats
from scheduling.cost_model import StepCostModel

COST = StepCostModel.linear(intercept_ms=8.0, per_request_ms=0.2, per_draft_ms=0.2, per_target_ms=0.3, draft_launch_ms=5.0)
MIX = StepMix(drafted=3.0, verified=2.0, accepted=1.0, measured=True)


def stats(running: int, *, cap_ms: float = 60.0, mix: StepMix = MIX, waiting: int = 0, max_num_seqs: int = 64):
    return routing_stats(
        cost=COST, running=running, waiting=waiting, kv_usage=0.1, max_num_seqs=max_num_seqs,
        token_budget=4096, cap_ms=cap_ms, mix=mix, predicted_accept_len=2.5,
    )


def test_headroom_is_the_largest_token_count_under_the_cap():
    for r, n, cap in [(1, 3, 20.0), (16, 40, 30.0), (64, 200, 80.0), (64, 200, 10.0)]:
        h = headroom_tokens(COST, r, 10, n, cap, token_budget=4096)
        fits = [t for t in range(0, 500) if COST.step_ms(r, 10, n + t) <= cap]
        assert h == (max(fits) if fits else 0.0), (r, n, cap)
    # The engine's token budget bounds it too (a flat cost model would otherwise claim unbounded room).
    flat = StepCostModel.linear(intercept_ms=1.0, per_request_ms=0.0, per_draft_ms=0.0, per_target_ms=0.0)
    assert headroom_tokens(flat, 4, 0, 8, 50.0, token_budget=100) == 92


def score(fleet, added, tokens):
    """Slack per replica; `tokens`: the request's tokens per step everywhere, or None for each replica's own."""
    arrays = FleetArrays(fleet)
    return placement_slack(arrays, np.asarray(added, dtype=float), expected_tokens_per_step(arrays, 1.0) if tokens is None else tokens)


def test_placement_prefers_the_unloaded_replica_and_counts_requests_routed_since_the_stats():
    slack = score([stats(40), stats(2)], [0, 0], 2.0)
    assert slack[1] > slack[0] + 1.0
    # Requests the router sent to the idle one since its stats were taken load it on paper.
    slack = score([stats(40), stats(2)], [0, 45], 2.0)
    assert slack[0] > slack[1]
    # A replica whose batch is full queues the request: a whole cap of slack lost.
    full = score([stats(63, max_num_seqs=64, waiting=3)], [0], 2.0)
    assert full[0] < score([stats(63, max_num_seqs=128)], [0], 2.0)[0] - 50.0


def test_acceptance_pays_only_where_the_cap_leaves_room_to_speculate():
    base = stats(30, cap_ms=1000.0, mix=StepMix(drafted=6.0, verified=5.0, accepted=4.0, measured=True))  # the batch gets 5 tokens a step
    step_after = base.step_ms + base.request_ms
    no_spec = base.base_step_ms + base.base_request_ms  # the same batch plus one, every request one token a step
    assert no_spec < step_after
    tight = base.model_copy(update={"cap_ms": no_spec})  # no room left for any speculation
    half = base.model_copy(update={"cap_ms": (no_spec + step_after) / 2})  # room for half of it
    roomy = base.model_copy(update={"cap_ms": step_after + 500.0})

    def tpot(s, tokens):  # slack = cap - TPOT when nothing queues
        return s.cap_ms - score([s], [0], tokens)[0]

    assert tpot(roomy, 4.0) == pytest.approx(step_after / 4.0)
    assert tpot(tight, 4.0) == pytest.approx(no_spec)  # its drafts cannot be verified there
    # Halfway, WCS keeps half of the speculation: half the accepted tokens (the new request's 3 become 1.5).
    assert tpot(half, 4.0) == pytest.approx(half.cap_ms / (1.0 + 3.0 * 0.5))
    # Control: acceptance changes the forecast only where there is room for it.
    assert tpot(roomy, 4.0) < tpot(roomy, 1.0) - 10.0
    assert tpot(tight, 4.0) == pytest.approx(tpot(tight, 1.0))


def test_expected_tokens_are_each_replicas_own_scaled_by_the_requests_relative_acceptance():
    fleet = FleetArrays([stats(8, mix=StepMix(drafted=4, verified=3, accepted=2, measured=True)), stats(8)])
    assert expected_tokens_per_step(fleet, 1.0) == pytest.approx([3.0, 2.0])
    assert (expected_tokens_per_step(fleet, 1.2) > expected_tokens_per_step(fleet, 0.8)).all()
    # A replica without a drafter (its engine runs autoregressive decoding) gives one token whatever the request.
    ar = FleetArrays([stats(8, mix=StepMix(measured=True))])
    assert expected_tokens_per_step(ar, 1.5) == pytest.approx([1.0])


def test_a_request_goes_to_the_replica_whose_drafter_serves_it_not_to_the_cheaper_step_without_one():
    # Same batch; one replica drafts (3 tokens a step, dearer steps), the other has no drafter (cheaper steps,
    # one token a step). A fleet-wide acceptance figure credited the second with the first's tokens.
    def replica(cost, mix, accept_len):
        return routing_stats(cost=cost, running=20, waiting=0, kv_usage=0.1, max_num_seqs=64, token_budget=4096,
                             cap_ms=60.0, mix=mix, predicted_accept_len=accept_len)

    drafts = StepMix(drafted=6.0, verified=4.0, accepted=2.0, measured=True)
    gpu_like = StepCostModel.linear(intercept_ms=10.0, per_request_ms=0.1, per_draft_ms=0.02, per_target_ms=0.02, draft_launch_ms=1.0)
    slack = score([replica(gpu_like, drafts, 2.5), replica(gpu_like, StepMix(measured=True), 1.0)], [0, 0], None)
    assert slack[0] > slack[1] + 5.0
    # Control: where drafting costs more than its tokens give (this cost model's TPOT 71/3 ms against 18/1), the
    # replica without a drafter is the better place, and the score says so.
    slack = score([replica(COST, drafts, 2.5), replica(COST, StepMix(measured=True), 1.0)], [0, 0], None)
    assert slack[1] > slack[0] + 5.0


def test_long_prompts_go_where_prefill_is_cheap_and_few_prompt_tokens_were_routed_since_the_stats():
    # Two replicas alike at the step the router sees, but one prefills at a fifth of the other's cost per prompt
    # token (a faster GPU above the knee, where a decoding step's few tokens cost the same on both).
    base = stats(16, cap_ms=40.0)
    fleet = FleetArrays([base.model_copy(update={"prefill_token_ms": 0.05}), base.model_copy(update={"prefill_token_ms": 0.01})])
    tokens = expected_tokens_per_step(fleet, 1.0)
    slack = lambda **request: placement_slack(fleet, np.zeros(2), tokens, **request)  # noqa: E731
    long_prompt = slack(prompt_tokens=4000)
    assert long_prompt[1] > long_prompt[0] + 2.0  # 200 ms of the next second's decoding against 40 ms
    short = slack(prompt_tokens=20)
    assert abs(short[1] - short[0]) < 0.05  # control: a short prompt costs about the same anywhere
    assert slack()[0] == pytest.approx(slack()[1])  # and with no prompt the score is the one before prompts
    # The prompts routed since the stats weigh too: 20,000 tokens sent to the cheap one (200 ms of its prefill) make
    # the other the better place.
    assert slack(prompt_tokens=4000, pending_prompt_tokens=np.array([0.0, 20000.0]))[0] > \
        slack(prompt_tokens=4000, pending_prompt_tokens=np.array([0.0, 20000.0]))[1]
    # The replica prices a prompt token itself, in a chunk that fills its token budget: this linear model's slope.
    assert base.prefill_token_ms == pytest.approx(0.3)


def test_a_replica_whose_realised_tpot_runs_over_its_model_scores_lower_until_it_catches_up():
    base = stats(16, cap_ms=40.0)
    modelled = base.step_ms / base.tokens_per_step
    slow = base.model_copy(update={"realised_tpot_ms": 2.0 * modelled})
    fleet = FleetArrays([slow, base])  # the second has no realised TPOT: its model stands
    slack = placement_slack(fleet, np.zeros(2), expected_tokens_per_step(fleet, 1.0))
    assert slack[1] > slack[0] + 5.0
    on_model = FleetArrays([base.model_copy(update={"realised_tpot_ms": modelled}), base])  # control: as modelled
    slack = placement_slack(on_model, np.zeros(2), expected_tokens_per_step(on_model, 1.0))
    assert slack[0] == pytest.approx(slack[1])
    # Within the band the ratio is the forecast's own bias (a WCS replica at its cap reads 1.10-1.15): it moves nothing;
    # past the band only what lies beyond it counts.
    for ratio, lower in [(1.15, False), (0.85, False), (1.5, True)]:
        fleet = FleetArrays([base.model_copy(update={"realised_tpot_ms": ratio * modelled}), base])
        slack = placement_slack(fleet, np.zeros(2), expected_tokens_per_step(fleet, 1.0))
        assert (slack[0] < slack[1] - 1.0) if lower else slack[0] == pytest.approx(slack[1]), ratio


def test_a_replica_that_ran_is_judged_by_its_measured_tokens_even_when_nothing_was_accepted():
    # Served at temperature 1 nothing is accepted: measured 1.0 tokens per step, whatever the estimator predicts.
    nothing = StepMix(drafted=0.1, verified=0.1, accepted=0.0, measured=True)
    assert expected_tokens_per_step(FleetArrays([stats(8, mix=nothing)]), 1.0) == pytest.approx(1.0)
    # Control: a replica that has not run yet goes by the estimator's prediction (2.5 here).
    assert expected_tokens_per_step(FleetArrays([stats(0, mix=StepMix())]), 1.0) == pytest.approx(2.5)


def test_prompt_model_tells_the_shipped_domains_apart_held_out():
    from cluster.prompt_model import PromptModel
    from replicas.models.workloads import load_workloads

    workloads = load_workloads()
    rng = random.Random(0)
    pairs = [(p.prompt, d) for d in workloads for p in workloads[d]]
    rng.shuffle(pairs)
    train, test = pairs[: len(pairs) // 2], pairs[len(pairs) // 2 :]
    accept = {"code": 6.6, "prose": 6.3}
    model = PromptModel.fit([t for t, _ in train], [d for _, d in train], accept)
    assert model.accuracy([t for t, _ in test], [d for _, d in test]) >= 0.9
    # Negative control: trained on shuffled labels it is near chance.
    labels = [d for _, d in train]
    rng.shuffle(labels)
    control = PromptModel.fit([t for t, _ in train], labels, accept)
    assert control.accuracy([t for t, _ in test], [d for _, d in test]) <= 0.75
    code = next(t for t, d in test if d == "code")
    assert model.predict({"prompt": code}) == pytest.approx(6.6, abs=0.1)
    assert model.predict({"messages": [{"role": "user", "content": code}]}) == pytest.approx(6.6, abs=0.1)


def test_the_shipped_prompt_model_takes_served_acceptance_from_traces_with_domains(tmp_path, monkeypatch):
    import dataclasses
    import shutil

    import replicas.models as models
    from cluster.prompt_model import PromptModel
    from scheduling.traces import synthetic_traces

    shutil.copy(models.WEIGHTS_DIR / "build_report.json", tmp_path)
    monkeypatch.setattr(models, "WEIGHTS_DIR", tmp_path)
    built = PromptModel.shipped().accept_len  # no traces: the build report's offline acceptance
    traces = synthetic_traces(num_requests=40, steps_per_request=5, seed=3)
    domain = np.where(traces.request_id % 2 == 0, "code", "prose")
    dataclasses.replace(traces, domain=domain).save(tmp_path / "traces.npz")
    expected = dataclasses.replace(traces, domain=domain).mean_accepted_length()
    assert PromptModel.shipped().accept_len == pytest.approx([expected["code"], expected["prose"]])
    assert PromptModel.shipped().accept_len != pytest.approx(built)
    # Control: traces without domains say nothing per domain; the build report stays the source.
    traces.save(tmp_path / "traces.npz")
    assert PromptModel.shipped().accept_len == pytest.approx(built)


def make_router(**kw):
    from ray.serve._private.common import DeploymentHandleSource, DeploymentID

    from cluster.router import AcceptanceHeadroomRouter

    router = AcceptanceHeadroomRouter(deployment_id=DeploymentID(name="E", app_name="t"), handle_source=DeploymentHandleSource.UNKNOWN)
    router.initialize_state(tie_ms=0.5, **kw)
    return router


def fleet(loads: list[int]):
    from ray.serve._private.common import DeploymentID, ReplicaID

    dep = DeploymentID(name="E", app_name="t")
    return [BenchReplica(ReplicaID(unique_id=f"r{i}", deployment_id=dep), stats(n).model_dump()) for i, n in enumerate(loads)]


def updated(replicas, changes: dict[int, dict]):
    """What Serve does when stats arrive: a new candidate list of new replica objects."""
    return [BenchReplica(r.replica_id, changes.get(i, r.routing_stats)) for i, r in enumerate(replicas)]


def pending(body=None):
    from ray.serve._private.common import RequestMetadata
    from ray.serve._private.request_router.common import PendingRequest

    return PendingRequest(args=["completions", body or {"prompt": "def f(x):"}], kwargs={}, metadata=RequestMetadata(request_id="x", internal_request_id="x"))


def test_router_ranks_the_least_loaded_first_and_backs_off():
    async def go():
        router, replicas = make_router(), fleet([50, 5, 30])
        request = pending()
        ranks = await router.choose_replicas(replicas, request)
        assert request.routing_context.should_backoff
        assert [r.replica_id.unique_id for rank in ranks for r in rank] == ["r1", "r2", "r0"]

    asyncio.run(go())


def test_router_in_flight_accounting_spreads_requests_between_stats_updates():
    async def go():
        router, replicas = make_router(), fleet([20, 20])
        chosen = []
        for _ in range(40):  # no stats refresh in between: only the router's own accounting moves
            request = pending()
            first = (await router.choose_replicas(replicas, request))[0]
            pick = first[0] if len(first) == 1 else random.choice(first)
            router.on_request_routed(request, pick.replica_id, None)
            chosen.append(pick.replica_id.unique_id)
        assert abs(chosen.count("r0") - chosen.count("r1")) <= 2
        # New stats for r0 (now showing the requests it got) reset its baseline: nothing is counted twice.
        replicas = updated(replicas, {0: stats(20 + chosen.count("r0")).model_dump()})
        view = router._fleet(replicas)
        assert list(view.baseline) == [chosen.count("r0"), 0]  # r1's stats are the old ones: its additions still count
        replicas = updated(replicas, {1: stats(20 + chosen.count("r1")).model_dump()})
        view = router._fleet(replicas)
        assert list(view.baseline) == [chosen.count("r0"), chosen.count("r1")]
        assert list(view.routed - view.baseline) == [0, 0]

    asyncio.run(go())


def test_router_counts_the_prompt_tokens_it_routed_since_the_stats_and_sends_long_prompts_apart():
    async def route_four(body):
        router, replicas = make_router(), fleet([20, 14])  # r1 has room for several more requests than r0
        picks = []
        for _ in range(4):
            request = pending(body)
            first = (await router.choose_replicas(replicas, request))[0]
            pick = first[0] if len(first) == 1 else random.choice(first)
            router.on_request_routed(request, pick.replica_id, None)
            picks.append(pick.replica_id.unique_id)
        return router, replicas, picks

    async def go():
        long_body = {"prompt": "x = 1\n" * 580}  # ~1,000 tokens by the router's estimate, 300 ms of prefill here
        router, replicas, picks = await route_four(long_body)
        assert picks[:2] == ["r1", "r0"]  # the second long prompt goes where no prefill is pending
        _, _, short_picks = await route_four(None)
        assert short_picks[:2] == ["r1", "r1"]  # control: short prompts fill the emptier replica first
        view = router._fleet(replicas)
        tokens = len(long_body["prompt"]) / 3.5
        assert view.prompts.sum() == pytest.approx(4 * tokens)
        # New stats for r0 reset what counts as routed since them there; r1's old stats keep its count.
        on_r1 = view.prompts[1]
        view = router._fleet(updated(replicas, {0: stats(22).model_dump()}))
        assert view.prompts[0] == 0 and view.prompts[1] == pytest.approx(on_r1) and on_r1 > 0

    asyncio.run(go())


def test_each_of_several_ingresses_counts_its_own_routing_as_its_share_of_the_fleets():
    async def first_after_routing_to_r0(router, n):
        replicas = fleet([20, 40])
        for _ in range(n):
            request = pending()
            await router.choose_replicas(replicas, request)
            router.on_request_routed(request, replicas[0].replica_id, None)
        return (await router.choose_replicas(replicas, pending()))[0][0].replica_id.unique_id

    async def go():
        # 8 requests this ingress sent to r0 since the stats: alone, r0 has 28 against r1's 40; as one of 4 ingresses
        # sharing the traffic, the fleet sent about 32 there (52 against 40).
        assert await first_after_routing_to_r0(make_router(), 8) == "r0"
        assert await first_after_routing_to_r0(make_router(ingresses=4), 8) == "r1"

    asyncio.run(go())


def test_router_falls_back_to_two_choices_without_fresh_stats_and_forgets_dead_replicas():
    async def go():
        router, replicas = make_router(), fleet([10, 10, 10, 10])
        replicas[2].routing_stats = {}
        ranks = await router.choose_replicas(replicas, pending())
        assert len(ranks) == 1 and len(ranks[0]) == 2
        replicas = updated(replicas, {2: {**stats(10).model_dump(), "timestamp": time.time() - 3600}})
        assert len((await router.choose_replicas(replicas, pending()))[0]) == 2
        replicas = updated(replicas, {2: stats(10).model_dump()})
        assert sum(len(r) for r in await router.choose_replicas(replicas, pending())) == 4
        router.on_request_routed(pending(), replicas[3].replica_id, None)
        router.on_replica_actor_died(replicas[3].replica_id)
        assert replicas[3].replica_id not in router.in_flight and router._view is None

    asyncio.run(go())


def test_router_keeps_the_prediction_of_a_ticketed_request_for_the_replica_it_went_to_and_gates_on_refusal():
    from ray.serve._private.common import DeploymentHandleSource, DeploymentID

    from cluster import admission
    from cluster.router import AcceptanceHeadroomRouter

    async def go():
        router = AcceptanceHeadroomRouter(deployment_id=DeploymentID(name="gated", app_name="t"), handle_source=DeploymentHandleSource.UNKNOWN)
        router.initialize_state(admission={"ttft_ms": 1000.0, "gate_s": 60.0})
        loop = admission.admission_loop("gated", admission.AdmissionConfig())
        assert router.loop is loop  # the ingress of this process gets the same one
        replicas = fleet([4, 40])
        request = pending()
        request.kwargs["ticket"] = ticket = loop.ticket()
        ranks = await router.choose_replicas(replicas, request)
        chosen = ranks[0][0]
        assert chosen.replica_id.unique_id == "r0"
        router.on_request_routed(request, chosen.replica_id, None)
        replica, ttft, *_ = loop._routed[ticket]
        assert replica == chosen.replica_id and ttft > 0 and loop._forecasts[replica][-1][1] > 0
        assert not loop.gate.closed()
        # A request's own SLO that no replica meets: refused, the gate stays open for the others.
        own = pending()
        own.kwargs["slo"] = {"tpot_ms": 0.5}
        await router.choose_replicas(replicas, own)
        assert isinstance(own.future.exception(), admission.AdmissionRejected) and not loop.gate.closed()
        # Every replica full past the SLO: refused; a second such refusal in a row shuts the gate until a request
        # completes.
        full = fleet([400, 400])
        refused = pending()
        await router.choose_replicas(full, refused)
        assert isinstance(refused.future.exception(), admission.AdmissionRejected) and not loop.gate.closed()
        again = pending()
        await router.choose_replicas(full, again)
        assert isinstance(again.future.exception(), admission.AdmissionRejected) and loop.gate.closed()
        router.on_request_completed(chosen.replica_id, "x")
        assert not loop.gate.closed()

    asyncio.run(go())


def test_a_ticketed_request_refused_only_for_tpot_waits_in_the_routers_queue_and_goes_when_a_replica_frees():
    """`AdmissionLoop.hold` in the router: Serve's routing loop asks again (every `HOLD_RETRY_S`) while the request
    waits; the ingress's look before the body lets requests through while the hold has room, and refuses once it
    is full; past `hold_ms` the request is refused. Control: without a ticket (no caller to wait) it is refused."""
    from ray.serve._private.common import DeploymentHandleSource, DeploymentID

    from cluster import admission
    from cluster.app import HOLD_RETRY_S, RouterConfig
    from cluster.router import AcceptanceHeadroomRouter

    async def go():
        router = AcceptanceHeadroomRouter(deployment_id=DeploymentID(name="held", app_name="t"), handle_source=DeploymentHandleSource.UNKNOWN)
        router.initialize_state(
            admission={"ttft_ms": 1000.0, "gate_s": 60.0, "hold_ms": 300.0, "hold_per_replica": 1.0, "hold_refused_share": 0.1}
        )
        loop = router.loop
        busy = fleet([60, 60])  # past the TPOT limit, nothing queued: only TPOT keeps requests out
        router.update_replicas(busy)
        for replica in busy:  # it completes what arrives, 8 a second (`hold_demand`: no wait under overload)
            for _ in range(20):
                router.drain.completed(replica.replica_id)

        def ticketed():
            request = pending()
            request.kwargs["ticket"] = loop.ticket()
            return request

        first, second, third = ticketed(), ticketed(), ticketed()
        assert router.refusal_for_any_body(None) is None  # room to wait: the body is read
        assert await router.choose_replicas(busy, first) == [] and not first.future.done()
        assert await router.choose_replicas(busy, second) == [] and not second.future.done()
        assert router.refusal_for_any_body(None) is not None  # both replicas' holds taken: refused unread
        await router.choose_replicas(busy, third)
        assert isinstance(third.future.exception(), admission.AdmissionRejected)
        untagged = pending()  # control
        await router.choose_replicas(busy, untagged)
        assert isinstance(untagged.future.exception(), admission.AdmissionRejected)
        # A replica frees up: the request waiting is decided again and placed there, and leaves the hold.
        freed = updated(busy, {0: stats(2).model_dump()})
        ranks = await router.choose_replicas(freed, first)
        assert ranks and ranks[0][0].replica_id.unique_id == "r0" and not first.future.done()
        router.on_request_routed(first, ranks[0][0].replica_id, None)
        assert first.kwargs["ticket"] not in loop._held and second.kwargs["ticket"] in loop._held
        # Within its hold a request still refused for TPOT waits on (the two refusals above aside); past it, it is refused.
        for _ in range(loop.config.feedback_window):
            loop.decided(refused=False)
        second.created_at = time.time() - 0.2
        assert await router.choose_replicas(busy, second) == [] and not second.future.done()
        second.created_at = time.time() - 0.35
        await router.choose_replicas(busy, second)
        assert isinstance(second.future.exception(), admission.AdmissionRejected) and loop.hold_room(2)

    asyncio.run(go())
    # Serve's routing loop asks again at a steady pace while requests may wait, and backs off as Serve does without.
    assert RouterConfig().request_router_config(1.0).max_backoff_s == HOLD_RETRY_S
    unheld = RouterConfig.model_validate({"admission": {"hold_ms": 0}}).request_router_config(1.0)
    assert unheld.initial_backoff_s != HOLD_RETRY_S and unheld.backoff_multiplier > 1


def test_gpu_tensor_parallel_replicas_get_one_bundle_per_gpu():
    """GPU placement cannot run here: this checks the deployment options Serve would be given."""
    from ray.serve.schema import DeploymentSchema

    from cluster.app import engine_deployment_options
    from replicas.deployment import ReplicaConfig
    from replicas.engine import EngineConfig

    config = ReplicaConfig(accelerator="gpu", num_cpus=2, engine=EngineConfig(tensor_parallel_size=4))
    options = engine_deployment_options(config)
    assert options["placement_group_bundles"] == [{"CPU": 2, "GPU": 1}, {"GPU": 1}, {"GPU": 1}, {"GPU": 1}]
    assert options["ray_actor_options"]["num_gpus"] == 0
    assert config.replica_engine().distributed_executor_backend == "ray"
    DeploymentSchema(name="EngineReplica", **options)  # Serve's own schema accepts them
    one = engine_deployment_options(ReplicaConfig(accelerator="gpu"))
    assert one == {"ray_actor_options": {"num_cpus": 1.0, "num_gpus": 1}}
    assert ReplicaConfig().replica_engine().distributed_executor_backend is None


def test_custom_resources_and_autoscaling_reach_the_deployment_options():
    """A config check (no GPUs here): resources pin replicas (also inside a TP placement group); autoscaling replaces num_replicas."""
    from ray.serve.schema import DeploymentSchema

    from cluster.app import engine_deployment_options, replica_count_options
    from replicas.deployment import AutoscalingBounds, ReplicaConfig
    from replicas.engine import EngineConfig

    pinned = ReplicaConfig(resources={"forespark_engine_node": 1}, autoscaling=AutoscalingBounds(min_replicas=1, max_replicas=3))
    options = {**engine_deployment_options(pinned), **replica_count_options(pinned)}
    assert options["ray_actor_options"]["resources"] == {"forespark_engine_node": 1}
    assert "num_replicas" not in options and options["autoscaling_config"]["max_replicas"] == 3
    DeploymentSchema(name="EngineReplica", **options)
    tp = ReplicaConfig(accelerator="gpu", engine=EngineConfig(tensor_parallel_size=2), resources={"h200": 1})
    assert engine_deployment_options(tp)["placement_group_bundles"][0] == {"CPU": 1.0, "GPU": 1, "h200": 1}
    assert replica_count_options(ReplicaConfig(num_replicas=3)) == {"num_replicas": 3}



def test_an_ingress_over_deployments_of_two_tensor_parallel_sizes_calls_the_one_with_more_slack():
    """`cluster/fleet_backend.py` with the routers Serve makes for each deployment's handle (here over stand-in
    replicas, as above): each request goes to the deployment whose best replica keeps the most TPOT slack."""
    from types import SimpleNamespace

    from ray.serve._private.common import DeploymentHandleSource, DeploymentID, ReplicaID

    from cluster import router_registry
    from cluster.fleet_backend import FleetBackend
    from cluster.router import AcceptanceHeadroomRouter

    def deployment(name: str, loads: list[int], fresh: bool = True):
        dep = DeploymentID(name=name, app_name="t")
        router = AcceptanceHeadroomRouter(deployment_id=dep, handle_source=DeploymentHandleSource.UNKNOWN)
        router.initialize_state(tie_ms=0.5)
        router.update_replicas([BenchReplica(ReplicaID(unique_id=f"{name}-{i}", deployment_id=dep),
                                             stats(n).model_dump() if fresh else {}) for i, n in enumerate(loads)])
        return SimpleNamespace(deployment_name=name), router

    async def go():
        (tp1, r1), (tp2, r2) = deployment("mixed-tp1", [40, 30, 50]), deployment("mixed-tp2", [10, 45])
        backend = FleetBackend([tp1, tp2], seed=0)
        body = {"prompt": "def f(x):"}
        assert r2.best_slack(body) > r1.best_slack(body)
        assert backend.choose(body) == 1
        r2.update_replicas([BenchReplica(r.replica_id, stats(60).model_dump()) for r in r2.curr_replicas.values()])
        assert backend.choose(body) == 0  # control: loaded, it loses the request
        # A deployment with as many of the ingress's requests outstanding as its replicas run at once would queue the
        # request: it loses it to one with room, whatever its slack; with room again it is ranked by slack again.
        for r in r1.curr_replicas.values():
            r.max_ongoing_requests = 4
        backend.outstanding[0] = 12
        assert backend.choose(body) == 1
        backend.outstanding[0] = 11
        assert backend.choose(body) == 0
        # A deployment whose router Serve has not made yet gets the request (its first makes it); one without stats
        # yet shares the traffic by replica count.
        router_registry.ROUTERS.pop("mixed-tp2")
        assert backend.choose(body) == 1
        (cold, _) = deployment("mixed-cold", [5, 5, 5], fresh=False)
        picks = [FleetBackend([tp1, cold], seed=s).choose(body) for s in range(60)]
        assert 15 < picks.count(1) < 45

    asyncio.run(go())


def test_the_ingress_counts_a_request_outstanding_at_its_deployment_until_its_reply_ends():
    """What `FleetBackend` sent a deployment counts against its room until the reply ends: a whole reply when it
    returns, a stream when it ends, fails, or is dropped unread; a call that raises at once."""
    import gc

    from cluster.fleet_backend import FleetBackend
    from replicas.openai_api import Reply

    async def chunks():
        yield "data: a\n\n"
        yield "data: [DONE]\n\n"

    class Deployment:
        deployment_name = "counted-unregistered"  # no router: `choose` takes the first backend

        def __init__(self) -> None:
            self.reply: Reply | Exception = Reply(200, {})

        async def completions(self, body, raw_request=None) -> Reply:
            if isinstance(self.reply, Exception):
                raise self.reply
            return self.reply

    async def go():
        dep = Deployment()
        backend = FleetBackend([dep])
        await backend.completions({"prompt": "x"})
        assert backend.outstanding == [0]
        dep.reply = Reply(200, stream=chunks())
        streamed = await backend.completions({"prompt": "x"})
        assert backend.outstanding == [1]  # control: held while the stream is open
        assert [c async for c in streamed.stream] == ["data: a\n\n", "data: [DONE]\n\n"]
        assert backend.outstanding == [0]
        dep.reply = Reply(200, stream=chunks())
        unread = await backend.completions({"prompt": "x"})
        assert backend.outstanding == [1]
        del unread
        gc.collect()
        assert backend.outstanding == [0]
        dep.reply = RuntimeError("replica gone")
        with pytest.raises(RuntimeError):
            await backend.completions({"prompt": "x"})
        assert backend.outstanding == [0]

    asyncio.run(go())


def test_the_ingress_builds_its_router_without_importing_torch():
    """Serve builds the request router on the ingress's event loop when the first request arrives; an import of
    torch there (the prompt model once read the build report through the model build's module) held that loop,
    and every request on it, for seconds. Control: importing the build module does pull torch in, so the check
    sees the import it guards against."""
    import subprocess
    import sys

    probe = "import sys; {}; print('torch' in sys.modules)"
    ingress = "import cluster.ingress, cluster.router; from cluster.prompt_model import PromptModel; PromptModel.shipped()"
    run = lambda code: subprocess.run([sys.executable, "-c", probe.format(code)], capture_output=True, text=True, check=True).stdout.split()[-1]
    assert run(ingress) == "False"
    assert run("import replicas.models.build") == "True"


def test_the_router_refuses_before_the_body_only_where_it_would_refuse_every_body():
    """The ingress asks `refusal_for_any_body` before it reads a request's body. Sound: wherever it refuses, `rank`
    refuses every body (code and prose, short and long prompts) on the same fleet under the same SLO header. It only
    looks (no gate shut, the probe's clock kept) until `refuse` commits it. Control: the same look with the
    worst-accepting domain's acceptance in place of the best one's is no bound: it refuses where a code prompt is
    admitted."""
    async def go():
        from ray.serve._private.common import DeploymentHandleSource, DeploymentID

        from cluster import admission
        from cluster.route import route
        from cluster.router import AcceptanceHeadroomRouter

        router = AcceptanceHeadroomRouter(deployment_id=DeploymentID(name="lookahead", app_name="t"), handle_source=DeploymentHandleSource.UNKNOWN)
        router.initialize_state(admission={"ttft_ms": 1000.0, "gate_s": 60.0, "hold_ms": 0.0})  # (holds: their own test)
        loop = router.loop
        code = {"prompt": "def f(x):\n    return x"}
        bodies = [code, {"prompt": "def f(x):\n" + "    y = x + 1\n" * 300}, {"prompt": "The history of the river valley is"},
                  {"messages": [{"role": "user", "content": "Tell me about rivers."}]}]
        looks = refused_looks = unsound_control = 0
        worst_acceptance = router.model.relative(min(router.model.accept_len))
        for loads in ([2, 3], [12, 10], [30, 20], [45, 40], [64, 60]):
            replicas = fleet(loads)
            router.update_replicas(replicas)
            view = router._fleet(list(router.curr_replicas.values()))
            # The SLOs a code prompt just meets, among others: where acceptance decides.
            best = route(view.arrays, view.routed - view.baseline, router.model.relative_acceptance(code), loop=loop,
                         config=router.admission, prompt_tokens=router._prompt_tokens(code), commit=False)
            edge = float(best.decision.tpot_ms.min()) / router.admission.tpot_share * 1.0001
            for tpot_ms in [*np.linspace(2.0, 40.0, 96), edge]:
                slo = {"tpot_ms": float(tpot_ms)}
                loop.gate.open()
                loop.last_admitted = -1e9
                looked = router.refusal_for_any_body(slo)
                looks += 1
                assert not loop.gate.closed() and loop.last_admitted == -1e9  # a look commits nothing
                admitted = []
                for body in bodies:
                    try:
                        router.rank(list(router.curr_replicas.values()), body, slo=slo)
                        admitted.append(True)
                    except admission.AdmissionRejected:
                        admitted.append(False)
                if looked is not None:
                    refused_looks += 1
                    assert not any(admitted), (loads, tpot_ms, admitted)
                worst = route(view.arrays, view.routed - view.baseline, worst_acceptance, loop=loop, config=router.admission,
                              prompt_tokens=0.0, slo=admission.RequestSLO(tpot_ms=float(tpot_ms)), commit=False)
                unsound_control += (not worst.decision.admit) and admitted[0]
        assert 0 < refused_looks < looks and unsound_control > 0, (refused_looks, looks, unsound_control)
        # Committed, a refusal for a full fleet shuts the gate as the router's own refusals do.
        router.update_replicas(fleet([400, 400]))
        loop.gate.open()
        decision = router.refusal_for_any_body(None)
        assert decision is not None and decision.full and not loop.gate.closed()
        assert isinstance(router.refuse(decision), admission.AdmissionRejected) and loop.gate.closed()
        router.update_replicas(fleet([2, 3]))
        assert router.refusal_for_any_body(None) is None

    asyncio.run(go())
