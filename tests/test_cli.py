"""`kareus plan` / `kareus explain` / `kareus list`, and tracing at scale on fake tensors."""

import dataclasses
import json
import subprocess
import sys

import pytest

from kareus.cli import EXIT_BAD_INPUT, EXIT_INFEASIBLE, EXIT_OK, main
from kareus.hardware import gpu
from kareus.ir.plan_file import Plan
from kareus.jobs.trace import Workload, trace
from kareus.models import LlamaConfig
from kareus.planner.knobs import default_clocks

SMALL = ["--model", "tiny-4l", "--tp", "2", "--microbatch-size", "4", "--seq-len", "32"]
# These tests check what is planned and written, not gaps: little CP-SAT work (a twentieth of
# the default: the CLI's plans spend most of their time in CP-SAT), and ten clocks (the
# default plans 19; TEN_CLOCKS are among them).
TEN_CLOCKS = ",".join(map(str, default_clocks(gpu("a100-40gb").clocks_mhz(), 10)))
SMALL += ["--solver-work", "0.05", "--clocks", TEN_CLOCKS]


@pytest.fixture(scope="module")
def planned(tmp_path_factory):
    """One end-to-end run of the CLI on a small preset (TP 2 x CP 2, PP 2)."""
    out = tmp_path_factory.mktemp("plan")
    args = ["plan", *SMALL, "--cp", "2", "--pp", "2", "--microbatches", "4", "--out", str(out)]
    return main([*args, "--quiet"]), out


def test_a_micro_batch_of_one_is_traced_split_along_the_sequence():
    """What `kareus plan` traces at --microbatch-size 1 (CI's sample of the end-to-end test
    below): every layer split along the sequence in both directions, each half's
    all-reduces beside the other half's compute, and a note that says so."""
    work = Workload(model="tiny-4l", tp=2, microbatch_size=1, seq_len=32, microbatches=1)
    [split], notes = trace(work)
    assert {(p.block, p.instruction) for p in split.partitions} == {
        (f"layers.{i}", kind) for i in range(4) for kind in ("forward", "backward")
    }
    assert any("4 of 4 blocks split along the sequence" in n for n in notes), notes


@pytest.mark.slow  # CI's sample: the trace above (the planning path is any micro-batch's)
@pytest.mark.parametrize("size", [1, 3])
def test_micro_batches_of_one_to_three_sequences_are_split_along_the_sequence(
    size, tmp_path, capsys
):
    """Micro-batches of 1 to 3 sequences: the layers are traced split along the sequence
    (their attention is causal) and whole, and planned as any micro-batch is (the split
    chosen where it pays); the baselines priced on the same iteration, and kareus at
    Megatron-LM's time uses no more energy than Megatron-LM's own plan."""
    args = ["plan", *SMALL, "--microbatch-size", str(size), "--microbatches", "2"]
    assert main([*args, "--out", str(tmp_path)]) == EXIT_OK
    shown = capsys.readouterr().out
    plan = Plan.load(tmp_path / "plan.json")
    assert plan.workload["microbatch_size"] == size
    said = "4 of 4 blocks split along the sequence"
    assert said in shown and said in (tmp_path / "report.md").read_text()
    saved = json.loads((tmp_path / "partitions.json").read_text())
    split = [p for s in saved["sets"] for p in s["partitions"]]
    # every layer of the split graphs is partitioned in both directions, each half's
    # all-reduces beside the other half's compute; the original graphs hold none
    assert {p["instruction"] for p in split} == {"forward", "backward"}
    assert {p["block"] for p in split} == {f"layers.{i}" for i in range(4)}
    assert not any(s["partitions"] for s in saved["original"]["sets"])
    assert set(plan.baselines) == {"megatron", "perseus", "nanobatch+perseus"}
    assert len(plan.schedule) == 2 * 2  # (F, B) x micro-batches
    megatron = plan.baselines["megatron"][0]
    assert min(p.energy_j for p in plan.frontier if p.time_s <= megatron.time_s * 1.0001) <= (
        megatron.energy_j
    )
    assert "too small" not in (tmp_path / "report.md").read_text()


def test_plan_writes_plan_report_plot_and_partitions(planned, capsys):
    rc, out = planned
    assert rc == EXIT_OK
    plan = Plan.load(out / "plan.json")
    assert plan.parallel == {"tp": 2, "cp": 2, "pp": 2, "microbatches": 4}
    assert plan.workload["model"] == "tiny-4l" and plan.source == "modelled"
    assert plan.workload["graphs"] == "aot"  # a preset's default: AOTAutograd's graphs
    # Layers this small gain less from overlap than a second nanobatch's launches cost:
    # the plan runs the original graphs, clocks only, which Megatron-LM's and Perseus's
    # points run too; the split graphs and the original ones are both kept to re-plan from.
    assert plan.nanobatches == 1 and not any(plan.decisions.values())
    assert all(p.nanobatches == 1 for m in ("megatron", "perseus") for p in plan.baselines[m])
    saved = json.loads((out / "partitions.json").read_text())
    assert len(saved["original"]["sets"]) == 2 and not saved["original"]["sets"][0]["partitions"]
    # The fingerprint of the graphs the plan runs, which kareus.compile(plan=...) checks the
    # model against: each instruction whole, told by its layer blocks' matmuls and collectives.
    assert set(plan.fingerprint) == {f"{s}/{k}" for s in (0, 1) for k in ("forward", "backward")}
    assert all(set(fp) == {"whole"} for fp in plan.fingerprint.values())
    assert all("all_reduce" in fp["whole"] for fp in plan.fingerprint.values())
    assert "all_gather" in plan.fingerprint["0/forward"]["whole"]  # context parallel
    assert set(plan.baselines) == {"megatron", "perseus", "nanobatch+perseus"}
    assert len(plan.schedule) == 2 * 2 * 4  # stages x (F, B) x micro-batches
    report = (out / "report.md").read_text()
    for heading in ("## Methods side by side", "## Frontiers", "## Overlap decisions"):
        assert heading in report
    assert "modelled" in report and "frontier.png" in report
    assert report.count("| chosen |") == 1  # in kareus's frontier only
    assert "| per micro-batch |" in report and "## Hardware model" in report
    # The saving split over clocks, default overlap and the joint choice, at one time; kareus
    # (whose options include every baseline's) is never above a baseline there.
    ladder = report.split("## Where the saving comes from")[1].split("## Overlap decisions")[0]
    mega = plan.baselines["megatron"][0]
    t_ref = max(plan.chosen.time_s, mega.time_s)
    best = min(p.energy_j for p in plan.frontier if p.time_s <= t_ref * (1 + 1e-9))
    if mega.energy_j - best <= 5e-4 * mega.energy_j:  # no saving: none to split, said so
        assert "kareus saves nothing over Megatron-LM" in ladder and "|" not in ladder
    else:
        rows = [r.split("|")[1:3] for r in ladder.splitlines() if r.startswith("| ")]
        rows = [(a.strip(), b.strip()) for a, b in rows if a.strip() not in ("plan", "---")]
        assert len(rows) == 4 and rows[0][0].startswith("Megatron-LM")
        assert rows[-1][0].endswith("(kareus)")
        energies = [float(cell) for _, cell in rows if cell[:1].isdigit()]  # else "no plan"
        assert energies[-1] <= min(energies) * (1 + 1e-9)
        assert "overlap decisions" in ladder.split("|")[-1]  # which differ, or that none do
    assert "| proven gap |" in report and "The solver proved" in report
    assert all(p.lower_bound_j is not None for p in plan.frontier)
    assert (out / "frontier.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    sets = json.loads((out / "partitions.json").read_text())["sets"]
    kinds = {t["collective"]["kind"] for s in sets for t in s["types"].values() if t["collective"]}
    assert {"all_reduce", "all_gather", "reduce_scatter"} <= kinds  # TP and CP collectives
    for s in sets:  # every layer of every stage is partitioned in both directions
        blocks = {
            kind: {p["block"] for p in s["partitions"] if p["instruction"] == kind}
            for kind in ("forward", "backward")
        }
        assert blocks["forward"] == blocks["backward"] == {"layers.0", "layers.1"}


def test_explain_prints_a_saved_plan_through_the_entry_point(planned):
    _rc, out = planned
    shown = subprocess.run(
        [sys.executable, "-m", "kareus", "explain", str(out / "plan.json")],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "kareus frontier (modelled)" in shown and "megatron" in shown
    assert "workload: tiny-4l bf16, TP 2 x CP 2 x PP 2" in shown


@pytest.mark.parametrize(
    ("args", "rc", "message"),
    [
        (["plan", "--model", "llama9"], EXIT_BAD_INPUT, "unknown model 'llama9'; known models"),
        (["plan", "--model", "tiny", "--gpu", "v100"], EXIT_BAD_INPUT, "unknown GPU 'v100'"),
        (
            ["plan", "--model", "llama3.2-3b", "--tp", "16"],
            EXIT_BAD_INPUT,
            "num_kv_heads=8 is not divisible by the tensor-parallel size 16",
        ),
        (
            ["plan", "--model", "llama3.2-3b", "--pp", "3"],
            EXIT_BAD_INPUT,
            "num_layers=28 is not divisible by the pipeline-parallel size 3",
        ),
        (
            ["plan", "--model", "tiny", "--cp", "3", "--seq-len", "32"],
            EXIT_BAD_INPUT,
            "seq_len=32 is not divisible by the doubled context-parallel size (two chunks per "
            "rank) 6",
        ),
        (["plan", "--model", "tiny", "--select", "deadline_s"], EXIT_BAD_INPUT, "--deadline"),
        (["plan", "--model", "tiny", "--clocks", "99999"], EXIT_BAD_INPUT, "outside"),
        (
            ["plan", "--model", "tiny", "--select", "deadline_s", "--deadline", "0"],
            EXIT_BAD_INPUT,
            "--deadline must be a positive number of seconds",
        ),
        (
            ["plan", "--model", "tiny", "--select", "energy_budget_j", "--energy-budget", "-5"],
            EXIT_BAD_INPUT,
            "--energy-budget must be a positive number of joules",
        ),
        (["plan", "--model", "tiny", "--evaluator", "replay"], EXIT_BAD_INPUT, "--replay FILE"),
        (
            ["plan", "--model", "tiny", "--pp", "2", "--virtual-stages", "2"],
            EXIT_BAD_INPUT,
            "Interleaved1F1B needs 2 or more stages per rank",
        ),
        (
            ["plan", "--model", "llama3.2-3b", "--pp", "4", "--schedule", "Interleaved1F1B"],
            EXIT_BAD_INPUT,
            "num_layers=28 is not divisible by the pipeline-parallel size 8",
        ),
        (["explain", "/no/such/plan.json"], EXIT_BAD_INPUT, "cannot read the kareus plan"),
    ],
)
def test_bad_input_gets_its_error_and_exit_status(args, rc, message, capsys):
    assert main(args) == rc
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    ("option", "message"),
    [
        (["--clocks", "fast"], "comma-separated list of integers"),
        (["--layers-traced", "2"], "trace at least 4 layers per stage"),
        (["--solver-work", "0"], "'0' must be positive"),
    ],
)
def test_malformed_options_are_rejected_by_the_parser(option, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["plan", "--model", "tiny", *option])
    assert exit_.value.code == EXIT_BAD_INPUT
    assert message in capsys.readouterr().err


def test_version_and_help_show_what_a_user_needs(capsys):
    import kareus

    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert (
        exit_.value.code == 0 and capsys.readouterr().out.strip() == f"kareus {kareus.__version__}"
    )
    with pytest.raises(SystemExit):
        main(["plan", "--help"])
    shown = " ".join(capsys.readouterr().out.split())
    assert "(default: a100-40gb)" in shown and "(default: kareus-out)" in shown
    assert "(default: None)" not in shown and "directory for plan.json" in shown


def test_replanning_from_saved_partitions_needs_the_same_workload(
    planned, tmp_path, capsys, monkeypatch
):
    _rc, out = planned

    def resolved_again(name, **_kw):
        raise AssertionError(f"GPU {name!r} resolved a second time: the CLI resolves it once")

    monkeypatch.setattr("kareus.jobs.workload.gpu", resolved_again)
    args = ["plan", *SMALL, "--cp", "2", "--pp", "2", "--microbatches", "2", "--quiet"]
    saved = ["--partitions", str(out / "partitions.json"), "--out", str(tmp_path)]
    assert main(["-v", *args, *saved, "--gpu", "h100", "--select", "min_energy"]) == EXIT_OK
    plan = Plan.load(tmp_path / "plan.json")
    logged = capsys.readouterr().err  # -v: what kareus does, on stderr
    assert "kareus: INFO kareus.jobs.workload: read 2 pipeline stages' partitions" in logged
    assert "frontier points, chosen" in logged
    assert plan.gpu.startswith("H100") and plan.parallel["microbatches"] == 2
    other = ["plan", *SMALL, "--cp", "2", "--pp", "2", "--seq-len", "64", "--quiet", *saved]
    assert main(other) == EXIT_BAD_INPUT
    assert "traced for another workload: seq_len 32 != 64" in capsys.readouterr().err


def test_the_report_says_which_size_limit_left_points_unproven(planned):
    from kareus.jobs.report import report_markdown
    from kareus.jobs.workload import plan_workload
    from kareus.planner import PlannerSettings

    _rc, out = planned
    work = Workload(model="tiny-4l", tp=2, cp=2, pp=2, microbatch_size=4, seq_len=32)
    work = dataclasses.replace(work, microbatches=4)  # 16 instructions
    tight = PlannerSettings(  # (little CP-SAT work, five clocks: the text, not the proofs)
        clocks_mhz=(1410, 1260, 1095, 945, 780),
        solver_gap_limit=0.0,
        search_max_instructions=8,
        dive_max_instructions=8,
        solver_time_limit_s=0.05,
    )
    got = plan_workload(work, "a100-40gb", settings=tight, partitions=out / "partitions.json")
    assert got.plan.evaluations["solves_not_proven_optimal"] > 0  # gap limit 0: rounding is loose
    cost = report_markdown(got).split("## Cost of planning")[1]
    assert "this iteration has 16 instructions" in cost
    assert "`PlannerSettings.dive_max_instructions`" in cost
    assert "`PlannerSettings.search_max_instructions`" in cost
    roomy = dataclasses.replace(tight, search_max_instructions=None, dive_max_instructions=None)
    cost = report_markdown(
        plan_workload(work, "a100-40gb", settings=roomy, partitions=out / "partitions.json")
    ).split("## Cost of planning")[1]
    assert "this iteration has" not in cost
    # 16 instructions: the solves the relaxation left open were searched by SCIP, and said so
    assert "by SCIP's branch and bound" in cost


# CI's sample leaves it out: a second full plan
@pytest.mark.slow
def test_a_deadline_nothing_meets_says_what_is_achievable(planned, tmp_path, capsys):
    _rc, out = planned
    args = ["plan", *SMALL, "--cp", "2", "--pp", "2", "--quiet", "--out", str(tmp_path)]
    args += ["--partitions", str(out / "partitions.json")]
    assert main([*args, "--select", "deadline_s", "--deadline", "1e-9"]) == EXIT_INFEASIBLE
    assert "the fastest achievable is" in capsys.readouterr().err
    # Written before planning: the user can re-plan from it with another policy.
    assert (tmp_path / "partitions.json").is_file() and not (tmp_path / "plan.json").exists()


def test_explain_rejects_a_file_that_is_not_a_plan(tmp_path, capsys):
    bad = tmp_path / "x.json"
    bad.write_text('{"hello": 1}')
    assert main(["explain", str(bad)]) == EXIT_BAD_INPUT
    assert "plan version None is not supported" in capsys.readouterr().err


def test_list_shows_presets_and_gpus(capsys):
    assert main(["list"]) == EXIT_OK
    shown = capsys.readouterr().out
    assert "llama3.3-70b" in shown and "a100-sxm4-40gb" in shown and "a100-40gb" in shown


@pytest.mark.slow  # CI's sample leaves it out: an equivalence over full traces
def test_counting_repeated_layers_equals_tracing_them_all():
    """Four traced layers, the rest counted, give the partition set of tracing all five."""
    cfg = LlamaConfig(
        num_layers=5, hidden_size=16, num_heads=2, num_kv_heads=2, intermediate_size=32
    )
    work = Workload(model=cfg, tp=2, microbatch_size=4, seq_len=8, microbatches=1)
    [counted], _ = trace(work, layers=4)
    [full], _ = trace(work, layers=5)
    assert {k: t.describe() for k, t in counted.types.items()} == {
        k: t.describe() for k, t in full.types.items()
    }
    for kind in ("forward", "backward"):
        assert counted.counts(kind) == full.counts(kind)
        assert _costs(counted.other[kind]) == _costs(full.other[kind])
        assert sorted(_costs(counted.outside(kind))) == sorted(_costs(full.outside(kind)))
        assert _costs(counted.exposed[kind]) == _costs(full.exposed[kind])
    assert len(full.partitions) == 5 * 2 * 2 * 2  # layers x nanobatches x segments x kinds


@pytest.mark.slow  # CI keeps the split graphs' counting test above (same extrapolation)
def test_counting_repeated_layers_left_whole_counts_their_collectives():
    """Blocks left whole (the original graph): their collectives run alone, and four
    traced layers, the rest counted, count and recompute them as tracing all five."""
    cfg = LlamaConfig(
        num_layers=5, hidden_size=16, num_heads=2, num_kv_heads=2, intermediate_size=32
    )
    work = Workload(model=cfg, tp=2, microbatch_size=4, seq_len=8, microbatches=1)
    [counted], _ = trace(work, layers=4, nanobatches=1)
    [full], _ = trace(work, layers=5, nanobatches=1)
    assert not full.partitions and len(full.block_exposed["forward"]) == 5
    assert all(len(c) == 2 for c in full.block_exposed["forward"].values())  # f and g
    for kind in ("forward", "backward"):  # each layer's backward collectives are its own
        assert len(full.block_exposed[kind]) == 5
        assert sorted(_costs(counted.exposed[kind])) == sorted(_costs(full.exposed[kind]))
    assert sorted(_costs(counted.recomputed("full").recompute_collectives["backward"])) == sorted(
        _costs(full.recomputed("full").recompute_collectives["backward"])
    )
    assert len(full.recomputed("full").recompute_collectives["backward"]) == 10


def _costs(items):
    """Costs without node names (names differ between traces)."""
    return [tuple(v for k, v in vars(c).items() if k != "name") for c in items]


@pytest.mark.slow  # CI's sample leaves it out: three traces of a workload
def test_the_trace_cache_serves_a_traced_workload_and_retraces_when_asked(tmp_path, monkeypatch):
    from kareus.jobs.cache import cache_key, trace_cache_dir
    from kareus.jobs.workload import plan_workload as plan_fully
    from kareus.planner import PlannerSettings

    def plan_workload(*args, **kwargs):  # what is cached is the trace: plan it cheaply
        settings = PlannerSettings(clocks_mhz=(1410, 1005), sweep_points=2)
        return plan_fully(*args, settings=settings, **kwargs)

    monkeypatch.setenv("KAREUS_CACHE_DIR", str(tmp_path / "cache"))
    work = Workload(model="tiny-4l", tp=2, microbatch_size=4, seq_len=32, microbatches=2)
    first = plan_workload(work, "a100-40gb")
    assert first.cached is None
    # the split graphs and the original ones, cached apart
    entry, original = (tmp_path / "cache" / cache_key(work, 4, n) for n in (2, 1))
    assert sorted((tmp_path / "cache").iterdir()) == sorted([entry, original])
    assert entry.parent == trace_cache_dir() and (entry / "partitions.json").is_file()
    # The same workload from the cache plans exactly as from the trace.
    again = plan_workload(work, "a100-40gb")
    assert again.cached == entry and again.plan.to_dict() == first.plan.to_dict()
    # Another micro-batch count is the same trace; another sequence length is not.
    assert plan_workload(dataclasses.replace(work, microbatches=4), "a100-40gb").cached == entry
    assert cache_key(dataclasses.replace(work, seq_len=64), 4) != entry.name
    # Asked not to use the cache, it traces (stopped there: the tracing itself is above).
    import kareus.jobs.cache as cache_module

    class Traced(Exception):
        pass

    def tracing(*_args, **_kwargs):
        raise Traced

    with monkeypatch.context() as patch:
        patch.setattr(cache_module, "trace", tracing)
        with pytest.raises(Traced):
            plan_workload(work, "a100-40gb", cache=False)
        assert plan_workload(work, "a100-40gb").cached == entry  # (the cache was there)
    # A damaged entry is traced again and rewritten whole.
    (entry / "partitions.json").write_text("{not json")
    assert plan_workload(work, "a100-40gb").cached is None
    assert plan_workload(work, "a100-40gb").cached == entry


@pytest.mark.slow  # CI's sample leaves it out: a second full plan
def test_uneven_stages_and_full_recompute_are_planned_and_recorded(tmp_path, capsys):
    args = [
        "plan",
        *SMALL,
        "--pp",
        "2",
        "--microbatches",
        "2",
        "--layers-per-stage",
        "3,1",
        "--recompute",
        "full",
        "--quiet",
        "--out",
        str(tmp_path),
    ]
    assert main(args) == EXIT_OK
    plan = Plan.load(tmp_path / "plan.json")
    assert plan.workload["layers_per_stage"] == [3, 1] and plan.workload["recompute"] == "full"
    assert "layers 3/1, full recompute" in plan.workload["describe"]
    sets = json.loads((tmp_path / "partitions.json").read_text())
    # A stage of one layer has nothing repeated to split: its clocks are still planned.
    for stage, blocks in enumerate((3, 0)):
        pset = sets["sets"][sets["stages"][stage]]
        forward = [p for p in pset["partitions"] if p["instruction"] == "forward"]
        assert len({p["block"] for p in forward}) == blocks
        assert pset["recompute"]["backward"] and pset["recompute_collectives"]["backward"]
    report = (tmp_path / "report.md").read_text()
    assert "### stage 0 (3 layers" in report and "### stage 1 (1 layers" in report
    # The one-layer stage re-runs its whole forward (its layer cannot be told from the
    # head), and the plan says so.
    assert any(r.startswith("stage 1: no layer blocks found") for r in plan.skip_reasons), (
        plan.skip_reasons
    )
    assert not any(r.startswith("stage 0: no layer blocks") for r in plan.skip_reasons)
    bad = ["plan", *SMALL, "--pp", "2", "--layers-per-stage", "3,2", "--quiet"]
    assert main(bad) == EXIT_BAD_INPUT
    assert "adding up to the model's 4 layers" in capsys.readouterr().err


@pytest.mark.slow  # CI's sample leaves it out: a fusion check over two traces
def test_a_layer_left_whole_fuses_its_residual_add_with_the_next_layers_norm():
    """Memory-bound kernels do not stop at a layer boundary: in the original graphs the
    residual add ending one layer and the norm starting the next are one fused kernel, as
    in the split graphs, so the layers move no more bytes left whole than split (the split
    adds its own chunk and concatenation traffic). A run is costed where it starts: each
    layer hands its first norm to what runs before it and takes the next one's, so every
    layer costs the same. In the backward, the residual gradient's accumulation (a chain of
    adds that block detection gives to one block) stays in each layer's norm backward: no
    block gathers every layer's adds into one kernel across the others' matmuls."""
    work = Workload(model="tiny-4l", tp=2, microbatch_size=4, seq_len=64, microbatches=1)
    [split], _ = trace(work)
    [whole], _ = trace(work, nanobatches=1)

    def traffic(pset, kind):
        ops = list(pset.outside(kind))
        ops += [o for p in pset.partitions if p.instruction == kind for s in p.slots for o in s.ops]
        return sum(o.bytes for o in ops if o.op_class == "memory")

    def memory(ops):
        return [o.bytes for o in ops if o.op_class == "memory"]

    for kind in ("forward", "backward"):
        assert traffic(whole, kind) <= traffic(split, kind)
    forward = [memory(whole.block_other["forward"][f"layers.{i}"]) for i in range(4)]
    assert forward == [forward[0]] * 4
    backward = [memory(whole.block_other["backward"][f"layers.{i}"]) for i in range(4)]
    # (the first layer's last kernel also takes the embedding's gradient)
    assert backward[1] == backward[2] == backward[3] and len(backward[0]) == len(backward[1])


@pytest.mark.parametrize(
    "nanobatches",
    [pytest.param(2, marks=pytest.mark.slow), 1],  # CI's sample: whole
)
def test_extracted_programs_cost_what_the_partition_set_records(recwarn, nanobatches):
    """Extraction takes the work outside partitions from the same runs as partition cutting
    (the residual add joined to the next layer's kernel included): every layer's block
    program is extracted, and none disagrees (a disagreement leaves the graph as captured,
    with a warning)."""
    from kareus.jobs.trace import fake_world, trace_stage

    work = Workload(model="tiny-4l", tp=2, microbatch_size=4, seq_len=64, microbatches=1)
    with fake_world(2, 1) as groups:
        traced = trace_stage(
            work, 0, layers=4, groups=groups, extract=True, nanobatches=nanobatches
        )
    assert not [w for w in recwarn if "runs as captured" in str(w.message)]
    blocks = {k.split("/")[2] for k in traced.programs if k.startswith("forward/block/")}
    assert blocks == set(traced.pset.block_other["forward"])
    if nanobatches == 1:
        assert blocks == {f"layers.{i}" for i in range(4)}


def test_solver_work_sets_cp_sat_work_per_solve():
    from kareus.cli import COMMANDS
    from kareus.cli.commands import _settings
    from kareus.cli.options import _parser
    from kareus.planner import PlannerSettings

    args = _parser(COMMANDS).parse_args(["plan", *SMALL])
    assert _settings(args).solver_time_limit_s == 0.05
    default = _parser(COMMANDS).parse_args(["plan", "--model", "tiny-4l"])
    assert _settings(default).solver_time_limit_s == PlannerSettings().solver_time_limit_s


def test_the_saving_ladder_splits_a_saving_and_names_none():
    """The report's "where the saving comes from": each step's saving against the step
    before, as a share of Megatron-LM's energy; with no saving, one sentence saying so (not
    a ladder of zeros)."""
    import dataclasses

    from kareus.ir.plan_file import FrontierPoint, ScheduledInstruction
    from kareus.jobs.report import contribution_lines

    def point(energy):
        return FrontierPoint(1.0, energy, nanobatches=1)

    plan = Plan(
        gpu="A100-SXM4-40GB",
        source="modelled",
        policy="iso_time",
        parallel={"tp": 1, "cp": 1, "pp": 1, "microbatches": 1},
        frontier=(point(90.0),),
        chosen=point(90.0),
        schedule=(ScheduledInstruction(0, "forward", 0, 1410),),
        decisions={},
        baselines={
            "megatron": (point(100.0),),
            "perseus": (point(95.0),),
            "nanobatch+perseus": (point(92.0),),
        },
    )
    text = "\n".join(contribution_lines(plan, 32))
    for label, energy, saved, share in (
        ("Perseus", "95", "5", "5.0 %"),
        ("nanobatching's defaults", "92", "3", "3.0 %"),
        ("(kareus)", "90", "2", "2.0 %"),
    ):
        assert any(
            label in row and f"| {energy} | {saved} | {share} |" in row for row in text.splitlines()
        ), (label, text)
    same = dataclasses.replace(plan, frontier=(point(100.0),), chosen=point(100.0))
    text = "\n".join(contribution_lines(same, 32))
    assert text.startswith("kareus saves nothing over Megatron-LM") and "|" not in text
