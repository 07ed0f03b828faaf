"""The command line's commands: plan, profile, evaluate, explain, list, doctor, restore-clocks.

Each takes the parsed options and returns the exit status; :func:`kareus.cli.main` dispatches
and turns kareus's errors into one line and a status.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import pathlib
import sys
from typing import Any

EXIT_OK, EXIT_FAILED, EXIT_BAD_INPUT, EXIT_INFEASIBLE = 0, 1, 2, 3


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
    from kareus.hardware.specs import KNOWN_GPUS
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
    print(
        render_table(
            "GPU types",
            ("name", "also", "SMs", "max clock MHz", "TDP W"),
            [
                (n, ", ".join(k.aliases), k.spec.sm_count, k.spec.clock_max_mhz, k.spec.tdp_w)
                for n, k in KNOWN_GPUS.items()
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
    from kareus._files import output_dir
    from kareus.hardware import gpu
    from kareus.jobs.stages_file import save_stages
    from kareus.jobs.trace import stage_kinds
    from kareus.jobs.workload import plan_workload, planning_steps

    spec = gpu(args.gpu)
    work = _workload(args)
    _check_policy_options(args)
    _check_clocks(args.clocks, spec)
    evaluator, settings = _plan_evaluator(args, spec)
    # checked before minutes of tracing, not after; removed again if nothing was written
    with output_dir(args.out) as out:
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
                spec,
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
    from kareus.jobs.report import (
        COMPARISON_HEADER,
        comparison_rows,
        traffic_sentence,
        write_outputs,
    )

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
        print(pset.to_text())
        print(f"one micro-batch, {traffic_sentence(planned, pset)}\n")
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
        ep=args.ep,
        expert_skew=args.expert_skew,
        microbatch_size=args.microbatch_size,
        seq_len=args.seq_len,
        microbatches=args.microbatches,
        dtype=args.dtype,
        schedule=args.schedule,
        recompute=args.recompute,
        graphs=_graphs(args),
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


def _graphs(args: argparse.Namespace) -> str:
    """Return the graphs to trace: ``--graphs``, else Inductor's for your own model.

    A plan of a Hugging Face config or a factory is applied to the model it was made from
    with ``kareus.compile``, whose default codegen is Inductor: traced on Inductor's graphs
    it fits by construction (AOTAutograd's may not: a torchtitan-style factory's backward
    had 9 all-gathers on Inductor against 8 traced). The presets keep AOTAutograd's, the
    graphs their figures (docs/results.md) were planned on; so does a torch without the
    Inductor internals tracing them needs (said on stderr).
    """
    from kareus._torch_internals import inductor_lowering

    if getattr(args, "graphs", None):
        return args.graphs  # type: ignore[no-any-return]
    if not (getattr(args, "hf_config", None) or getattr(args, "factory", None)):
        return "aot"
    if inductor_lowering() is None:
        print(
            "kareus plan: this torch lacks the Inductor partition step that tracing "
            "Inductor's graphs needs; tracing AOTAutograd's (apply the plan with "
            "codegen='python')",
            file=sys.stderr,
        )
        return "aot"
    return "inductor"


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
