"""The main job's report (``report.md``) and the files ``kareus plan`` writes.

Rendering only: every figure comes from the plan and the planned workload
(:class:`~kareus.jobs.workload.WorkloadPlan`); nothing here plans or traces.
"""

from __future__ import annotations

import pathlib
from collections.abc import Sequence
from typing import Any

from kareus._files import check_output_dir, write_text
from kareus._table import fig
from kareus.ir.partitions import PartitionSet
from kareus.ir.plan_file import FrontierPoint, Plan
from kareus.jobs.stages_file import save_stages
from kareus.jobs.workload import WorkloadPlan
from kareus.planner import PlannerSettings
from kareus.planner.knobs import DEFAULT_CLOCK_COUNT
from kareus.planner.pareto import iso_energy_time_reduction, iso_time_energy_reduction


def _pts(points: Sequence[FrontierPoint]) -> list[tuple[float, float]]:
    return [(p.time_s, p.energy_j) for p in points]


def comparison_rows(plan: Plan) -> list[tuple[str, ...]]:
    """Per method: fastest time and its energy, least energy, and kareus's gains over it."""
    rows: list[tuple[str, ...]] = []
    kareus = _pts(plan.frontier)
    methods: dict[str, Sequence[FrontierPoint]] = {**plan.baselines, "kareus": plan.frontier}
    mega = min(_pts(plan.baselines["megatron"])) if "megatron" in plan.baselines else None
    for name, pts in methods.items():
        fast_t, fast_e = min(_pts(pts))
        least = min(e for _, e in _pts(pts))
        iso_t = iso_time_energy_reduction(kareus, _pts(pts)) if name != "kareus" else None
        iso_e = iso_energy_time_reduction(kareus, _pts(pts)) if name != "kareus" else None
        rows.append(
            (
                name,
                fig(fast_t),
                fig(fast_e),
                f"{100 * (fast_e - mega[1]) / mega[1]:+.1f} %" if mega else "",
                fig(least),
                _pct(iso_t),
                _pct(iso_e),
            )
        )
    return rows


COMPARISON_HEADER = (
    "method",
    "fastest time s",
    "its energy J (all GPUs)",
    "energy vs Megatron",
    "least energy J",
    "kareus iso-time energy saving",
    "kareus iso-energy time saving",
)


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:.1f} %"


def contribution_lines(plan: Plan, default_sm_share: int) -> list[str]:
    """Split the chosen plan's saving over Megatron-LM into clocks, overlap and the joint choice.

    A ladder at one time (the slower of the chosen plan and Megatron-LM), read off the
    frontiers computed on the same options: Perseus (clocks alone), nanobatching + Perseus
    (overlap at its defaults, then clocks), kareus (overlap decisions and clocks together).
    Then the overlap decisions that differ from nanobatching's defaults.
    """
    from kareus.planner.pareto import no_slower

    chosen = plan.chosen
    mega = plan.baselines["megatron"][0]
    t_ref = max(chosen.time_s, mega.time_s)
    fronts = {**plan.baselines, "kareus": plan.frontier}

    def least_at_ref(method: str) -> float | None:
        ok = [p.energy_j for p in fronts.get(method, ()) if no_slower(p.time_s, t_ref)]
        return min(ok) if ok else None

    best = least_at_ref("kareus")
    if best is None or mega.energy_j - best <= 5e-4 * mega.energy_j:
        return [
            "kareus saves nothing over Megatron-LM (max clock, no overlap) at "
            f"{fig(t_ref)} s on this workload: no plan of its options is as fast with less "
            "energy, so there is no saving to split into clocks and overlap.",
            "",
        ]
    steps = [
        ("per-instruction clocks, no overlap (Perseus)", least_at_ref("perseus")),
        ("overlap at nanobatching's defaults, then clocks", least_at_ref("nanobatch+perseus")),
        ("overlap decisions and clocks chosen together (kareus)", least_at_ref("kareus")),
    ]
    rows = [("Megatron-LM: max clock, no overlap", fig(mega.energy_j), "", "")]
    prev = mega.energy_j
    for label, energy in steps:
        if energy is None:
            rows.append((label, "no plan as fast", "n/a", ""))
            continue
        share = f"{100 * (prev - energy) / mega.energy_j:.1f} %"
        rows.append((label, fig(energy), fig(prev - energy), share))
        prev = energy
    lines = [
        f"Each method's least energy at {fig(t_ref)} s or faster (the slower of the chosen "
        "plan and Megatron-LM), read off its frontier on the same options; each step's "
        "saving is against the step before, as a share of Megatron-LM's energy.",
        "",
        _md_table(("plan", "energy J", "saved J", "of Megatron-LM's"), rows),
        "",
    ]
    changed = [
        (group, key, d)
        for group, decs in plan.decisions.items()
        for key, d in decs.items()
        if (d.launch_slot, d.sm_share) != (0, default_sm_share)
    ]
    total = sum(len(decs) for decs in plan.decisions.values())
    if not changed:
        lines.append(
            f"All {total} overlap decisions are nanobatching's defaults (launch at the "
            f"partition's start, SM share {default_sm_share}): kareus's saving over "
            "nanobatching + Perseus comes from clocks chosen knowing the overlap."
        )
        return lines
    listed = ", ".join(
        f"{group} {key}: "
        + (
            "no overlap"
            if d.launch_slot is None
            else f"slot {d.launch_slot}, SM {d.sm_share or 'default'}"
        )
        for group, key, d in changed
    )
    lines.append(
        f"{len(changed)} of {total} overlap decisions differ from nanobatching's defaults "
        f"(slot 0, SM share {default_sm_share}): {listed}."
    )
    return lines


def _gap_sentence(point: FrontierPoint) -> str:
    """Say how close to optimal the solver proved ``point`` (on the planner's options)."""
    if point.gap is None:
        return "No solve bounded its energy."
    if point.gap < 5e-4:
        return "The solver proved it the least energy of any plan as fast on these options."
    return (
        f"The solver proved that no plan as fast on these options uses more than "
        f"{100 * point.gap:.1f} % less energy."
    )


def write_outputs(planned: WorkloadPlan, out: str | pathlib.Path) -> dict[str, pathlib.Path]:
    """Write plan.json, report.md, frontier.png and partitions.json to ``out``."""
    from kareus.planner.plot import plot_frontiers

    out = check_output_dir(out)
    paths = {
        "plan": out / "plan.json",
        "report": out / "report.md",
        "plot": out / "frontier.png",
        "partitions": out / "partitions.json",
    }
    planned.plan.save(paths["plan"])
    plot_frontiers(planned.plan, paths["plot"])
    save_stages(planned.work, planned.stages, paths["partitions"], planned.originals)
    write_text(paths["report"], report_markdown(planned, plot_name=paths["plot"].name))
    return paths


def _md_table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def _why_loose(instructions: int, settings: PlannerSettings) -> str:
    """Say which size limit left solves unproven, and the setting that moves it ("" if none)."""
    limits = [
        (settings.dive_max_instructions, "the relaxation's dive", "dive_max_instructions"),
        (settings.search_max_instructions, "the search", "search_max_instructions"),
    ]
    skipped = [
        f"{what} runs on iterations of up to {limit} (`PlannerSettings.{name}`)"
        for limit, what, name in limits
        if limit is not None and instructions > limit
    ]
    if not skipped:
        return ""
    return (
        f"; this iteration has {instructions} instructions, and "
        + " and ".join(skipped)
        + ": raise the limit for tighter plans at the cost of planning time"
    )


def _searched(ev: dict[str, Any]) -> str:
    """Say how many solves each search took further (SCIP's branch and bound, CP-SAT)."""
    text = f"{ev.get('cp_sat_solves', 0)} searched further by CP-SAT"
    branch = ev.get("branch_solves", 0)
    return text + (f", {branch} by SCIP's branch and bound" if branch else "")


def _clocks_planned(clocks: int | None, settings: PlannerSettings) -> list[str]:
    """Say on how many clocks the plan was made, where more than the first grid's."""
    if clocks is None or settings.clocks_mhz or clocks <= DEFAULT_CLOCK_COUNT:
        return []
    return [
        f"- clocks: planned on all {clocks} of the GPU's top half, after the default "
        f"{DEFAULT_CLOCK_COUNT} left solves unproven past the dive "
        "(`PlannerSettings.finer_clocks`)"
    ]


def report_markdown(planned: WorkloadPlan, plot_name: str = "frontier.png") -> str:
    """Return the report: workload, comparison, frontiers, decisions, clocks, partitions, cost."""
    plan = planned.plan
    lines = [
        *_header(planned),
        *_workload_section(planned),
        *_chosen_section(plan),
        *_comparison_section(plan, plot_name),
        *data_parallel_lines(plan),
        *_frontiers_section(plan),
        "## Where the saving comes from",
        "",
        *contribution_lines(plan, planned.result.settings.default_sm_share),
        "",
        *_decisions_section(plan),
        *_clocks_section(plan),
        *_partitions_section(planned),
        *_cost_section(planned),
    ]
    if plan.source == "modelled":
        lines += ["", "## Hardware model", "", f"{plan.gpu}: {planned.spec.calibration_source}"]
    lines += [f"- note: {r}" for r in plan.skip_reasons]
    return "\n".join(lines) + "\n"


def _header(planned: WorkloadPlan) -> list[str]:
    plan, work, src = planned.plan, planned.work, planned.plan.source
    return [
        f"# kareus plan: {work.name} on {plan.gpu}",
        "",
        f"Every time and energy below is **{src}** "
        + (
            f"(the hardware model of {plan.gpu}; see *Hardware model* at the end)."
            if src == "modelled"
            else "(measured on the GPU)."
        )
        + " Energy is per training iteration, summed over all "
        f"{work.tp * work.cp * work.pp} GPUs of one pipeline, static power included"
        + (
            f" (each of the {work.dp} data-parallel replicas uses as much)."
            if (work.dp or 1) > 1
            else "."
        ),
        "",
    ]


def data_parallel_lines(plan: Plan) -> list[str]:
    """Return the report's data-parallel section (none where the plan priced none)."""
    dp = plan.data_parallel
    if not dp:
        return [
            "## Data parallelism",
            "",
            "Not priced: the plan is for one replica without data-parallel communication "
            "or optimizer step (plan with `--dp N` to add them).",
            "",
        ]
    if dp.get("in_graph"):
        return _in_graph_lines(plan)
    rows = []
    for i, st in enumerate(dp["stages"]):
        alone, added = st["alone_s"], st["added_s"]
        hidden = f"{1 - added / alone:.0%}" if alone > 0 else "n/a"
        rows.append(
            (
                i,
                f"{st['parameters'] / 1e6:.1f} M",
                f"{st['bytes'] / 2**30:.2f} GiB",
                f"{alone * 1e3:.1f}",
                f"{added * 1e3:.1f}",
                hidden,
                f"{st['optimizer_s'] * 1e3:.1f}",
            )
        )
    header = (
        "stage",
        "parameters / GPU",
        "moved / iteration",
        "alone ms",
        "added ms",
        "hidden",
        "optimizer ms",
    )
    return [
        "## Data parallelism",
        "",
        f"{dp['describe']}, {dp['gpus_per_node']} GPUs per node; **modelled** at the maximum "
        "clock. *alone*: the iteration's data-parallel collectives run by themselves; "
        "*added*: what they add to the stage's instructions, beside compute as PyTorch's hooks "
        "issue them (kareus prices them, it does not move them); the rest is hidden. What "
        "runs after a rank's last backward (DDP's last bucket, FSDP's reduce-scatters under "
        "a pipeline schedule, the optimizer step) is its *step*, at a clock of its own "
        f"({_step_clocks(plan)}; the baselines keep it at the maximum); what is added to "
        "the instructions that carry traffic (FSDP's gathers, DDP's buckets beside the "
        "last backward) is priced at every clock, so the clocks chosen account for it.",
        "",
        _md_table(header, rows),
        "",
        *([f"**Not priced**: {dp['caveat']}.", ""] if dp.get("caveat") else []),
        *_blind_lines(dp.get("blind")),
    ]


def _in_graph_lines(plan: Plan) -> list[str]:
    """Return the data-parallel section of a plan whose DP collectives are in the graphs."""
    dp = plan.data_parallel
    rows = [
        (i, f"{st['parameters'] / dp['degree'] / 1e6:.2f} M", f"{st['optimizer_s'] * 1e3:.2f}")
        for i, st in enumerate(dp["stages"])
    ]
    return [
        "## Data parallelism",
        "",
        f"{dp['describe']}, {dp['gpus_per_node']} GPUs per node; **modelled**. The parameters' "
        "all-gathers and the gradients' reduce-scatters are in the traced graphs (each rank "
        "holds a shard), so kareus plans them as it plans the tensor-parallel collectives: "
        "where the layers stay whole (no tensor parallelism) each overlaps the compute "
        "beside it as a partition whose clock, launch slot and SM share are chosen "
        "(*Partition types* lists them; a group across nodes says *over N nodes* and is "
        "priced on the network); where layers are split, a gather both nanobatches share "
        "runs alone, priced so. Each rank's *step* holds the optimizer on "
        f"its shard, at a clock of its own ({_step_clocks(plan)}; the baselines keep it at "
        "the maximum).",
        "",
        _md_table(("stage", "parameters / GPU (shard)", "optimizer ms"), rows),
        "",
    ]


def _step_clocks(plan: Plan) -> str:
    """Say the clock of each rank's step, e.g. ``rank 0 at 1005 MHz, rank 1 at 1410 MHz``."""
    steps = [s for s in plan.schedule if s.kind == "step"]
    if not steps:
        return "none in this plan's schedule"
    return ", ".join(f"rank {s.stage} at {s.freq_mhz:g} MHz" for s in steps)


def _blind_lines(blind: dict[str, Any] | None) -> list[str]:
    """Return what planning with the data-parallel traffic in view gained (none if unpriced)."""
    if not blind:
        return []
    if "note" in blind:
        return [f"What seeing the data-parallel traffic gained: {blind['note']}.", ""]
    return [
        "**What seeing it gained** (modelled): planned blind to this traffic (kareus's "
        f"`{blind['policy']}` plan of the iteration without it) and run with it, the "
        f"iteration takes {blind['time_s']:.4f} s and {blind['energy_j']:,.0f} J; planned "
        f"with it in view, kareus's least energy no slower is {blind['aware_energy_j']:,.0f} J: "
        f"**{blind['saving']:.1%} less**, the saving attributable to pricing the data-parallel "
        "communication and choosing clocks around it.",
        "",
    ]


def _workload_section(planned: WorkloadPlan) -> list[str]:
    work = planned.work
    cfg = work.shape
    shape: tuple[Any, ...] = (
        ("as traced",) * 5  # a factory's model declares no shape
        if cfg is None
        else (
            cfg.num_layers,
            cfg.hidden_size,
            f"{cfg.num_heads} ({cfg.num_kv_heads})",
            cfg.intermediate_size,
            cfg.vocab_size,
        )
    )
    return [
        "## Workload",
        "",
        _md_table(
            ("model", "layers", "hidden", "heads (kv)", "FFN", "vocab", "dtype"),
            [(work.name, *shape, work.dtype)],
        ),
        "",
        _md_table(
            ("TP", "CP", "PP", "micro-batch", "sequence", "micro-batches / iteration"),
            [(work.tp, work.cp, work.pp, work.microbatch_size, work.seq_len, work.microbatches)],
        ),
        "",
    ]


def _chosen_section(plan: Plan) -> list[str]:
    chosen = plan.chosen
    mega = min(_pts(plan.baselines["megatron"]))
    lines = [
        "## Chosen plan",
        "",
        f"Policy `{plan.policy}`: {chosen.time_s:.4f} s and {chosen.energy_j:.1f} J per "
        f"iteration ({plan.source}); Megatron-LM's default (max clock, no overlap) takes "
        f"{mega[0]:.4f} s and {mega[1]:.1f} J: "
        f"{100 * (chosen.time_s - mega[0]) / mega[0]:+.1f} % time, "
        f"{100 * (chosen.energy_j - mega[1]) / mega[1]:+.1f} % energy. " + _gap_sentence(chosen),
        "",
    ]
    if plan.nanobatches == 1:
        lines += [
            "It leaves the graphs unsplit (no nanobatches, no overlap): at its time no "
            "split plan beats per-instruction clocks alone, so `kareus.compile` applies "
            "its clocks only.",
            "",
        ]
    return lines


def _comparison_section(plan: Plan, plot_name: str) -> list[str]:
    return [
        "## Methods side by side",
        "",
        "Iso-time saving: least energy among kareus's plans no slower than the method's "
        "fastest plan, against that plan's energy. Iso-energy saving: shortest kareus time "
        "using no more energy than the method's least-energy plan.",
        "",
        _md_table(COMPARISON_HEADER, comparison_rows(plan)),
        "",
        f"![time-energy frontiers]({plot_name})",
        "",
    ]


def _frontiers_section(plan: Plan) -> list[str]:
    lines = [
        "## Frontiers",
        "",
        "Proven gap: how far each point's energy may be above the least energy of any plan as "
        "fast, on the same options (the better of the linear relaxation's and CP-SAT's proven "
        "lower bounds); 0.0 % is proven optimal. Graphs: *split* in two nanobatches, or the "
        "*original* ones (blocks whole, each collective alone), which Megatron-LM and Perseus "
        "run and which kareus keeps where no split plan beats them.",
        "",
    ]
    methods: dict[str, Sequence[FrontierPoint]] = {"kareus": plan.frontier, **plan.baselines}
    header = ("#", "time s", "energy J", "proven gap", "graphs", "")
    for name, pts in methods.items():
        rows = [
            (
                i,
                fig(p.time_s),
                fig(p.energy_j),
                _pct(p.gap),
                "split" if p.nanobatches == 2 else "original",
                "chosen" if name == "kareus" and p == plan.chosen else "",
            )
            for i, p in enumerate(pts)
        ]
        lines += [f"### {name} ({plan.source})", "", _md_table(header, rows), ""]
    return lines


def _decisions_section(plan: Plan) -> list[str]:
    rows = [
        (g, k, "no overlap" if d.launch_slot is None else d.launch_slot, d.sm_share or "default")
        for g, decs in plan.decisions.items()
        for k, d in decs.items()
    ]
    return [
        "## Overlap decisions (per partition type)",
        "",
        _md_table(("stage/kind", "type", "launch slot", "SM share"), rows),
        "",
    ]


def _clocks_section(plan: Plan) -> list[str]:
    lines = ["## Clock schedule (MHz; F = forward, B = backward, then the micro-batch)", ""]
    if any(s.kind == "step" for s in plan.schedule):
        lines += [
            "*step*: the data-parallel communication and optimizer step after the rank's "
            "last backward, at a clock of its own (the runtime sets it where that backward's "
            "graph ends).",
            "",
        ]
    lines += [f"- stage {s}: {steps}" for s, steps in plan.stage_clocks().items()]
    lines += ["", switch_sentence(plan)]
    return [*lines, ""]


def switch_sentence(plan: Plan) -> str:
    """Say how many clock changes an iteration makes and what each was charged (modelled)."""
    changes = plan.chosen.switches
    counted = "not counted" if changes is None else f"{changes}"
    cost = plan.clock_switch or {}
    if not cost.get("time_s"):
        return f"Clock changes per iteration, over the pipeline's ranks: {counted} (priced free)."
    return (
        f"Clock changes per iteration, over the pipeline's ranks: {counted} (a rank's change "
        "back to its first clock included); each was charged the energy of "
        f"{cost['time_s'] * 1e3:g} ms of GPU time at the instruction's highest power "
        f"(modelled; {cost.get('source', 'source not recorded')})."
    )


def _partitions_section(planned: WorkloadPlan) -> list[str]:
    lines = [
        "## Partition types",
        "",
        "A partition is the compute of one nanobatch overlapped with the collective of the "
        "other. *per micro-batch* counts a type's partitions in one forward or backward of "
        "one micro-batch: each layer is split into two nanobatches, and a layer with two "
        "collectives per direction (attention, MLP) gives two partitions per nanobatch.",
        "",
    ]
    for i, pset in planned.distinct_stages():
        per = planned.work.stage_layers()[i]
        rows = [
            (
                key,
                sum(1 for p in pset.partitions if p.type_key == key),
                t.describe(),
                len(t.slot_labels),
            )
            for key, t in pset.types.items()
        ]
        lines += [
            f"### stage {i} ({per} layers; traced on fake tensors, repeated layers counted)",
            "",
            _md_table(("type", "per micro-batch", "compute ‖ collective", "launch slots"), rows),
            "",
            f"One micro-batch's forward and backward, {traffic_sentence(planned, pset)}",
            "",
        ]
    return lines


def traffic_sentence(planned: WorkloadPlan, pset: PartitionSet) -> str:
    """Each collective kind's time and share beside the compute of one micro-batch."""
    from kareus.jobs.traffic import stage_traffic

    traffic = stage_traffic(pset, planned.spec, planned.result.settings.default_sm_share)
    return (
        "at the highest clock, each collective alone (modelled, before any overlap): "
        + traffic.describe()
    )


def _cost_section(planned: WorkloadPlan) -> list[str]:
    plan, settings = planned.plan, planned.result.settings
    ev = plan.evaluations
    unproven = ev.get("solves_not_proven_optimal", 0)
    return [
        "## Cost of planning (measured)",
        "",
        f"- tracing: {planned.trace_s:.1f} s; planning: {planned.plan_s:.1f} s; peak memory "
        f"{planned.peak_rss_mib:.0f} MiB",
        f"- evaluations: {ev.get('search', 0)} in the search of a {ev.get('grid', 0)}-setting "
        f"grid, {ev.get('total', 0)} in all; {ev.get('solves', 0)} solves of the composition "
        f"(linear relaxation; {_searched(ev)}; "
        f"{unproven} not proven within {100 * settings.solver_gap_limit:g} % of optimal; "
        "each point's proven gap is in *Frontiers*)"
        + (_why_loose(len(plan.schedule), settings) if unproven else ""),
        *_clocks_planned(ev.get("clocks"), settings),
        "",
        'Apply the plan: `model = kareus.compile(model, plan="plan.json", stage=STAGE)`.',
    ]
