"""What planning evaluates before it composes: each type's search, each instruction's options.

Every evaluation a plan needs happens here (composing evaluates nothing): the searched
frontier of each partition type, and each (stage, instruction kind)'s options, every clock
times every decision profile, priced by the evaluator.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from kareus.ir.costs import Knobs, PartitionWork
from kareus.ir.partitions import PartitionSet
from kareus.planner.dag import Option
from kareus.planner.knobs import CountingEvaluator, KnobSpace, Setting, knobs_of
from kareus.planner.search import SearchResult, exhaustive, search
from kareus.planner.settings import PlannerSettings

Pair = tuple[int | None, int | None]
"""One partition type's decision: (launch slot, SM share); (None, None) runs it alone."""

ORIGINAL = "original"
"""The decision profile of the original graphs' options: blocks whole, collectives alone."""


@dataclasses.dataclass
class Evaluated:
    """What planning evaluates before it composes (:func:`evaluate_options`).

    Attributes:
        searches: each type's search, by ``"stage/type"``.
        options: each (stage, kind)'s instruction options (clock x decision profile).
        profiles: each (stage, kind)'s decision profiles, by name.
        grid: the knob grid's size over the first stage's types.
        searched: evaluations the searches made.
    """

    searches: dict[str, SearchResult]
    options: dict[tuple[int, str], list[Option]]
    profiles: dict[tuple[int, str], dict[str, dict[str, Pair]]]
    grid: int
    searched: int


def evaluate_options(
    stages: Sequence[PartitionSet],
    ev: CountingEvaluator,
    freqs: Sequence[float],
    static_power_w: float,
    settings: PlannerSettings,
    note: Any = None,
    originals: Sequence[PartitionSet] | None = None,
) -> Evaluated:
    """Search each partition type and build every instruction's options.

    Every evaluation planning needs happens here (composing evaluates nothing), so a
    profiler that runs this records everything a later replay is asked for. ``originals``
    (the original graphs' sets, one per stage) add each instruction's options on them, at
    every clock with every collective alone (profile :data:`ORIGINAL`).
    """
    note = note or (lambda _step: None)
    freqs = tuple(freqs)

    # Per partition type: the frontier over the knob space.
    searches: dict[str, SearchResult] = {}
    for si, pset in enumerate(stages):
        for key, ptype in pset.types.items():
            name = f"{si}/{key}"
            if stages.index(pset) != si:  # the same set as an earlier stage
                searches[name] = searches[f"{stages.index(pset)}/{key}"]
                continue
            note(f"searching {name}")
            space = KnobSpace(
                freqs,
                settings.sm_shares,
                len(ptype.slot_labels) if ptype.collective else 0,
                settings.no_overlap_sm_share,
            )
            fn = exhaustive if settings.exhaustive else search
            kwargs = {} if settings.exhaustive else {"budget_fraction": settings.budget_fraction}
            work = PartitionWork(ptype.compute, ptype.collective)
            searches[name] = fn(work, space, ev, **kwargs)  # type: ignore[operator]
    grid = sum(r.grid_size for n, r in searches.items() if n.startswith("0/"))
    searched = ev.evaluations

    note("building instruction options")
    profiles_by_group = default_profiles(stages, settings)
    for (si, kind), profiles in profiles_by_group.items():
        for name, prof in _searched_profiles(si, kind, stages[si], searches).items():
            if prof not in profiles.values():  # a profile is tried once, by its first name
                profiles[name] = prof
    options = instruction_options(stages, ev, freqs, static_power_w, settings, profiles_by_group)
    if originals is not None:
        note("building the original graphs' options")
        alone = {
            group: {ORIGINAL: profiles["no-overlap"]}
            for group, profiles in default_profiles(originals, settings).items()
        }
        extra = instruction_options(originals, ev, freqs, static_power_w, settings, alone)
        for group, opts in extra.items():
            options[group] = options[group] + opts
    return Evaluated(searches, options, profiles_by_group, grid, searched)


def default_profiles(
    stages: Sequence[PartitionSet], settings: PlannerSettings
) -> dict[tuple[int, str], dict[str, dict[str, Pair]]]:
    """Return each (stage, kind)'s two fixed decision profiles (no search needed).

    ``no-overlap``: every collective alone, as Megatron-LM and Perseus run; ``nanobatch``:
    each collective launched at its partition's start on the default communicator.
    """
    out: dict[tuple[int, str], dict[str, dict[str, Pair]]] = {}
    for si, pset in enumerate(stages):
        for kind in ("forward", "backward"):
            with_coll = [
                k
                for k, t in pset.types.items()
                if t.instruction == kind and t.collective is not None
            ]
            out[(si, kind)] = {
                "no-overlap": {k: (None, None) for k in with_coll},
                "nanobatch": {k: (0, settings.default_sm_share) for k in with_coll},
            }
    return out


def instruction_options(
    stages: Sequence[PartitionSet],
    ev: CountingEvaluator,
    freqs: Sequence[float],
    static_power_w: float,
    settings: PlannerSettings,
    profiles: dict[tuple[int, str], dict[str, dict[str, Pair]]],
) -> dict[tuple[int, str], list[Option]]:
    """Each (stage, kind)'s options: every clock of ``freqs`` x every decision profile.

    An option's time and dynamic energy are those of the work outside partitions (with what
    activation recompute re-runs) plus each partition type's, under the profile's (slot,
    SM share), times the type's count in the instruction.
    """
    options: dict[tuple[int, str], list[Option]] = {}
    for si, pset in enumerate(stages):
        for kind in ("forward", "backward"):
            counts = pset.counts(kind)
            types = [k for k in pset.types if pset.types[k].instruction == kind]
            spaces = {
                key: KnobSpace(
                    tuple(freqs),
                    settings.sm_shares,
                    len(pset.types[key].slot_labels) if pset.types[key].collective else 0,
                    settings.no_overlap_sm_share,
                )
                for key in types
            }
            works = {
                key: PartitionWork(pset.types[key].compute, pset.types[key].collective)
                for key in types
            }
            opts = []
            for f in freqs:
                base_t, base_e = _base(pset, kind, f, ev, settings, static_power_w)
                for pname, pairs in profiles[(si, kind)].items():
                    t, e = base_t, base_e
                    for key in types:
                        pair = pairs[key] if pset.types[key].collective else (None, None)
                        est = ev.partition(works[key], knobs_of(Setting(f, *pair), spaces[key]))
                        t += counts.get(key, 0) * est.time_s
                        e += counts.get(key, 0) * (est.energy_j - static_power_w * est.time_s)
                    opts.append(Option(f, pname, t, e))
            options[(si, kind)] = opts
    return options


def _searched_profiles(
    stage: int, kind: str, pset: PartitionSet, searches: dict[str, SearchResult]
) -> dict[str, dict[str, Pair]]:
    """Decision profiles (one (slot, share) per type) the searches suggest for one group.

    Per type, the pairs on its frontier that are fastest and most frugal at the top, middle
    and bottom of the clock grid (the fixed profiles, :func:`default_profiles`, come first).
    """
    with_coll = [
        k for k, t in pset.types.items() if t.instruction == kind and t.collective is not None
    ]
    profiles: dict[str, dict[str, Pair]] = {}
    for label in ("fast", "frugal"):
        for where in ("top", "mid", "low"):
            prof: dict[str, Pair] = {}
            for key in with_coll:
                pts = searches[f"{stage}/{key}"].points
                clocks = sorted({p.setting.freq_mhz for p in pts}, reverse=True)
                f = {"top": clocks[0], "mid": clocks[len(clocks) // 2], "low": clocks[-1]}[where]
                at = [p for p in pts if p.setting.freq_mhz == f]
                best = min(
                    at, key=(lambda p: p.time_s) if label == "fast" else (lambda p: p.energy_j)
                )
                prof[key] = best.setting.pair
            profiles[f"{label}@{where}"] = prof
    return profiles


def _base(
    pset: PartitionSet,
    kind: str,
    f: float,
    ev: CountingEvaluator,
    settings: PlannerSettings,
    static_power_w: float,
) -> tuple[float, float]:
    """Time and dynamic energy of an instruction's work outside partitions at clock f.

    That is the compute outside partitions, what activation recompute re-runs, and the
    collectives that overlap nothing.
    """
    t = e = 0.0
    for ops in (pset.outside(kind), pset.recompute.get(kind, ())):
        if ops:
            est = ev.ops(ops, f)
            t += est.time_s
            e += est.energy_j - static_power_w * est.time_s
    for coll in pset.exposed.get(kind, ()) + pset.recompute_collectives.get(kind, ()):
        est = ev.partition(
            PartitionWork((), coll), Knobs(f, settings.no_overlap_sm_share, launch_slot=None)
        )
        t += est.time_s
        e += est.energy_j - static_power_w * est.time_s
    return t, e
