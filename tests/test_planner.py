"""The joint planner reaches the brute-force optimum; the post-draft allocator is a stopping rule."""

import itertools

import numpy as np
import pytest

from scheduling.allocator import distribute_verify_budget
from scheduling.cost_model import PiecewiseLinear, StepCostModel
from scheduling.planner import plan_step
from scheduling.slots import rank_slots
from scheduling.survival import survival_from_hazards

COSTS = {
    "linear": StepCostModel.linear(2.0, 0.1, 0.05, 0.3),
    "draft-heavy": StepCostModel.linear(1.0, 0.0, 0.6, 0.1),
    "knee": StepCostModel(
        intercept_ms=1.5,
        requests=PiecewiseLinear(knots=[0, 1], slopes=[0.05]),
        drafted=PiecewiseLinear(knots=[0, 4, 8], slopes=[0.02, 0.4]),
        target=PiecewiseLinear(knots=[0, 6, 9], slopes=[0.05, 0.0]),
    ),
    # Running the drafter at all costs more than most slots gain: drafting is all-or-nothing per step.
    "launch": StepCostModel.linear(2.0, 0.1, 0.05, 0.1, draft_launch_ms=3.0),
    # Verifying is dear up to 5 target tokens and free after: the objective along the sort can dip and rise.
    "falling-marginal": StepCostModel(
        intercept_ms=1.0,
        target=PiecewiseLinear(knots=[0, 5, 6], slopes=[1.0, 0.0]),
    ),
}


def objective(survival, widths, cost):
    r = len(widths)
    gain = sum(survival[i, : widths[i]].sum() for i in range(r))
    total = int(np.sum(widths))
    return (r + gain) / float(cost.predict(r, total, r + total))


def brute_force(survival, cost, lo, hi, token_budget, time_cap_ms):
    r = survival.shape[0]
    best, best_value = None, -np.inf
    for widths in itertools.product(*[range(lo[i], hi[i] + 1) for i in range(r)]):
        total = sum(widths)
        if token_budget is not None and r + total > token_budget:
            continue
        if time_cap_ms is not None and cost.predict(r, total, r + total) > time_cap_ms:
            continue
        value = objective(survival, widths, cost)
        if value > best_value:
            best, best_value = widths, value
    return best, best_value


def random_instance(rng):
    b, k = int(rng.integers(1, 5)), int(rng.integers(1, 5))
    survival = survival_from_hazards(rng.uniform(0.05, 1.0, (b, k)))
    hi = rng.integers(0, k + 1, b) if rng.random() < 0.3 else np.full(b, k)
    budget = int(rng.integers(b, b * (k + 1) + 1)) if rng.random() < 0.5 else None
    return survival, hi, budget


@pytest.mark.parametrize("cost_name", list(COSTS))
def test_global_sort_reaches_brute_force_optimum(cost_name):
    cost = COSTS[cost_name]
    rng = np.random.default_rng(hash(cost_name) % 2**32)
    for _ in range(150):
        survival, hi, budget = random_instance(rng)
        b = survival.shape[0]
        cap = None
        if rng.random() < 0.4:
            cap = float(cost.predict(b, 0, b)) * float(rng.uniform(1.0, 1.6))
        plan = plan_step(survival, cost, hi=hi, token_budget=budget, time_cap_ms=cap)
        _, best_value = brute_force(survival, cost, np.zeros(b, int), hi, budget, cap)
        widths = plan.draft
        assert np.all(widths <= hi) and np.all(widths >= 0)
        total = int(widths.sum())
        assert plan.verify_cap == total
        if budget is not None:
            assert b + total <= budget
        if cap is not None:
            assert cost.predict(b, total, b + total) <= cap + 1e-9
        # Gains are sorted at a resolution of 1.5e-5, so allow that much per slot.
        assert objective(survival, widths, cost) >= best_value - 2e-5 * survival.size


def _on_pace(survival, widths, cost, slack, tpot):
    """Whether a plan keeps on pace every request the shortest step keeps on it (checked directly)."""
    b = len(widths)
    step = float(cost.predict(b, int(widths.sum()), b + int(widths.sum())))
    savable = slack + tpot >= float(cost.predict(b, 0, b))
    tau = 1 + np.array([survival[i, : widths[i]].sum() for i in range(b)])
    return bool(np.all(step <= (slack + tpot * tau)[savable] + 1e-9))


def test_a_tpot_pace_shortens_the_step_for_a_request_it_can_keep_and_only_then():
    cost = COSTS["linear"]
    survival = np.vstack([survival_from_hazards(np.full((1, 4), 0.9)), survival_from_hazards(np.full((1, 4), 0.15))])
    free = plan_step(survival, cost)
    assert free.draft[0] == 4  # the confident request drafts wide, and the step grows with it
    base = float(cost.predict(2, 0, 2))
    tpot = base * 1.2  # the unconfident request, at about one token a step, allows little growth
    assert not _on_pace(survival, free.draft, cost, np.zeros(2), tpot)

    paced = plan_step(survival, cost, slack_ms=np.zeros(2), tpot_ms=tpot)
    assert _on_pace(survival, paced.draft, cost, np.zeros(2), tpot) and paced.step_ms < free.step_ms and paced.draft.sum() > 0
    # Controls: slack enough to absorb the long step, or so far behind that even the shortest step leaves the
    # request behind (it is left to the argmax, which serves it tokens): the unconstrained plan stands.
    for slack in (np.full(2, free.step_ms), np.array([0.0, -10 * base])):
        assert plan_step(survival, cost, slack_ms=slack, tpot_ms=tpot).draft.tolist() == free.draft.tolist()


@pytest.mark.parametrize("cost_name", list(COSTS))
def test_the_paced_plan_is_the_best_prefix_on_pace(cost_name):
    """Against every prefix of the global sort, scored directly: the paced plan is on pace, and no prefix on
    pace does better."""
    cost = COSTS[cost_name]
    rng = np.random.default_rng(7 + len(cost_name))
    binds = 0
    for _ in range(150):
        survival, hi, budget = random_instance(rng)
        b, k = survival.shape
        tpot = float(cost.predict(b, 0, b)) * float(rng.uniform(0.8, 2.5))
        slack = rng.uniform(-0.5, 1.0, b) * tpot
        plan = plan_step(survival, cost, hi=hi, token_budget=budget, slack_ms=slack, tpot_ms=tpot)
        ranking = rank_slots(survival, cost, lo=None, hi=hi, drafted_tokens=None, token_budget=budget, time_cap_ms=None)
        on_pace = [objective(survival, ranking.widths(n), cost) for n in range(ranking.feasible_upto + 1)
                   if _on_pace(survival, ranking.widths(n), cost, slack, tpot)]
        assert _on_pace(survival, plan.draft, cost, slack, tpot)
        assert objective(survival, plan.draft, cost) >= max(on_pace) - 2e-5 * survival.size
        binds += plan.draft.tolist() != plan_step(survival, cost, hi=hi, token_budget=budget).draft.tolist()
    assert binds > 0 or cost_name in ("launch", "draft-heavy")  # the pace changed some plans (where many draft)


def test_forced_widths_are_kept_unless_a_limit_cuts_them():
    cost = COSTS["linear"]
    survival = survival_from_hazards(np.full((3, 4), 0.2))
    width = np.array([4, 2, 3])
    plan = plan_step(survival, cost, lo=width, hi=width)
    assert plan.draft.tolist() == [4, 2, 3]  # low gains, but the policy fixes the width
    cut = plan_step(survival, cost, lo=width, hi=width, token_budget=3 + 5)
    assert cut.draft.sum() == 5 and np.all(cut.draft <= width)


def test_ar_bounds_draft_nothing():
    plan = plan_step(np.ones((4, 3)), COSTS["linear"], lo=np.zeros(4), hi=np.zeros(4))
    assert plan.draft.tolist() == [0, 0, 0, 0] and plan.verify_cap == 0


def test_more_expensive_drafting_drafts_less():
    survival = survival_from_hazards(np.full((8, 6), 0.8))
    cheap = plan_step(survival, StepCostModel.linear(5.0, 0.0, 0.01, 0.05))
    dear = plan_step(survival, StepCostModel.linear(5.0, 0.0, 0.5, 0.05))
    assert dear.draft.sum() < cheap.draft.sum()


def test_survival_must_be_monotone_and_in_range():
    with pytest.raises(ValueError, match="non-increasing"):
        plan_step(np.array([[0.5, 0.9]]), COSTS["linear"])
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        plan_step(np.array([[1.5, 0.9]]), COSTS["linear"])


def _verify_properties(rng, cost):
    b, k = int(rng.integers(1, 6)), int(rng.integers(1, 6))
    survival = survival_from_hazards(rng.uniform(0.1, 1.0, (b, k)))
    drafted = rng.integers(0, k + 1, b)
    cap = int(rng.integers(0, drafted.sum() + 1))
    budget = int(rng.integers(b, b + drafted.sum() + 2))
    return survival, drafted, cap, budget


@pytest.mark.parametrize("cost_name", list(COSTS))
def test_verify_lengths_respect_drafts_and_budgets(cost_name):
    cost = COSTS[cost_name]
    rng = np.random.default_rng(1)
    for _ in range(200):
        survival, drafted, cap, budget = _verify_properties(rng, cost)
        floor = np.minimum(rng.integers(0, 3, len(drafted)), drafted) if rng.random() < 0.3 else None
        v = distribute_verify_budget(survival, drafted, cost, verify_cap=cap, min_verify=floor, token_budget=budget)
        assert np.all(v <= drafted) and v.sum() <= cap and len(drafted) + v.sum() <= budget
        if floor is not None and floor.sum() <= min(cap, budget - len(drafted)):
            assert np.all(v >= floor)


def _later_positions_perturbed(survival, i, j, rng):
    """Same curves except request i's positions after j (0-based), redrawn but still non-increasing."""
    out = survival.copy()
    k = survival.shape[1]
    if j + 1 < k:
        out[i, j + 1 :] = out[i, j] * np.cumprod(rng.uniform(0.0, 1.0, k - j - 1))
    return out


def _stopping_rule_violations(allocate, cost, trials, seed):
    """Count cases where verifying position j of request i changed when only its later positions changed."""
    rng = np.random.default_rng(seed)
    violations = 0
    for _ in range(trials):
        b, k = int(rng.integers(2, 5)), int(rng.integers(2, 5))
        survival = survival_from_hazards(rng.uniform(0.2, 1.0, (b, k)))
        drafted = np.full(b, k)
        base = allocate(survival, drafted, cost)
        i, j = int(rng.integers(b)), int(rng.integers(k - 1))
        changed = allocate(_later_positions_perturbed(survival, i, j, rng), drafted, cost)
        violations += int(min(base[i], j + 1) != min(changed[i], j + 1))
    return violations


@pytest.mark.parametrize("cost_name", list(COSTS))
def test_post_draft_allocation_is_a_stopping_rule(cost_name):
    """Whether (i, j) is verified never depends on request i's later positions (DESIGN.md "Losslessness")."""

    def sorted_admission(survival, drafted, cost):
        return distribute_verify_budget(survival, drafted, cost, token_budget=len(drafted) + 4)

    assert _stopping_rule_violations(sorted_admission, COSTS[cost_name], 400, seed=5) == 0


def test_retrospective_argmax_breaks_the_stopping_rule():
    """Negative control: the same check catches the lossy rule. It needs a step-cost curve whose
    marginal cost falls somewhere; along a linear one the objective is unimodal and the argmax
    happens to equal the early stop."""

    def argmax_rule(survival, drafted, cost):
        ranking = rank_slots(
            survival, cost, lo=None, hi=None, drafted_tokens=int(drafted.sum()),
            token_budget=len(drafted) + 4, time_cap_ms=None,
        )
        return ranking.widths(int(np.argmax(ranking.scaled_ratio(ranking.feasible_upto))))

    assert _stopping_rule_violations(argmax_rule, COSTS["falling-marginal"], 1000, seed=5) >= 5


def test_verify_with_the_plans_slots_equals_the_general_path():
    rng = np.random.default_rng(9)
    for cost in COSTS.values():
        for _ in range(100):
            b, k = int(rng.integers(1, 6)), int(rng.integers(1, 6))
            pre = survival_from_hazards(rng.uniform(0.1, 1.0, (b, k)))
            post = survival_from_hazards(rng.uniform(0.1, 1.0, (b, k)))
            hi = rng.integers(0, k + 1, b)
            plan = plan_step(pre, cost, hi=hi)
            budget = int(rng.integers(b, b + plan.verify_cap + 2))
            general = distribute_verify_budget(post, plan.draft, cost, verify_cap=plan.verify_cap, token_budget=budget)
            fast = distribute_verify_budget(
                post, plan.draft, cost, verify_cap=plan.verify_cap, token_budget=budget, drafted_slots=plan.slots
            )
            assert fast.tolist() == general.tolist()
