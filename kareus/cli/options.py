"""The command line's options: one parser, a sub-parser per command (``kareus.cli``)."""

from __future__ import annotations

import argparse
import pathlib
from collections.abc import Sequence
from typing import Any


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
    from kareus.jobs.extrapolate import TEMPLATE_POSITION

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
    _expert_options(p)
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
        "--graphs",
        choices=("aot", "inductor"),
        help="the graphs traced and priced, which applying the plan runs: aot (AOTAutograd's "
        "plain graphs, the backward recomputing nothing) or inductor (those Inductor "
        "compiles: its decompositions, joint-graph passes and min-cut partition). Default: "
        "inductor for --hf-config and --factory (your model, which kareus.compile runs on "
        "Inductor: the plan fits it as traced), aot for the presets",
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


def _expert_options(p: argparse.ArgumentParser) -> None:
    """Options of a mixture-of-experts model's expert parallelism."""
    p.add_argument(
        "--ep",
        type=int,
        default=1,
        help="expert-parallel size of a mixture-of-experts model (its experts split over "
        "N data-parallel ranks, reached by an all-to-all)",
    )
    p.add_argument(
        "--expert-skew",
        type=float,
        default=1.0,
        metavar="X",
        help="the busiest expert's load as a multiple of the mean (1: uniform routing); "
        "the plan is priced on the rank that holds it",
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
        help="a search's work per solve and 64 instructions (default 1.0: CP-SAT's "
        "deterministic time, about seconds of one core; SCIP's 500 nodes, up to 32 "
        "instructions): less plans sooner with larger proven gaps, the same plan on any "
        "machine either way",
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


def _parser(commands: Sequence[Any]) -> argparse.ArgumentParser:
    """Return the command line's parser: the common options, then each command's subparser.

    Each ``commands`` entry's ``options`` builds its subparser; its ``run`` is the ``run``
    default the parsed arguments carry.
    """
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
    for command in commands:
        command.options(sub).set_defaults(run=command.run)
    return parser


def _plan_parser(sub: Any) -> argparse.ArgumentParser:
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
    return p


def _profile_parser(sub: Any) -> argparse.ArgumentParser:
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
    return f


def _evaluate_parser(sub: Any) -> argparse.ArgumentParser:
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
    return v


def _explain_parser(sub: Any) -> argparse.ArgumentParser:
    e = sub.add_parser("explain", help="print a saved plan", formatter_class=_Formatter)
    e.add_argument("plan", type=pathlib.Path, help="a plan.json written by `kareus plan`")
    return e


def _list_parser(sub: Any) -> argparse.ArgumentParser:
    return sub.add_parser("list", help="list the model presets and GPU types")


def _restore_clocks_parser(sub: Any) -> argparse.ArgumentParser:
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
    return r


def _doctor_parser(sub: Any) -> argparse.ArgumentParser:
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
    return d
