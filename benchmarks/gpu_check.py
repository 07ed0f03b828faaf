"""One prepared GPU check: kareus on a real GPU, measured against its own model.

Ten steps, each reported even when another fails:

0. ``devices``: which GPU is which — each GPU's NVML UUID, NVML index and CUDA index, clock
   and power limit (``kareus doctor``'s reading) — and the CPU time a switch's wait costs on
   a blocking CUDA event (as the clock runtime waits) against a spinning one.

1. ``compile``: kareus.compile of a tiny Llama (python and Inductor codegen, with and
   without a clock plan; the dry run leaves Inductor to the test suite) trains like eager:
   losses and gradients side by side.
1b. ``train_step``: ``benchmarks/train_step.py`` on the H200 check's Llama (hidden 2048,
   4 layers, bf16, batch 8 x seq 2048, TP over an NCCL group of one): eager, torch.compile,
   kareus.compile split on and off; step ms, first call, peak memory, J/step (NVML), losses.
1c. ``emulated_tp``: the same Llama as one rank of TP 8 on this one GPU, its collectives
   emulated at this GPU's NVLink durations as kareus's hardware model gives them (a side
   stream's timed kernel, waited for by the compute stream): kareus against torch.compile
   with and without Inductor's overlap scheduling; step ms, J/step, peak memory.
2. ``switches``: the clock runtime, with a dry-run controller (nothing is changed), applies
   each instruction's clock in the plan's order, and only once the GPU reaches it: a 50 ms
   sleep kernel queued before the step delays the first switch by at least that long.
3. ``energy``: Zeus's monitor (NVML's counter) over idle and busy windows: idle power,
   busy power, and how much windows of 0.1 s scatter.
4. ``ops``: the GEMMs of the Llama 3.2 3B, 3.1 8B and 3.3 70B tensor-parallel (TP 8) layers
   for one nanobatch (4 x 4096 tokens), causal flash attention forward and backward, and
   memory-bound ops, timed with CUDA events after a warm-up, each against the hardware
   model at the clock its kernels ran at (NVML, sampled in the timed window; the ratio
   per op class is what recalibration needs).
5. ``sizes``: GEMMs (square, the 3B FC1 shape at four token counts, and shapes whose tiles
   leave SMs idle, beside the model's ``matmul_fill``), causal attention
   forward and backward at four sequence lengths, the masked prefix attention of
   ``kareus.models``' context parallelism, and copies of 1 MiB to 1 GiB: achieved
   throughput as a fraction of the peak at the clock read in the timed window, beside the
   model (what efficiencies by size would be fitted to).
6. ``profile``: one partition type of Llama 3.2 3B (TP 8) extracted and measured as
   ``kareus profile`` does, on this one GPU (its collective left out), against the model.
7. ``nccl``: with 2+ GPUs, all-reduce time of a 64 MiB tensor under NCCL CTA limits
   (the SM share) against the model.

It never changes clocks, the power limit or any other setting (it runs under
``KAREUS_CLOCKS=off``, so every kareus clock controller refuses): the clock controller is a
dry run, measurements run at the clock the GPU chooses, read from NVML (with the power) in
every timed window and recorded per row; the model is priced at that clock, never at the
idle clock read before work. It writes
``OUT/summary.md`` and CSVs with a README under ``benchmarks/data/<gpu>/`` (``--data``);
it takes about 5 minutes on one H200.

``--dry-run`` runs every step on the CPU (tiny shapes, gloo for step 6, energy from the
model): the code paths are exercised, no figure is a measurement of a GPU. CI runs it.

Run: python benchmarks/gpu_check.py --out gpu-check
     python benchmarks/gpu_check.py --dry-run --out /tmp/gpu-check
"""

from __future__ import annotations

import argparse
import copy
import csv
import dataclasses
import os
import pathlib
import platform
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch

import kareus
from kareus.hardware import Emulator, GPUSpec, gpu
from kareus.hardware.emulator import matmul_fill
from kareus.hardware.specs import spec_name_for_device
from kareus.ir.costs import CollectiveCost, Knobs, OpCost, PartitionWork
from kareus.jobs.gpu_watch import GpuWatch, Reader, fixed_reader, nvml_reader


@dataclasses.dataclass
class Context:
    """What every step needs: where it runs, what it compares against, where it writes."""

    dry_run: bool
    device: torch.device
    spec: GPUSpec
    clock_mhz: float
    clock_source: str  # "NVML" or "taken as the model's maximum"
    out: pathlib.Path
    data: pathlib.Path
    reader: Reader = dataclasses.field(default=fixed_reader(None))
    """Reads the GPU's SM clock and power (NVML; the dry run: the model's maximum clock)."""

    @property
    def emulator(self) -> Emulator:
        return Emulator(self.spec)

    def watch(self) -> GpuWatch:
        """A watch of this GPU's clock and power, for one timed window."""
        return GpuWatch(self.reader, period_s=0.005 if self.device.type == "cuda" else None)

    def clock_of(self, watch: GpuWatch) -> float:
        """The clock the window's kernels ran at (the clock found before, if none was read)."""
        return watch.clock_mhz or self.clock_mhz

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


@dataclasses.dataclass
class StepResult:
    """One step: passed, failed or skipped, a line saying what it found, and its rows."""

    name: str
    status: str
    summary: str
    rows: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    seconds: float = 0.0


# ---- 0. devices --------------------------------------------------------------------------------


def step_devices(ctx: Context) -> StepResult:
    """Which GPU is which (UUID, NVML and CUDA index), and what a switch's wait costs the CPU.

    Reads only (``kareus doctor`` without ``--try-switch``). The wait: the switch worker
    waits for the GPU to reach a switch point on a CUDA event; a blocking event sleeps, a
    spinning one burns a core. Both are timed over a 50 ms sleep kernel, in CPU seconds of
    the waiting thread (on the CPU, the dry run times a 50 ms sleep in their place).
    """
    from kareus.jobs.doctor import diagnose

    report = diagnose()
    rows: list[dict[str, Any]] = [
        {
            "what": "gpu",
            "uuid": g.uuid,
            "nvml_index": g.nvml_index,
            "cuda_index": g.cuda_index,
            "name": g.name,
            "sm_clock_mhz": g.sm_clock_mhz,
            "power_limit_w": g.power_limit_w,
        }
        for g in report.gpus
    ]
    waits = {}
    for blocking in (True, False):
        _timed_wait(ctx, blocking, seconds=0.005)  # warm-up: CUDA's start-up is not a wait
        cpu, wall = _timed_wait(ctx, blocking)
        waits[blocking] = cpu
        rows.append({"what": "wait", "blocking": blocking, "cpu_s": cpu, "wall_s": wall})
    mapping = ", ".join(
        f"CUDA {g.cuda_index} = NVML {g.nvml_index} = {g.uuid}"
        for g in report.gpus
        if g.cuda_index is not None
    )
    return StepResult(
        "devices",
        "passed" if waits[True] <= max(0.5 * waits[False], 0.01) else "failed",
        f"{len(report.gpus)} GPU(s) by NVML ({report.nvml_error or 'driver ' + str(report.driver)})"
        f"{'; ' + mapping if mapping else ''}; waiting 50 ms on the GPU costs "
        f"{waits[True] * 1e3:.1f} ms of CPU with a blocking event, {waits[False] * 1e3:.1f} ms "
        "spinning (measured)",
        rows,
    )


def _timed_wait(ctx: Context, blocking: bool, seconds: float = 0.05) -> tuple[float, float]:
    """CPU and wall seconds of this thread waiting ``seconds`` for the device."""
    cycles = _sleep_cycles(ctx, seconds) if ctx.device.type == "cuda" else 0
    cpu, wall = time.thread_time(), time.perf_counter()
    if ctx.device.type == "cuda":  # pragma: no cover - needs a GPU
        torch.cuda._sleep(cycles)
        event = torch.cuda.Event(blocking=blocking)
        event.record()
        event.synchronize()
    elif blocking:
        time.sleep(seconds)
    else:  # what a spinning wait does on the CPU
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            pass
    return time.thread_time() - cpu, time.perf_counter() - wall


_CYCLES_PER_S: dict[str, float] = {}


def _sleep_cycles(ctx: Context, seconds: float) -> int:  # pragma: no cover - needs a GPU
    """Cycles of ``torch.cuda._sleep`` that keep the GPU busy ``seconds``, timed by events.

    A cycle count is no duration: it lasts as long as the clock the GPU runs it at, which
    is not the idle clock ``torch.cuda.clock_rate()`` reports before work. The rate is
    measured once, on a 20 ms sleep after a warm-up one, with CUDA events.
    """
    if "rate" not in _CYCLES_PER_S:
        guess = int(0.02 * 1.5e9)
        torch.cuda._sleep(guess)  # warm-up (and lets the clock rise)
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        torch.cuda._sleep(guess)
        end.record()
        end.synchronize()
        _CYCLES_PER_S["rate"] = guess / (begin.elapsed_time(end) / 1e3)
    return int(seconds * _CYCLES_PER_S["rate"])


# ---- 1. compile -------------------------------------------------------------------------------


def _tiny_llama():
    from kareus.models import Llama, LlamaConfig

    torch.manual_seed(0)
    return Llama(LlamaConfig(num_layers=2, hidden_size=64, intermediate_size=128))


def _clock_plan(clocks: list[int]):
    """A plan for one stage, two micro-batches (gradient accumulation), four clocks."""
    from kareus.ir.plan_file import FrontierPoint, Plan, ScheduledInstruction

    picks = [clocks[0], clocks[len(clocks) // 3], clocks[len(clocks) // 2], clocks[-1]]
    order = [("forward", 0), ("backward", 0), ("forward", 1), ("backward", 1)]
    schedule = tuple(
        ScheduledInstruction(0, k, m, float(f), time_s=0.01, dynamic_energy_j=1.0)
        for (k, m), f in zip(order, picks, strict=True)
    )
    return Plan(
        gpu="A100-SXM4-40GB",
        source="modelled",
        policy="iso_time",
        parallel={"tp": 1, "pp": 1, "microbatches": 2},
        frontier=(FrontierPoint(1.0, 1.0),),
        chosen=FrontierPoint(1.0, 1.0),
        schedule=schedule,
        decisions={},
        baselines={},
        static_power_w=80.0,
    )


def step_train_step(ctx: Context) -> StepResult:
    """A training step against torch.compile and eager (``benchmarks/train_step.py``).

    On a GPU: the H200 check's Llama (hidden 2048, 4 layers, bf16, batch 8 x seq 2048),
    TP over an NCCL group of one, 3 interleaved rounds of 3 steps. The dry run times eager
    and kareus's python codegen on a tiny Llama (Inductor compiles take tens of seconds
    on a CPU; ``tests/test_inductor.py`` covers them).
    """
    sys.path.insert(0, str(pathlib.Path(__file__).parent))
    import train_step

    if ctx.dry_run:
        argv = ["--batch", "4", "--seq", "32", "--steps", "1", "--rounds", "1",
                "--variants", "eager,kareus python"]  # fmt: skip
    else:
        argv = ["--device", "cuda", "--preset", "h200", "--steps", "3", "--rounds", "3"]
    rows = train_step.run_one_process(train_step.parse(argv))
    return _step_result("train_step", "measured", ctx, rows)


def _step_result(name: str, what: str, ctx: Context, rows: list[dict[str, str]]) -> StepResult:
    """A ``train_step.py`` run's verdict: every variant trained, losses as eager's."""
    ran = [r for r in rows if r["step_ms_median"] != "nan"]
    diffs = [float(v) for r in ran for k, v in r.items() if k.startswith("loss_rel") and v]
    worst = max(diffs, default=0.0)
    ratios = ", ".join(
        f"{r['variant']} {r['vs_torch_compile']}x" for r in ran if r["vs_torch_compile"]
    )
    ok = len(ran) == len(rows) and worst <= (1e-2 if not ctx.dry_run else 1e-5)
    return StepResult(
        name,
        "passed" if ok else "failed",
        f"{len(ran)}/{len(rows)} variants trained ({what}); step time against "
        f"torch.compile: {ratios or 'no torch.compile in this run'}; losses within "
        f"{worst:.1e} of the reference's",
        rows,
    )


def step_emulated_tp(ctx: Context) -> StepResult:
    """One rank of TP 8 on this GPU, collectives emulated (``train_step.py --emulate-tp``).

    On a GPU: the H200 check's Llama at TP 8's per-rank shapes, bf16, its collectives at
    this GPU's NVLink durations in the hardware model, 3 interleaved rounds of 3 steps. The
    dry run: a tiny Llama as one rank of TP 2 at a given scale (no model trace), kareus's
    python codegen beside eager.
    """
    sys.path.insert(0, str(pathlib.Path(__file__).parent))
    import train_step

    if ctx.dry_run:
        argv = ["--emulate-tp", "2", "--preset", "tiny", "--emulate-scale", "25", "--steps",
                "1", "--rounds", "1", "--variants", "eager,kareus python"]  # fmt: skip
    else:
        variants = "eager,torch.compile,torch.compile overlap,kareus,kareus nanobatches=1"
        argv = ["--device", "cuda", "--emulate-tp", "8", "--link", ctx.spec.name,
                "--preset", "h200", "--steps", "3", "--rounds", "3",
                "--variants", variants]  # fmt: skip
    rows = train_step.run_one_process(train_step.parse(argv))
    return _step_result(
        "emulated_tp", "measured, collectives emulated at modelled durations", ctx, rows
    )


def step_compile(ctx: Context) -> StepResult:
    from kareus.runtime.clocks import DryRunClocks, EmulatedClocks

    ids = torch.randint(0, 128, (4, 4, 32), generator=torch.Generator().manual_seed(0))
    ids = ids.to(ctx.device)
    rows, worst = [], 0.0
    for codegen in ("python", "inductor"):
        for with_plan in (False, True):
            if ctx.dry_run and codegen == "inductor":
                continue  # ~25 s a compile on a CPU: the test suite covers Inductor
            torch._dynamo.reset()
            eager = _tiny_llama().to(ctx.device)
            kwargs: dict[str, Any] = {"codegen": codegen}
            if with_plan:
                kwargs |= {
                    "plan": _clock_plan(ctx.spec.clocks_mhz()),
                    "clocks": DryRunClocks(EmulatedClocks()),
                }
            compiled = kareus.compile(copy.deepcopy(eager), **kwargs)
            start = time.perf_counter()
            loss_diff = grad_diff = 0.0
            for step in range(2):  # two micro-batches per step: the plan's instructions
                for m in range(2):
                    x = ids[2 * step + m]
                    le, lc = eager(x, x), compiled(x, x)
                    le.backward()
                    lc.backward()
                    loss_diff = max(loss_diff, abs(le.item() - lc.item()) / abs(le.item()))
            for p, q in zip(compiled.parameters(), eager.parameters(), strict=True):
                scale = q.grad.abs().max().item() or 1.0
                grad_diff = max(grad_diff, (p.grad - q.grad).abs().max().item() / scale)
            runtime = getattr(kareus.compiler.backend.find_backend(compiled), "runtime", None)
            if runtime is not None:
                runtime.close()
            worst = max(worst, loss_diff, grad_diff)
            rows.append(
                {
                    "codegen": codegen,
                    "plan": with_plan,
                    "max_rel_loss_diff": loss_diff,
                    "max_rel_grad_diff": grad_diff,
                    "compile_and_run_s": round(time.perf_counter() - start, 3),
                }
            )
    ok = worst <= 1e-4
    return StepResult(
        "compile",
        "passed" if ok else "failed",
        f"{len(rows)} configurations against eager, largest relative difference {worst:.2e} "
        f"(fp32; limit 1e-4)",
        rows,
    )


# ---- 2. clock switches ------------------------------------------------------------------------


class _Recorder:
    """A dry-run controller that records when each clock would have been set.

    ``waits_for_gpu=False`` is the check's control: a runtime that sets clocks as the host
    reaches the switch, which must come out early where the real one comes out late.
    """

    name = "recorder"
    journal_name = "dry-run"
    device_key = None
    index = 0

    def __init__(self, clocks: list[int], *, waits_for_gpu: bool = True) -> None:
        self.clocks = clocks
        self.waits_for_gpu = waits_for_gpu
        self.sets: list[tuple[float, float]] = []

    def supported_clocks(self) -> list[int]:
        return list(self.clocks)

    def set(self, freq_mhz: float) -> None:
        self.sets.append((time.perf_counter(), float(freq_mhz)))

    def reset(self) -> None:
        """Nothing was changed."""


def _switch_timing(
    ctx: Context, plan: Any, *, waits: bool
) -> tuple[list[tuple[float, float]], float, float]:
    """Run two micro-batches after a GPU sleep; return the switches (time from the start,
    MHz), the sleep's length on the GPU (CUDA events; 0 without one) and when its last
    kernel was queued (host seconds from the start)."""
    recorder = _Recorder(ctx.spec.clocks_mhz(), waits_for_gpu=waits)
    torch._dynamo.reset()
    model = kareus.compile(_tiny_llama().to(ctx.device), plan=plan, clocks=recorder)
    x = torch.randint(0, 128, (2, 4, 32), generator=torch.Generator().manual_seed(1))
    x = x.to(ctx.device)
    for m in range(2):  # compile and warm up outside the timed step
        model(x[m], x[m]).backward()
    ctx.sync()
    recorder.sets.clear()
    sleep_s = 0.0
    if ctx.device.type == "cuda":  # pragma: no cover - needs a GPU
        cycles = _sleep_cycles(ctx, 0.05)
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start = time.perf_counter()
    if ctx.device.type == "cuda":  # pragma: no cover - the GPU is busy before the first switch
        begin.record()
        torch.cuda._sleep(cycles)
        end.record()
    for m in range(2):
        model(x[m], x[m]).backward()
    queued = time.perf_counter() - start
    ctx.sync()
    if ctx.device.type == "cuda":  # pragma: no cover
        sleep_s = begin.elapsed_time(end) / 1e3
    kareus.compiler.backend.find_backend(model).runtime.close()  # drains the switch queue
    return [(t - start, f) for t, f in recorder.sets], sleep_s, queued


def step_switches(ctx: Context) -> StepResult:
    """The runtime's switches: the plan's clocks in order, each once the GPU reaches it.

    On a GPU a sleep kernel (its length measured with CUDA events, not assumed from a
    cycle count) runs before the step; the runtime's first switch must come after it ends.
    The control, a controller that does not wait for the GPU, must switch before it ends:
    where it does not (the host itself waited), the check cannot tell and fails.
    """
    plan = _clock_plan(ctx.spec.clocks_mhz())
    sets, sleep_s, _queued = _switch_timing(ctx, plan, waits=True)
    want = [s.freq_mhz for s in plan.schedule]
    got = [f for _t, f in sets]
    in_order = _dedup(want) == _dedup(got)
    first = sets[0][0] if sets else float("nan")
    rows = [
        {"run": "runtime", "switch": i, "freq_mhz": f, "after_start_s": round(t, 6)}
        for i, (t, f) in enumerate(sets)
    ]
    if ctx.device.type != "cuda":
        return StepResult(
            "switches",
            "passed" if in_order else "failed",
            f"{len(got)} switches, {'in' if in_order else 'NOT in'} the plan's order "
            f"({' '.join(f'{f:g}' for f in got)}); dry run: no CUDA stream, so whether the "
            "runtime waits for the GPU is checked only on a GPU",
            rows,
        )
    control, _s, _q = _switch_timing(ctx, plan, waits=False)  # pragma: no cover - GPU
    rows += [  # pragma: no cover
        {"run": "control (no wait)", "switch": i, "freq_mhz": f, "after_start_s": round(t, 6)}
        for i, (t, f) in enumerate(control)
    ]
    early = control[0][0] if control else float("nan")  # pragma: no cover
    waited = first >= 0.95 * sleep_s  # pragma: no cover
    telling = early < 0.5 * sleep_s  # pragma: no cover
    verdict = in_order and waited and telling  # pragma: no cover
    return StepResult(  # pragma: no cover
        "switches",
        "passed" if verdict else "failed",
        f"{len(got)} switches, {'in' if in_order else 'NOT in'} the plan's order; first "
        f"switch {first * 1e3:.1f} ms after a GPU sleep of {sleep_s * 1e3:.1f} ms (CUDA "
        f"events); control without waiting switched at {early * 1e3:.1f} ms"
        + ("" if telling else " (the control did not switch early: the check cannot tell)"),
        rows,
    )


def _clocks_seen(rows: list[dict[str, Any]]) -> str:
    """The clocks the rows' kernels ran at, in a few words."""
    clocks = sorted({float(r["clock_mhz"]) for r in rows})
    if len(clocks) == 1:
        return f"{clocks[0]:g} MHz"
    return f"{clocks[0]:g}-{clocks[-1]:g} MHz (median {statistics.median(clocks):g})"


def _dedup(values: list[float]) -> list[float]:
    """Consecutive equal clocks are one switch."""
    return [v for i, v in enumerate(values) if i == 0 or v != values[i - 1]]


# ---- 3. energy --------------------------------------------------------------------------------


def step_energy(ctx: Context) -> StepResult:
    if ctx.device.type != "cuda":
        from kareus.planner.measured import EmulatedProfilingDevice, ProfilerEvaluator
        from kareus.runtime.clocks import DryRunClocks

        # The window logic over the emulated device's coarse counter (modelled figures).
        emu = ctx.emulator
        work = PartitionWork((OpCost("gemm", 4e12, 1e8), OpCost("memory", 0.0, 4e9)), None)
        rows = []
        for window in (0.0, 0.1, 1.0):
            prof = ProfilerEvaluator(
                EmulatedProfilingDevice(emu), DryRunClocks(), min_window_s=window
            )
            got = prof.partition(work, Knobs(ctx.clock_mhz, 0, launch_slot=None))
            want = emu.partition(work, Knobs(ctx.clock_mhz, 0, launch_slot=None))
            rows.append(
                {
                    "window_s": window,
                    "energy_j": got.energy_j,
                    "model_j": want.energy_j,
                    "source": "modelled",
                }
            )
        return StepResult(
            "energy",
            "passed" if abs(rows[-1]["energy_j"] / rows[-1]["model_j"] - 1) < 0.12 else "failed",
            f"dry run: 1 s windows over the emulated counter read "
            f"{rows[-1]['energy_j'] / rows[-1]['model_j']:.3f} of the modelled energy "
            f"(0 s windows: {rows[0]['energy_j']:.3g} J); idle power modelled "
            f"{ctx.spec.calibration.static_power_w:.0f} W",
            rows,
        )
    from zeus.monitor import ZeusMonitor  # pragma: no cover - needs a GPU

    index = ctx.device.index or 0
    monitor = ZeusMonitor(gpu_indices=[index])
    rows = []

    a = torch.randn(8192, 8192, device=ctx.device, dtype=torch.bfloat16)
    for _ in range(20):  # warm-up: cuBLAS's start-up, and the clock and power settle
        a @ a
    ctx.sync()

    def window(name: str, seconds: float, busy: bool) -> float:
        with ctx.watch() as watch:
            monitor.begin_window(name)
            end = time.perf_counter() + seconds
            while time.perf_counter() < end:
                if busy:
                    a @ a
                    ctx.sync()
                else:
                    time.sleep(0.01)
            m = monitor.end_window(name)
        power = m.total_energy / m.time
        rows.append(
            {
                "window": name,
                "seconds": m.time,
                "energy_j": m.total_energy,
                "power_w": power,
                "nvml_power_w": watch.power_w,  # NVML's power samples in the window
                "clock_mhz": watch.clock_mhz,
                "clock_range_mhz": "-".join(f"{c:g}" for c in watch.clock_range or ()),
                "source": "measured",
            }
        )
        return power

    idle = window("idle", 2.0, busy=False)
    busy = window("busy-gemm", 2.0, busy=True)
    short = [window(f"idle-0.1s-{i}", 0.1, busy=False) for i in range(10)]
    spread = statistics.pstdev(short) / statistics.mean(short) if statistics.mean(short) else 0
    return StepResult(
        "energy",
        "passed" if busy > idle > 0 else "failed",
        f"idle {idle:.0f} W (model's static power {ctx.spec.calibration.static_power_w:.0f} W), "
        f"busy GEMM {busy:.0f} W at {rows[1]['clock_mhz']} MHz (TDP {ctx.spec.tdp_w:.0f} W); "
        "0.1 s idle windows scatter "
        f"{spread * 100:.0f} % (measured)",
        rows,
    )


# ---- 4. op classes ----------------------------------------------------------------------------

SHAPES = {  # hidden, intermediate, heads, kv heads (TP 8 shards)
    "llama3.2-3b": (3072, 8192, 24, 8),
    "llama3.1-8b": (4096, 14336, 32, 8),
    "llama3.3-70b": (8192, 28672, 64, 8),
}


def _costs(fn: Callable[..., Any], inputs: list[torch.Tensor]) -> tuple[OpCost, ...]:
    """kareus's own cost of each op ``fn`` runs (traced on fake tensors, as the passes do)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from kareus.passes.annotate_costs import annotate_node

    gm = make_fx(fn, tracing_mode="fake")(*inputs)
    costs = [annotate_node(n) for n in gm.graph.nodes if n.op == "call_function"]
    return tuple(c for c in costs if c.op_class != "view")


def _time(
    ctx: Context, fn: Callable[..., Any], inputs: list[torch.Tensor], window_s: float
) -> tuple[float, GpuWatch]:
    """Seconds per call of ``fn`` over a window of ``window_s``, after a warm-up; and the
    watch of the GPU's clock and power in that window (sampled after each synchronisation,
    where the kernels have just run, and on a thread)."""
    for _ in range(3):  # warm-up: first-call costs, and the clock rises from idle
        fn(*inputs)
    ctx.sync()
    reps = 0
    with ctx.watch() as watch:
        start = time.perf_counter()
        if ctx.device.type == "cuda":
            begin = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            begin.record()
        while True:
            fn(*inputs)
            reps += 1
            if reps % 10 == 0:
                ctx.sync()
                watch.sample()
                if time.perf_counter() - start >= window_s:
                    break
        if ctx.device.type == "cuda":
            end.record()
            end.synchronize()
            return begin.elapsed_time(end) / 1e3 / reps, watch
    return (time.perf_counter() - start) / reps, watch


def _causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)


def _causal_grads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Any:
    out = _causal(q, k, v)
    return torch.autograd.grad(out, (q, k, v), torch.ones_like(out))


def _op_cases(ctx: Context) -> list[tuple[str, str, str, Callable[..., Any], list[torch.Tensor]]]:
    dt = torch.bfloat16 if ctx.device.type == "cuda" else torch.float32
    scale = 1 if ctx.device.type == "cuda" else 16
    tokens, seq, tp = 4 * 4096 // scale, 4096 // scale, 8
    gen = torch.Generator().manual_seed(0)

    def t(*shape: int, grad: bool = False) -> torch.Tensor:
        x = torch.randn(*shape, generator=gen).to(ctx.device, dt)
        return x.requires_grad_(grad)

    cases = []
    for model, (h, i, heads, kv) in SHAPES.items():
        h, i = h // scale, i // scale
        hd = 128 // min(scale, 4)
        qkv = (heads + 2 * kv) * hd // tp
        for name, (m, k, n) in {
            "qkv": (tokens, h, qkv),
            "out_proj": (tokens, heads * hd // tp, h),
            "fc1": (tokens, h, 2 * i // tp),
            "fc2": (tokens, i // tp, h),
        }.items():
            cases.append((model, f"gemm {name}", "gemm", torch.mm, [t(m, k), t(k, n)]))
    # Attention of the 3B layer (24 heads / TP 8 = 3 per rank), causal, 4 sequences.
    heads, hd, b = 3, 128 // min(scale, 4), 4
    q, k, v = (t(b, heads, seq, hd, grad=True) for _ in range(3))
    cases.append(("llama3.2-3b", "attention forward", "attention", _causal, [q, k, v]))
    cases.append(
        ("llama3.2-3b", "attention forward+backward", "attention", _causal_grads, [q, k, v])
    )
    h = 3072 // scale
    x, w = t(tokens, h), t(h)

    def rmsnorm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * w

    def swiglu(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.silu(a) * b

    cases.append(("llama3.2-3b", "rmsnorm (eager ops)", "memory", rmsnorm, [x, w]))
    cases.append(("llama3.2-3b", "swiglu (eager ops)", "memory", swiglu, [x, t(tokens, h)]))
    return cases


def step_ops(ctx: Context) -> StepResult:
    emu = ctx.emulator
    window = 0.3 if ctx.device.type == "cuda" else 0.02
    rows = []
    for model, name, cls, fn, inputs in _op_cases(ctx):
        costs = _costs(fn, inputs)
        measured, watch = _time(ctx, fn, inputs, window)
        clock = ctx.clock_of(watch)  # the clock its kernels ran at, not the one before
        modelled = emu.ops(costs, clock).time_s
        rows.append(
            {
                "model": model,
                "op": name,
                "class": cls,
                "kernels_costed": len(costs),
                "gflop": round(sum(c.flops for c in costs) / 1e9, 3),
                "mbytes": round(sum(c.bytes for c in costs) / 1e6, 3),
                "clock_mhz": clock,
                "clock_range_mhz": "-".join(f"{c:g}" for c in watch.clock_range or ()),
                "power_w": watch.power_w if watch.power_w is not None else "",
                "measured_s": measured,
                "modelled_s": modelled,
                "ratio": measured / modelled,
            }
        )
    per_class = {
        cls: statistics.median(r["ratio"] for r in rows if r["class"] == cls)
        for cls in dict.fromkeys(r["class"] for r in rows)
    }
    what = (
        "CPU against the GPU model: not a fidelity figure" if ctx.dry_run else "measured / modelled"
    )
    return StepResult(
        "ops",
        "passed",
        f"{len(rows)} ops at {_clocks_seen(rows)} (read in each timed window); median time "
        f"ratio per class at that clock ({what}): "
        + ", ".join(f"{c} {v:.2f}" for c, v in per_class.items()),
        rows,
    )


def _size_cases(ctx: Context) -> list[tuple[str, str, str, Callable[..., Any], list[torch.Tensor]]]:
    """GEMMs, causal attention and copies over a range of sizes (what efficiency-by-size needs)."""
    cuda = ctx.device.type == "cuda"
    dt = torch.bfloat16 if cuda else torch.float32
    scale = 1 if cuda else 16
    gen = torch.Generator().manual_seed(1)

    def t(*shape: int, grad: bool = False) -> torch.Tensor:
        x = torch.randn(*shape, generator=gen).to(ctx.device, dt)
        return x.requires_grad_(grad)

    cases = []
    for n in (1024, 2048, 4096, 8192):
        n //= scale
        cases.append(("gemm", f"square {n}", "gemm", torch.mm, [t(n, n), t(n, n)]))
    for m in (1024, 4096, 16384, 32768):  # the 3B layer's FC1 at TP 4 (k 3072, n 4096)
        m //= scale
        a, b = t(m, 3072 // scale), t(3072 // scale, 4096 // scale)
        cases.append(("gemm", f"fc1 tokens {m}", "gemm", torch.mm, [a, b]))
    # Tile and wave quantization (the model's matmul_fill): one column of 128 x 128 tiles
    # filling the SMs exactly, then one tile more (a second, nearly empty wave), and the
    # 3B layer's narrowest matmuls at TP 8 (key projection: n 128; its weight gradient).
    sms = ctx.spec.sm_count
    for rows, what in ((sms, "one wave"), (sms + 1, "one wave + 1 tile")):
        a, b = t(128 * rows // scale, 4096 // scale), t(4096 // scale, 128 // scale)
        cases.append(("wave", f"{what}: {128 * rows // scale} x 128", "gemm", torch.mm, [a, b]))
    a, b = t(16384 // scale, 3072 // scale), t(3072 // scale, 128 // scale)
    cases.append(("wave", "key projection 16384 x 128", "gemm", torch.mm, [a, b]))
    a, b = t(128 // scale, 16384 // scale), t(16384 // scale, 3072 // scale)
    cases.append(("wave", "its weight gradient 128 x 3072", "gemm", torch.mm, [a, b]))
    hd = 128 // min(scale, 4)
    for seq in (1024, 2048, 4096, 8192):  # 32768 tokens, 6 heads (3B at TP 4)
        seq //= scale
        qkv = [t(32768 // scale // seq, 6, seq, hd, grad=True) for _ in range(3)]
        cases.append(("attention", f"causal forward seq {seq}", "attention", _causal, qkv))
        cases.append(("attention", f"causal fwd+bwd seq {seq}", "attention", _causal_grads, qkv))
    # kareus.models' context-parallel attention: the last of four 1024-token chunks against
    # its 4096-key prefix through a mask (PyTorch's memory-efficient kernel, not flash).
    c = 1024 // scale
    q = t(8, 6, c, hd, grad=True)
    k, v = (t(8, 6, 4 * c, hd, grad=True) for _ in range(2))
    mask = torch.ones(c, 4 * c, dtype=torch.bool, device=ctx.device).tril(3 * c)

    def prefix(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, m: torch.Tensor) -> Any:
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=m)

    def prefix_grads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, m: torch.Tensor) -> Any:
        out = prefix(q, k, v, m)
        return torch.autograd.grad(out, (q, k, v), torch.ones_like(out))

    name = f"masked prefix {c} x {4 * c}"
    cases.append(("attention", f"{name} forward", "attention", prefix, [q, k, v, mask]))
    cases.append(("attention", f"{name} fwd+bwd", "attention", prefix_grads, [q, k, v, mask]))
    for mib in (1, 16, 256, 1024):
        x = t(mib * 2**20 // 2 // scale)
        size = x.numel() * x.element_size() / 2**20
        cases.append(("memory", f"copy {size:g} MiB", "memory", torch.clone, [x]))
    return cases


def step_sizes(ctx: Context) -> StepResult:
    """Achieved throughput by size, against the peak at the clock read in the window."""
    emu = ctx.emulator
    window = 0.3 if ctx.device.type == "cuda" else 0.02
    rows = []
    for family, name, cls, fn, inputs in _size_cases(ctx):
        costs = _costs(fn, inputs)
        measured, watch = _time(ctx, fn, inputs, window)
        clock = ctx.clock_of(watch)
        speed = clock / ctx.spec.clock_max_mhz
        flops, nbytes = sum(c.flops for c in costs), sum(c.bytes for c in costs)
        if cls == "memory":
            achieved = nbytes / measured / 1e9
            peak = ctx.spec.memory_bandwidth_gbs
            unit = "GB/s"
        else:
            achieved = flops / measured / 1e12
            peak = ctx.spec.peak_flops("bf16") / 1e12 * speed
            unit = "TFLOP/s"
        fills = [matmul_fill(c.dims, ctx.spec.sm_count) for c in costs if c.dims]
        rows.append(
            {
                "family": family,
                "op": name,
                "class": cls,
                "modelled_fill": round(min(fills), 3) if fills else "",
                "gflop": round(flops / 1e9, 3),
                "mbytes": round(nbytes / 1e6, 3),
                "clock_mhz": clock,
                "power_w": watch.power_w if watch.power_w is not None else "",
                "measured_s": measured,
                "modelled_s": emu.ops(costs, clock).time_s,
                "achieved": achieved,
                "unit": unit,
                "fraction_of_peak": achieved / peak,
            }
        )
    what = "CPU against the GPU's peak: not a GPU figure" if ctx.dry_run else "measured"
    parts = []
    for family in dict.fromkeys(r["family"] for r in rows):
        fam = [r for r in rows if r["family"] == family]
        parts.append(
            f"{family} {min(r['fraction_of_peak'] for r in fam) * 100:.0f}-"
            f"{max(r['fraction_of_peak'] for r in fam) * 100:.0f} % of peak"
        )
    return StepResult(
        "sizes",
        "passed",
        f"{len(rows)} sizes at {_clocks_seen(rows)} (read in each timed window; {what}): "
        + ", ".join(parts),
        rows,
    )


# ---- 5. one partition, as kareus profile measures it ------------------------------------------


def step_profile(ctx: Context) -> StepResult:
    from kareus.jobs.program_device import Piece, ProgramDevice
    from kareus.jobs.trace import Workload, fake_world, trace_stage
    from kareus.planner.knobs import _digest
    from kareus.planner.measured import ProfilerEvaluator
    from kareus.runtime.clocks import DryRunClocks

    if ctx.dry_run:
        work = Workload(model="tiny", tp=2, microbatch_size=4, seq_len=64)
    else:  # pragma: no cover - needs a GPU
        work = Workload(model="llama3.2-3b", tp=8, microbatch_size=4, seq_len=4096)
    start = time.perf_counter()
    with fake_world(work.tp, work.cp) as groups:
        traced = trace_stage(
            work,
            1 if work.pp > 1 else 0,
            layers=min(4, work.config.num_layers),
            groups=groups,
            extract=True,
            device=ctx.device.type,
        )
    trace_s = time.perf_counter() - start
    key = next(k for k, t in traced.pset.types.items() if t.collective is not None)
    ptype = traced.pset.types[key]
    type_work = PartitionWork(ptype.compute, ptype.collective)
    static = ctx.spec.calibration.static_power_w
    cuda = ctx.device.type == "cuda"
    device = ProgramDevice(
        {_digest(type_work): [Piece(traced.programs[key])]},
        {"tp": None},  # one GPU: the collective is left out
        ctx.device,
        model=None if cuda else ctx.emulator,
        static_power_w=static,
        gpu_index=ctx.device.index or 0,
    )
    profiler = ProfilerEvaluator(
        device,
        DryRunClocks(),
        lock_clocks=False,
        static_power_w=static,
        min_window_s=1.0 if cuda else 0.05,
    )
    with ctx.watch() as watch:
        got = profiler.partition(type_work, Knobs(ctx.clock_mhz, 0, launch_slot=None))
        watch.sample()
    clock = ctx.clock_of(watch)  # the clock the partition ran at, not the one before
    knobs = Knobs(clock, 0, launch_slot=None)
    want = ctx.emulator.partition(PartitionWork(ptype.compute, None), knobs)
    row = {
        "workload": work.describe(),
        "type": key,
        "ops": len(ptype.compute),
        "clock_mhz": clock,
        "measured_s": got.time_s,
        "modelled_s": want.time_s,
        "time_ratio": got.time_s / want.time_s,
        "energy_j": got.energy_j,
        "modelled_energy_j": want.energy_j,
        "energy_ratio": got.energy_j / want.energy_j,
        "energy_source": device.energy_source,
        "trace_s": round(trace_s, 1),
    }
    return StepResult(
        "profile",
        "passed",
        f"{key} of {work.describe()} ({len(ptype.compute)} ops, collective left out) at "
        f"{clock:g} MHz (read while it ran): time "
        f"{got.time_s * 1e3:.3f} ms measured vs {want.time_s * 1e3:.3f} ms modelled "
        f"({row['time_ratio']:.2f}x), energy {row['energy_ratio']:.2f}x "
        f"({device.energy_source})",
        [row],
    )


# ---- 6. NCCL all-reduce under CTA limits ------------------------------------------------------


def _nccl_rank(rank: int, world: int, port: int, nbytes: int, shares: list[int], out: str) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    cuda = torch.cuda.is_available() and torch.cuda.device_count() >= world
    if cuda:  # pragma: no cover - needs 2 GPUs
        torch.cuda.set_device(rank)
    backend = "nccl" if cuda else "gloo"
    dist.init_process_group(backend, rank=rank, world_size=world)
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    buf = torch.ones(nbytes // 2, dtype=torch.bfloat16 if cuda else torch.float16, device=device)
    rows = []
    for share in shares:
        options = None
        if cuda:  # pragma: no cover - needs 2 GPUs
            options = dist.ProcessGroupNCCL.Options()
            options.config.max_ctas = share
            options.config.min_ctas = min(share, options.config.min_ctas or share)
        group = dist.new_group(list(range(world)), backend=backend, pg_options=options)
        for _ in range(3):
            dist.all_reduce(buf, group=group)
        if cuda:  # pragma: no cover
            torch.cuda.synchronize()
        start, reps = time.perf_counter(), 10
        for _ in range(reps):
            dist.all_reduce(buf, group=group)
        if cuda:  # pragma: no cover
            torch.cuda.synchronize()
        rows.append({"sm_share": share, "measured_s": (time.perf_counter() - start) / reps})
    if rank == 0:
        torch.save(rows, out)
    dist.destroy_process_group()


def step_nccl(ctx: Context) -> StepResult:
    import tempfile

    import torch.multiprocessing as mp

    from kareus.testing import free_port

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if not ctx.dry_run and gpus < 2:
        return StepResult("nccl", "skipped", f"{gpus} GPU(s): the all-reduce needs 2")
    nbytes = 64 * 2**20 if not ctx.dry_run else 2**20
    shares = [1, 2, 4, 8, 16, 32]
    with tempfile.TemporaryDirectory() as tmp:
        out = f"{tmp}/rows.pt"
        mp.start_processes(
            _nccl_rank, args=(2, free_port(), nbytes, shares, out), nprocs=2, start_method="spawn"
        )
        rows = torch.load(out)
    emu = ctx.emulator
    for row in rows:
        coll = CollectiveCost("all_reduce", float(nbytes), 2)
        est = emu.partition(PartitionWork((), coll), Knobs(ctx.clock_mhz, row["sm_share"], None))
        row |= {"bytes": nbytes, "modelled_s": est.time_s, "ratio": row["measured_s"] / est.time_s}
    backend = "gloo on the CPU (the CTA limit has no effect)" if ctx.dry_run else "NCCL"
    return StepResult(
        "nccl",
        "passed",
        f"{backend}: {nbytes / 2**20:g} MiB all-reduce over 2 ranks, "
        + ", ".join(f"{r['sm_share']} SMs {r['measured_s'] * 1e3:.2f} ms" for r in rows),
        rows,
    )


# ---- driver -----------------------------------------------------------------------------------

STEPS = (
    step_devices,
    step_compile,
    step_train_step,
    step_emulated_tp,
    step_switches,
    step_energy,
    step_ops,
    step_sizes,
    step_profile,
    step_nccl,
)


def _context(args: argparse.Namespace) -> Context:
    if args.dry_run:
        device = torch.device("cpu")
        spec = gpu(args.gpu or "a100-40gb")
        clock, how = float(spec.clock_max_mhz), "taken as the model's maximum (dry run)"
        data = args.data or args.out / "data" / "dry-run"
    else:
        if not torch.cuda.is_available():
            raise SystemExit(
                "gpu_check: no CUDA GPU here; run it on a GPU machine, or with --dry-run to "
                "exercise every step on the CPU"
            )
        device = torch.device("cuda", 0)  # pragma: no cover - needs a GPU
        name = args.gpu or spec_name_for_device(torch.cuda.get_device_name(device))
        if name is None:
            raise SystemExit(
                f"gpu_check: kareus has no model of {torch.cuda.get_device_name(device)}; "
                "name the closest with --gpu"
            )
        spec = gpu(name)
        reader = nvml_reader(0) or fixed_reader(None)
        found = reader()[0]
        clock, how = (
            (found, "read from NVML")
            if found
            else (float(spec.clock_max_mhz), "taken as the model's maximum (NVML unreadable)")
        )
        data = args.data or pathlib.Path(__file__).parent / "data" / spec.name.lower()
        return Context(args.dry_run, device, spec, clock, how, args.out, pathlib.Path(data), reader)
    reader = fixed_reader(clock)  # the dry run: the model's clock stands for a reading
    return Context(args.dry_run, device, spec, clock, how, args.out, pathlib.Path(data), reader)


def _write_csv(path: pathlib.Path, rows: list[dict[str, Any]]) -> None:
    with path.open("w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(dict.fromkeys(k for r in rows for k in r)))
        writer.writeheader()
        writer.writerows(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("gpu-check"))
    parser.add_argument("--dry-run", action="store_true", help="every step on the CPU")
    parser.add_argument("--gpu", help="kareus GPU type to compare with (default: detected)")
    parser.add_argument("--data", type=pathlib.Path, help="directory for the CSVs")
    parser.add_argument(
        "--steps",
        help="comma-separated subset of: "
        + ", ".join(s.__name__.removeprefix("step_") for s in STEPS),
    )
    args = parser.parse_args(argv)
    # Whatever a step asks, kareus changes no setting of this GPU in this process (and the
    # processes it starts): every real clock controller refuses, clocks="auto" is a dry run.
    os.environ["KAREUS_CLOCKS"] = "off"
    ctx = _context(args)
    ctx.out.mkdir(parents=True, exist_ok=True)
    ctx.data.mkdir(parents=True, exist_ok=True)
    wanted = set(args.steps.split(",")) if args.steps else None
    results = []
    for step in STEPS:
        name = step.__name__.removeprefix("step_")
        if wanted is not None and name not in wanted:
            continue
        print(f"[{name}] running", flush=True)
        start = time.perf_counter()
        try:
            result = step(ctx)
        except Exception as err:  # every step reports, whatever another did
            traceback.print_exc()
            result = StepResult(name, "failed", f"{type(err).__name__}: {err}")
        result.seconds = time.perf_counter() - start
        if result.rows:
            _write_csv(ctx.data / f"{name}.csv", result.rows)
        print(f"[{name}] {result.status} in {result.seconds:.1f} s: {result.summary}", flush=True)
        results.append(result)
    device = "CPU (dry run)" if ctx.dry_run else torch.cuda.get_device_name(ctx.device)
    summary = [
        f"# kareus GPU check{' (dry run: no figure here measures a GPU)' if ctx.dry_run else ''}",
        "",
        f"Device: {device}; compared with kareus's model of {ctx.spec.name}; SM clock "
        f"{ctx.clock_mhz:g} MHz before any work ({ctx.clock_source}; each step prices the "
        f"clock read while its kernels ran); torch {torch.__version__}, "
        f"python {platform.python_version()}. No clock, power limit or other setting was "
        "changed (the run sets KAREUS_CLOCKS=off: every kareus clock controller refuses). "
        "CSVs: " + str(ctx.data),
        "",
        "| step | status | seconds | what it found |",
        "|---|---|---|---|",
    ]
    summary += [f"| {r.name} | {r.status} | {r.seconds:.1f} | {r.summary} |" for r in results]
    (ctx.out / "summary.md").write_text("\n".join(summary) + "\n")
    (ctx.data / "README.md").write_text(
        f"# GPU check data: {device}\n\nWritten by `benchmarks/gpu_check.py"
        f"{' --dry-run' if ctx.dry_run else ''}` (see its docstring for each step). Times are "
        f"measured on {device}; `clock_mhz` is the SM clock read (NVML) while each row's "
        f"kernels ran, and `modelled_*` columns are kareus's model of {ctx.spec.name} at "
        "that clock; `ratio` is measured / modelled. Energies say their source.\n\n"
        + "\n".join(f"- `{r.name}.csv`: {r.summary}" for r in results if r.rows)
        + "\n"
    )
    print(f"wrote {ctx.out / 'summary.md'} and CSVs in {ctx.data}")
    return 1 if any(r.status == "failed" for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
