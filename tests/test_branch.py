"""SCIP's branch and bound (kareus.planner.mip): exact where it ends, and proving where CP-SAT
does not on iterations whose gaps are clock changes."""

import random

import pytest

from kareus.planner.compose import Composer, Problem, SolveKnobs, brute_force
from kareus.planner.dag import SwitchCost, chain, one_f_one_b
from kareus.planner.mip import MipSearch
from kareus.testing import random_options, tradeoff_options


@pytest.mark.parametrize("seed", range(6))
def test_the_search_finds_the_least_energy_and_bounds_it_with_changes_priced(seed):
    """Random two-profile, three-clock instances, changes from cheap to dear, run to
    optimality (gap limit 0): SCIP's plan is the enumerated optimum within each time bound,
    meets the bound, and its bound is not above it."""
    rng = random.Random(seed)
    it = chain(2) if seed % 2 else one_f_one_b(2, 2)
    options = {k: random_options(rng) for k in sorted({i.key for i in it.instructions})}
    knobs = SolveKnobs(switch=SwitchCost(rng.choice((0.02, 0.1, 0.3))), gap_limit=0.0)
    comp = Composer(Problem(it, options, static_power_w=50, gpus=1), knobs)
    fastest = comp.fastest_choice().time_s
    for bound in (None, fastest * 1.05, fastest * 1.2):
        best_j, _t = brute_force(comp, bound)
        status, choices, bound_j = MipSearch(comp.problem, knobs).run(bound, None)
        assert status == "OPTIMAL" and choices is not None, (seed, bound)
        time_s, energy_j = comp.evaluate(choices)
        assert bound is None or time_s <= bound * (1 + 1e-9)
        assert energy_j == pytest.approx(best_j, rel=1e-6), (seed, bound)
        assert bound_j is not None and bound_j <= best_j * (1 + 1e-9)


def test_the_composer_searches_small_iterations_with_scip():
    """Under ``branch_max_instructions`` the composer's searches are SCIP's; run to
    optimality (gap limit 0), every solve of a frontier is the enumerated optimum within its
    bound, and its proven bound is not above it."""
    it = chain(3)
    opts = {g: tradeoff_options(g, (810, 1110, 1410)) for g in {i.group for i in it.instructions}}
    knobs = SolveKnobs(switch=SwitchCost(0.01), gap_limit=0.0, branch_max_instructions=6)
    comp = Composer(Problem(it, opts, static_power_w=20.0, gpus=4), knobs)
    assert comp.frontier(4)
    assert comp.searches == len(comp.solves) > 0  # none proven by the relaxation alone
    for s in comp.solves:
        best_j, _t = brute_force(comp, s.within_s)
        assert s.within_s is None or s.time_s <= s.within_s + 1e-9
        assert s.energy_j == pytest.approx(best_j, rel=1e-6)
        assert s.bound_j is not None and s.bound_j <= best_j * (1 + 1e-9)


# CI's sample leaves it out: two frontiers of 24 instructions, about 25 s
@pytest.mark.slow
def test_branch_and_bound_proves_the_solves_cp_sat_leaves_open():
    """A two-stage 1F1B of six micro-batches on seven clocks, changes priced: CP-SAT, at the
    planner's default work, leaves solves unproven within 0.5 %; SCIP, at the same work,
    proves every one (measured 2026-12-08: 4 of 10 against 0 of 9)."""
    it = one_f_one_b(2, 6)
    freqs = (810, 900, 1005, 1100, 1200, 1305, 1410)
    opts = {g: tradeoff_options(g, freqs) for g in {i.group for i in it.instructions}}
    unproven = {}
    for branch in (None, 64):
        knobs = SolveKnobs(
            time_limit_s=1.0,
            switch=SwitchCost(0.001),
            gap_limit=0.005,
            branch_max_instructions=branch,
        )
        comp = Composer(Problem(it, opts, static_power_w=20.0, gpus=4), knobs)
        comp.frontier(3)
        assert comp.searches > 0  # the relaxation alone did not prove them
        unproven[branch] = sum(not s.proven(0.005) for s in comp.solves)
    assert unproven[None] > 0
    assert unproven[64] == 0
