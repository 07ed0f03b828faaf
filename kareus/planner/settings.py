"""The planner's own knobs and the job's parallelism: what every planning call is given."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from kareus.planner.dag import SwitchCost
from kareus.planner.problem import SolveKnobs


@dataclasses.dataclass(frozen=True, kw_only=True)
class PlannerSettings:
    """Knobs of the planner itself.

    Attributes:
        clocks_mhz: clocks to consider; None takes a spread of the top of the GPU's range
            (:data:`~kareus.planner.knobs.DEFAULT_CLOCK_COUNT` of them), planned again on
            every clock there where an iteration past ``dive_max_instructions`` leaves
            solves unproven (:meth:`finer_clocks`).
        sm_shares: SM shares of the collective to consider.
        no_overlap_sm_share: SMs of a collective that runs alone: NCCL's defaults, which
            reach its published bus bandwidth (about 230 GB/s on 8 A100s, with 24 channels:
            NCCL's init log on an HGX A100, NVIDIA/nccl-tests#100), in the hardware model
            32 CTAs of the measured copy rate.
        default_sm_share: SMs of a collective that the nanobatching baseline overlaps on
            the default communicator: NCCL's defaults again, hence the same 32. With 16
            (an SM limit the baseline does not set) its plans priced 10 % slower than the
            reference A100 nanobatching plans at TP 8 (``benchmarks/pipeline_fidelity.py``).
        exhaustive: evaluate every setting instead of searching.
        budget_fraction: search budget as a fraction of each type's grid.
        sweep_points: bounds swept to trace each frontier.
        solver_time_limit_s: a search's work limit per solve and 64 instructions:
            CP-SAT's deterministic time units (roughly seconds of one core), or 500 of
            SCIP's nodes a unit (``branch_max_instructions``): a limit of work, not of
            wall-clock time, so plans never depend on machine load.
        solver_workers: CP-SAT workers; more than one are interleaved in one thread (that
            keeps the search deterministic).
        solver_gap_limit: a solve stops once its plan is proven within this fraction of
            the least energy at its time bound: by the linear relaxation alone, or else by
            CP-SAT's search (each point's proven gap is reported).
        search_max_instructions: CP-SAT searches only iterations of at most this many
            instructions; larger ones keep the relaxation's plan (improved by its dive) with
            its proven gap. On the traced Llama 3.3 70B PP 8 x 16 with full recompute (256
            instructions) CP-SAT's five searches took 102 s of the 127 s planning and
            improved one point by 0.04 %. Smaller iterations (the README's main job has 32
            instructions) keep it for the points the relaxation and dive leave loose.
        branch_max_instructions: iterations of at most this many instructions are searched
            by SCIP's branch and bound (:mod:`kareus.planner.mip`) instead of CP-SAT, under
            the same work limit (``solver_time_limit_s``: 500 nodes a unit and 64
            instructions). Where clock changes decide a solve's gap, CP-SAT's bound stays
            below the simplex's and proves nothing: at micro-batches of 1, 2 and 3
            sequences (Llama 3.2 3B, TP 8 x PP 2 x 8, 32 instructions, A100) it left 16 of
            41, 15 of 44 and 17 of 43 solves unproven within 0.5 %, SCIP 0 of 36, 0 of 38
            and 0 of 32 (modelled; docs/planning.md has the times). At 64 instructions
            SCIP's root alone takes seconds and its nodes raised no bound (the Mixtral 8x7B
            and Qwen3 30B-A3B solves of docs/planning.md: 20-30 s a solve, gaps 0.5-0.9 %
            either way), so larger iterations keep CP-SAT.
        dive_max_instructions: the relaxation's dive (re-solving with mixed instructions
            fixed, round by round) improves the rounded plan only in iterations of at most
            this many instructions; larger ones keep the rounded plan with its proven gap,
            and are planned again on every clock of the GPU's top half where that leaves
            solves unproven (:meth:`finer_clocks`). The traced Llama 3.3 70B at TP 8 x
            PP 8 (``python benchmarks/planner.py --traced``, 2 cores; docs/planning.md): at
            32 micro-batches (512 instructions) dives on 19 clocks took 172.5 s and left 8
            solves unproven within 0.5 % (largest gap 0.52 %), the flow on 19 clocks and
            then on every clock 22.6 s and 1 (0.50 %); at 64 (1,024) 404 s and 6 (0.68 %)
            against 46.0 s and none (0.49 %). The simplex's programs at that size stall
            after a dive (45-249 s a fresh solve) and bought a tighter bound, not a better
            plan.
            At 2,048 instructions (the traced Llama 3.3 70B, PP 16 x 64) each round
            re-solves a program of about 100,000 variables: with dives planning took more
            than 15 minutes, without them 24-47 s with every point within 0.92 % (the
            chosen one within 0.43 %).
        flow_min_instructions: iterations of at least this many instructions solve the
            relaxation as a min-cost flow (:mod:`kareus.planner.flow`: the simplex's bound,
            a plan rounded about as well, a solve in 0.1-2 s at 4,096 instructions) rather
            than by the simplex (None: always the simplex). Where the flow's plan is not
            proven within the gap limit and the iteration has at most
            ``dive_max_instructions``, the simplex dives as well and the better plan and
            bound are kept. The default starts past CP-SAT's search limit, so small
            iterations plan as before. On Llama 3.3 70B shapes, TP 8 (``python
            benchmarks/planner.py --scale 8x16,8x64,16x64,16x128``, 2026-12-03, 2 cores,
            on the ten clocks then planned by default): PP 8 x 64 (1,024 instructions)
            plans in 7.9 s instead of 16.9 s, PP 16 x 64 in 23 s instead of 63 s, PP 16 x
            128 in 77 s instead of 661 s, gaps no larger.
        switch: what one clock change costs; None takes the GPU spec's
            (:func:`plan_for_gpu`), or none where no spec is given.
    """

    clocks_mhz: tuple[float, ...] | None = None
    sm_shares: tuple[int, ...] = (2, 4, 8, 16, 32)
    no_overlap_sm_share: int = 32
    default_sm_share: int = 32
    exhaustive: bool = False
    budget_fraction: float = 0.2
    sweep_points: int = 10
    solver_time_limit_s: float = 1.0
    solver_workers: int = 1
    solver_gap_limit: float = 0.005
    search_max_instructions: int | None = 128
    branch_max_instructions: int | None = 32
    dive_max_instructions: int | None = 256
    flow_min_instructions: int | None = 129
    switch: SwitchCost | None = None

    def solve_knobs(self) -> SolveKnobs:
        """Return how the composer solves under these settings."""
        return SolveKnobs(
            time_limit_s=self.solver_time_limit_s,
            workers=self.solver_workers,
            gap_limit=self.solver_gap_limit,
            search_max_instructions=self.search_max_instructions,
            branch_max_instructions=self.branch_max_instructions,
            dive_max_instructions=self.dive_max_instructions,
            flow_min_instructions=self.flow_min_instructions,
            switch=self.switch,
        )

    def planned_clocks(self, supported_mhz: Sequence[int]) -> tuple[float, ...]:
        """Return the clocks planned first: ``clocks_mhz``, or a spread of ``supported_mhz``.

        The spread is :data:`~kareus.planner.knobs.DEFAULT_CLOCK_COUNT` clocks of the top
        half of the GPU's (``supported_mhz``).
        """
        from kareus.planner.knobs import default_clocks

        return tuple(self.clocks_mhz or default_clocks(supported_mhz))

    def finer_clocks(
        self, supported_mhz: Sequence[int], instructions: int
    ) -> tuple[float, ...] | None:
        """Return the clocks planned again where the first grid leaves solves unproven.

        Every clock of the top half of ``supported_mhz``, for an iteration of more than
        ``dive_max_instructions`` instructions planned on the default clocks (None
        otherwise). Without a dive the plan is the flow's rounding, and each instruction
        that mixes two clocks pays a fraction of the step between them: a pipeline mixes
        hundreds. On the traced Llama 3.3 70B at TP 8 x PP 8 x 64 micro-batches, near the
        fastest plan the stages that wait on the last one lost 0.6 % of the energy so on
        19 clocks; on every clock (48 on an A100) every solve is proven within 0.5 %. Not
        first, nor everywhere: with every clock nearly each instruction changes clock (on
        the synthetic 70B pipelines of ``benchmarks/planner.py --scale``, 980 changes a
        solve against 50-650), which the flow's bound leaves out, so where the default
        grid proves its solves it plans tighter and sooner (2026-12-06, 2 cores).
        """
        from kareus.planner.knobs import default_clocks

        dives = self.dive_max_instructions is None or instructions <= self.dive_max_instructions
        if self.clocks_mhz or dives:
            return None
        return default_clocks(supported_mhz, len(supported_mhz))


@dataclasses.dataclass(frozen=True, kw_only=True)
class Parallelism:
    """How the job is parallelised: tensor, context, pipeline stages, micro-batches."""

    tp: int = 1
    pp: int = 1
    microbatches: int = 1
    cp: int = 1
    schedule: str = "1F1B"  # the pipeline schedule: a key of compose.SCHEDULES
    virtual_stages: int = 1  # stages per pipeline rank (Interleaved1F1B: 2 or more)

    @property
    def stages(self) -> int:
        """Pipeline stages: ranks times stages per rank (stage ``v * pp + r`` on rank r)."""
        return self.pp * self.virtual_stages

    @property
    def instructions(self) -> int:
        """Forward and backward instructions of one iteration (each micro-batch's, per stage)."""
        return 2 * self.stages * self.microbatches

    @property
    def gpus_per_stage(self) -> int:
        """GPUs of one pipeline stage (tensor x context parallel)."""
        return self.tp * self.cp

    @property
    def gpus(self) -> int:
        """GPUs of one pipeline replica (its ranks, not its stages)."""
        return self.gpus_per_stage * self.pp
