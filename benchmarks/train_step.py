"""A training step of kareus.compile against torch.compile and eager, side by side.

A ``kareus.models.Llama`` with tensor parallelism over ``--tp`` ranks (gloo on CPU, NCCL on
GPUs; ``--tp 1`` is a group of one, so every layer holds its all-reduces and kareus splits
it as it would at TP 8) trains with AdamW under each variant, from the same weights and on
the same batches:

- ``eager``: the model as written;
- ``torch.compile``: ``torch.compile(model)`` (Inductor);
- ``kareus``: ``kareus.compile(model)``, the defaults (Inductor, the nanobatch split);
- ``kareus nanobatches=1``: the same without the split;
- ``kareus python``: ``codegen="python"``, the debugging codegen (``--python``).

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
    # The H200 check of 2026-12-04 (docs/gpu.md): hidden 2048, 4 layers, batch 8 x 2048.
    "h200": dict(
        hidden_size=2048, intermediate_size=8192, num_layers=4, num_heads=16,
        num_kv_heads=8, vocab_size=32000, batch=8, seq=2048, dtype="bfloat16",
    ),
}  # fmt: skip

VARIANTS = ("eager", "torch.compile", "kareus", "kareus nanobatches=1", "kareus python")


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
    options: dict[str, Any] = {"codegen": "inductor"}
    if variant == "kareus nanobatches=1":
        options["nanobatches"] = 1
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
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group(
        "nccl" if device.type == "cuda" else "gloo", rank=rank, world_size=world
    )
    try:
        results = _measure(device, args, dist.group.WORLD)
        return _report(results, args, world, out) if rank == 0 else []
    finally:
        dist.destroy_process_group()


def _measure(device: torch.device, args: argparse.Namespace, group: Any) -> list[Result]:
    from kareus.models import Llama, LlamaConfig
    from kareus.testing import token_batches

    preset = dict(PRESETS[args.preset])
    batch, seq = preset.pop("batch"), preset.pop("seq")
    dtype = getattr(torch, preset.pop("dtype"))
    batch = args.batch or batch
    seq = args.seq or seq
    cfg = LlamaConfig(**preset)
    torch.manual_seed(0)
    with torch.device(device):
        base = Llama(cfg, tp_group=group).to(dtype)
    data = [
        (ids.to(device), labels.to(device))
        for ids, labels in token_batches(args.steps, batch, seq, cfg.vocab_size, seed=1)
    ]
    variants = args.variants or [v for v in VARIANTS if args.python or v != "kareus python"]
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
    for _round in range(args.rounds):
        for v, (fn, opt) in runs.items():
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            times: list[float] = []
            losses: list[float] = []

            def run(fn: Any = fn, opt: Any = opt, times: Any = times, losses: Any = losses) -> None:
                for batch_ in data:
                    _sync(device)
                    start = time.perf_counter()
                    losses.append(_step(fn, opt, batch_))
                    _sync(device)
                    times.append((time.perf_counter() - start) * 1e3)

            joules = energy(run)
            results[v].step_ms.extend(times)
            if joules is not None:
                results[v].energy_j.append(joules / len(data))
            if not results[v].losses:
                results[v].losses = losses
            if device.type == "cuda":
                peak = torch.cuda.max_memory_allocated(device) / 2**30
                results[v].peak_gib = max(results[v].peak_gib or 0.0, peak)
    return list(results.values())


def _step(fn: Callable[..., Any], opt: torch.optim.Optimizer, batch: Any) -> float:
    ids, labels = batch
    opt.zero_grad(set_to_none=True)
    loss = fn(ids, labels)
    loss.backward()
    opt.step()
    return float(loss.detach())


def _report(
    results: list[Result], args: argparse.Namespace, world: int, out: str
) -> list[dict[str, str]]:
    by = {r.variant: r for r in results}
    ref = by.get("torch.compile")
    eager = by.get("eager")
    rows = []
    for r in results:
        ratio = r.median_ms / ref.median_ms if ref and ref.step_ms and r.step_ms else None
        loss_diff = None
        if eager and eager.losses and r.losses:
            loss_diff = max(
                abs(a - b) / max(abs(a), 1e-12)
                for a, b in zip(eager.losses, r.losses, strict=False)
            )
        rows.append(
            {
                "variant": r.variant,
                "first_call_s": f"{r.first_call_s:.2f}",
                "step_ms_median": f"{r.median_ms:.2f}",
                "vs_torch_compile": "" if ratio is None else f"{ratio:.3f}",
                "peak_gib": "" if r.peak_gib is None else f"{r.peak_gib:.2f}",
                "j_per_step": f"{statistics.median(r.energy_j):.2f}" if r.energy_j else "",
                "loss_rel_diff_vs_eager": "" if loss_diff is None else f"{loss_diff:.2e}",
                "note": r.note,
            }
        )
    title = (
        f"train step, measured: device {args.device}, TP {world}, preset {args.preset}, "
        f"{args.rounds} rounds x {args.steps} steps, torch {torch.__version__}"
    )
    print(title)
    widths = {k: max(len(k), *(len(row[k]) for row in rows)) for k in rows[0]}
    print("  ".join(k.ljust(w) for k, w in widths.items()))
    for row in rows:
        print("  ".join(row[k].ljust(w) for k, w in widths.items()))
    if out:
        path = pathlib.Path(out)
        path.mkdir(parents=True, exist_ok=True)
        name = f"train_step_{args.device}_tp{world}_{args.preset}.csv"
        with open(path / name, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
        (path / (name[:-4] + ".txt")).write_text(title + "\n")
    return rows


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
    if args.tp == 1:
        run_one_process(args)
    else:
        torch.multiprocessing.spawn(_rank, args=(args.tp, args, port, args.out), nprocs=args.tp)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
