"""What a clock runtime did, as text for ``kareus.explain``."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kareus.runtime.switcher import ClockRuntime


def describe(rt: ClockRuntime) -> str:
    """Describe the schedule, what was applied and the iterations (for ``explain``)."""
    lines = [f"clock controller: {rt.controller.name} (GPU {rt.controller.index})"]
    dry = rt.controller.name == "dry-run"
    if dry:
        why = getattr(rt.controller, "why", "") or "asked for"
        lines[0] += f": a dry run ({why}), no clock is changed"
    for stage in rt.stages():
        sched = " ".join(
            f"{s.kind[0].upper()}{s.microbatch}@{s.freq_mhz:g}"
            for s in rt.schedule
            if s.stage == stage
        )
        lines.append(f"stage {stage} per iteration (MHz): {sched}")
    lines += [
        f"switches applied: {rt.switch_count}; clocks "
        + ("applied" if rt.enabled and not dry else "NOT applied")
        + (f"; {rt.failed_switches} switch(es) failed" if rt.failed_switches else ""),
    ]
    if rt.switch_calls:
        lines.append(
            f"switch calls (measured): mean {rt.switch_call_s / rt.switch_calls * 1e3:.3f}"
            f" ms, max {rt.switch_call_max_s * 1e3:.3f} ms over {rt.switch_calls}"
        )
    if rt._worker_thread is not None:
        lines.append(
            f"switch worker CPU time waiting on the GPU (measured): "
            f"{rt.worker_cpu_s * 1e3:.1f} ms in all"
        )
    if rt.iterations:
        lines.append(
            f"iterations recorded: {len(rt.iterations)} (one ends when the next starts; "
            "the last, at close)"
        )
    lines += [
        f"iteration {r.iteration}: {r.time_s:.6f} s, {r.energy_j:.3f} J of this GPU ({r.source})"
        for r in rt.iterations[-5:]
    ]
    return "\n".join(lines + [f"note: {n}" for n in rt.notes])
