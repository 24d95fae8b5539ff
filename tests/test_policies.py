import numpy as np
import pytest

from scheduling.cost_model import StepCostModel
from scheduling.policies import Policy, PolicyName, StepLimits
from scheduling.survival import survival_from_hazards

COST = StepCostModel.linear(5.0, 0.01, 0.02, 0.05)
K = 6


def step(name, survival, post, max_width=None, oracle=None, limits=StepLimits()):
    policy = Policy(name=name, k=K)
    width = np.full(len(survival), K) if max_width is None else max_width
    plan = policy.plan(survival, COST, limits, width, oracle)
    return plan.draft, policy.verify(post, plan, COST, limits)


@pytest.fixture
def curves():
    rng = np.random.default_rng(0)
    return survival_from_hazards(rng.uniform(0.2, 0.99, (8, K))), survival_from_hazards(rng.uniform(0.2, 0.99, (8, K)))


def test_ar_drafts_nothing(curves):
    draft, verify = step("ar", *curves)
    assert draft.sum() == 0 and verify.sum() == 0


def test_static_drafts_and_verifies_the_full_block(curves):
    draft, verify = step("static", *curves)
    assert np.all(draft == K) and np.all(verify == K)


def test_dspark_drafts_full_width_and_schedules_verification(curves):
    pre, post = curves
    draft, verify = step("dspark", pre, np.minimum(post, 0.3))  # low confidence: verify less
    assert np.all(draft == K) and verify.sum() < draft.sum()


def test_wcs_drafts_per_request_widths(curves):
    pre, post = curves
    draft, verify = step("wcs", pre, post)
    assert len(set(draft.tolist())) > 1 and np.all(verify <= draft)
    # Requests with higher survival get at least as wide a draft (same gain order as the sort).
    top = np.argmax(pre[:, 2])
    bottom = np.argmin(pre[:, 2])
    assert draft[top] >= draft[bottom]


def test_oracle_drafts_true_accepted_plus_one(curves):
    accepted = np.array([0, 1, 2, 3, 4, 5, 6, 6])
    draft, verify = step("oracle", *curves, oracle=accepted)
    assert draft.tolist() == np.minimum(accepted + 1, K).tolist() and np.all(verify == draft)
    with pytest.raises(ValueError, match="oracle"):
        step("oracle", *curves)


def test_max_width_caps_every_policy(curves):
    cap = np.array([0, 1, 2, 3, 6, 6, 6, 6])
    for name in ("static", "dspark", "wcs"):
        draft, _ = step(name, *curves, max_width=cap)
        assert np.all(draft <= cap)


def test_limits_bind_every_policy(curves):
    limits = StepLimits(token_budget=8 + 10)
    for name in PolicyName:
        oracle = np.full(8, K) if name == "oracle" else None
        draft, verify = step(name, *curves, oracle=oracle, limits=limits)
        assert 8 + verify.sum() <= 18 and draft.sum() <= 10


def test_unknown_policy_is_rejected():
    with pytest.raises(ValueError):
        Policy(name="greedy", k=4)


@pytest.mark.parametrize("level", [0.05, 0.5, 0.95])
def test_whole_blocks_wcs_drafts_every_full_block_or_nothing_whichever_pays(level):
    """For drafters whose truncated blocks lose acceptance: no ragged widths, and the better of the two plans."""
    survival = survival_from_hazards(np.full((8, K), level))
    width = np.array([K, K, K, 3, K, K, 0, K])  # some requests cannot draft their whole block now
    whole = Policy(name="wcs", k=K, whole_blocks=True).plan(survival, COST, StepLimits(), width)
    full = Policy(name="static", k=K).plan(survival, COST, StepLimits(), width)
    none = Policy(name="ar", k=K).plan(survival, COST, StepLimits(), width)
    assert np.array_equal(whole.draft, full.draft) or np.array_equal(whole.draft, none.draft)
    assert whole.tokens_per_ms == pytest.approx(max(full.tokens_per_ms, none.tokens_per_ms))
    ragged = Policy(name="wcs", k=K).plan(survival, COST, StepLimits(), width)
    if level == 0.5:  # ragged widths are what the whole-block mode gives up
        assert set(ragged.draft.tolist()) - {0, 3, K} and ragged.tokens_per_ms > whole.tokens_per_ms
    assert (whole.draft.any()) == (level > 0.05)


def test_trace_replay_reports_every_policys_regret_against_the_oracle():
    from scheduling.simulate import simulate

    rows = {r.policy: r for r in simulate(list(PolicyName), batch=16, steps=30, seed=3)}
    assert rows[PolicyName.ORACLE].regret_vs_oracle == 0.0
    assert all(r.regret_vs_oracle >= -1e-9 for r in rows.values())  # the oracle is never beaten
    assert rows[PolicyName.AR].regret_vs_oracle > 0.5 and rows[PolicyName.WCS].regret_vs_oracle < rows[PolicyName.STATIC].regret_vs_oracle


def test_engine_bench_reports_wcs_against_the_best_other_policy_per_concurrency():
    from replicas.wcs.bench import EngineRun, wcs_vs_best

    def row(policy, c, tps):
        return EngineRun(policy=policy, concurrency=c, finished=1, output_tokens=1, seconds=1.0, tokens_per_s=tps,
                         per_request_rate=1.0, mean_accepted_length=1.0, draft_waste=0.0, draft_share=0.0,
                         planner_share=0.0, steps=1)

    rows = [row("ar", 1, 100.0), row("static", 1, 120.0), row("wcs", 1, 114.0), row("ar", 64, 50.0), row("wcs", 64, 60.0),
            row("ar", 128, 10.0)]
    assert wcs_vs_best(rows) == pytest.approx({"1": 0.95, "64": 1.2, "128": None})


def test_engine_bench_pairs_each_repetition_of_wcs_with_the_same_repetition_of_the_best_other_policy():
    """The host runs at 100, 60 and 80 over three repetitions; wcs runs at 0.97, 0.97 and 0.80 of `static` in them.
    Paired, the median is 0.97; the ratio of medians (64 / 80) takes wcs's from the slow repetition and `static`'s
    from another. Control: without repetitions to pair there is no paired figure."""
    from replicas.wcs.bench import EngineRun, median_run, wcs_vs_best, wcs_vs_best_paired

    def run(policy, tps):
        return EngineRun(policy=policy, concurrency=4, finished=1, output_tokens=1, seconds=1.0, tokens_per_s=tps,
                         per_request_rate=1.0, mean_accepted_length=1.0, draft_waste=0.0, draft_share=0.0,
                         planner_share=0.0, steps=1)

    host = [100.0, 60.0, 80.0]
    rows = [
        median_run([run("ar", 0.9 * h) for h in host]),
        median_run([run("static", h) for h in host]),
        median_run([run("wcs", share * h) for share, h in zip((0.97, 0.97, 0.80), host)]),
    ]
    assert rows[2].runs_tokens_per_s == pytest.approx([97.0, 58.2, 64.0])
    assert wcs_vs_best_paired(rows) == pytest.approx({"4": 0.97})
    assert wcs_vs_best(rows) == pytest.approx({"4": 0.80})
    single = [r.model_copy(update={"runs_tokens_per_s": []}) for r in rows]
    assert wcs_vs_best_paired(single) == {"4": None}


def test_engine_bench_order_puts_every_policy_as_often_early_as_late():
    """Over each pair of repetitions every policy's positions sum alike, so a drift of the host within a concurrency's
    runs falls on all of them alike. Control: the same order every repetition leaves `wcs` last each time."""
    from replicas.wcs.bench import POLICIES, rotation

    assert "wcs" in POLICIES and len(POLICIES) > 2
    for reps in (2, 4):
        sums = {p: sum(rotation(POLICIES, r).index(p) for r in range(reps)) for p in POLICIES}
        assert len(set(sums.values())) == 1, sums
    fixed = {p: sum(list(POLICIES).index(p) for _ in range(2)) for p in POLICIES}
    assert len(set(fixed.values())) > 1


def test_engine_bench_times_no_run_before_every_policy_has_run_at_its_concurrency():
    """The first drafting-heavy run at a load slows the engine for the runs after it: at each concurrency every
    policy runs once untimed before the timed repetitions, which keep their rotation. Control: the rotation alone
    times `ar` before any other policy has run at the load."""
    from replicas.wcs.bench import POLICIES, rotation, schedule

    def settled(runs) -> bool:
        for c in {c for c, _, _ in runs}:
            at = [(rep, p) for cc, rep, p in runs if cc == c]
            first_timed = next(n for n, (rep, _) in enumerate(at) if rep is not None)
            if {p for rep, p in at[:first_timed] if rep is None} != set(POLICIES):
                return False
        return True

    runs = schedule(POLICIES, (1, 64), 3)
    assert settled(runs)
    for c in (1, 64):
        timed = [p for cc, rep, p in runs if cc == c and rep is not None]
        assert timed == [p for r in range(3) for p in rotation(POLICIES, r)]
    assert not settled([(c, r, p) for c in (1, 64) for r in range(3) for p in rotation(POLICIES, r)])
