"""``kareus.explain``: a printable account of what kareus captured, found and rewrote."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch

from kareus._table import render_table
from kareus.compiler.backend import find_backend
from kareus.compiler.config import Config
from kareus.compiler.region import Region
from kareus.errors import NotCompiledError, NotYetCapturedError
from kareus.ir.partitions import PartitionSet
from kareus.passes.blocks import BlockSet
from kareus.runtime.switcher import IterationEnergy


@dataclasses.dataclass(frozen=True)
class Report:
    """What kareus did for one compiled model; ``print(report)`` shows it all.

    Attributes:
        config: the settings the model was compiled with.
        regions: one entry per compiled region (Dynamo graph), in capture order.
    """

    config: Config
    regions: tuple[Region, ...]

    def graph(self, kind: str, region: int = 0, *, captured: bool = False) -> str:
        """Return the code of one graph.

        Args:
            kind: "dynamo", "forward", "backward" or "inference".
            region: index of the region.
            captured: the graph as captured instead of as it runs.

        Raises:
            KeyError: the region has no graph of that kind (yet): a backward graph exists
                only after the first backward pass, an inference graph only after a call
                without gradients.
        """
        graphs = self.regions[region].graphs
        if kind not in graphs:
            raise KeyError(
                f"region {region} has no {kind!r} graph; it has {sorted(graphs)}. A backward "
                "graph is captured at the first backward, an inference graph at the first "
                "call under torch.no_grad()."
            )
        rec = graphs[kind]
        return rec.captured_code if captured else rec.final_code

    def summary(self) -> str:
        """Return the report without the graphs' code: findings, notes and pass history."""
        return self._text(with_code=False)

    def __str__(self) -> str:
        return self._text(with_code=True)

    def verdict(self) -> list[str]:
        """Return the verdict: were blocks split, collectives overlapped, clocks planned.

        Three lines; each says how many, or the first reason why not (clocks: whether
        applied or a dry run, and why).
        """
        return [_split_line(self.regions), _overlap_line(self.regions), _clock_line(self)]

    def _text(self, *, with_code: bool) -> str:
        head = [f"kareus report: {len(self.regions)} compiled region(s)", *self.verdict()]
        parts = ["\n".join(head), f"config: {self.config}"]
        parts.extend(_region_text(region, with_code) for region in self.regions)
        return "\n\n".join(parts)


def _blocks(regions: tuple[Region, ...]) -> list[tuple[Region, BlockSet]]:
    return [(r, r.findings.blocks) for r in regions if r.findings.blocks is not None]


def _partitions(regions: tuple[Region, ...]) -> list[tuple[Region, PartitionSet]]:
    return [(r, r.findings.partitions) for r in regions if r.findings.partitions is not None]


def _split_line(regions: tuple[Region, ...]) -> str:
    found = _blocks(regions)
    total = sum(len(bs.blocks) for _r, bs in found)
    split = sum(len(bs.split) for _r, bs in found)
    reasons = [why for _r, bs in found for why in bs.skipped.values()]
    if not total:
        why = next((bs.why_none for _r, bs in found if bs.why_none), "no repeated layers found")
        return f"split: no, no block to split: {why}"
    if not split:
        why = reasons[0] if reasons else "no reason kept"
        broken = next((r.graph_break for r in regions if r.graph_break), "")
        if broken:  # the first reason is then a piece's: say first what cut the layers
            why = (
                f"Dynamo broke the model's graph at {broken}, and a layer cut by a graph break "
                f"has no graph of its own to split (in the first piece: {why})"
            )
        return f"split: no, 0 of {total} blocks: {why}"
    line = f"split: yes, {split} of {total} blocks into nanobatches"
    along = {a for _r, bs in found for a in bs.split_along.values()}
    line += {"sequence": " along the sequence", "batch": ""}.get(
        along.pop() if len(along) == 1 else "", " along the batch or the sequence"
    )
    priced = [
        text
        for r, bs in found
        for block, (split, text) in r.split_prices.items()
        if split and block in bs.split
    ]
    line += f" ({priced[0].removeprefix('split: ')})" if priced else ""
    return line + (f"; left whole: {reasons[0]}" if reasons else "")


def _overlap_line(regions: tuple[Region, ...]) -> str:
    found = _partitions(regions)
    flying: dict[str, int] = {}
    exposed = 0
    for _r, pset in found:
        for p in pset.partitions:
            if p.collective is not None:
                flying[p.instruction] = flying.get(p.instruction, 0) + 1
        exposed += sum(len(c) for c in pset.exposed.values())
    if flying:
        each = ", ".join(f"{kind} {n}" for kind, n in flying.items())
        tail = f"; {exposed} exposed (overlapping no compute)" if exposed else ""
        return f"overlapped: yes, {sum(flying.values())} collectives beside compute ({each}){tail}"
    if exposed:
        return (
            f"overlapped: no, {exposed} collectives overlap no compute (no block split around them)"
        )
    if not found:
        return "overlapped: no, no graph was partitioned (see the pass history)"
    return "overlapped: no, the graphs hold no collective to overlap"


def _clock_line(report: Report) -> str:
    plans = [r.inputs.plan for r in report.regions if r.inputs.plan is not None]
    runtimes = [r.inputs.clock_runtime for r in report.regions if r.inputs.clock_runtime]
    if not plans:
        note = next(
            (n for r in report.regions for n in r.notes if n.startswith("no clock plan")), ""
        )
        if note:
            return f"clocks: not planned ({note})"
        return (
            "clocks: not planned: no gpu= and no plan= given (gpu='a100-40gb' plans for a GPU "
            "type at compile time; plan= applies a saved kareus plan)"
        )
    plan = plans[0]
    line = f"clocks: planned for {plan.gpu} ({plan.source}, policy {plan.policy})"
    if not runtimes:
        return line + "; no clock runtime: not applied"
    runtime = runtimes[0]
    controller = runtime.controller
    if controller.name == "dry-run" or not runtime.enabled:
        why = getattr(controller, "why", "") or "asked for"
        return line + f"; dry run ({why}): NOT applied"
    return line + f"; applied by the {controller.name} controller ({runtime.switch_count} switches)"


def _region_text(region: Region, with_code: bool) -> str:
    lines = [f"== region {region.index} (Dynamo compile id {region.compile_id}) =="]
    for note in region.notes:
        lines.append(f"note: {note}")
    if region.codegen:
        codegen = region.codegen
        lines.append(f"-- codegen --\n{getattr(codegen, 'to_text', lambda: codegen)()}")
    inputs = region.inputs
    supplied = {
        "decisions": inputs.decisions,
        "plan": inputs.plan,
        "clock_runtime": inputs.clock_runtime,
        "communicator_pool": inputs.communicator_pool,
    }
    for name, value in supplied.items():
        if value is not None:
            text = value.to_text() if hasattr(value, "to_text") else repr(value)
            lines.append(f"-- {name} --\n{text}")
    notes = {block: text for block, (split, text) in region.split_prices.items() if split}
    for name, finding in region.findings.items():
        if name == "blocks":
            text = finding.to_text(notes)
        else:
            text = finding.to_text() if hasattr(finding, "to_text") else repr(finding)
        lines.append(f"-- {name} --\n{text}")
    if region.history:
        rows = [
            (
                r.graph,
                r.name,
                r.status,
                "yes" if r.modified else "no",
                f"{r.nodes_before} -> {r.nodes_after}" if r.status == "ran" else "",
                f"{r.duration_s * 1e3:.1f}",
            )
            for r in region.history
        ]
        lines.append(
            render_table(
                "pass history", ("graph", "pass", "status", "modified", "nodes", "ms"), rows
            )
        )
    else:
        lines.append("pass history: no pass applied to this region's graphs")
    for kind, rec in region.graphs.items():
        changed = "rewritten" if rec.final_code != rec.captured_code else "unchanged"
        head = f"-- {kind} graph ({changed}, {rec.num_inputs} inputs) --"
        lines.append(f"{head}\n{rec.final_code}" if with_code else head)
    return "\n".join(lines)


def explain(compiled: object) -> Report:
    """Return the report of a model or function compiled by kareus.

    Args:
        compiled: the result of :func:`kareus.compile`, or of ``torch.compile`` with the
            ``"kareus"`` backend or a :class:`~kareus.KareusBackend`.

    Raises:
        NotCompiledError: (a ``TypeError``) ``compiled`` was not compiled by kareus.
        NotYetCapturedError: (a ``RuntimeError``) it was, but has not been called yet.
    """
    backend = find_backend(compiled)
    if backend is None:
        raise NotCompiledError(
            f"kareus.explain needs a model compiled by kareus, got {type(compiled).__name__}; "
            "compile it with kareus.compile(model) or torch.compile(model, backend='kareus')."
        )
    if not backend.regions:
        raise NotYetCapturedError(
            "nothing captured yet: kareus captures graphs on the first call of the compiled "
            "model; call it once (a forward, and a backward for the backward graph), then "
            "explain it."
        )
    return Report(backend.config, _regions_of(compiled, backend.regions))


def _regions_of(compiled: object, regions: Sequence[Region]) -> tuple[Region, ...]:
    """Return the regions of ``compiled``'s graphs among a backend's.

    One backend may compile several models (``torch.compile(m, backend="kareus")`` shares
    one): a module's regions are those whose graphs take its parameters. Without
    parameters to tell (a function), or when none is found, all of them.
    """
    module = getattr(compiled, "_orig_mod", compiled)
    if not isinstance(module, torch.nn.Module):
        return tuple(regions)
    own = {id(p) for p in module.parameters()}
    mine = tuple(r for r in regions if r.parameters & own)
    return mine or tuple(regions)


@dataclasses.dataclass(frozen=True)
class JobEnergy:
    """Per-iteration energy of every rank's GPU, and of the whole job.

    Attributes:
        per_rank: each rank's iterations (``IterationEnergy``: time, energy, source).
        iterations: per iteration, the job's time (the slowest rank's) and energy (the sum
            over ranks); ``source`` is "measured" only when every rank measured it
            ("measured+modelled" when some did).
    """

    per_rank: tuple[tuple[IterationEnergy, ...], ...]
    iterations: tuple[IterationEnergy, ...]

    def to_text(self) -> str:
        """One line per iteration of the job, with how its numbers were obtained."""
        ranks = len(self.per_rank)
        return "\n".join(
            f"iteration {it.iteration}: {it.time_s:.6f} s, {it.energy_j:.3f} J over "
            f"{ranks} GPU(s) ({it.source})"
            for it in self.iterations
        )


def job_energy(compiled: object, group: Any = None) -> JobEnergy:
    """Return the energy of each iteration run so far, per rank and summed over the job.

    With ``torch.distributed`` initialised this is a collective: call it on every rank of
    ``group`` (the default group when None). Energies are measured (Zeus, ``measure=True``)
    or modelled from the plan, as each record says.

    Raises:
        NotCompiledError: ``compiled`` was not compiled by kareus.
        ValueError: it was compiled without a plan (no clock runtime, no energy).
    """
    import torch.distributed as dist

    backend = find_backend(compiled)
    if backend is None:
        raise NotCompiledError(f"kareus.job_energy needs a kareus-compiled model, got {compiled!r}")
    runtime = backend.runtime
    if runtime is None:
        raise ValueError(
            "this model has no clock runtime (compiled without a plan, and not planned at "
            "compile time): there is no per-iteration energy to report"
        )
    mine = tuple(runtime.iterations)
    if dist.is_available() and dist.is_initialized():
        gathered: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(gathered, mine, group=group)
        per_rank = tuple(tuple(r) for r in gathered)
    else:
        per_rank = (mine,)
    common = min(len(r) for r in per_rank)
    iterations = tuple(
        IterationEnergy(
            i,
            max(r[i].time_s for r in per_rank),
            sum(r[i].energy_j for r in per_rank),
            _source({r[i].source for r in per_rank}),
        )
        for i in range(common)
    )
    return JobEnergy(per_rank, iterations)


def _source(sources: set[str]) -> str:
    return sources.pop() if len(sources) == 1 else "+".join(sorted(sources))
