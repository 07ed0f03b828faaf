"""A training step of kareus.compile against torch.compile and eager, side by side.

A ``kareus.models.Llama`` with tensor parallelism over ``--tp`` ranks (gloo on CPU, NCCL on
GPUs; ``--tp 1`` is a group of one, so every layer holds its all-reduces and kareus splits
it as it would at TP 8) trains with AdamW under each variant, from the same weights and on
the same batches:

- ``eager``: the model as written;
- ``torch.compile``: ``torch.compile(model)`` (Inductor);
- ``kareus``: ``kareus.compile(model)``, the defaults (Inductor, the nanobatch split);
- ``kareus nanobatches=1``: the same without the split;
- ``kareus nanobatches=2``: the split forced on every block that can be split;
- ``torch.compile overlap``: torch.compile with Inductor's own overlap scheduling
  (``aten_distributed_optimizations.enable_overlap_scheduling``), what a user would switch on
  instead of kareus; ``torch.compile reorder``: its older ``reorder_for_compute_comm_overlap``;
- ``kareus python``: ``codegen="python"``, the debugging codegen (``--python``).

``kareus`` splits a block only where kareus's cost model for this device predicts the step
gets faster (``kareus.explain`` says per block why); ``nanobatches=2`` shows what the split
itself costs or gains.

``--emulate-tp N --link a100-nvlink`` runs one rank of TP N in this process over a process
group whose collectives return their true result but complete after the duration kareus's
hardware model gives them on that link, scaled to this device's speed (``emulated_tp.py``):
the overlap measured at TP N's shapes and communication times on one machine. Its figures
say "collectives emulated at modelled durations".

The variants' steps are timed in interleaved rounds (each round runs every variant's steps
in turn), so that a machine's drift hits all alike; a step is forward, backward and the
optimizer step, ended by a device synchronisation. Printed and written as CSV (``--out``):
first call s (the compile), step ms (median over rounds), the ratio to torch.compile's step,
peak memory (CUDA: ``max_memory_allocated``), J/step (NVML's energy counter through Zeus,
on a GPU) and the losses' largest relative difference from eager's. Every figure is
**measured** on this machine; nothing is modelled. It changes no clock or other setting of
a GPU (kareus plans nothing at compile time here: no ``gpu=``, and planned clocks would be a
dry run anyway).

Run: python benchmarks/train_step.py                     # CPU, TP 1 (gloo), small Llama
     python benchmarks/train_step.py --tp 2              # CPU, two gloo ranks
     python benchmarks/train_step.py --device cuda --preset h200   # one GPU (NCCL), bf16
     python benchmarks/train_step.py --device cuda --tp 8 --preset h200
     python benchmarks/train_step.py --emulate-tp 8 --link a100-nvlink [--comm-scale 0.5]
     python benchmarks/train_step.py --device cuda --emulate-tp 8 --link h200-nvlink --preset h200
"""

from __future__ import annotations

import argparse
import copy
import csv
import dataclasses
import os
import pathlib
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

PRESETS: dict[str, dict[str, Any]] = {
    # CPU: small enough for two cores, large enough that the GEMMs dominate.
    "small": dict(
        hidden_size=256, intermediate_size=1024, num_layers=4, num_heads=8,
        num_kv_heads=4, vocab_size=4096, batch=8, seq=256, dtype="float32",
    ),
    # framework-bound: kareus's and Dynamo's per-call work, not the kernels, set the step
    "tiny": dict(
        hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
        num_kv_heads=2, vocab_size=256, batch=4, seq=32, dtype="float32",
    ),
    # --emulate-tp: the full (TP 1) size of the model one rank of which runs here
    "emulate": dict(
        hidden_size=1024, intermediate_size=4096, num_layers=4, num_heads=16,
        num_kv_heads=8, vocab_size=32000, batch=8, seq=1024, dtype="float32",
    ),
    # The H200 check of 2026-12-04 (docs/gpu.md): hidden 2048, 4 layers, batch 8 x 2048.
    "h200": dict(
        hidden_size=2048, intermediate_size=8192, num_layers=4, num_heads=16,
        num_kv_heads=8, vocab_size=32000, batch=8, seq=2048, dtype="bfloat16",
    ),
}  # fmt: skip

VARIANTS = (
    "eager",
    "torch.compile",
    "torch.compile overlap",
    "torch.compile reorder",
    "kareus",
    "kareus nanobatches=2",
    "kareus nanobatches=1",
    "kareus python",
)
DEFAULT_VARIANTS = (
    "eager",
    "torch.compile",
    "kareus",
    "kareus nanobatches=2",
    "kareus nanobatches=1",
)
"""Run unless ``--variants`` names others (``--python`` adds ``kareus python``)."""
EMULATED_VARIANTS = tuple(v for v in VARIANTS if v != "kareus python")
"""Run with ``--emulate-tp`` unless ``--variants`` names others."""


@dataclasses.dataclass
class Result:
    """One variant's figures (all measured)."""

    variant: str
    first_call_s: float = float("nan")
    step_ms: list[float] = dataclasses.field(default_factory=list)
    peak_gib: float | None = None
    energy_j: list[float] = dataclasses.field(default_factory=list)
    losses: list[float] = dataclasses.field(default_factory=list)
    note: str = ""
    overlapped_ms: list[float] = dataclasses.field(default_factory=list)
    """Per timed step, the emulated collectives' time in flight before a wait (emulation)."""
    calls: dict[tuple[str, int], tuple[float, float]] = dataclasses.field(default_factory=dict)
    """(kind, bytes) -> (calls per step, seconds each) of the emulated collectives."""

    @property
    def median_ms(self) -> float:
        """The median step time over the timed rounds."""
        return statistics.median(self.step_ms) if self.step_ms else float("nan")


def _make(variant: str, model: torch.nn.Module) -> Callable[..., Any]:
    import kareus

    if variant == "eager":
        return model
    if variant == "torch.compile":
        return torch.compile(model)
    if variant == "torch.compile overlap":
        from emulated_tp import inductor_overlap_options

        device = next(model.parameters()).device.type
        return torch.compile(model, options=inductor_overlap_options(device))
    if variant == "torch.compile reorder":
        return torch.compile(model, options={"reorder_for_compute_comm_overlap": True})
    options: dict[str, Any] = {"codegen": "inductor"}
    if variant.startswith("kareus nanobatches="):
        options["nanobatches"] = int(variant.rsplit("=", 1)[1])
    if variant == "kareus python":
        options["codegen"] = "python"
    return kareus.compile(model, **options)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class _Energy:
    """J over a window: NVML's energy counter of this GPU (through Zeus), else nothing."""

    def __init__(self, device: torch.device) -> None:
        self.monitor = None
        if device.type != "cuda":
            return
        try:
            from zeus.monitor import ZeusMonitor
        except ImportError:
            return
        self.index = device.index or 0
        self.monitor = ZeusMonitor(gpu_indices=[self.index], cpu_indices=[])

    def __call__(self, run: Callable[[], None]) -> float | None:
        if self.monitor is None:
            run()
            return None
        self.monitor.begin_window("step")
        run()
        measured = self.monitor.end_window("step")
        return float(measured.gpu_energy[self.index])


def _rank(
    rank: int, world: int, args: argparse.Namespace, port: int, out: str
) -> list[dict[str, str]]:
    """Run one rank of the benchmark; rank 0 reports and returns the rows."""
    device = torch.device("cuda", rank) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    emulation = None
    if args.emulate_tp:  # traced before this process has a process group (tracing makes one)
        from emulated_tp import Emulation, modelled_step

        cfg, batch, seq, dtype = _preset(args, emulate=True)
        modelled = None
        if not args.emulate_scale:
            print(f"  tracing the model at TP {args.emulate_tp} to price it on {args.link} "
                  "(modelled)...", file=sys.stderr)  # fmt: skip
            modelled = modelled_step(cfg, args.emulate_tp, batch, seq, args.link)
        # the emulated GPU moves bf16: an fp32 run's collectives move twice its bytes
        scale = 2 / torch.empty((), dtype=dtype).element_size()
        emulation = Emulation.make(args.link, args.emulate_tp, args.comm_scale, modelled, scale)
        emulation.scale = args.emulate_scale
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group(
        "nccl" if device.type == "cuda" else "gloo", rank=rank, world_size=world
    )
    try:
        results = _measure(device, args, dist.group.WORLD, emulation)
        return _report(results, args, world, out, emulation) if rank == 0 else []
    finally:
        dist.destroy_process_group()


def _preset(args: argparse.Namespace, *, emulate: bool) -> tuple[Any, int, int, torch.dtype]:
    """The full-size config, batch, sequence and dtype the arguments ask for."""
    from kareus.models import LlamaConfig

    preset = dict(PRESETS["emulate" if emulate and args.preset == "small" else args.preset])
    batch, seq = preset.pop("batch"), preset.pop("seq")
    dtype = getattr(torch, preset.pop("dtype", "float32"))
    args.batch = args.batch or batch
    args.seq = args.seq or seq
    return LlamaConfig(**preset), args.batch, args.seq, dtype


def _model_and_data(
    device: torch.device, args: argparse.Namespace, group: Any, emulation: Any
) -> tuple[torch.nn.Module, list[Any]]:
    """The model every variant copies (one rank of it where emulating), and the batches."""
    from kareus.models import Llama
    from kareus.testing import token_batches

    cfg, _batch, _seq, dtype = _preset(args, emulate=emulation is not None)
    run_cfg = cfg
    if emulation is not None:
        from emulated_tp import per_rank

        run_cfg = per_rank(cfg, emulation.tp)
        group = emulation.group.group_name
    torch.manual_seed(0)
    with torch.device(device):
        base = Llama(run_cfg, tp_group=group).to(dtype)
    data = [
        (ids.to(device), labels.to(device))
        for ids, labels in token_batches(
            args.steps, args.batch, args.seq, run_cfg.vocab_size, seed=1
        )
    ]
    return base, data


def _measure(
    device: torch.device, args: argparse.Namespace, group: Any, emulation: Any = None
) -> list[Result]:
    base, data = _model_and_data(device, args, group, emulation)
    default = EMULATED_VARIANTS if emulation is not None else DEFAULT_VARIANTS
    variants = list(args.variants or default)
    if args.python and "kareus python" not in variants:
        variants.append("kareus python")
    if emulation is not None and "torch.compile" in variants:
        # torch.compile first: its compute, measured with collectives completing at once,
        # sets the scale of every emulated duration before kareus prices its split
        variants.remove("torch.compile")
        variants.insert(0, "torch.compile")
    results = {v: Result(v) for v in variants}
    runs: dict[str, tuple[Callable[..., Any], torch.optim.Optimizer]] = {}
    energy = _Energy(device)
    for v in variants:  # first call: the compile, then a warm-up step
        model = copy.deepcopy(base)
        fn = _make(v, model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        runs[v] = (fn, opt)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        _sync(device)
        start = time.perf_counter()
        try:
            _step(fn, opt, data[0])
            _sync(device)
        except Exception as err:  # a variant that fails is reported, not fatal
            results[v].note = f"failed: {type(err).__name__}: {str(err)[:200]}"
            del runs[v]
            continue
        results[v].first_call_s = time.perf_counter() - start
        print(f"  {v}: first call {results[v].first_call_s:.1f} s", file=sys.stderr)
        if emulation is not None and emulation.scale == 0:
            _calibrate(emulation, fn, data, device)
            emulation.calibrated_with = v
    for _round in range(args.rounds):
        for v, (fn, opt) in runs.items():
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            times: list[float] = []
            losses: list[float] = []
            seen = len(emulation.group.records) if emulation is not None else 0

            def run(fn: Any = fn, opt: Any = opt, times: Any = times, losses: Any = losses) -> None:
                for batch_ in data:
                    _sync(device)
                    start = time.perf_counter()
                    losses.append(_step(fn, opt, batch_))
                    _sync(device)
                    times.append((time.perf_counter() - start) * 1e3)

            joules = energy(run)
            results[v].step_ms.extend(times)
            if emulation is not None:
                flown = emulation.group.records[seen:]
                total = sum(r.overlapped_s or 0.0 for r in flown)
                results[v].overlapped_ms.append(total * 1e3 / len(data))
                for r in flown:
                    if not _round and r.duration_s > 0:
                        calls, _d = results[v].calls.get((r.kind, r.nbytes), (0.0, 0.0))
                        results[v].calls[(r.kind, r.nbytes)] = (calls + 1 / len(data), r.duration_s)
            if joules is not None:
                results[v].energy_j.append(joules / len(data))
            if not results[v].losses:
                results[v].losses = losses
            if device.type == "cuda":
                peak = torch.cuda.max_memory_allocated(device) / 2**30
                results[v].peak_gib = max(results[v].peak_gib or 0.0, peak)
    for v, (fn, _opt) in runs.items():
        if v.startswith("kareus"):
            results[v].note = results[v].note or _split_note(fn)
    if args.profile:
        for v, (fn, opt) in runs.items():
            _profile(v, fn, opt, data[0], device, args.profile)
    return list(results.values())


def _profile(
    variant: str, fn: Any, opt: Any, batch: Any, device: Any, rows: int
) -> None:  # pragma: no cover - a measuring aid
    """Print where one step of ``variant`` spends its time (torch.profiler, this rank)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities) as prof:
        _step(fn, opt, batch)
        _sync(device)
    key = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    print(f"profile of one step, {variant} (measured, torch.profiler):")
    print(prof.key_averages().table(sort_by=key, row_limit=rows))


def _calibrate(emulation: Any, fn: Callable[..., Any], data: list[Any], device: Any) -> None:
    """Set the emulated durations' scale: this device's compute over the modelled GPU's.

    The forward and backward of ``fn`` (torch.compile's code) with every collective
    completing at once, median of a few, against the hardware model's compute of the
    same rank's forward and backward on the emulated GPU.
    """
    times = []
    for batch_ in data * 2:
        _sync(device)
        start = time.perf_counter()
        fn(*batch_).backward()
        _sync(device)
        times.append(time.perf_counter() - start)
    measured = statistics.median(times)
    emulation.measured_compute_s = measured
    emulation.scale = measured / emulation.modelled.compute_s
    print(f"  emulated durations x{emulation.scale:.0f} (compute measured here "
          f"{measured * 1e3:.1f} ms / modelled on {emulation.gpu} "
          f"{emulation.modelled.compute_s * 1e3:.3f} ms)", file=sys.stderr)  # fmt: skip


def _split_note(fn: Any) -> str:
    """What kareus decided for the compiled model's blocks (from ``kareus.explain``)."""
    import kareus

    try:
        report = kareus.explain(fn)
    except Exception:  # a variant kareus did not compile
        return ""
    split = total = 0
    for region in report.regions:
        blockset = region.findings.blocks
        if blockset is not None:
            split += len(blockset.split)
            total += len(blockset.blocks)
    return f"{split} of {total} blocks split"


def _step(fn: Callable[..., Any], opt: torch.optim.Optimizer, batch: Any) -> float:
    ids, labels = batch
    opt.zero_grad(set_to_none=True)
    loss = fn(ids, labels)
    loss.backward()
    opt.step()
    return float(loss.detach())


def _report(
    results: list[Result], args: argparse.Namespace, world: int, out: str, emulation: Any = None
) -> list[dict[str, str]]:
    by = {r.variant: r for r in results}
    ref = by.get("torch.compile")
    eager = by.get("eager")
    modelled = emulation.modelled if emulation is not None else None
    contention = modelled.contention if modelled is not None else None
    rows = []
    for r in results:
        ratio = r.median_ms / ref.median_ms if ref and ref.step_ms and r.step_ms else None
        loss_diff = None
        base = eager if eager is not None else ref
        if base and base.losses and r.losses and base is not r:
            loss_diff = max(
                abs(a - b) / max(abs(a), 1e-12) for a, b in zip(base.losses, r.losses, strict=False)
            )
        row = {
            "variant": r.variant,
            "first_call_s": f"{r.first_call_s:.2f}",
            "step_ms_median": f"{r.median_ms:.2f}",
            "vs_torch_compile": "" if ratio is None else f"{ratio:.3f}",
            "peak_gib": "" if r.peak_gib is None else f"{r.peak_gib:.2f}",
            "j_per_step": f"{statistics.median(r.energy_j):.2f}" if r.energy_j else "",
            f"loss_rel_diff_vs_{'eager' if eager else 'torch.compile'}": (
                "" if loss_diff is None else f"{loss_diff:.2e}"
            ),
        }
        flown = statistics.median(r.overlapped_ms) if r.overlapped_ms else float("nan")
        if emulation is not None:  # the emulated collectives' time in flight before a wait
            row["overlapped_ms"] = f"{flown:.2f}"
        if contention is not None:
            # the compute a real collective would take beside each emulated one in flight
            row["with_contention_ms"] = f"{r.median_ms + (contention - 1) * flown:.2f}"
            row["with_contention_vs_tc"] = ""
            if ref and ref.step_ms and r.step_ms:
                mine = r.median_ms + (contention - 1) * flown
                theirs = ref.median_ms + (contention - 1) * statistics.median(ref.overlapped_ms)
                row["with_contention_vs_tc"] = f"{mine / theirs:.3f}"
        row["note"] = r.note
        rows.append(row)
    title = (
        f"train step, measured: device {args.device}, TP {world}, preset {args.preset}, "
        f"batch {args.batch} x {args.seq}, {args.rounds} rounds x {args.steps} steps, "
        f"torch {torch.__version__}"
    )
    if emulation is not None:
        title = (
            f"train step, measured, collectives emulated at modelled durations: one rank of "
            f"TP {emulation.tp} on {args.link} (comm scale {args.comm_scale:g}), device "
            f"{args.device}, batch {args.batch} x {args.seq}, {args.rounds} rounds x "
            f"{args.steps} steps, torch {torch.__version__}"
        )
    print(title)
    if emulation is not None:
        _print_emulation(emulation, args, ref)
    widths = {k: max(len(k), *(len(row[k]) for row in rows)) for k in rows[0]}
    print("  ".join(k.ljust(w) for k, w in widths.items()))
    for row in rows:
        print("  ".join(row[k].ljust(w) for k, w in widths.items()))
    if emulation is not None:
        _print_predictions(emulation, by)
    if out:
        path = pathlib.Path(out)
        path.mkdir(parents=True, exist_ok=True)
        where = f"emu{emulation.tp}_{args.link}_x{args.comm_scale:g}" if emulation else f"tp{world}"
        name = f"train_step_{args.device}_{where}_{args.preset}.csv"
        with open(path / name, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
        (path / (name[:-4] + ".txt")).write_text(title + "\n")
    return rows


def _print_emulation(emulation: Any, args: argparse.Namespace, ref: Result | None) -> None:
    """The scale of the emulated durations and each collective's share of the step."""
    m = emulation.modelled
    if m is None:
        print(f"  scale: x{emulation.scale:g} as given (--emulate-scale); every modelled "
              f"duration runs x{emulation.scale:g} x {args.comm_scale:g}")  # fmt: skip
    else:
        print(
            f"  scale: compute here {emulation.measured_compute_s * 1e3:.1f} ms (measured, "
            f"{emulation.calibrated_with}'s forward and backward, collectives completing at "
            f"once) / {m.compute_s * 1e3:.3f} ms on {emulation.gpu} (modelled) = "
            f"x{emulation.scale:.0f}; every modelled duration runs x{emulation.scale:.0f} x "
            f"{args.comm_scale:g}"
        )
    step_ms = ref.median_ms if ref and ref.step_ms else float("nan")
    scale = emulation.scale * args.comm_scale
    for (kind, nbytes), (calls, seconds) in sorted((ref.calls if ref else {}).items()):
        modelled = f"{seconds / scale * 1e6:.1f} us modelled, " if scale else ""
        print(
            f"  {kind} of {nbytes / 2**20:.3f} MiB here, {calls:g} per step: "
            f"{modelled}{seconds * 1e3:.2f} ms emulated here, "
            f"{100 * calls * seconds * 1e3 / step_ms:.1f} % of torch.compile's step"
        )
    if m is not None:
        print(
            f"  contention (modelled, {emulation.gpu}): compute beside a collective on NCCL's "
            f"default SMs runs x{m.contention:.3f}; 'with_contention' adds that to each "
            "emulated collective's time in flight before a wait (the emulation itself takes "
            "no compute)"
        )


def _print_predictions(emulation: Any, by: dict[str, Result]) -> None:
    """The split/whole step ratio kareus's hardware model predicts, beside the measured."""
    m = emulation.modelled
    if m is None:
        return
    split, whole = by.get("kareus nanobatches=2"), by.get("kareus nanobatches=1")
    measured = (
        f"{split.median_ms / whole.median_ms:.3f}"
        if split and whole and split.step_ms and whole.step_ms
        else "n/a"
    )
    print(
        f"split / whole step: measured here {measured} (nanobatches=2 / nanobatches=1); "
        f"modelled on {emulation.gpu} at comm scale 1: {m.split_s / m.whole_s:.3f} "
        f"(split {m.split_s * 1e3:.3f} ms, whole {m.whole_s * 1e3:.3f} ms, of which "
        f"collectives {m.comm_s * 1e3:.3f} ms; forward and backward, top clock)"
    )


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse the command line (``benchmarks/gpu_check.py`` builds its run with it too)."""
    return _parser().parse_args(argv)


def run_one_process(args: argparse.Namespace) -> list[dict[str, str]]:
    """Run the benchmark in this process (``--tp 1``); return the rows it printed."""
    from kareus.testing import free_port

    return _rank(0, 1, args, free_port(), args.out)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks (processes)")
    parser.add_argument("--preset", choices=sorted(PRESETS), default="small")
    parser.add_argument("--batch", type=int, default=None, help="replace the preset's batch")
    parser.add_argument("--seq", type=int, default=None, help="replace the preset's seq")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--python", action="store_true", help="also time codegen='python'")
    parser.add_argument("--out", default="", help="folder for the CSV")
    parser.add_argument(
        "--emulate-tp",
        type=int,
        default=0,
        metavar="N",
        help="run one rank of TP N here, its collectives emulated at modelled durations",
    )
    parser.add_argument(
        "--link",
        default="a100-nvlink",
        help="the emulated link: a100-nvlink, h100-nvlink, "
        "h200-nvlink (the GPU whose hardware model prices compute and collectives)",
    )
    parser.add_argument(
        "--profile", type=int, default=0, metavar="N",
        help="after timing, print the N costliest ops of one step of each variant",
    )  # fmt: skip
    parser.add_argument(
        "--emulate-scale", type=float, default=0.0, metavar="S",
        help="emulated durations run S times the modelled ones, as given (no trace, no "
        "calibration, no model prediction; 0: measured as the docstring says)",
    )  # fmt: skip
    parser.add_argument(
        "--comm-scale",
        type=float,
        default=1.0,
        help="multiply every emulated collective's (scaled) duration, e.g. 0, 0.5, 2",
    )
    parser.add_argument(
        "--variants", type=lambda v: v.split(","), default=None,
        help=f"comma-separated subset of: {', '.join(VARIANTS)}",
    )  # fmt: skip
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; print the table (and write CSV with ``--out``)."""
    parser = _parser()
    args = parser.parse_args(argv)
    unknown = set(args.variants or ()) - set(VARIANTS)
    if unknown:
        parser.error(f"unknown variants {sorted(unknown)}: choose from {', '.join(VARIANTS)}")
    if args.device == "cuda" and torch.cuda.device_count() < args.tp:
        parser.error(f"--tp {args.tp} needs {args.tp} GPUs; this machine has "
                     f"{torch.cuda.device_count()}")  # fmt: skip
    from kareus.testing import free_port

    port = free_port()
    if args.emulate_tp and args.tp != 1:
        parser.error("--emulate-tp runs one rank in one process: leave --tp at 1")
    if args.tp == 1:
        run_one_process(args)
    else:
        torch.multiprocessing.spawn(_rank, args=(args.tp, args, port, args.out), nprocs=args.tp)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
