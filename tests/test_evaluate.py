"""`kareus evaluate`: pricing given per-instruction clock plans without planning."""

import csv
import dataclasses
import json
import pathlib

import pytest

from kareus.cli import EXIT_BAD_INPUT, EXIT_OK, main
from kareus.hardware.calibrate import shared_data_dir
from kareus.jobs.evaluate import (
    ClockPlan,
    ClockPlanError,
    evaluate_clock_plans,
    read_clock_plans,
    stage_orders,
)
from kareus.jobs.stages_file import load_stages, save_stages
from kareus.jobs.trace import Workload
from kareus.jobs.workload import plan_workload
from kareus.planner import PlannerSettings

WORK = Workload(
    model="tiny-4l", tp=2, pp=2, microbatch_size=4, seq_len=32, microbatches=4, recompute="full"
)
ARGS = ["--model", "tiny-4l", "--tp", "2", "--pp", "2", "--microbatch-size", "4"]
ARGS += ["--seq-len", "32", "--microbatches", "4", "--recompute", "full", "--quiet"]
A100 = (210.0, 1410.0)


def uniform(plan_id: str, mhz: float, work: Workload = WORK) -> ClockPlan:
    return ClockPlan(plan_id, tuple(tuple(mhz for _ in o) for o in stage_orders(work)))


def write_csv(path: pathlib.Path, plans: list[ClockPlan], work: Workload = WORK) -> pathlib.Path:
    orders = stage_orders(work)
    with path.open("w", newline="") as fh:
        out = csv.writer(fh)
        out.writerow(["plan_id", "stage", "position", "kind", "microbatch", "freq_mhz", "note"])
        for plan in plans:
            for s, order in enumerate(orders):
                for p, instr in enumerate(order):
                    freq = plan.freqs_mhz[s][p]
                    out.writerow([plan.plan_id, s, p, instr.kind, instr.microbatch, freq, "x"])
    return path


@pytest.mark.slow  # CI's sample leaves it out: a full plan and its evaluation
def test_max_clocks_price_as_the_planners_megatron_plan(tmp_path):
    """Two paths to one figure: the planner's Megatron-LM point (every instruction at the
    highest clock, no overlap, on the original graphs) and evaluate's price of the
    all-highest-clock plan on the same graphs; on the nanobatched graphs kareus plans, the
    same work runs in twice the kernel launches."""
    settings = PlannerSettings(clocks_mhz=(1410, 1005), sweep_points=2)
    traced = tmp_path / "partitions.json"
    planned = plan_workload(
        WORK,
        "a100-40gb",
        settings=settings,
        policy="min_energy",
        on_traced=lambda stages, originals: save_stages(WORK, stages, traced, originals),
    )
    (megatron,) = planned.plan.baselines["megatron"]
    result = evaluate_clock_plans(WORK, "a100-40gb", [uniform("max", 1410)])
    (cost,) = result.plans
    assert result.source == "modelled" and result.method == "megatron"
    assert cost.time_s == pytest.approx(megatron.time_s, rel=1e-9)
    assert cost.energy_j == pytest.approx(megatron.energy_j, rel=1e-9)
    assert cost.energy_per_gpu_column_j == pytest.approx(cost.energy_j / 2)
    # kareus plan's partitions.json holds both graphs: megatron prices its original ones
    (saved,) = evaluate_clock_plans(
        WORK, "a100-40gb", [uniform("max", 1410)], partitions=traced
    ).plans
    assert (saved.time_s, saved.energy_j) == (cost.time_s, cost.energy_j)
    # a file with the split graphs only is priced as it is
    split_only = tmp_path / "split.json"
    save_stages(WORK, load_stages(WORK, traced), split_only)
    (split,) = evaluate_clock_plans(
        WORK, "a100-40gb", [uniform("max", 1410)], partitions=split_only
    ).plans
    assert split.time_s > cost.time_s  # the same work in twice the kernel launches


@pytest.mark.slow  # CI's sample: the frequency-file, data-parallel and reference-plan tests
def test_clock_plans_price_as_the_physics_says():
    slow, fast = uniform("slow", 405), uniform("fast", 1410)  # tiny: memory-bound ops
    # Stage 0's first forward at a low clock: every other instruction waits for it.
    first = uniform("first-slow", 1410)
    first = ClockPlan("first-slow", ((210.0, *first.freqs_mhz[0][1:]), first.freqs_mhz[1]))
    costs = {
        p.plan_id: p for p in evaluate_clock_plans(WORK, "a100-40gb", [slow, fast, first]).plans
    }
    assert costs["slow"].time_s > costs["fast"].time_s
    assert costs["first-slow"].time_s > costs["fast"].time_s
    # Overlap hides part of the collectives, but on this tiny model the nanobatches' extra
    # kernels cost more than it hides: the original graph is faster.
    over = evaluate_clock_plans(WORK, "a100-40gb", [fast], method="nanobatch").plans[0]
    assert over.time_s > costs["fast"].time_s


def test_a_perseus_frequency_file_prices_as_its_csv(tmp_path):
    orders = stage_orders(WORK)
    freqs = [[1410 - 15 * ((s + p) % 7) for p in range(len(o))] for s, o in enumerate(orders)]
    pairs = [
        [(instr.kind, f) for instr, f in zip(o, fs, strict=True)]
        for o, fs in zip(orders, freqs, strict=True)
    ]
    py = tmp_path / "freqs_pipeline_00042.py"
    py.write_text(repr(pairs) + "\n# Iteration 42 total cost: 1.0\n")
    plan = ClockPlan("freqs_pipeline_00042", tuple(tuple(map(float, f)) for f in freqs))
    assert read_clock_plans(py, WORK, A100) == [plan]
    # the same plan from either file: evaluate prices what it reads, so both price alike
    # (evaluating both took 17 s of CI; a plan priced from a file is checked above and below)
    csv = write_csv(tmp_path / "p.csv", [plan])
    assert read_clock_plans(csv, WORK, A100) == read_clock_plans(py, WORK, A100)


def test_plans_built_in_python_are_checked_as_files_are():
    with pytest.raises(ClockPlanError, match="clock 2000 MHz is outside"):
        evaluate_clock_plans(WORK, "a100-40gb", [uniform("hot", 2000)])
    short = ClockPlan("short", ((1410.0,), (1410.0,)))
    with pytest.raises(ClockPlanError, match="clocks per stage, the schedule runs"):
        evaluate_clock_plans(WORK, "a100-40gb", [short])


@pytest.mark.slow  # CI's sample: evaluate's other CLI runs (its table and its errors)
def test_json_output_is_one_object_with_every_plan(tmp_path, capsys):
    path = write_csv(tmp_path / "plans.csv", [uniform("a", 1410), uniform("b", 1200)])
    assert main(["evaluate", *ARGS, "--clocks", str(path), "--json"]) == EXIT_OK
    data = json.loads(capsys.readouterr().out)
    assert data["source"] == "modelled" and [p["plan_id"] for p in data["plans"]] == ["a", "b"]
    for p in data["plans"]:
        assert p["energy_per_gpu_column_j"] == pytest.approx(p["energy_j"] / 2)
    assert main(["evaluate", *ARGS, "--clocks", str(path)]) == EXIT_OK
    table = capsys.readouterr().out
    assert "clock plans (modelled" in table and "│ b " in table


def test_the_reference_pipeline_plans_read_as_they_are(tmp_path):
    """The shared data's plans.csv, filtered to one configuration and method, is a clocks
    file: its positions follow 1F1B and each of its plans covers all 32 instructions."""
    source = shared_data_dir() / "a100_llama_pipeline_plans" / "plans.csv"
    with source.open() as fh:
        rows = list(csv.DictReader(fh))
    keep = [
        r
        for r in rows
        if (r["tp"], r["cp"], r["seq_len"], r["method"]) == ("8", "1", "4096", "perseus")
    ]
    path = tmp_path / "perseus.csv"
    with path.open("w", newline="") as fh:
        out = csv.DictWriter(fh, fieldnames=list(keep[0]))
        out.writeheader()
        out.writerows(keep)
    work = Workload(model="llama3.2-3b", tp=8, pp=2, microbatches=8, recompute="full")
    plans = read_clock_plans(path, work, A100)
    assert len(plans) == len({r["plan_id"] for r in keep}) == 10
    assert all(len(p.freqs_mhz[0]) == len(p.freqs_mhz[1]) == 16 for p in plans)
    with pytest.raises(ClockPlanError, match=r"line \d+: a plan for another configuration: "):
        read_clock_plans(source, work, A100)  # unfiltered: other configurations' rows


def test_under_interleaved_1f1b_a_stage_row_is_a_pipeline_rank(tmp_path):
    """A rank runs two model stages; its rows count its instructions in the order it runs."""
    work = Workload(
        model="tiny-4l", pp=2, schedule="Interleaved1F1B", virtual_stages=2, microbatches=4
    )
    orders = stage_orders(work)
    assert [len(o) for o in orders] == [16, 16]  # 2 stages x (F, B) x 4 micro-batches
    assert {i.stage for i in orders[0]} == {0, 2} and {i.stage for i in orders[1]} == {1, 3}
    plan = uniform("i", 1200, work)
    assert read_clock_plans(write_csv(tmp_path / "i.csv", [plan], work), work, A100) == [plan]


def _edit(rows: list[list[str]], line: int, column: int, value: str) -> list[list[str]]:
    rows = [list(r) for r in rows]
    rows[line - 1][column] = value
    return rows


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda r: [[c for i, c in enumerate(row) if i != 4] for row in r], None),
        (lambda r: [[c for i, c in enumerate(row) if i != 5] for row in r], "missing column"),
        (lambda r: _edit(r, 3, 3, "recompute"), "line 3: unknown kind 'recompute'"),
        (lambda r: _edit(r, 4, 5, "1500"), "line 4: clock 1500 MHz is outside"),
        (lambda r: _edit(r, 2, 3, "backward"), "line 2: stage 0 position 0 runs the forward"),
        (lambda r: _edit(r, 5, 4, "3"), "line 5: stage 0 position 3 runs the forward of micro"),
        (lambda r: _edit(r, 6, 2, "40"), "line 6: stage 0 runs 8 instructions"),
        (lambda r: _edit(r, 6, 1, "7"), "line 6: stage 7 does not exist"),
        (lambda r: _edit(r, 6, 2, "x"), "line 6: stage, position and microbatch must be"),
        (lambda r: r[:-3], "plan a has no clock for stage 1 position(s) 5-7"),
        (lambda r: [*r, r[1]], "gives stage 0 position 0 a clock twice"),
    ],
)
def test_bad_clocks_files_exit_2_naming_the_row(tmp_path, capsys, change, message):
    good = write_csv(tmp_path / "good.csv", [uniform("a", 1410)])
    rows = list(csv.reader(good.read_text().splitlines()))
    path = tmp_path / "bad.csv"
    with path.open("w", newline="") as fh:
        csv.writer(fh).writerows(change(rows))
    if message is None:  # without the optional microbatch column the file is fine
        assert len(read_clock_plans(path, WORK, A100)) == 1
        return
    assert main(["evaluate", *ARGS, "--clocks", str(path)]) == EXIT_BAD_INPUT
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[[('forward', 1410)]]", "the frequency file has 1 stage(s), the pipeline 2"),
        ("{'a': 1}", "a list of per-stage lists"),
        ("not a plan", "neither a clocks CSV"),
        ("[[('forward', 'fast')], []]", "the clock 'fast' is not a number"),
    ],
)
def test_bad_frequency_files_say_what_is_wrong(tmp_path, text, message):
    path = tmp_path / "freqs.py"
    path.write_text(text)
    with pytest.raises(ClockPlanError, match=message.replace("(", r"\(").replace(")", r"\)")):
        read_clock_plans(path, WORK, A100)


def test_with_data_parallelism_evaluate_prices_as_the_planner(tmp_path):
    """`kareus evaluate --dp` prices the iteration `kareus plan --dp` composes: the planner's
    Megatron-LM point and evaluate's all-highest-clock plan agree, and both are slower than
    without data-parallel traffic."""
    import dataclasses

    work = dataclasses.replace(WORK, dp=4, dp_mode="fsdp", gpus_per_node=2)  # across nodes
    settings = PlannerSettings(clocks_mhz=(1410, 1005), sweep_points=2)
    planned = plan_workload(work, "a100-40gb", settings=settings, policy="min_energy")
    (megatron,) = planned.plan.baselines["megatron"]
    (cost,) = evaluate_clock_plans(work, "a100-40gb", [uniform("max", 1410, work)]).plans
    assert cost.time_s == pytest.approx(megatron.time_s, rel=1e-9)
    assert cost.energy_j == pytest.approx(megatron.energy_j, rel=1e-9)
    (alone,) = evaluate_clock_plans(WORK, "a100-40gb", [uniform("max", 1410)]).plans
    assert cost.time_s > alone.time_s and cost.energy_j > alone.energy_j


def test_instruction_times_are_the_profiles_the_plans_are_priced_from():
    """What `evaluate` reports per instruction is what its plans' makespans are made of."""
    from kareus.planner.dag import makespan, schedule_iteration

    plans = [uniform("max", 1410), uniform("low", 1005)]
    result = evaluate_clock_plans(WORK, "a100-40gb", plans)
    times = result.instruction_times_s
    assert set(times) == {(s, k) for s in (0, 1) for k in ("forward", "backward")}
    iteration = schedule_iteration(WORK.schedule, WORK.pp, WORK.microbatches)
    for plan, cost in zip(plans, result.plans, strict=True):
        mhz = plan.freqs_mhz[0][0]
        durations = [times[(i.stage, i.kind)][mhz] for i in iteration.instructions]
        assert makespan(iteration, durations) == pytest.approx(cost.time_s, rel=1e-9)
    assert all(t[1005] > t[1410] for t in times.values())
    listed = json.loads(json.dumps(result.to_dict()))["instructions"]
    assert {(e["stage"], e["kind"]) for e in listed} == set(times)


def test_the_fidelity_benchmark_recovers_a_known_clock_response():
    """`pipeline_fidelity.clock_response` fitted to makespans made from a known response
    (stage 0's forward + backward at the top clock, the share not scaling with the clock,
    the later stage's weight) gives that response back, on the reference plans' own 1F1B
    schedule and clocks."""
    import sys

    from kareus.planner.dag import makespan, schedule_iteration

    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))
    import pipeline_fidelity as pf

    if not (shared_data_dir() / "a100_llama_pipeline_plans" / "plans.csv").is_file():
        pytest.skip("the reference A100 pipeline plans are not at shared/data")
    key = (8, 1, 2, 8, 4096, 8)
    work = pf._workload(key, "full")
    plans = [p for p, _t, _e in pf.reference()[key]["perseus"].values()]
    top = {(0, "forward"): 0.15, (0, "backward"): 0.39, (1, "forward"): 0.16}
    top[(1, "backward")] = 0.37
    shape = {k: {1410.0: v} for k, v in top.items()}
    iteration = schedule_iteration(work.schedule, work.pp, work.microbatches)
    position = {
        (i.stage, i.kind, i.microbatch): (r, p)
        for r, order in enumerate(stage_orders(work))
        for p, i in enumerate(order)
    }
    for stage0_s, fixed, later in ((0.54, 0.09, 1.0), (0.50, 0.32, 0.95)):
        times = []
        for plan in plans:
            durations = []
            for i in iteration.instructions:
                rank, p = position[i.stage, i.kind, i.microbatch]
                scale = fixed + (1 - fixed) * 1410 / plan.freqs_mhz[rank][p]
                scale *= later if i.stage else 1.0
                durations.append(stage0_s * top[(i.stage, i.kind)] / 0.54 * scale)
            times.append(makespan(iteration, durations))
        fit = pf.clock_response(key, "full", plans, times, shape)
        assert fit.stage0_s == pytest.approx(stage0_s, rel=1e-3)
        assert fit.fixed == pytest.approx(fixed, abs=1e-3)
        assert fit.later_stages == pytest.approx(later, abs=1e-3)
        assert fit.rms < 1e-4


@pytest.mark.parametrize("bad", ["foo=1", "contention=1", "mem_clock_knee=x", "mem_clock_knee"])
def test_the_fidelity_benchmark_refuses_a_factor_it_cannot_set(bad, monkeypatch, capsys):
    """`--set` takes a prior of the calibration and a number; a fitted factor would be
    refitted whatever it is set to, so it is refused too, before anything is priced."""
    import sys

    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))
    import pipeline_fidelity as pf

    def no_pricing(*_args, **_kwargs):
        raise AssertionError("priced before refusing")

    monkeypatch.setattr(pf, "recalibrated", no_pricing)
    monkeypatch.setattr(pf, "priced", no_pricing)
    monkeypatch.setattr(sys, "argv", ["pipeline_fidelity.py", "--set", bad])
    with pytest.raises(SystemExit) as exit_:
        pf.main()
    assert exit_.value.code == 2
    assert f"--set {bad!r}" in capsys.readouterr().err


def test_the_comparison_of_the_reference_configurations_plans_what_the_fidelity_prices():
    """`compare.py --reference` plans, on A100, exactly the workloads whose reference plans
    `pipeline_fidelity.py` prices, so that kareus's own savings stand beside the reference's."""
    import sys

    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))
    import compare
    import pipeline_fidelity as pf

    if not (shared_data_dir() / "a100_llama_pipeline_plans" / "plans.csv").is_file():
        pytest.skip("the reference A100 pipeline plans are not at shared/data")
    runs = compare.reference_matrix()
    assert {gpus for _f, gpus in runs} == {("a100-40gb",)}
    planned = {
        compare.workload_key(fields): dataclasses.asdict(Workload(**fields)) for fields, _g in runs
    }
    priced = {
        compare.workload_key(w): w
        for w in (dataclasses.asdict(pf._workload(key, "full")) for key in pf.reference())
    }
    assert planned == priced


def test_the_comparison_saves_each_workloads_rows_and_resumes_only_the_same_codes(
    tmp_path, monkeypatch, capsys
):
    """A stopped `compare.py` keeps every workload planned so far: `--resume` takes those
    rows instead of planning again, but only where the same kareus code (by the digest of
    its package files) planned them on the same GPUs."""
    import sys

    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))
    import compare

    fields = {"model": "llama3.2-3b", "tp": 8, "cp": 1, "pp": 2, "microbatch_size": 8,
              "seq_len": 4096, "microbatches": 8, "layers_per_stage": (15, 13)}  # fmt: skip
    other = {**fields, "seq_len": 8192}
    rows = [{"key": compare.workload_key(fields), "gpu_key": "a100-40gb", "plan_s": 1.0}]
    code = compare.code_fingerprint()
    compare.save_rows(tmp_path, fields, ("a100-40gb",), code, rows)
    assert compare.saved_rows(tmp_path, fields, ("a100-40gb",), code)[0] == rows
    assert compare.saved_rows(tmp_path, fields, ("a100-40gb", "h100"), code)[0] is None
    assert compare.saved_rows(tmp_path, fields, ("a100-40gb",), "0" * 16)[0] is None
    assert compare.saved_rows(tmp_path, other, ("a100-40gb",), code)[0] is None
    assert not list(tmp_path.glob("rows/*.tmp"))

    # every workload saved: nothing is planned (a planning worker would fail here)
    monkeypatch.setattr(compare, "run_workload", None)
    got, resumed = compare.plan_all(
        [(fields, ("a100-40gb",))], tmp_path, jobs=1, reuse=True, resume=True
    )
    assert got == rows and resumed == [compare.workload_key(fields)]
    assert "planned by the same code" in capsys.readouterr().out

    # the digest covers the package's files: one byte changed anywhere changes it
    import kareus

    package = tmp_path / "kareus"
    (package / "hardware" / "calibration").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    calibration = package / "hardware" / "calibration" / "gpu.json"
    calibration.write_text('{"knee": 0.82}')
    monkeypatch.setattr(kareus, "__file__", str(package / "__init__.py"))
    before = compare.code_fingerprint()
    calibration.write_text('{"knee": 0.83}')
    assert compare.code_fingerprint() != before != code
