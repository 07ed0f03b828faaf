"""kareus against Megatron-LM, Perseus and nanobatching + Perseus, side by side.

For a matrix of configurations, traces each workload once (fake tensors), plans it on
every GPU type with the same evaluator for all four methods, and writes:

- ``results.md``: per configuration and method, the fastest plan's time and energy and
  their change against Megatron-LM; against Perseus, the iso-time energy reduction and the
  iso-energy time reduction; the distance from the lower bound; planning wall time;
- ``results.json``: every frontier point of every method, the bounds and the timings;
- ``plots/<config>.png``: the frontiers of one configuration;
- ``partitions/<workload>.json``: the traced partition sets (``--reuse`` plans from them);
- ``rows/<workload>.json``: each workload's rows, saved as soon as it is planned, so that a
  stopped run loses none: ``--resume`` takes them instead of planning again where the same
  kareus code (package files and calibration, by digest) saved them.

Every time and energy is modelled (the emulator); wall times are measured. Checks that fail
the run (exit 1): every frontier monotone, no plan below the lower bound, and no baseline
point below kareus's frontier (the planner joins the baselines' plans into kareus's, so this
checks that joining, not kareus's own solves). What kareus's own solves found is reported
apart: its frontier without the points that are a baseline's plan (*own points*), their
share, and the iso-time saving over Perseus of those alone (*own iso-time*), which can be
zero or negative where the joined frontier's saving is a Perseus plan's.

The matrix runs the reference A100 pipelines' setup: full activation recompute, PP 2 split
15/13 (``--recompute`` changes the first). ``--reference`` runs only the configurations
of the reference A100 pipeline plans (``shared/data/a100_llama_pipeline_plans``), on A100,
so that kareus's own plans stand beside the reference's (``pipeline_fidelity.py``).

Run: python benchmarks/compare.py [--quick | --reference] [--out DIR] [--jobs 2] [--reuse]
[--resume] [--gpus G,...]
(writes compare-out/; ``--update-results`` runs the full matrix into the committed
``benchmarks/results``)
"""

from __future__ import annotations

import argparse
import concurrent.futures
import csv
import dataclasses
import json
import pathlib
import sys
import time
from collections.abc import Sequence
from typing import Any

RESULTS = pathlib.Path(__file__).resolve().parent / "results"
"""The committed results, written only with --update-results."""

GPUS = ("a100-40gb", "h100", "h200")
MODELS = ("llama3.2-3b", "qwen3-1.7b")
PARALLEL = ((8, 1), (4, 2))  # (TP, CP)
MICROBATCH = (8, 16)
SEQ = (4096, 8192)
PP, MICROBATCHES = 2, 8
REFERENCE_SPLIT = (15, 13)  # the reference A100 pipelines' stages (embedding + 15, 13 + head)
RECOMPUTE = "full"  # the reference A100 pipelines' activation recompute
AT_SCALE = {"model": "llama3.3-70b", "tp": 8, "cp": 1, "pp": 8, "microbatch_size": 8,
            "seq_len": 4096, "microbatches": 16}  # fmt: skip


def matrix(
    quick: bool, recompute: str = RECOMPUTE, gpus: tuple[str, ...] | None = None
) -> list[tuple[dict[str, Any], tuple[str, ...]]]:
    """(workload fields, GPU types) to run: the reference setup (``recompute``; PP 2 with
    the 15/13 split of the reference A100 pipelines), on ``gpus`` if given."""
    runs = _matrix(quick)
    out = []
    for fields, on in runs:
        fields = {**fields, "recompute": recompute}
        if fields["pp"] == PP:
            fields["layers_per_stage"] = REFERENCE_SPLIT
        on = tuple(g for g in on if gpus is None or g in gpus)
        if on:
            out.append((fields, on))
    return out


def reference_configs() -> set[tuple[Any, ...]]:
    """(model, tp, cp, microbatch size, sequence length) of each configuration the reference
    A100 pipeline plans cover, read from the shared data."""
    from kareus.hardware.calibrate import shared_data_dir

    path = shared_data_dir() / "a100_llama_pipeline_plans" / "plans.csv"
    with path.open() as fh:
        return {
            (r["model"], int(r["tp"]), int(r["cp"]), int(r["microbatch_size"]), int(r["seq_len"]))
            for r in csv.DictReader(fh)
        }


def reference_matrix(recompute: str = RECOMPUTE) -> list[tuple[dict[str, Any], tuple[str, ...]]]:
    """The matrix's runs of the reference A100 pipeline plans' configurations, on A100."""
    configs = reference_configs()
    runs = [
        (fields, ("a100-40gb",))
        for fields, _on in matrix(False, recompute)
        if fields["pp"] == PP
        and tuple(fields[k] for k in ("model", "tp", "cp", "microbatch_size", "seq_len")) in configs
    ]
    if len(runs) != len(configs):
        raise SystemExit(
            f"the matrix covers {len(runs)} of the {len(configs)} reference configurations"
        )
    return runs


def _matrix(quick: bool) -> list[tuple[dict[str, Any], tuple[str, ...]]]:
    if quick:
        base = {"pp": PP, "microbatches": MICROBATCHES, "microbatch_size": 8, "seq_len": 4096}
        return [
            ({"model": "llama3.2-3b", "tp": 8, "cp": 1, **base}, ("a100-40gb",)),
            ({"model": "qwen3-1.7b", "tp": 4, "cp": 2, **base}, ("a100-40gb",)),
        ]
    runs = [
        (
            {
                "model": m,
                "tp": tp,
                "cp": cp,
                "pp": PP,
                "microbatches": MICROBATCHES,
                "microbatch_size": mb,
                "seq_len": seq,
            },
            GPUS,
        )
        for m in MODELS
        for tp, cp in PARALLEL
        for mb in MICROBATCH
        for seq in SEQ
    ]
    return [*runs, (AT_SCALE, ("a100-40gb", "h100"))]


def workload_key(w: dict[str, Any]) -> str:
    """A short file-name-safe name of a workload."""
    return (
        f"{w['model']}_tp{w['tp']}cp{w['cp']}pp{w['pp']}_mb{w['microbatch_size']}"
        f"_s{w['seq_len']}_m{w['microbatches']}_r{w.get('recompute', 'none')}"
    )


def holds_partition_set(work: Any, parts: pathlib.Path) -> bool:
    """Whether ``parts`` holds ``work``'s partition set, split and original graphs both."""
    from kareus.jobs.stages_file import load_originals

    return parts.is_file() and load_originals(work, parts) is not None


def partition_set(work: Any, parts: pathlib.Path, reuse: bool) -> None:
    """Trace ``work`` into ``parts`` (its split graphs, which kareus plans, and the original
    ones the baselines run), unless ``reuse`` and ``parts`` already holds this workload's."""
    from kareus.jobs.stages_file import save_stages
    from kareus.jobs.trace import trace

    if reuse and holds_partition_set(work, parts):
        return
    stages, _notes = trace(work)
    originals, _notes = trace(work, nanobatches=1)
    parts.parent.mkdir(parents=True, exist_ok=True)
    save_stages(work, stages, parts, originals)


def run_workload(
    fields: dict[str, Any], gpus: tuple[str, ...], out: str, reuse: bool
) -> list[dict[str, Any]]:
    """Trace one workload (or reuse its partitions), plan it on each GPU; return rows."""
    from kareus.hardware import Emulator, gpu
    from kareus.jobs.trace import Workload
    from kareus.jobs.workload import plan_workload
    from kareus.planner import PlannerSettings
    from kareus.planner.bounds import lower_bound

    work = Workload(**fields)
    key = workload_key(fields)
    parts = pathlib.Path(out) / "partitions" / f"{key}.json"
    start = time.perf_counter()
    partition_set(work, parts, reuse)
    trace_s = time.perf_counter() - start
    rows = []
    for name in gpus:
        spec = gpu(name)
        marks: list[tuple[float, str]] = []
        planned = plan_workload(
            work,
            name,
            partitions=parts,
            settings=PlannerSettings(solver_workers=1),
            progress=lambda step, marks=marks: marks.append((time.perf_counter(), step)),
        )
        marks.append((time.perf_counter(), "end"))
        # the four methods compose together (the baselines in a second thread)
        compose_s = marks[-1][0] - next(t for t, s in marks if s.startswith("composing"))
        search_s = next(t for t, s in marks if s.startswith("building")) - marks[0][0]
        # a plan runs the split graphs or the original ones: the lower of both bounds
        bounds = [
            lower_bound(
                sets,
                Emulator(spec),
                spec.clocks_mhz(),
                gpus_per_stage=work.tp * work.cp,
                microbatches=work.microbatches,
            )
            for sets in (planned.stages, planned.originals)
            if sets is not None
        ]
        bound = min(bounds, key=lambda b: b.energy_j)
        bound = dataclasses.replace(bound, time_s=min(b.time_s for b in bounds))
        plan = planned.plan
        rows.append(
            {
                "workload": fields,
                "key": key,
                "gpu": spec.name,
                "gpu_key": name,
                "source": plan.source,
                "frontiers": {
                    "kareus": [dataclasses.asdict(p) for p in plan.frontier],
                    **{
                        m: [dataclasses.asdict(p) for p in pts] for m, pts in plan.baselines.items()
                    },
                },
                "lower_bound": {"time_s": bound.time_s, "energy_j": bound.energy_j},
                "trace_s": trace_s,
                "search_s": search_s,
                "compose_s": compose_s,
                "plan_s": planned.plan_s,
                "plan": plan.to_dict(),
            }
        )
    return rows


def code_fingerprint() -> str:
    """A digest of the kareus package's files (code and calibration): rows saved by other
    code are planned again, never reused."""
    import hashlib

    import kareus

    root = pathlib.Path(kareus.__file__).resolve().parent
    digest = hashlib.sha256()
    for f in sorted(root.rglob("*")):
        if f.is_file() and "__pycache__" not in f.parts:
            digest.update(f"{f.relative_to(root).as_posix()}\0".encode() + f.read_bytes())
    return digest.hexdigest()[:16]


def rows_path(out: pathlib.Path, fields: dict[str, Any]) -> pathlib.Path:
    """Where one workload's rows are saved as soon as it is planned."""
    return out / "rows" / f"{workload_key(fields)}.json"


def save_rows(
    out: pathlib.Path,
    fields: dict[str, Any],
    gpus: tuple[str, ...],
    code: str,
    rows: list[dict[str, Any]],
) -> None:
    """Save one workload's rows (replaced whole: a stopped write leaves no partial file)."""
    path = rows_path(out, fields)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"code": code, "workload": fields, "gpus": list(gpus), "rows": rows}))
    tmp.replace(path)


def saved_rows(
    out: pathlib.Path, fields: dict[str, Any], gpus: tuple[str, ...], code: str
) -> tuple[list[dict[str, Any]] | None, str]:
    """Return one workload's saved rows if the same code planned them on the same GPUs
    (else None), and why not."""
    path = rows_path(out, fields)
    if not path.is_file():
        return None, "not planned yet"
    try:
        saved = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        return None, f"{path} unreadable ({err})"
    if saved.get("code") != code:
        return None, f"{path} was planned by other kareus code"
    if saved.get("workload") != json.loads(json.dumps(fields)) or saved.get("gpus") != list(gpus):
        return None, f"{path} holds another workload or other GPUs"
    return saved["rows"], f"from {path}"


def _pts(points: list[dict[str, float]]) -> list[tuple[float, float]]:
    return [(p["time_s"], p["energy_j"]) for p in points]


def analyse(row: dict[str, Any]) -> tuple[list[dict[str, Any]], list[str]]:
    """Per-method figures of one configuration, and the sanity-check failures."""
    from kareus.planner.pareto import (
        is_monotone,
        iso_energy_time_reduction,
        iso_time_energy_reduction,
        no_slower,
    )

    fronts = {m: _pts(p) for m, p in row["frontiers"].items()}
    mega_t, mega_e = min(fronts["megatron"])
    perseus = fronts["perseus"]
    lb = row["lower_bound"]
    where = f"{row['key']} on {row['gpu']}"
    failures = []
    out = []
    for method in ("megatron", "perseus", "nanobatch+perseus", "kareus"):
        pts = fronts[method]
        if not is_monotone(pts):
            failures.append(f"{where}: the {method} frontier is not monotone: {pts}")
        if method != "kareus":
            for t, e in pts:
                covered = any(
                    no_slower(kt, t) and ke <= e * (1 + 1e-9) for kt, ke in fronts["kareus"]
                )
                if not covered:
                    failures.append(f"{where}: {method} point ({t}, {e}) lies below kareus's")
        for t, e in pts:
            if t < lb["time_s"] * (1 - 1e-9) or e < lb["energy_j"] * (1 - 1e-9):
                failures.append(f"{where}: {method} point ({t}, {e}) beats the lower bound {lb}")
        fast_t, fast_e = min(pts)
        least_e = min(e for _, e in pts)
        iso_t = iso_time_energy_reduction(pts, perseus)
        iso_e = iso_energy_time_reduction(pts, perseus)
        own = {}
        if method == "kareus":
            own = _own_figures(fronts, perseus)
        out.append(
            {
                "method": method,
                "fastest_time_s": fast_t,
                "fastest_energy_j": fast_e,
                "time_vs_megatron": (fast_t - mega_t) / mega_t,
                "energy_vs_megatron": (fast_e - mega_e) / mega_e,
                "least_energy_j": least_e,
                "iso_time_energy_reduction_vs_perseus": iso_t,
                "iso_energy_time_reduction_vs_perseus": iso_e,
                "time_above_bound": fast_t / lb["time_s"] - 1,
                "energy_above_bound": least_e / lb["energy_j"] - 1,
                **own,
            }
        )
    return out, failures


def _own_figures(
    fronts: dict[str, list[tuple[float, float]]], perseus: list[tuple[float, float]]
) -> dict[str, Any]:
    """kareus's frontier points that are no baseline's plan, their share, their iso-time saving.

    A point counts as a baseline's when a baseline has a point at the same time and energy
    (to 1e-9): the planner joined it into kareus's frontier.
    """
    from kareus.planner.pareto import iso_time_energy_reduction

    baseline = [pt for m, pts in fronts.items() if m != "kareus" for pt in pts]

    def same(a: tuple[float, float], b: tuple[float, float]) -> bool:
        return abs(a[0] - b[0]) <= 1e-9 * b[0] and abs(a[1] - b[1]) <= 1e-9 * b[1]

    own = [p for p in fronts["kareus"] if not any(same(p, b) for b in baseline)]
    return {
        "own_points": len(own),
        "own_share": len(own) / len(fronts["kareus"]),
        "own_iso_time_energy_reduction_vs_perseus": (
            iso_time_energy_reduction(own, perseus) if own else None
        ),
    }


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:+.1f} %"


def markdown(
    rows: list[dict[str, Any]], total_s: float, command: str, resumed: Sequence[str] = ()
) -> str:
    """The results table (``resumed``: the workloads whose rows an earlier run planned)."""
    head = (
        "| configuration | GPU | method | fastest time s | its energy kJ | time vs Megatron "
        "| energy vs Megatron | iso-time energy vs Perseus | iso-energy time vs Perseus "
        "| least energy kJ | time above bound | energy above bound | own points "
        "| own iso-time vs Perseus |"
    )
    lines = [
        "# kareus vs Megatron-LM, Perseus and nanobatching + Perseus",
        "",
        "All times and energies are **modelled** (the kareus hardware model; H100 and H200 "
        "borrow the A100's fitted factors, with GEMM and attention efficiencies scaled by "
        "their published kernel ceilings); wall times are **measured** on the machine that "
        f"ran `{command}` ({total_s / 60:.1f} min "
        + (
            f"this run; {len(resumed)} workloads' rows, and their wall times, are an earlier "
            "run's of the same code"
            if resumed
            else "in all"
        )
        + "). Energy is per iteration, all GPUs "
        "of one pipeline. Iso-time: least energy among the method's plans no slower than "
        "Perseus's fastest, as a reduction of that plan's energy (positive = saves). "
        "Iso-energy: shortest time among plans using no more energy than Perseus's "
        "least-energy plan, as a reduction of its time. Bound: every op at its own best "
        "clock, communication hidden and free (`kareus.planner.bounds`). Own points: kareus's "
        "frontier points that are no baseline's plan (the planner joins the baselines' plans "
        "into kareus's frontier), and the iso-time saving over Perseus of those alone.",
        "",
        head,
        "|" + "---|" * (head.count("|") - 1),
    ]
    for row in rows:
        w = row["workload"]
        config = (
            f"{w['model']} TP{w['tp']} CP{w['cp']} PP{w['pp']} mb{w['microbatch_size']} "
            f"seq{w['seq_len']} x{w['microbatches']}"
            + (f" {'/'.join(map(str, w['layers_per_stage']))}" if w.get("layers_per_stage") else "")
            + (f" rc-{w['recompute']}" if w.get("recompute", "none") != "none" else "")
        )
        for m in row["methods"]:
            lines.append(
                f"| {config} | {row['gpu']} | {m['method']} | {m['fastest_time_s']:.3f} "
                f"| {m['fastest_energy_j'] / 1e3:.2f} | {_pct(m['time_vs_megatron'])} "
                f"| {_pct(m['energy_vs_megatron'])} "
                f"| {_pct(m['iso_time_energy_reduction_vs_perseus'])} "
                f"| {_pct(m['iso_energy_time_reduction_vs_perseus'])} "
                f"| {m['least_energy_j'] / 1e3:.2f} | {_pct(m['time_above_bound'])} "
                f"| {_pct(m['energy_above_bound'])} "
                + (
                    f"| {m['own_points']} ({m['own_share']:.0%}) "
                    f"| {_pct(m['own_iso_time_energy_reduction_vs_perseus'])} |"
                    if "own_points" in m
                    else "| | |"
                )
            )
    lines += [
        "",
        "Planning wall time per configuration (measured): "
        + "; ".join(
            f"{r['key']} on {r['gpu_key']}: trace {r['trace_s']:.0f} s (once per workload), "
            f"search {r['search_s']:.1f} s, compose {r['compose_s']:.1f} s, "
            f"plan {r['plan_s']:.1f} s"
            for r in rows
        ),
    ]
    return "\n".join(lines) + "\n"


def plan_all(
    runs: list[tuple[dict[str, Any], tuple[str, ...]]],
    out: pathlib.Path,
    jobs: int,
    reuse: bool,
    resume: bool,
) -> tuple[list[dict[str, Any]], list[str]]:
    """Plan every workload (``jobs`` at a time), saving each one's rows as it finishes;
    with ``resume``, a workload whose rows the same code saved is not planned again.

    Returns the rows and the keys of the workloads resumed.
    """
    start = time.perf_counter()
    code = code_fingerprint()
    rows: list[dict[str, Any]] = []
    resumed: list[str] = []
    todo = []
    for fields, gpus in runs:
        got, why = saved_rows(out, fields, gpus, code) if resume else (None, "")
        if got is None:
            todo.append((fields, gpus))
            if resume:
                print(f"{workload_key(fields)}: planned ({why})", flush=True)
            continue
        rows.extend(got)
        resumed.append(workload_key(fields))
        print(f"{workload_key(fields)}: rows {why} (planned by the same code)", flush=True)
    ctx = __import__("multiprocessing").get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(jobs, mp_context=ctx) as pool:
        futures = {
            pool.submit(run_workload, fields, gpus, str(out), reuse): (fields, gpus)
            for fields, gpus in todo
        }
        for n, fut in enumerate(concurrent.futures.as_completed(futures), 1):
            got = fut.result()
            fields, gpus = futures[fut]
            save_rows(out, fields, gpus, code, got)
            rows.extend(got)
            print(
                f"[{n}/{len(todo)}] {workload_key(fields)}: "
                + ", ".join(f"{r['gpu_key']} plan {r['plan_s']:.0f} s" for r in got)
                + f", trace {got[0]['trace_s']:.0f} s ({time.perf_counter() - start:.0f} s in;"
                " wall times measured)",
                flush=True,
            )
    return rows, resumed


def main() -> int:
    """Run the matrix; return 1 when a sanity check fails."""
    parser = argparse.ArgumentParser(description=__doc__)
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--quick", action="store_true", help="two A100 configurations")
    which.add_argument(
        "--reference",
        action="store_true",
        help="the reference A100 pipeline plans' configurations, on A100",
    )
    parser.add_argument(
        "--out",
        type=pathlib.Path,
        help="output directory (default: compare-out, or benchmarks/results with --update-results)",
    )
    parser.add_argument(
        "--update-results",
        action="store_true",
        help="write the committed benchmarks/results (the full matrix only)",
    )
    parser.add_argument("--jobs", type=int, default=2, help="workloads traced in parallel")
    parser.add_argument("--reuse", action="store_true", help="reuse traced partition sets")
    parser.add_argument(
        "--resume",
        action="store_true",
        help="take each workload's rows saved in OUT/rows by an earlier run of the same "
        "kareus code (a stopped run) instead of planning it again; implies --reuse",
    )
    parser.add_argument(
        "--recompute",
        default=RECOMPUTE,
        choices=("none", "full", "selective"),
        help="activation recompute of every workload (default: the reference pipelines')",
    )
    parser.add_argument("--gpus", help="only these GPU types, comma-separated (say a100-40gb)")
    args = parser.parse_args()
    if args.update_results and (
        args.quick or args.reference or args.gpus or args.recompute != RECOMPUTE
    ):
        parser.error("--update-results replaces the committed results: run the full matrix")
    if args.reference and args.gpus:
        parser.error("--reference plans on A100, the GPU of the reference plans: drop --gpus")
    if args.out is None:
        args.out = RESULTS if args.update_results else pathlib.Path("compare-out")
    elif args.out.resolve() == RESULTS.resolve() and not args.update_results:
        parser.error(f"{RESULTS} holds the committed results: add --update-results")
    from kareus.ir.plan_file import Plan
    from kareus.planner.plot import plot_frontiers

    start = time.perf_counter()
    if args.reference:
        runs = reference_matrix(args.recompute)
    else:
        gpus = tuple(args.gpus.split(",")) if args.gpus else None
        runs = matrix(args.quick, args.recompute, gpus)
    args.out.mkdir(parents=True, exist_ok=True)
    rows, resumed = plan_all(runs, args.out, args.jobs, args.reuse or args.resume, args.resume)
    order = {workload_key(f): i for i, (f, _g) in enumerate(runs)}
    rows.sort(key=lambda r: (order[r["key"]], r["gpu_key"]))
    failures: list[str] = []
    for row in rows:
        row["methods"], bad = analyse(row)
        failures += bad
        plot_frontiers(
            Plan.from_dict(row["plan"]), args.out / "plots" / f"{row['key']}_{row['gpu_key']}.png"
        )
    total = time.perf_counter() - start
    command = " ".join(["python benchmarks/compare.py", *sys.argv[1:]])
    (args.out / "results.md").write_text(markdown(rows, total, command, resumed))
    for row in rows:
        del row["plan"]  # plotted; the frontiers stay
    (args.out / "results.json").write_text(
        json.dumps(
            {"total_s": total, "resumed": resumed, "failures": failures, "rows": rows}, indent=1
        )
        + "\n"
    )
    print((args.out / "results.md").read_text())
    for f in failures:
        print(f"SANITY CHECK FAILED: {f}", file=sys.stderr)
    kareus = [m for r in rows for m in r["methods"] if m["method"] == "kareus"]
    own = [m["own_iso_time_energy_reduction_vs_perseus"] for m in kareus]
    beat = sum(1 for x in own if x is not None and x > 1e-9)
    points = sum(len(r["frontiers"]["kareus"]) for r in rows)
    print(
        f"kareus's own solves (no baseline plan) beat Perseus at iso-time in {beat} of "
        f"{len(own)} configurations; own points are "
        f"{sum(m['own_points'] for m in kareus)} of {points} frontier points (modelled)"
    )
    print(f"{len(rows)} configurations in {total / 60:.1f} min; wrote {args.out}/results.md")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
