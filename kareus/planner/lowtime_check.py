"""Cross-check of the Perseus baseline with the ``lowtime`` package.

Perseus plans clocks with the Phillips–Dessouky time–cost trade-off algorithm, which
``lowtime`` implements over a continuous (exponential) fit of each operation's options.
:func:`lowtime_frontier` runs it on the same instruction DAG and clock options as kareus's
composition, then prices each schedule it visits exactly, so the two frontiers can be
compared point by point: the composition is exact over the discrete options (within its
gap limit) and should never be worse, and close where the fit is good.

``lowtime`` is a development dependency (``pip install -e ".[dev]"``): planning does not
need it, only this cross-check does.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from kareus.planner.compose import Composer, Problem
from kareus.planner.dag import Iteration, Option


def lowtime_frontier(
    iteration: Iteration,
    options: Mapping[tuple[int, str], Sequence[Option]],
    *,
    static_power_w: float,
    gpus: int,
    gpus_per_stage: int = 1,
    unit_time_s: float = 1e-3,
    max_points: int = 200,
) -> list[tuple[float, float]]:
    """Return the (time, energy) points Phillips–Dessouky visits, priced exactly.

    ``options`` must hold one profile only (clock planning, as Perseus does).
    """
    import networkx as nx
    from lowtime.cost_model import ExponentialModel
    from lowtime.operation import (
        CandidateExecutionOptions,
        DummyOperation,
        ExecutionOption,
        Operation,
        OperationSpec,
    )
    from lowtime.solver import PhillipsDessouky

    specs = {}
    for group, opts in options.items():
        cand = CandidateExecutionOptions(
            options=[
                ExecutionOption(
                    real_time=o.time_s,
                    unit_time=unit_time_s,
                    cost=o.dynamic_energy_j * gpus_per_stage,
                    knob=o.freq_mhz,
                )
                for o in opts
            ]
        )
        specs[group] = OperationSpec(options=cand, cost_model=ExponentialModel(cand))
    n = len(iteration.instructions)
    dag = nx.DiGraph()
    dag.add_node(0, op=DummyOperation())
    for i, instr in enumerate(iteration.instructions, start=1):
        dag.add_node(i, op=Operation(spec=specs[instr.key]))
    dag.add_node(n + 1, op=DummyOperation())
    has_pred = {b for _a, b in iteration.edges}
    has_succ = {a for a, _b in iteration.edges}
    for a, b in iteration.edges:
        dag.add_edge(a + 1, b + 1)
    for i in range(n):
        if i not in has_pred:
            dag.add_edge(0, i + 1)
        if i not in has_succ:
            dag.add_edge(i + 1, n + 1)
    dag.graph["source_node"] = 0
    dag.graph["sink_node"] = n + 1
    composer = Composer(Problem(iteration, options, static_power_w, gpus, gpus_per_stage))
    by_freq = {g: {o.freq_mhz: o for o in opts} for g, opts in options.items()}
    points = []
    for k, _result in enumerate(PhillipsDessouky(dag).run()):
        choices = [
            by_freq[instr.key][dag.nodes[i]["op"].assigned_knob]
            for i, instr in enumerate(iteration.instructions, start=1)
        ]
        points.append(composer.evaluate(choices))
        if k >= max_points:
            break
    return points
