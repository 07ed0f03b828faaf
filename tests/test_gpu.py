"""On a real GPU: kareus's default path trains right and does its job, and what measures
the GPU reads it right. Skipped without CUDA; ``pytest -m gpu`` selects them (a few minutes).

Nothing here changes a GPU's settings: the suite runs under ``KAREUS_CLOCKS=off``, and clock
control is checked through dry-run controllers that record when each clock would be set.
"""

import copy
import time

import pytest
import torch
import torch.distributed as dist

import kareus
from kareus.models import Llama, LlamaConfig
from kareus.testing import blocks_run, inductor_buffers, inductor_windows, token_batches

pytestmark = pytest.mark.gpu

CFG = LlamaConfig(num_layers=2, hidden_size=256, intermediate_size=1024)


@pytest.fixture(scope="module")
def nccl_one():
    """Tensor parallelism over an NCCL group of one: every layer holds its all-reduces."""
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def test_kareus_compile_on_cuda_trains_like_eager_with_blocks_split_and_overlapped(
    nccl_one, monkeypatch
):
    from torch._inductor.utils import run_and_get_code

    monkeypatch.delenv("KAREUS_CODEGEN", raising=False)  # the default: Inductor
    torch.manual_seed(0)
    base = Llama(CFG, tp_group=nccl_one).cuda()
    eager, compiled = copy.deepcopy(base), kareus.compile(copy.deepcopy(base))
    ids, labels = (t.cuda() for t in token_batches(1, 8, 256, CFG.vocab_size)[0])

    def step(model):
        loss = model(ids, labels)
        loss.backward()
        return loss

    ref = step(eager)
    with inductor_buffers() as made:
        got, codes = run_and_get_code(step, compiled)
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-5)
    for (name, p), q in zip(compiled.named_parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-3, atol=1e-5, msg=name)
    region = kareus.explain(compiled).regions[0]
    assert region.codegen == "inductor"
    assert set(blocks_run(region).split) == {"layers.0", "layers.1"}
    for kind, code, buffers in zip(("forward", "backward"), codes, made, strict=True):
        flying = [w for w in inductor_windows(code, buffers) if w.overlapped]
        assert flying, f"no collective of the {kind} flies over the other nanobatch's kernels"
    runtime = kareus.compiler.backend.find_backend(compiled).runtime
    if runtime is not None:  # planned at compile time for this GPU: a dry run under off
        assert runtime.controller.name == "dry-run" and "NOT applied" in runtime.to_text()
        runtime.close()


class _Recorder:
    name = "recorder"
    journal_name = "dry-run"
    device_key = None
    index = 0

    def __init__(self, waits_for_gpu):
        self.waits_for_gpu = waits_for_gpu
        self.sets = []

    def supported_clocks(self):
        return [1980, 1455]

    def set(self, freq_mhz):
        self.sets.append((time.perf_counter(), freq_mhz))

    def reset(self):
        pass


def _sleep_s(cycles):
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    torch.cuda._sleep(cycles)
    end.record()
    end.synchronize()
    return begin.elapsed_time(end) / 1e3


def test_the_runtime_switches_when_the_gpu_gets_there_and_the_control_does_not():
    from kareus.runtime.switcher import ClockRuntime, Step

    torch.cuda.init()
    _sleep_s(10**7)  # warm-up: the clock rises
    rate = 2 * 10**7 / _sleep_s(2 * 10**7)  # cycles a second at the clock it runs at
    seen = {}
    for waits in (True, False):
        recorder = _Recorder(waits)
        runtime = ClockRuntime([Step("forward", 1455)], recorder)
        torch.cuda.synchronize()
        start = time.perf_counter()
        torch.cuda._sleep(int(0.05 * rate))  # the GPU is busy 50 ms before the switch
        runtime.switch(0, "forward")
        torch.cuda.synchronize()
        runtime.close()
        seen[waits] = recorder.sets[0][0] - start
    assert seen[True] >= 0.045, seen  # the runtime waited for the GPU
    assert seen[False] < 0.025, seen  # the control did not: the check tells them apart


def test_what_a_busy_gpu_runs_at_is_read_in_the_window():
    from kareus.jobs.gpu_watch import GpuWatch, nvml_reader

    reader = nvml_reader(0)
    assert reader is not None, "NVML cannot read this GPU"
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    for _ in range(5):
        a @ a
    torch.cuda.synchronize()
    with GpuWatch(reader) as watch:
        end = time.perf_counter() + 0.5
        while time.perf_counter() < end:
            a @ a
            torch.cuda.synchronize()
            watch.sample()
    assert len(watch.samples) > 20 and watch.power_w and watch.power_w > 0
    clocks = sorted(r.sm_mhz for r in watch.samples if r.sm_mhz)
    idle_clock = 345  # an H200's idle clock; a GEMM never runs there
    assert clocks and watch.clock_mhz > 2 * idle_clock, watch.describe()


def test_kareus_clocks_off_holds_on_a_real_gpu():
    from kareus.runtime.clocks import ClocksOffError, DryRunClocks, NvmlClocks, default_controller

    controller = default_controller()
    assert isinstance(controller, DryRunClocks) and "KAREUS_CLOCKS" in controller.why
    with pytest.raises(ClocksOffError):
        NvmlClocks().set(1455)


def test_a_profiled_partition_runs_inductors_kernels_and_reads_energy():
    from kareus.hardware import gpu
    from kareus.ir.costs import Knobs, PartitionWork
    from kareus.jobs.program_device import Piece, ProgramDevice
    from kareus.jobs.trace import Workload, fake_world, trace_stage
    from kareus.planner.knobs import _digest
    from kareus.planner.measured import ProfilerEvaluator
    from kareus.runtime.clocks import DryRunClocks

    work = Workload(model="llama3.2-3b", tp=8, microbatch_size=4, seq_len=4096)
    with fake_world(work.tp, work.cp) as groups:
        traced = trace_stage(work, 0, layers=2, groups=groups, extract=True, device="cuda")
    key = next(k for k, t in traced.pset.types.items() if t.collective is not None)
    ptype = traced.pset.types[key]
    tw = PartitionWork(ptype.compute, ptype.collective)
    knobs = Knobs(1980, 0, launch_slot=None)
    got = {}
    for codegen in ("inductor", "python"):
        device = ProgramDevice(
            {_digest(tw): [Piece(traced.programs[key])]},
            {"tp": None},
            torch.device("cuda", 0),
            model=None,
            static_power_w=gpu("h200").calibration.static_power_w,
            codegen=codegen,
        )
        profiler = ProfilerEvaluator(device, DryRunClocks(), min_window_s=0.5)
        got[codegen] = profiler.partition(tw, knobs)
        assert got[codegen].energy_j > 0 and device.energy_source == "measured"
    # Inductor's fused kernels, not one per aten op: faster than the op-by-op program
    assert got["inductor"].time_s < got["python"].time_s, got
