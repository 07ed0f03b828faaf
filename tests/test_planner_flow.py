"""The relaxation as a min-cost flow (kareus.planner.flow) and the DAG timing kept in place."""

import dataclasses
import random

import numpy as np
import pytest

from kareus.planner.compose import Composer, Problem, SolveKnobs, brute_force
from kareus.planner.dag import Option, SwitchCost, Timing, gpipe, makespan, one_f_one_b
from kareus.planner.flow import FlowRelaxation
from kareus.planner.relax import Relaxation, recover_slack
from kareus.testing import tradeoff_options


def _options(group, freqs=(810, 1005, 1200, 1410)):
    # Two profiles whose hulls cross (so a group's best profile depends on the bound) and
    # a real trade-off of dynamic energy against static power; stages differ in size.
    return tradeoff_options(group, freqs, stage_step=0.15)


def _pair(it, static_w=20.0, gpus=4):
    opts = {g: _options(g) for g in {i.group for i in it.instructions}}
    comp = Composer(Problem(it, opts, static_power_w=static_w, gpus=gpus))
    kw = {"static_power_w": static_w, "gpus": gpus, "gpus_per_stage": 1}
    return (
        comp,
        Relaxation(Problem(it, comp.model_options, **kw)),
        FlowRelaxation(Problem(it, comp.model_options, **kw)),
    )


def _bounds(comp):
    fastest = comp.fastest_choice().time_s
    slowest = max(u.time_s for u in comp.uniform_plans())
    return [None] + [fastest + f * (slowest - fastest) for f in (1.0, 0.6, 0.3, 0.1, 0.0)]


@pytest.mark.parametrize("it", [one_f_one_b(4, 12), gpipe(3, 6)], ids=["1f1b", "gpipe"])
def test_the_flow_proves_the_simplex_bound_and_rounds_to_a_plan_within_it(it):
    # The flow solves the same relaxation as the simplex: the same lower bound (to its
    # integer scaling), and a plan within the time bound that costs no less than it.
    comp, simplex, flow = _pair(it)
    for bound in _bounds(comp):
        want, got = simplex.at(bound), flow.at(bound)
        assert want is not None and got is not None and got.choices is not None
        assert got.bound_j == pytest.approx(want.bound_j, rel=1e-3), bound
        t, e = comp.evaluate(got.choices)
        assert bound is None or t <= bound + 1e-9
        assert got.bound_j <= e
        # rounded about as well as the simplex rounds: on these coarse options (four
        # clocks) both roundings lie up to 5 % above the bound, each better at some bounds
        simplex_e = comp.evaluate(want.choices)[1]
        assert (e - got.bound_j) / e <= (simplex_e - want.bound_j) / simplex_e + 0.02, bound
        picked = {(i.group, c.profile) for i, c in zip(it.instructions, got.choices, strict=True)}
        assert len(picked) == len({i.group for i in it.instructions})  # a profile per group


def test_on_a_models_options_the_flow_agrees_with_the_simplex_and_proves_its_plans():
    # Llama 3.3 70B shapes on the modelled A100 (19 clocks, five overlap profiles), PP 4 x
    # 16: on the whole hulls the bounds agree to 0.01 %; on the hulls the flow's arcs are
    # thinned to by default (flow.HULL_TOLERANCE, 0.2 % a vertex) they lie at most 0.1 %
    # below (0.056 % at most on the current A100 model, 0.05 % before its contended clock
    # exponent), and every plan is proven within the gap limit.
    from kareus.hardware import Emulator, gpu
    from kareus.planner.instruction_options import evaluate_options
    from kareus.planner.knobs import CountingEvaluator, default_clocks
    from kareus.planner.settings import PlannerSettings
    from kareus.testing import megatron_partition_set

    spec = gpu("a100-sxm4-40gb")
    pset = megatron_partition_set(
        hidden=8192, ffn=28672, heads=64, seq=4096, microbatch=8, layers=20, tp=8
    )
    static = spec.calibration.static_power_w
    ev = CountingEvaluator(Emulator(spec))
    clocks = default_clocks(spec.clocks_mhz())
    opts = evaluate_options([pset] * 4, ev, clocks, static, PlannerSettings()).options
    it = one_f_one_b(4, 16)
    comp = Composer(Problem(it, opts, static_power_w=static, gpus=32, gpus_per_stage=8))
    kw = {"static_power_w": static, "gpus": 32, "gpus_per_stage": 8}
    simplex = Relaxation(Problem(it, comp.model_options, **kw))
    whole = FlowRelaxation(Problem(it, comp.model_options, **kw), hull_tolerance=0.0)
    flow = FlowRelaxation(Problem(it, comp.model_options, **kw))
    better = 0
    for bound in _bounds(comp):
        want, got = simplex.at(bound), flow.at(bound)
        assert whole.at(bound).bound_j == pytest.approx(want.bound_j, rel=1e-4), bound
        assert want.bound_j * (1 - 1e-3) <= got.bound_j <= want.bound_j * (1 + 1e-6), bound
        t, e = comp.evaluate(got.choices)
        assert (bound is None or t <= bound + 1e-9) and got.bound_j <= e <= got.bound_j * 1.005
        # Asked for a gap of zero, every plan is re-planned on the whole hulls: never worse,
        # and the bound no lower.
        again = flow.at(bound, 0.0)
        t2, e2 = comp.evaluate(again.choices)
        assert (bound is None or t2 <= bound + 1e-9) and e2 <= e and again.bound_j >= got.bound_j
        better += e2 < e * (1 - 1e-6)
    assert better  # on these nearly straight hulls, at some bounds the whole hull plans better


def test_slack_goes_first_where_it_saves_most():
    # A forward then a backward share 0.6 s of slack, room for one step: the backward's
    # saves 20 J/s, the forward's 2 J/s. Taken in the DAG's order, the forward would take it.
    it = one_f_one_b(1, 1)
    fwd = [Option(1410, "a", 1.0, 10.0), Option(1200, "a", 1.5, 9.0)]
    bwd = [Option(1410, "a", 1.0, 20.0), Option(1200, "a", 1.5, 10.0)]
    allowed = [fwd if i.kind == "forward" else bwd for i in it.instructions]
    choices = [row[0] for row in allowed]
    recover_slack(it, choices, allowed, 2.6)
    assert [c.freq_mhz for c in choices] == [
        1410 if i.kind == "forward" else 1200 for i in it.instructions
    ]
    # with room for both, both move; with none, nothing does
    for bound_s, moved in ((3.0, 2), (2.4, 0)):
        choices = [row[0] for row in allowed]
        recover_slack(it, choices, allowed, bound_s)
        assert sum(c.freq_mhz == 1200 for c in choices) == moved


def test_any_prices_prove_a_bound_below_every_plan():
    # The Lagrangian bound holds for any non-negative prices, not only the flow's optimal
    # ones: random prices, however unbalanced, never prove more than the relaxation's
    # optimum (itself below every plan).
    from kareus.planner import flow as flow_module

    it = one_f_one_b(3, 6)
    comp, simplex, relaxation = _pair(it)
    bound_s = 1.3 * comp.fastest_choice().time_s
    optimum = simplex.at(bound_s).bound_j
    rng = random.Random(0)
    real = flow_module._Flow.__init__

    def random_prices(self, *args):
        real(self, *args)
        self.out = np.asarray([rng.uniform(0, 40) for _ in self.out])
        self.into = np.asarray([rng.uniform(0, 40) for _ in self.into])
        self.paid = rng.uniform(0, 40)

    pick = {g: "a" for g in relaxation._groups}
    proven = []
    for _ in range(50):
        flow_module._Flow.__init__ = random_prices
        try:
            proven.append(relaxation._flow(pick, bound_s)[1])
        finally:
            flow_module._Flow.__init__ = real
    assert max(proven) <= optimum * (1 + 1e-9)
    # the union's optimal prices (each instruction free to take any profile's hull: a
    # relaxation of the group's one mix) prove nearly the optimum: within 0.15 % on these
    # crossing profiles, 0.003 % on a model's (test above)
    assert relaxation._flow(relaxation._union, bound_s)[1] == pytest.approx(optimum, rel=3e-3)


def test_no_plan_within_a_bound_below_the_fastest():
    comp, _simplex, flow = _pair(one_f_one_b(2, 4))
    assert flow.at(0.5 * comp.fastest_choice().time_s) is None
    assert flow.at(1.1 * comp.fastest_choice().time_s) is not None  # still usable


def test_a_composer_past_the_flow_threshold_plans_a_proven_frontier():
    # The composer's frontier on the flow: every point within its bound and carrying a
    # lower bound below its energy; no worse than the simplex's frontier by more than the
    # dive's edge.
    it = one_f_one_b(4, 16)  # 128 instructions
    opts = {g: _options(g) for g in {i.group for i in it.instructions}}
    problem = Problem(it, opts, static_power_w=20.0, gpus=4)
    knobs = SolveKnobs(search_max_instructions=0, gap_limit=0.005)
    simplex = Composer(problem, knobs).frontier(points=6)
    flowed_comp = Composer(problem, dataclasses.replace(knobs, flow_min_instructions=128))
    flowed = flowed_comp.frontier(points=6)
    assert flowed_comp._flow is not None  # the flow solved every bound (the simplex dived
    # where its plan was not proven within the gap limit)
    for p in flowed:
        assert p.bound_j is not None and p.bound_j <= p.energy_j
        assert p.time_s <= p.within_s + 1e-9
    # the flow's frontier covers the simplex's points (which dive) to 2 % on these coarse
    # options (four clocks: both lie up to 5 % above their bounds)
    for q in simplex:  # (the sweeps refine points at their own times: within 0.5 %)
        near = [p.energy_j for p in flowed if p.time_s <= q.time_s * 1.005]
        assert min(near) <= 1.02 * q.energy_j, q


def test_timing_follows_each_change_exactly():
    # Heads, tails and the makespan kept in place through random changes equal those
    # computed afresh; the makespan to the bit.
    it = one_f_one_b(4, 10)
    rng = random.Random(1)
    durations = [rng.uniform(0.5, 2.0) for _ in it.instructions]
    timing = Timing(it, durations)
    for _ in range(200):
        i = rng.randrange(len(durations))
        durations[i] = rng.choice([rng.uniform(0.5, 2.0), durations[i] * 0.5])
        timing.set(i, durations[i])
        fresh = Timing(it, durations)
        assert timing.makespan() == makespan(it, durations)
        assert timing.head == fresh.head
        assert timing.tail == pytest.approx(fresh.tail, rel=1e-12)


def test_sole_says_which_instructions_every_longest_path_runs_through():
    # An instruction is alone on the longest paths exactly where running it faster
    # shortens the iteration.
    for it, seed in [(one_f_one_b(3, 6), 2), (gpipe(2, 4), 3), (one_f_one_b(2, 5), 4)]:
        rng = random.Random(seed)
        # coarse durations: ties between paths, so some longest paths avoid an instruction
        durations = [float(rng.choice((1, 2, 3))) for _ in it.instructions]
        timing = Timing(it, durations)
        total = timing.makespan()
        for j in range(len(durations)):
            faster = list(durations)
            faster[j] -= 0.5
            assert timing.sole(j, total) == (makespan(it, faster) < total), (seed, j)


def test_the_switch_greedy_keeps_its_plans_on_large_iterations():
    # Past the flow threshold the greedy that undoes unprofitable clock changes prices
    # moves from the timing it keeps; its plans are priced afresh at the end.
    it = one_f_one_b(4, 16)
    opts = {g: _options(g) for g in {i.group for i in it.instructions}}
    comp = Composer(
        Problem(it, opts, static_power_w=20.0, gpus=4),
        SolveKnobs(
            search_max_instructions=0,
            flow_min_instructions=1,
            dive_max_instructions=0,
            switch=SwitchCost(0.05),
        ),
    )
    sol = comp.solve(bound_s=1.2 * comp.fastest_choice().time_s)
    assert (sol.time_s, sol.energy_j) == comp.evaluate(sol.choices)
    assert sol.time_s <= sol.within_s + 1e-9
    assert sol.bound_j is not None and sol.bound_j <= sol.energy_j
    # every change kept pays: undoing any one costs energy or breaks the bound
    for a, b in it.switch_pairs():
        if sol.choices[a].freq_mhz == sol.choices[b].freq_mhz:
            continue
        for i, j in ((b, a), (a, b)):
            same = [
                o
                for o in opts[it.instructions[i].group]
                if o.profile == sol.choices[i].profile and o.freq_mhz == sol.choices[j].freq_mhz
            ]
            trial = list(sol.choices)
            trial[i] = same[0]
            t, e = comp.evaluate(trial)
            assert t > sol.within_s + 1e-9 or e >= sol.energy_j * (1 - 1e-9)


def test_a_plan_past_its_bound_is_brought_back_by_running_late_instructions_fastest():
    # The flow's integer times are rounded up; at a bound within that rounding of the least
    # time its plan may lie a hair over, and the instructions past the bound run fastest.
    from kareus.planner.dag import slack
    from kareus.planner.flow import _meet

    it = one_f_one_b(2, 3)
    opts = {
        g: [o for o in _options(g) if o.profile == "a"] for g in {i.group for i in it.instructions}
    }
    allowed = [opts[i.group] for i in it.instructions]
    fast = [min(a, key=lambda o: o.time_s) for a in allowed]
    slow = [min(a, key=lambda o: -o.time_s) for a in allowed]
    bound = makespan(it, [o.time_s for o in fast])
    rooms = slack(it, [o.time_s for o in fast], bound)
    loose = max(range(len(fast)), key=lambda i: rooms[i])  # slack enough to run slow
    assert rooms[loose] >= slow[loose].time_s - fast[loose].time_s
    choices = list(fast)
    choices[0] = slow[0]  # the first forward: on every path, past the bound
    choices[loose] = slow[loose]
    _meet(it, choices, allowed, bound)
    assert makespan(it, [c.time_s for c in choices]) <= bound
    assert choices[0] is fast[0] and choices[loose] is slow[loose]


def test_at_the_least_time_groups_take_a_profile_that_runs_their_fastest_option():
    # Profile "a" is cheap and slow, "b" fast: the union's prices may pick "a" for a group
    # whose slack they misjudge; at the least time every group must run "b".
    opts = {
        (s, k): [
            Option(1410, "b", 1.0 + s, 300.0),
            Option(1005, "b", 1.5 + s, 250.0),
            Option(1410, "a", 2.0 + s, 100.0),
            Option(1005, "a", 2.5 + s, 80.0),
        ]
        for s in range(2)
        for k in ("forward", "backward")
    }
    it = one_f_one_b(2, 4)
    comp = Composer(Problem(it, opts, static_power_w=5.0, gpus=2))
    flow = FlowRelaxation(
        Problem(it, comp.model_options, static_power_w=5.0, gpus=2, gpus_per_stage=1)
    )
    bound = comp.fastest_choice().time_s + 1e-6
    got = flow.at(bound)
    assert got is not None and got.choices is not None
    t, e = comp.evaluate(got.choices)
    assert t <= bound + 1e-9 and got.bound_j <= e


def test_a_thinned_hull_prices_the_flow_but_the_bound_and_plan_use_every_option():
    # The flow's arcs leave out hull vertices near the segment between their neighbours
    # (flow.thin); its prices are then those of a higher hull, but the bound is evaluated
    # on every option, so it stays below the simplex's optimum however much is left out,
    # and the plan still picks among all the options (clocks the arcs lack included).
    from kareus.planner.flow import thin
    from kareus.planner.relax import lower_hull

    it = one_f_one_b(3, 8)
    freqs = tuple(range(705, 1411, 45))  # 16 clocks: hulls with vertices to leave out
    opts = {g: _options(g, freqs) for g in {i.group for i in it.instructions}}
    comp = Composer(Problem(it, opts, static_power_w=20.0, gpus=4))
    kw = {"static_power_w": 20.0, "gpus": 4, "gpus_per_stage": 1}
    simplex = Relaxation(Problem(it, comp.model_options, **kw))
    whole = FlowRelaxation(Problem(it, comp.model_options, **kw), hull_tolerance=0.0)
    coarse = FlowRelaxation(Problem(it, comp.model_options, **kw), hull_tolerance=0.05)
    hull = lower_hull([o for o in next(iter(opts.values())) if o.profile == "a"])
    assert 2 < len(thin(hull, 0.05)) < len(hull) == len(thin(hull, 0.0))
    used = set()
    for bound in _bounds(comp):
        optimum = simplex.at(bound).bound_j
        exact, loose = whole.at(bound), coarse.at(bound)
        assert exact.bound_j == pytest.approx(optimum, rel=1e-3), bound
        assert loose.bound_j <= optimum * (1 + 1e-6), bound  # a bound, if a weaker one
        t, e = comp.evaluate(loose.choices)
        assert (bound is None or t <= bound + 1e-9) and loose.bound_j <= e
        used |= {c.freq_mhz for c in loose.choices}
    hulls = [lower_hull(o) for o in opts.values()]  # each group's, and each profile's
    hulls += [lower_hull([o for o in os if o.profile == p]) for os in opts.values() for p in "ab"]
    arcs = {o.freq_mhz for h in hulls for o in thin(h, 0.05)}
    assert used - arcs  # the plan ran clocks the thinned arcs did not have


# A relaxation's program that GLOP's presolve ended ABNORMAL from its basis and from scratch
# with either simplex (a replay of measured CPU profiles: tiny-16l, TP 2, full recompute;
# kareus plan failed with "the composition's relaxation ended with GLOP status 4").
_ABNORMAL_PROGRAM = (
    "H4sICB/NEWsAA21vZGVsLnBiAMWZaXAcxRWAp/fQ7sqydRhjaQFbrDGWZcnW3LOyHRl8yDa+ANkGbBAreeRbq9NH"
    "jCVbGGOICcHhPs0fSsAfqigKwx9NiaKgKP5wFoeTShWBVFJUoiSVFDkqlemHVprdnZbmTSeS/njlfu9N9+vvm55Z"
    "RYVSYfQnvjSW+Tj2f5VCdfnxqrqaykUtqdaDR1NdexYtbkt196w6vH8PKr4n3RGvG40faSjNfLDj43nxXb17U4cg"
    "Y5nrFSpyM9pT7emWVE/rvrFLZCfkXaI9XZs+YnYdSnXEa10z5v6Y0ZbuyllzresaXMPpAiZs0Vj4+PwnXPB4/Pj0"
    "K8cTLjbOeal66xurKt75W9Xuh4ffpRMjTfHy3JIj/fZAoLuOOSIyRyTmiMwcUZgjKnNEY47ozBGDOZKMV7iOBLvF"
    "OvaQyB6S2EMye0hhDzE7YTJ3yWTuksncJZO5SyZzl0z23Ji7ZDJ3yWTuksncJZO9SyZ7l0z2LpnsXTLZu2Tau1ST"
    "N9RQsT5qiXPeeZnaNvNYXXPmTtFc5xr96bKmty89NMPKjRbdoy9Xv/dRYyQr2r6t2LXzblt29B8vqzt3m8NDdvQs"
    "O3rsrsIIP//lW/8cHiy28sLF/NuWHS5c/tNTF0LLafViGj52D7LLu8UXzf/r848+Xmjlx7uvdbDv8y0/lL07BGsV"
    "J+vjv7/+Q9mJoQ/yot1r7xj5x/uXlnzb4Iz+sY9u0Yl1bUUtT38xlBvt3pcdA4nN+u9/2wDrtKPHTi9GXwo/1OPF"
    "//l8KD9edN2mA18uiD3w/eg2iVm76la+t+CNS43KbGu0fNY2TYqvhMJXQuErofCVcPhKOHwlJL4SEl8Zha+MwldG"
    "4Suj8JWR+MpIfGUcvjISXwWFr4LCV0Hhq+DwVXD4Kkh8FSS+KgpfFYWvisJXReGrIvFVkfiqOHxVJL4aCl8Nha+G"
    "wlfD4avh8NWQ+GpIfHUUvjoKXx2Fr47CV0fiqyPx1XH46kh8DRS+BgpfA4WvgcPXwOFrIPE1kPgmUfgmUfgmUfgm"
    "Ufgmkfgmkfgmcfgms7fJrbwDX/vROuvdzS3cwW92uPvkHQCPh7N74yC4mIZPtlgHwjnxYv7XSNkMl0C8sztuCQ6I"
    "cxPcF+yg2F6wOFk7HRhnh7tXd3A8Hs6+IThAzg53746D5BIId6LsluBAOTfB3RUHy8U0wbm/bhdwwAwXQNIs4WiW"
    "cDRLOJolJM0SkmYJS7OEpVnG0SzjaJZxNMs4mmUszTKWZhlJs4ylWcHRrOBoVnA0K0iaFSTNCpZmBUuziqNZxdGs"
    "4mhWcTSrWJpVLM0qkubs97zETse+jn5IlKR6e9LNrc11mZ8qQQoLJBAM1Vdlgib7N7HFQ2HRLhwKF0Si9ZWT1jtR"
    "mllZReZDXj3JrhcrjFcvqalduqyufv1o8lCmyCvlxb9OfdNhCeuOfv/ZsU5LKKpZ9tqbe61XAyPps9ZBS6hp+Obj"
    "zYetV9aor78etscLznx97mSnlVjr4eKyffFguHpJfXnuZcfWsMJDGcUuEyioqS/JreJpEiqdRKR26QST8FJGo2Wi"
    "dgvZZc4QD3V0u07hjKtESVZUTTfqt+WWGxzeuO+H7f1WR7z077tOnbIGvyLzOof7rI63exb++ZMBazDxlwV99Pd4"
    "eMO5Xw1YTZ3f/ebOTaetpvCnv/vX6tPedsagqxFEibMpSVqGyApfGZHaFAyoGh8nInUnENRdOPGSTU0JhAyXbA+e"
    "iRT1WNHVyfrlK1b+pGFqPRMV8CxZz9k/FTxb7s8zEQSJrFjJyYIOntkt5PNMpIQXzrxm1Q03rl6zdl3j9HgmgiDC"
    "qhv4miKBIOTG1ZxlRPBszVo+TiQwJbjOn2eSDJ41+vNMoqjHZs1bv2HjTZs2b5lazyQ4SsLrN3D2TwPPNvrzTAJB"
    "Ijdt4mQBToCo3UI+zyRKeGHx/K3bbr7l1qbtO6bHMxkEEbZu42uKDIKQm2/hLCOBZ7c28XEigynB7f48k+GpKbTD"
    "n2cyRT1WUrnzttvv2LX7zqn1TIajJLzzNs7+6eDZ7f48k0GQyB27OFmAEyBqt5DPM4USXlh67V3Nd6daWveY0+OZ"
    "AoIIdzXzNUUBQcjdKc4y8H4RaGnl40QBU4J7/HmmwFNTyPTnmUJRj5Ul2vbu23/g4KGp9UyBoyTctpezfwZ4ts+f"
    "ZwoIEtl/gI8FFU6AqN1CPs9USnjh7AWH29MdnV3dPdPjmQqCCIfbOZsCgpB0B2cZeL8IdHbxcaKCKcFuf56p8NQU"
    "6vHnmUpRj11xXe+Ro8eO//TE1HqmwlES7j3C2b8keHbUn2caCBI5dpyPBQ1OgKjdQnaZcx480yjhs+YsvOdkX/8p"
    "cpoMkHvJ9LimgSTCPSc5GwOSkL7+Cco0eihDJQkHaEsmKLTSQyF4iAoOEBdcvKTD2RC61y19wMv+UuZLrrz+DLmP"
    "nCX3k3PkAfIg+R9656WXVJhwmE6Br5c6uFNw1q0ZHuahU2fCEdoEPjh0Kk04Cp1kFzrvYXt0Cn3Z3EU/I+fJQ+Tn"
    "5GHyC/IIufD/UNDLuhT4Op1OhrNBYA+siLOQBhrStnCiAx4FH/GpoQ5HR+iCXw11qkBJedUvyaPkMfI4eYI8SZ6a"
    "Yg0N+GNJmE6Br5cGnD0Fj/nU0AB7IrQJfHAYMmgIneTT0KDgl1Usfpo8Q54lz5HnyQvkInlxmjQ0wB6BToazQWAP"
    "rIizkA4a0rZwogMeBS/61NCAl5TQi27peU9uI/256UlqQGBGfCw7M/chT9nwd42iq3xmw7e1M6/2mQ3fQc26xmc2"
    "vFkXz/OZDe8LJfN9ZsP7Qmmlz2z47qjsWp/Z8EY8O+EzG57zr1jgK1uEP00H5lznMxtYu3Khz2xgbe71PrOBtfJF"
    "PrOBtYoqn9nAWmxxfna18F/CAK21YzsAAA=="
)


def test_a_program_glop_ends_abnormally_on_is_solved_without_presolve():
    import base64
    import gzip

    from ortools.linear_solver import linear_solver_pb2, pywraplp

    from kareus.planner.relax import solve_afresh

    model = linear_solver_pb2.MPModelProto()
    model.ParseFromString(gzip.decompress(base64.b64decode(_ABNORMAL_PROGRAM)))
    status, _solver = solve_afresh(model)
    assert status == pywraplp.Solver.INFEASIBLE  # proven, not abandoned


def test_instructions_with_traffic_of_their_own_keep_their_groups_profile():
    """Data-parallel traffic beside some instructions of a group (FSDP2's gathers before a
    stage's first forward and after a forward) gives them options of their own, a key, not
    a profile of their own: the group runs one compiled graph. With the tagged instructions
    favouring another profile than the rest, CP-SAT's plans equal the brute force's, the
    simplex's and the flow's bounds lie below them, the flow's plans within its bound, and
    every plan runs one profile per group."""
    import dataclasses

    from kareus.planner.dag import chain

    base = chain(3)
    tagged = {("forward", 0), ("backward", 1)}
    it = dataclasses.replace(
        base,
        instructions=tuple(
            dataclasses.replace(i, traffic="+dp gather") if (i.kind, i.microbatch) in tagged else i
            for i in base.instructions
        ),
    )
    assert (
        len({i.key for i in it.instructions}) == 4 and len({i.group for i in it.instructions}) == 2
    )
    opts = {}
    for i in it.instructions:  # beside traffic, profile "a" costs more than "b" does
        worse = 1.3 if i.traffic else 1.0
        opts[i.key] = [
            Option(o.freq_mhz, o.profile, o.time_s, o.dynamic_energy_j * worse)
            if o.profile == "a"
            else o
            for o in _options(i.group)
        ]
    comp = Composer(Problem(it, opts, static_power_w=20.0, gpus=1))
    kw = {"static_power_w": 20.0, "gpus": 1, "gpus_per_stage": 1}
    simplex = Relaxation(Problem(it, comp.model_options, **kw))
    flow = FlowRelaxation(Problem(it, comp.model_options, **kw))
    for bound in _bounds(comp):
        best_j, _t = brute_force(comp, bound)
        solved = comp.solve(bound_s=bound)
        assert solved.energy_j == pytest.approx(best_j, rel=1e-6), bound
        for relaxed in (simplex.at(bound), flow.at(bound)):
            assert relaxed is not None and relaxed.bound_j <= best_j * (1 + 1e-9), bound
        planned = flow.at(bound).choices
        for choices in (solved.choices, planned):
            by_group = {}
            for i, c in zip(it.instructions, choices, strict=True):
                assert c in opts[i.key]  # each instruction runs an option of its key
                by_group.setdefault(i.group, set()).add(c.profile)
            assert all(len(p) == 1 for p in by_group.values()), by_group
        assert comp.evaluate(planned)[1] >= flow.at(bound).bound_j
    # Alone, the untagged instructions would run "a" (less energy at every clock); the
    # tagged ones pull their whole group to "b".
    assert {c.profile for c in comp.solve().choices} == {"b"}
