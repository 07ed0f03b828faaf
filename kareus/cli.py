r"""The ``kareus`` command line.

    kareus plan --model llama3.2-3b --gpu a100-40gb --tp 8 --pp 2 --microbatch-size 8 \\
        --seq-len 4096 --microbatches 8 --select iso_time --out kareus-out
    kareus evaluate --model llama3.2-3b --tp 8 --pp 2 --recompute full --clocks plans.csv
    kareus explain kareus-out/plan.json
    kareus list

Exit status: 0 done; 2 bad input (unknown model or GPU, parallel sizes that do not divide
the model, unreadable files); 3 no plan meets the selection policy; 1 any other failure.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import pathlib
import sys
from collections.abc import Sequence
from typing import Any

EXIT_OK, EXIT_FAILED, EXIT_BAD_INPUT, EXIT_INFEASIBLE = 0, 1, 2, 3


def _ints(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a comma-separated list of integers"
        ) from None
    if not values or min(values) <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} must list positive integers")
    return values


def _positive(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be positive")
    return value


def _layers_traced(text: str) -> int:
    from kareus.jobs.trace import TEMPLATE_POSITION

    least = TEMPLATE_POSITION + 2
    value = int(text) if text.strip().isdigit() else -1
    if value < least:
        raise argparse.ArgumentTypeError(
            f"{text!r}: trace at least {least} layers per stage (the layer the others are "
            "counted from needs an ordinary layer on each side)"
        )
    return value


def _version() -> str:
    from importlib import metadata

    try:
        return metadata.version("kareus")
    except metadata.PackageNotFoundError:  # run from a source tree, not installed
        from kareus import __version__

        return __version__


class _Formatter(argparse.HelpFormatter):
    """Help that shows each option's default, where it has one worth showing."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if default in (None, False, argparse.SUPPRESS):
            return text
        if action.option_strings and action.nargs != 0:
            return f"{text} (default: %(default)s)"
        return text


def _workload_options(p: argparse.ArgumentParser) -> None:
    """Options naming the workload (``plan`` and ``profile`` share them)."""
    model = p.add_mutually_exclusive_group(required=True)
    model.add_argument(
        "--model",
        help="a preset (see `kareus list`), or MODULE:ATTRIBUTE naming a kareus LlamaConfig",
    )
    model.add_argument(
        "--hf-config",
        metavar="PATH",
        help="a Hugging Face config.json (or its directory), traced at its real size; TP by the "
        "model's own tensor-parallel plan",
    )
    model.add_argument(
        "--factory",
        metavar="MODULE:FUNCTION",
        help="your function returning (model, inputs), called with those of tp_mesh, "
        "microbatch_size, seq_len, dtype it takes (docs/user-guide.md)",
    )
    p.add_argument("--gpu", default="a100-40gb", help="GPU type (see `kareus list`)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    p.add_argument("--cp", type=int, default=1, help="context-parallel size")
    p.add_argument("--pp", type=int, default=1, help="pipeline-parallel size")
    p.add_argument("--microbatch-size", type=int, default=8, help="sequences per micro-batch")
    p.add_argument("--seq-len", type=int, default=4096, help="tokens per sequence")
    p.add_argument("--microbatches", type=int, default=8, help="micro-batches per iteration")
    p.add_argument(
        "--schedule",
        choices=("1F1B", "GPipe", "Interleaved1F1B"),
        default="1F1B",
        help="pipeline schedule, as torch.distributed.pipelining runs it",
    )
    p.add_argument(
        "--virtual-stages",
        type=int,
        default=None,
        metavar="N",
        help="stages per pipeline rank with --schedule Interleaved1F1B (the model is split "
        "into PP x N stages; default 2)",
    )
    p.add_argument(
        "--dtype", default="bf16", choices=("bf16", "fp16", "fp32"), help="training dtype"
    )
    p.add_argument(
        "--recompute",
        choices=("none", "full", "selective"),
        default="none",
        help="activation recompute: full re-runs each layer's forward in its backward "
        "(collectives included), selective the attention core only",
    )
    p.add_argument(
        "--layers-per-stage",
        type=_ints,
        help="decoder layers of each pipeline stage, comma-separated (say 15,13; the first "
        "stage also holds the embedding, the last the head and loss); default: even",
    )
    _data_parallel_options(p)
    p.add_argument(
        "--layers-traced",
        type=_layers_traced,
        default=4,
        help="layers traced per pipeline stage (at least 4); the others are counted",
    )


def _data_parallel_options(p: argparse.ArgumentParser) -> None:
    """Options of the data-parallel layout (plan and evaluate price its traffic)."""
    p.add_argument(
        "--dp",
        type=int,
        default=None,
        metavar="N",
        help="data-parallel replicas: adds their gradient (and, with FSDP, parameter) "
        "communication and the optimizer step to the iteration (1: the step alone); "
        "default: one replica, no step",
    )
    p.add_argument(
        "--world-size",
        type=int,
        default=None,
        metavar="N",
        help="GPUs of the whole job: the data-parallel degree is N / (TP x CP x PP)",
    )
    p.add_argument(
        "--dp-mode",
        choices=("ddp", "fsdp", "hsdp", "simplefsdp"),
        default="ddp",
        help="how the replicas communicate: DDP all-reduce, FSDP2 all-gather and "
        "reduce-scatter per layer, HSDP (FSDP2 within a node, replicated across nodes), "
        "or SimpleFSDP (parameters gathered in the graphs: traced so, and their "
        "collectives planned as partitions)",
    )
    p.add_argument(
        "--gpus-per-node",
        type=int,
        default=8,
        metavar="N",
        help="GPUs an NVLink domain joins: data-parallel groups wider than a node use the "
        "GPU's network",
    )
    p.add_argument(
        "--reshard-after-forward",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="FSDP2's reshard_after_forward for the layers: resharded after the forward and "
        "gathered again for the backward (FSDP2's default), or kept (torchtitan's choice "
        "under pipeline parallelism: gathered once per iteration)",
    )


def _search_options(p: argparse.ArgumentParser) -> None:
    """Options of the per-type search (a replay needs the ones its profile used)."""
    p.add_argument("--clocks", type=_ints, help="SM clocks to consider, MHz, comma-separated")
    p.add_argument("--sm-shares", type=_ints, help="SM shares of the collective, comma-separated")
    p.add_argument("--exhaustive", action="store_true", help="evaluate the whole knob grid")
    p.add_argument(
        "--solver-work",
        type=_positive,
        default=None,
        metavar="UNITS",
        help="CP-SAT's deterministic work per solve and 64 instructions (default 1.0; "
        "about seconds of one core): less plans sooner with larger proven gaps, the same "
        "plan on any machine either way",
    )
    p.add_argument(
        "--gpu-profile",
        type=pathlib.Path,
        help="`kareus doctor --try-switch --json FILE`'s FILE: price clock changes as measured",
    )


def _output_options(p: argparse.ArgumentParser, default: str, files: str) -> None:
    """Add ``--out`` (the directory ``files`` go to) and ``--quiet``."""
    p.add_argument(
        "--out", type=pathlib.Path, default=pathlib.Path(default), help=f"directory for {files}"
    )
    p.add_argument("--quiet", action="store_true", help="no progress display")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kareus",
        description="Plan GPU clocks and communication overlap together for training.",
        epilog="exit status: 0 done, 1 failed, 2 bad input, 3 no plan meets the policy",
        formatter_class=_Formatter,
    )
    parser.add_argument("--version", action="version", version=f"kareus {_version()}")
    parser.add_argument(
        "-v",
        "--verbose",
        action="count",
        default=0,
        help="log diagnostics to stderr (-v: what kareus does, -vv: debug detail)",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    _plan_parser(sub)
    _profile_parser(sub)
    _evaluate_parser(sub)
    _other_parsers(sub)
    return parser


def _plan_parser(sub: Any) -> None:
    p = sub.add_parser(
        "plan",
        formatter_class=_Formatter,
        help="trace a model configuration, plan it, print the frontiers, write plan and report",
        description="Trace a preset at scale on fake tensors, search clocks x SM shares x "
        "launch points per partition type, compose the iteration (linear relaxation, then "
        "CP-SAT where the relaxation leaves a gap), and compare "
        "kareus with Megatron-LM, Perseus and nanobatching + Perseus on the same evaluator.",
    )
    _workload_options(p)
    from kareus.planner.select import POLICIES

    p.add_argument("--select", default="iso_time", choices=POLICIES, help="selection policy")
    p.add_argument("--energy-budget", type=float, help="J per iteration (--select energy_budget_j)")
    p.add_argument("--deadline", type=float, help="s per iteration (--select deadline_s)")
    _search_options(p)
    p.add_argument(
        "--evaluator",
        default="emulator",
        choices=("emulator", "replay"),
        help="where times and energies come from: the hardware model (modelled) or a "
        "recorded file (--replay)",
    )
    p.add_argument("--replay", type=pathlib.Path, help="recorded evaluations (--evaluator replay)")
    p.add_argument("--record", type=pathlib.Path, help="append every evaluation to this file")
    p.add_argument(
        "--partitions",
        type=pathlib.Path,
        help="partitions.json of an earlier run of this workload: plan again without tracing",
    )
    _output_options(p, "kareus-out", "plan.json, report.md, frontier.png and partitions.json")
    p.add_argument(
        "--no-cache",
        action="store_true",
        help="trace again instead of reading the trace cache ($KAREUS_CACHE_DIR, else "
        "~/.cache/kareus), and do not write it",
    )


def _profile_parser(sub: Any) -> None:
    f = sub.add_parser(
        "profile",
        formatter_class=_Formatter,
        help="measure the workload's partitions on this machine's devices (launch with "
        "torchrun, one process per GPU of one TP x CP group)",
        description="Trace the workload, extract each partition type as a runnable program, "
        "and measure every knob setting the planner's search asks for on the real devices: "
        "`torchrun --nproc-per-node TP*CP -m kareus profile ... --out DIR`. Then plan from "
        "the measurements: `kareus plan ... --evaluator replay --replay DIR/profiles.jsonl "
        "--partitions DIR/partitions.json` (profile.md prints the exact command). On CPUs "
        "(gloo) times are measured and energies modelled. Clocks are never changed unless "
        "--lock-clocks is given and permitted.",
    )
    _workload_options(f)
    _search_options(f)
    f.add_argument(
        "--window",
        type=float,
        default=1.0,
        help="shortest measurement window, s (NVML's energy counter needs about a second)",
    )
    f.add_argument("--warmup", type=int, default=3, help="runs before each measurement")
    f.add_argument(
        "--lock-clocks",
        action="store_true",
        help="lock each clock the search asks for on the GPU (needs permission; without it, "
        "or without this option, the clock as found is measured and planned; on a CPU every "
        "clock of --gpu is used, since only the energy model sees it)",
    )
    f.add_argument(
        "--device",
        choices=("cuda", "cpu"),
        help="where the partitions run (default: CUDA when available, else the CPU)",
    )
    _output_options(f, "kareus-profile", "profiles.jsonl, partitions.json and profile.md")


def _evaluate_parser(sub: Any) -> None:
    v = sub.add_parser(
        "evaluate",
        formatter_class=_Formatter,
        help="predict the time and energy of given per-instruction clock plans (no planning)",
        description="Trace the workload once and price each clock plan of a file: a CSV with "
        "columns plan_id,stage,position,kind,microbatch,freq_mhz (stage: the pipeline rank; "
        "position: index in its order under --schedule; other columns ignored, microbatch "
        "optional), or a "
        "Perseus / Zeus frequency file (a Python list per stage of (instruction, MHz) pairs). "
        "Energy is of every GPU of one pipeline, and of one GPU per stage (/ TP x CP).",
    )
    _workload_options(v)
    v.add_argument(
        "--clocks",
        type=pathlib.Path,
        required=True,
        metavar="FILE",
        help="the clock plans: a .csv, or a Perseus frequency file (.py)",
    )
    v.add_argument(
        "--method",
        choices=("megatron", "nanobatch"),
        default="megatron",
        help="megatron: no nanobatching or overlap; nanobatch: two nanobatches, each "
        "collective launched at its partition's start",
    )
    v.add_argument(
        "--replay",
        type=pathlib.Path,
        help="price from measured partitions (profiles.jsonl of `kareus profile`) instead of "
        "the hardware model",
    )
    v.add_argument(
        "--partitions",
        type=pathlib.Path,
        help="partitions.json of an earlier `kareus plan` of this workload: no tracing "
        "(megatron prices its original graphs, nanobatch its split ones)",
    )
    v.add_argument("--json", action="store_true", help="print one JSON object to stdout")
    v.add_argument("--no-cache", action="store_true", help="trace again; do not write the cache")
    v.add_argument("--quiet", action="store_true", help="no progress display")


def _other_parsers(sub: Any) -> None:
    e = sub.add_parser("explain", help="print a saved plan", formatter_class=_Formatter)
    e.add_argument("plan", type=pathlib.Path, help="a plan.json written by `kareus plan`")

    sub.add_parser("list", help="list the model presets and GPU types")

    r = sub.add_parser(
        "restore-clocks",
        formatter_class=_Formatter,
        help="restore GPU clocks that a crashed run left locked",
        description="Read a clock journal (the journal= of kareus.compile) and restore every "
        "GPU clock whose locking process no longer runs; report locks held on other hosts.",
    )
    r.add_argument(
        "--journal",
        type=pathlib.Path,
        default=pathlib.Path("kareus-clocks.jsonl"),
        help="the clock journal",
    )

    d = sub.add_parser(
        "doctor",
        formatter_class=_Formatter,
        help="what this node offers kareus: NVML, Zeus, each GPU, clock permission",
        description="Read the driver (NVML), Zeus and its daemon, each GPU (UUID, CUDA and "
        "NVML index, current and supported clocks, power limit) and whether this process "
        "may lock clocks, and say what to do where it may not. Changes nothing unless "
        "--try-switch is given.",
    )
    d.add_argument(
        "--try-switch",
        action="store_true",
        help="lock each GPU's clock once, time the call and the transition, restore at once "
        "(also on Ctrl-C); the latencies are measured",
    )
    d.add_argument("--json", type=pathlib.Path, metavar="FILE", help="also write the report")


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; return the exit status."""
    args = _parser().parse_args(argv)
    if not args.verbose:
        return _run(args)
    # The command's own handler on kareus's logger, for this command only.
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("kareus: %(levelname)s %(name)s: %(message)s"))
    logger = logging.getLogger("kareus")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG if args.verbose > 1 else logging.INFO)
    try:
        return _run(args)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def _run(args: argparse.Namespace) -> int:
    from kareus.errors import KareusError
    from kareus.planner.select import InfeasiblePlanError

    try:
        if args.command == "plan":
            return _plan(args)
        if args.command == "profile":
            return _profile(args)
        if args.command == "evaluate":
            return _evaluate(args)
        if args.command == "explain":
            return _explain(args.plan)
        if args.command == "restore-clocks":
            return _restore_clocks(args.journal)
        if args.command == "doctor":
            return _doctor(args)
        return _list()
    except InfeasiblePlanError as err:
        print(f"kareus: no plan meets --select {args.select}: {err}", file=sys.stderr)
        return EXIT_INFEASIBLE
    except (ValueError, FileNotFoundError, KareusError) as err:
        message = err.args[0] if isinstance(err, KeyError) and err.args else err
        print(f"kareus: error: {message}", file=sys.stderr)
        return EXIT_BAD_INPUT if _bad_input(err) else EXIT_FAILED


def _bad_input(err: Exception) -> bool:
    from kareus.jobs.trace import TraceError

    return not isinstance(err, TraceError)


def _restore_clocks(journal: pathlib.Path) -> int:
    from kareus.runtime.journal import recover

    if not journal.is_file():  # nothing was ever locked there: nothing to restore
        print(f"nothing to restore: no clock journal at {journal}")
        return EXIT_OK
    messages = recover(journal)
    for message in messages:
        print(message)
    if not messages:
        print(f"no clock left locked by a finished process in {journal}")
    return EXIT_FAILED if any("failed" in m for m in messages) else EXIT_OK


def _doctor(args: argparse.Namespace) -> int:
    from kareus.jobs.doctor import diagnose, try_switches, write_json

    report = diagnose()
    if args.try_switch:
        if not report.gpus:
            print("kareus doctor: --try-switch needs a GPU; there is none here", file=sys.stderr)
        elif not report.may_lock:
            print(f"kareus doctor: --try-switch skipped: {report.why}", file=sys.stderr)
        else:
            report.switches = try_switches(report)
    print(report.to_text())
    if args.json:
        write_json(report, args.json)
        print(f"wrote {args.json}")
    return EXIT_OK


def _list() -> int:
    from kareus._table import render_table
    from kareus.hardware.specs import ALIASES, GPUS
    from kareus.models import PRESETS

    print(
        render_table(
            "model presets",
            ("name", "layers", "hidden", "heads (kv)", "FFN", "vocab"),
            [
                (
                    n,
                    c.num_layers,
                    c.hidden_size,
                    f"{c.num_heads} ({c.num_kv_heads})",
                    c.intermediate_size,
                    c.vocab_size,
                )
                for n, c in PRESETS.items()
            ],
        )
    )
    aliases = {v: [k for k, t in ALIASES.items() if t == v] for v in GPUS}
    print(
        render_table(
            "GPU types",
            ("name", "also", "SMs", "max clock MHz", "TDP W"),
            [
                (n, ", ".join(aliases[n]), s.sm_count, s.clock_max_mhz, s.tdp_w)
                for n, s in GPUS.items()
            ],
        )
    )
    return EXIT_OK


def _explain(path: pathlib.Path) -> int:
    from kareus.hardware import clock_range
    from kareus.ir.plan_file import Plan

    print(Plan.load(path, clock_range).to_text())
    return EXIT_OK


def _plan(args: argparse.Namespace) -> int:
    from kareus._files import check_output_dir
    from kareus.hardware import gpu
    from kareus.jobs.stages_file import save_stages
    from kareus.jobs.trace import stage_kinds
    from kareus.jobs.workload import plan_workload, planning_steps

    spec = gpu(args.gpu)
    work = _workload(args)
    _check_policy_options(args)
    _check_clocks(args.clocks, spec)
    evaluator, settings = _plan_evaluator(args, spec)
    out = check_output_dir(args.out)  # before minutes of tracing, not after
    print(f"kareus plan: {work.describe()} on {spec.name} ({args.evaluator})", flush=True)

    def traced(stages: Any, originals: Any) -> None:
        # Saved at once: an infeasible policy or a later failure still leaves it to re-plan
        # from (--partitions).
        save_stages(work, stages, out / "partitions.json", originals)
        dp = work.data_parallel() is not None
        progress.start("planning", planning_steps(stages, originals is not None, dp))

    with _Progress(enabled=not args.quiet) as progress:
        # the split graphs, then the original ones (a replay plans the split ones only)
        graphs = 1 if args.evaluator == "replay" else 2
        progress.start("tracing", graphs * len(stage_kinds(work.stages)))
        planned = plan_workload(
            work,
            args.gpu,
            policy=args.select,
            settings=settings,
            evaluator=evaluator,
            energy_budget_j=args.energy_budget,
            deadline_s=args.deadline,
            layers=args.layers_traced,
            partitions=args.partitions,
            cache=not args.no_cache,
            on_traced=traced,
            progress=progress.step,
        )
    _print_planned(planned, args)
    return EXIT_OK


def _check_policy_options(args: argparse.Namespace) -> None:
    """Raise ValueError for a budget or deadline that is missing or not positive."""
    for option, value, unit in (
        ("--energy-budget", args.energy_budget, "joules per iteration"),
        ("--deadline", args.deadline, "seconds per iteration"),
    ):
        if value is not None and not value > 0:
            raise ValueError(f"{option} must be a positive number of {unit}, got {value:g}")
    if args.select == "energy_budget_j" and args.energy_budget is None:
        raise ValueError("--select energy_budget_j needs --energy-budget J")
    if args.select == "deadline_s" and args.deadline is None:
        raise ValueError("--select deadline_s needs --deadline SECONDS")


def _plan_evaluator(args: argparse.Namespace, spec: Any) -> tuple[Any, Any]:
    """Return the evaluator ``kareus plan`` prices with, and the planner settings."""
    from kareus.hardware import Emulator
    from kareus.planner import RecordingEvaluator, ReplayEvaluator

    evaluator: Any
    settings = _settings(args)
    if args.evaluator == "replay":
        if args.replay is None:
            raise ValueError(
                "--evaluator replay needs --replay FILE (written by --record or `kareus profile`)"
            )
        evaluator = ReplayEvaluator(args.replay)
        if args.clocks is None:  # the clocks it was recorded at (one, if not locked)
            settings = dataclasses.replace(settings, clocks_mhz=evaluator.clocks())
        if args.partitions is None and (beside := _partitions_beside(args.replay)):
            args.partitions = beside
            print(f"partitions from {beside}, recorded with {args.replay}")
    else:
        evaluator = Emulator(spec)
    if args.record is not None:
        evaluator = RecordingEvaluator(evaluator, args.record)
    return evaluator, settings


def _print_planned(planned: Any, args: argparse.Namespace) -> None:
    """Print what ``kareus plan`` found and write its files."""
    from kareus._table import render_table
    from kareus.jobs.report import COMPARISON_HEADER, comparison_rows, write_outputs

    source = (
        f"partitions from the trace cache ({planned.cached}; --no-cache traces again) in"
        if planned.cached
        else "partitions read in"
        if args.partitions
        else "traced in"
    )
    print(
        f"{source} {planned.trace_s:.1f} s, planned in {planned.plan_s:.1f} s, peak memory "
        f"{planned.peak_rss_mib:.0f} MiB (measured)\n"
    )
    for i, pset in planned.distinct_stages():
        print(f"stage {i} partition types (repeated layers counted):")
        print(pset.to_text() + "\n")
    print(planned.plan.to_text() + "\n")
    print(
        render_table(
            f"methods side by side ({planned.plan.source})",
            COMPARISON_HEADER,
            comparison_rows(planned.plan),
        )
    )
    paths = write_outputs(planned, args.out)
    print("\nwrote " + ", ".join(str(p) for p in paths.values()))
    print(f"report: {paths['report']}  |  show the plan again: kareus explain {paths['plan']}")


def _evaluate(args: argparse.Namespace) -> int:
    import json

    from kareus._table import render_table
    from kareus.hardware import gpu
    from kareus.jobs.evaluate import evaluate_clock_plans, read_clock_plans
    from kareus.jobs.trace import stage_kinds
    from kareus.planner import ReplayEvaluator

    spec = gpu(args.gpu)
    work = _workload(args)
    clocks = spec.clocks_mhz()
    plans = read_clock_plans(args.clocks, work, (min(clocks), max(clocks)))  # before tracing
    evaluator = ReplayEvaluator(args.replay) if args.replay is not None else None
    if args.replay is not None and args.partitions is None:
        args.partitions = _partitions_beside(args.replay)
    print(
        f"kareus evaluate: {len(plans)} clock plan(s) of {args.clocks} for {work.describe()} "
        f"on {spec.name}, method {args.method}",
        file=sys.stderr if args.json else sys.stdout,
        flush=True,
    )
    with _Progress(enabled=not args.quiet) as progress:
        progress.start("tracing", len(stage_kinds(work.stages)))
        result = evaluate_clock_plans(
            work,
            args.gpu,
            plans,
            method=args.method,
            evaluator=evaluator,
            layers=args.layers_traced,
            partitions=args.partitions,
            cache=not args.no_cache,
            progress=progress.step,
        )
    if args.json:
        print(json.dumps(result.to_dict()))
        return EXIT_OK
    per = work.tp * work.cp
    print(
        render_table(
            f"clock plans ({result.source}, {result.gpu}, method {result.method})",
            ("plan", "time s", "energy J (pipeline)", f"energy J per GPU column (/ {per})"),
            [
                (
                    p.plan_id,
                    f"{p.time_s:.4f}",
                    f"{p.energy_j:.1f}",
                    f"{p.energy_per_gpu_column_j:.1f}",
                )
                for p in result.plans
            ],
        )
    )
    return EXIT_OK


def _partitions_beside(replay: pathlib.Path) -> pathlib.Path | None:
    """Return the partitions.json a recording was made with (written next to it), if any."""
    beside = replay.parent / "partitions.json"
    return beside if beside.is_file() else None


def _workload(args: argparse.Namespace) -> Any:
    from kareus.jobs.trace import Workload

    return Workload(
        model=_model(args),
        tp=args.tp,
        cp=args.cp,
        pp=args.pp,
        microbatch_size=args.microbatch_size,
        seq_len=args.seq_len,
        microbatches=args.microbatches,
        dtype=args.dtype,
        schedule=args.schedule,
        recompute=args.recompute,
        layers_per_stage=args.layers_per_stage,
        dp=_dp_degree(args),
        dp_mode=args.dp_mode,
        gpus_per_node=args.gpus_per_node,
        reshard_after_forward=args.reshard_after_forward,
        virtual_stages=(
            args.virtual_stages
            if args.virtual_stages is not None
            else 2
            if args.schedule == "Interleaved1F1B"
            else 1
        ),
    )


def _model(args: argparse.Namespace) -> Any:
    """Return the workload's model: a preset's name, a Hugging Face config, or a factory."""
    from kareus.models.sources import FactoryModel, HFModel

    if getattr(args, "hf_config", None):
        return HFModel(args.hf_config)
    if getattr(args, "factory", None):
        return FactoryModel(args.factory)
    return args.model


def _dp_degree(args: argparse.Namespace) -> int | None:
    """Return the data-parallel degree from --dp and --world-size (which must agree).

    Raises:
        ValueError: the world size is no multiple of a replica's GPUs, or --dp disagrees.
    """
    world = getattr(args, "world_size", None)
    if world is None:
        return args.dp  # type: ignore[no-any-return]
    replica = args.tp * args.cp * args.pp
    if world < 1 or world % replica:
        raise ValueError(
            f"--world-size {world} is not a multiple of the GPUs of one replica, TP {args.tp} "
            f"x CP {args.cp} x PP {args.pp} = {replica}"
        )
    if args.dp is not None and args.dp * replica != world:
        raise ValueError(
            f"--dp {args.dp} with --world-size {world}: {world} GPUs over {replica} per "
            f"replica (TP x CP x PP) make {world // replica} replicas, not {args.dp}"
        )
    return world // replica


def _settings(args: argparse.Namespace) -> Any:
    from kareus.jobs.doctor import switch_cost
    from kareus.planner import PlannerSettings

    profile = getattr(args, "gpu_profile", None)
    return PlannerSettings(
        clocks_mhz=args.clocks,
        exhaustive=args.exhaustive,
        switch=switch_cost(profile) if profile is not None else None,
        **({"sm_shares": args.sm_shares} if args.sm_shares else {}),
        **({"solver_time_limit_s": args.solver_work} if args.solver_work is not None else {}),
    )


def _profile(args: argparse.Namespace) -> int:
    from kareus.hardware import gpu
    from kareus.jobs.profile import ProfileSettings, plan_command, profile_workload

    spec = gpu(args.gpu)
    work = _workload(args)
    _check_clocks(args.clocks, spec)
    if work.graph_dp > 1:
        raise ValueError(
            f"--dp-mode simplefsdp puts the data-parallel collectives in the graphs, and "
            f"kareus profile runs one TP x CP group ({work.tp * work.cp} GPUs), not its "
            f"{work.dp} replicas: profile with another --dp-mode (the same partitions "
            "without the gathers) or plan with the hardware model"
        )
    if not args.window >= 0 or args.warmup < 0:
        raise ValueError(
            f"--window {args.window:g} and --warmup {args.warmup} must not be negative"
        )
    rank0 = int(os.environ.get("RANK", "0")) == 0
    if rank0:
        print(f"kareus profile: {work.describe()} for {spec.name}", flush=True)
    from kareus.jobs.trace import stage_kinds
    from kareus.jobs.workload import planning_steps

    with _Progress(enabled=rank0 and not args.quiet) as progress:
        progress.start("tracing", len(stage_kinds(work.stages)))
        result = profile_workload(
            work,
            args.gpu,
            args.out,
            planner=_settings(args),
            settings=ProfileSettings(
                window_s=args.window,
                warmup=args.warmup,
                lock_clocks=True if args.lock_clocks else None,
                device=args.device,
            ),
            layers=args.layers_traced,
            on_traced=lambda stages: progress.start("measuring", planning_steps(stages) - 2),
            progress=progress.step,
        )
    if rank0:
        measured = sum(r["time_source"] == "measured" for r in result.rows)
        print(
            f"traced in {result.trace_s:.1f} s, measured in {result.profile_s:.1f} s on "
            f"{result.ranks} {result.device} process(es) (wall, measured): {len(result.rows)} "
            f"evaluations, {measured} of them run as extracted partitions"
        )
        for note in result.notes:
            print(f"note: {note}")
        print(f"wrote {args.out}/profiles.jsonl, partitions.json, profile.md")
        print("plan from it:\n  " + plan_command(result, str(args.out)))
    return EXIT_OK


def _check_clocks(clocks: Any, spec: Any) -> None:
    if clocks:
        lo, hi = min(spec.clocks_mhz()), max(spec.clocks_mhz())
        bad = [c for c in clocks if not lo <= c <= hi]
        if bad:
            raise ValueError(f"--clocks {bad} outside {spec.name}'s range {lo}-{hi} MHz")


class _Progress:
    """Progress bars on stderr (rich); a no-op when disabled or not a terminal stage."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self._progress: Any = None
        self._task: Any = None

    def __enter__(self) -> _Progress:
        if self.enabled:
            from rich.console import Console
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                TextColumn,
                TimeElapsedColumn,
            )

            self._progress = Progress(
                TextColumn("{task.description:<10}"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                TextColumn("{task.fields[step]}"),
                console=Console(stderr=True),
                transient=False,
            )
            self._progress.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._progress is not None:
            if exc[0] is None:  # a failed step is not "done"
                self._finish()
            elif self._task is not None:
                self._progress.update(self._task, step="failed")
            self._progress.__exit__(*exc)

    def _finish(self) -> None:
        if self._task is not None:
            task = self._progress.tasks[self._task]
            self._progress.update(self._task, completed=task.total, step="done")

    def start(self, name: str, total: int) -> None:
        """Begin a new bar of ``total`` steps."""
        if self._progress is None:
            return
        self._finish()
        self._task = self._progress.add_task(name, total=total, step="", started=True)
        self._first = True

    def step(self, text: str) -> None:
        """Mark the previous step complete and show ``text`` as the current one."""
        if self._progress is None or self._task is None:
            return
        if not self._first:
            self._progress.advance(self._task)
        self._first = False
        self._progress.update(self._task, step=text)


if __name__ == "__main__":
    sys.exit(main())
