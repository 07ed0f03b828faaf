"""What a clock runtime did, as text for ``kareus.explain``."""

from __future__ import annotations

from collections.abc import Sequence

from kareus.runtime.safety import ClockHold
from kareus.runtime.schedule import IterationEnergy, Step


def describe(
    hold: ClockHold,
    schedule: Sequence[Step],
    iterations: Sequence[IterationEnergy],
    notes: Sequence[str],
) -> str:
    """Describe the schedule, what was applied and the iterations (for ``explain``).

    ``hold``: the runtime's hold on the GPU (what it set, and how).
    """
    lines = [f"clock controller: {hold.controller.name} (GPU {hold.controller.index})"]
    dry = hold.controller.name == "dry-run"
    if dry:
        why = getattr(hold.controller, "why", "") or "asked for"
        lines[0] += f": a dry run ({why}), no clock is changed"
    for stage in sorted({s.stage for s in schedule}):
        sched = " ".join(
            f"{s.kind[0].upper()}{s.microbatch}@{s.freq_mhz:g}"
            for s in schedule
            if s.stage == stage
        )
        lines.append(f"stage {stage} per iteration (MHz): {sched}")
    lines += [
        f"switches applied: {hold.switch_count}; clocks "
        + ("applied" if hold.enabled and not dry else "NOT applied")
        + (f"; {hold.failed_switches} switch(es) failed" if hold.failed_switches else ""),
    ]
    if hold.switch_calls:
        lines.append(
            f"switch calls (measured): mean {hold.switch_call_s / hold.switch_calls * 1e3:.3f}"
            f" ms, max {hold.switch_call_max_s * 1e3:.3f} ms over {hold.switch_calls}"
        )
    if hold.worker is not None:
        lines.append(
            f"switch worker CPU time waiting on the GPU (measured): "
            f"{hold.worker_cpu_s * 1e3:.1f} ms in all"
        )
    if iterations:
        lines.append(
            f"iterations recorded: {len(iterations)} (one ends when the next starts; "
            "the last, at close)"
        )
    lines += [
        f"iteration {r.iteration}: {r.time_s:.6f} s, {r.energy_j:.3f} J of this GPU ({r.source})"
        for r in iterations[-5:]
    ]
    return "\n".join(lines + [f"note: {n}" for n in notes])
