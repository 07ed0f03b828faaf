"""Applying a plan to a region: its decisions, its clock schedule, and checks that it fits.

A plan comes from ``kareus plan`` (passed as ``plan=``) or is made here at compile time with
the hardware model for a GPU type kareus knows (:func:`plan_region`). Either way the region
gets the overlap decisions of its partition types and a clock runtime gets the plan's steps.
"""

from __future__ import annotations

import dataclasses
import functools
import logging

import torch

from kareus._table import fig
from kareus.compiler.config import GRAPHS, Config
from kareus.compiler.region import Region
from kareus.errors import PlanMismatchError
from kareus.ir.plan_file import PIPELINE_SCHEDULES, Plan
from kareus.runtime.switcher import Step

SCHEDULE_NAMES = {
    alias + name.lower(): name for name in PIPELINE_SCHEDULES for alias in ("", "schedule")
}
"""Pipeline schedules by the names users give them (``"gpipe"``, ``"Schedule1F1B"``...)."""


def check_schedule(plan: Plan, schedule: str | None) -> None:
    """Raise when the pipeline schedule the job runs is not the one the plan was made for."""
    if schedule is None:
        return
    name = SCHEDULE_NAMES.get(schedule.replace("_", "").replace("-", "").lower())
    if name is None:
        raise PlanMismatchError(
            f"unknown pipeline schedule {schedule!r}: use one of {list(PIPELINE_SCHEDULES)}"
        )
    planned = plan.pipeline_schedule
    if name != planned:
        raise PlanMismatchError(
            f"the plan was made for the {planned} pipeline schedule, but this job runs "
            f"{name}: re-plan with `kareus plan --schedule {name}` (or run {planned})"
        )


def check_data_parallel(plan: Plan, world_size: int | None = None) -> None:
    """Raise when the job's data-parallel degree is not the one the plan priced.

    The job's degree is its world size (``torch.distributed``'s, unless given) over the
    plan's tensor x context x pipeline-parallel GPUs. A plan made without ``--dp`` priced
    no data-parallel traffic and fits any degree (its report says so).
    """
    planned = plan.data_parallel.get("degree")
    if planned is None:
        return
    if world_size is None:
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            return
        world_size = dist.get_world_size()
    replica = 1
    for key in ("tp", "cp", "pp"):
        replica *= int(plan.parallel.get(key, 1))
    if world_size % replica or world_size // replica != planned:
        raise PlanMismatchError(
            f"the plan was made for data-parallel degree {planned} "
            f"({plan.data_parallel.get('describe', '')}), but this job's {world_size} GPUs over "
            f"{replica} per replica (TP x CP x PP of the plan) give "
            f"{world_size / replica:g}: re-plan with `kareus plan --world-size {world_size}`"
        )


class Decisions(dict):  # type: ignore[type-arg]
    """The overlap decisions a region was compiled with, shown by ``kareus.explain``."""

    def to_text(self) -> str:
        """Render the decisions a line each (or what runs without any)."""
        if not self:
            return "none given: every partition's collective launches at the partition's start"
        return "\n".join(f"{k}: {v}" for k, v in self.items())


def check_plan(plan: Plan, config: Config, stage: int, schedule: str | None) -> Config:
    """Check that ``plan`` fits this job; return the config it runs with.

    That config runs the plan's graphs: the original ones for a plan of nanobatches 1, and
    Inductor's (its decompositions, joint-graph passes and min-cut partition) for a plan
    traced on them, on either codegen, where the config leaves those fields open. A plan
    traced on AOTAutograd's graphs (the default) changes nothing: the python codegen runs
    those, and Inductor keeps its own partition (as torch.compile; its decompositions
    would differ from the plan's graphs all the same).

    Raises:
        PlanMismatchError: the plan runs the original graphs but ``nanobatches=2`` was
            asked for, the job's pipeline schedule is not the plan's, or ``stage`` is not
            one of its stages.
    """
    if plan.nanobatches == 1:
        # The plan found that splitting does not pay here: it runs the original graphs.
        if config.nanobatches == 2:
            raise PlanMismatchError(
                "the plan runs the original graphs (nanobatches 1: no split plan beat "
                "per-instruction clocks alone), but nanobatches=2 was asked for: drop "
                "nanobatches=2, or plan again"
            )
        config = config.replace(nanobatches=1)
    if plan.workload.get("graphs") == "inductor":  # `kareus plan --graphs inductor`
        unset = {k: v for k, v in GRAPHS["inductor"].items() if getattr(config, k) is None}
        config = config.replace(**unset) if unset else config
    check_schedule(plan, schedule)
    check_data_parallel(plan)
    if stage not in plan.stages():
        raise PlanMismatchError(
            f"stage={stage} is not in the plan: it schedules stages "
            f"{plan.stages()} ({plan.parallel}); pass the pipeline stage this "
            "process runs"
        )
    return config


def steps(plan: Plan, stage: int, *, as_stage: int | None = None) -> list[Step]:
    """Return the clock runtime's steps of ``stage`` (numbered ``as_stage`` if given)."""
    return [
        Step(
            s.kind,
            s.freq_mhz,
            s.time_s,
            s.dynamic_energy_j,
            s.stage if as_stage is None else as_stage,
            s.microbatch,
        )
        for s in plan.schedule
        if as_stage is not None or s.stage == stage
    ]


def plan_region(region: Region, gpu_name: str, policy: str) -> Plan | None:
    """Plan this region's forward and backward with the hardware model for ``gpu_name``.

    Returns the plan, or None when planning failed (the region keeps nanobatching's
    defaults, and says so): planning must never stop training.
    """
    from kareus.hardware import gpu
    from kareus.planner import Parallelism, plan_for_gpu

    pset = region.findings.partitions
    if pset is None:
        region.warn(
            "nothing to plan: the graphs were not cut into partitions (see the pass history)"
        )
        return None
    sizes = [
        c.world_size for t in pset.types.values() for c in ([t.collective] if t.collective else [])
    ] + [c.world_size for cs in pset.exposed.values() for c in cs]
    spec = gpu(gpu_name)
    try:
        result = plan_for_gpu(
            pset, spec, parallel=Parallelism(tp=max(sizes, default=1)), policy=policy
        )
    except Exception as err:  # planning must never stop training
        region.warn(f"planning for {spec.name} failed, nanobatching defaults kept: {err}")
        return None
    plan = _unsplit_if_whole(result.plan, region)
    region.notes.append(
        f"planned at compile time for {spec.name} with the hardware model "
        f"(policy {policy}; modelled {fig(plan.chosen.time_s)} s and "
        f"{fig(plan.chosen.energy_j)} J of all its GPUs per forward and backward)"
    )
    return plan


def _unsplit_if_whole(plan: Plan, region: Region) -> Plan:
    """Label the plan's points as the original graphs' where no block of the region is split.

    The planner prices the graphs as traced: with every block whole they are the original
    graphs, whatever the partition set's name for them (nanobatches 2).
    """
    blockset = region.findings.blocks
    if blockset is None or blockset.split:
        return plan
    whole = functools.partial(dataclasses.replace, nanobatches=1)
    return dataclasses.replace(
        plan, frontier=tuple(whole(p) for p in plan.frontier), chosen=whole(plan.chosen)
    )


_DRY_RUN_LOGGED = False


def note_dry_run(region: Region) -> None:
    """Say (in the region, and once per process in the log) that planned clocks stay unset."""
    global _DRY_RUN_LOGGED
    note = (
        "clocks planned at compile time are recorded, not applied (dry run): kareus changes "
        "a GPU's clocks only when asked. Apply them with kareus.compile(model, "
        "clocks='auto'), or plan with `kareus plan` and pass plan=..."
    )
    region.notes.append(note)
    if not _DRY_RUN_LOGGED:
        _DRY_RUN_LOGGED = True
        logging.getLogger("kareus").warning("kareus: %s", note)


def this_gpu() -> str | None:
    """Return the kareus GPU type of this CUDA device, or None (no GPU or unknown)."""
    if not torch.cuda.is_available():
        return None
    from kareus.hardware.specs import spec_name_for_device

    return spec_name_for_device(torch.cuda.get_device_name())
