"""Every policy leaves the target's output distribution unchanged; a planted lossy allocator is caught.

Chi-square over the exact joint distribution of the first three tokens in
the toy world (tests/toyworld.py), fixed seeds, same sample size for the
policies and for the negative control.
"""

import pytest

from scheduling.policies import Policy, PolicyName
from tests import toyworld

TRIALS = 8000
ALPHA = 1e-3


@pytest.mark.parametrize("name", list(PolicyName))
def test_policy_output_matches_target_distribution(name):
    counts = toyworld.run_trials(toyworld.policy_rule(Policy(name=name, k=toyworld.K)), TRIALS, seed=11)
    assert toyworld.chi_square_pvalue(counts) > ALPHA


def test_planted_lossy_allocator_is_rejected():
    counts = toyworld.run_trials(toyworld.retrospective_argmax_rule, TRIALS, seed=11)
    assert toyworld.chi_square_pvalue(counts) < 1e-6


def test_wcs_post_draft_allocation_depends_on_draft_confidences():
    """The wcs case above is only a real test if its verify lengths vary with the drafts."""
    import numpy as np

    rule = toyworld.policy_rule(Policy(name=PolicyName.WCS, k=toyworld.K))
    rng = np.random.default_rng(3)
    verified_all = 0
    verified_less = 0
    for _ in range(400):
        step = toyworld.draw_step(np.arange(3), rng)
        draft, verify = rule(step, rng)
        verified_all += int((verify == draft).sum())
        verified_less += int((verify < draft).sum())
    assert verified_less > 50 and verified_all > 50
