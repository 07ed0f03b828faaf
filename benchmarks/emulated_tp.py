"""Tensor parallelism at TP N's shapes and communication times in one process (train_step.py).

One rank of a ``kareus.models.Llama`` at TP N (heads, KV heads, FFN and vocabulary divided by
N) runs in one process over an :class:`~kareus.testing.emulated_group.EmulatedGroup`: each
collective returns its true result (a group of one) and completes after the duration
kareus's hardware model gives it on the named GPU's NVLink at TP N. The device here is not
that GPU (a CPU is about a thousand times slower than an A100), so the durations are scaled
by the ratio of the compute measured here (a forward and backward of torch.compile's code
with collectives completing at once) to the compute the model predicts on the GPU for the
same rank: each collective keeps its modelled share of the step. ``--comm-scale`` multiplies
every scaled duration.

What the emulation leaves out: the compute a real collective takes from the kernels beside it
(SMs and memory bandwidth under NCCL). The hardware model's contention factor gives it
(``Emulator.contention``), and the figures are printed with and without it, labelled.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from kareus.models import LlamaConfig
from kareus.testing.emulated_group import LINKS, EmulatedGroup, modelled_durations

PRESET: dict[str, Any] = dict(
    hidden_size=1024, intermediate_size=4096, num_layers=4, num_heads=16, num_kv_heads=8,
    vocab_size=32000, batch=8, seq=1024,
)  # fmt: skip
"""The emulated model at its full (TP 1) size: per-rank GEMMs at TP 8 at least 128 wide."""


def per_rank(cfg: LlamaConfig, tp: int) -> LlamaConfig:
    """Return the config of one rank of ``cfg`` at TP ``tp``, run at TP 1."""
    cfg.check_parallel(tp=tp)
    return dataclasses.replace(
        cfg,
        num_heads=cfg.num_heads // tp,
        num_kv_heads=cfg.num_kv_heads // tp,
        head_dim=cfg.dim_per_head,
        intermediate_size=cfg.intermediate_size // tp,
        vocab_size=cfg.vocab_size // tp,
    )


@dataclasses.dataclass
class ModelledStep:
    """A forward and backward of one rank on the named GPU, as kareus's hardware model prices it.

    All seconds **modelled**, at the GPU's top clock: ``compute_s`` the compute alone (no
    collective), ``whole_s`` the original graphs with every collective alone (Megatron-LM),
    ``split_s`` the split graphs with each collective launched at its partition's start
    (nanobatching), ``comm_s`` the collectives alone.
    """

    compute_s: float
    whole_s: float
    split_s: float
    comm_s: float
    contention: float


def modelled_step(cfg: LlamaConfig, tp: int, batch: int, seq: int, gpu: str) -> ModelledStep:
    """Trace ``cfg`` at TP ``tp`` under fake tensors and price one step on ``gpu`` (bf16)."""
    from kareus.hardware import Emulator
    from kareus.hardware import gpu as gpu_spec
    from kareus.ir.costs import Knobs
    from kareus.jobs.trace import Workload, trace
    from kareus.planner.instruction_options import default_profiles, instruction_options
    from kareus.planner.knobs import CountingEvaluator
    from kareus.planner.settings import PlannerSettings

    spec = gpu_spec(LINKS.get(gpu, gpu))
    emulator = Emulator(spec)
    ev = CountingEvaluator(emulator)
    settings = PlannerSettings()
    work = Workload(
        model=cfg, tp=tp, microbatch_size=batch, seq_len=seq, microbatches=1,
        dtype="bf16", graphs="inductor",
    )  # fmt: skip
    fmax = spec.clock_max_mhz
    static = spec.calibration.static_power_w
    times: dict[int, float] = {}
    compute = comm = 0.0
    ops: list[Any] = []
    for nanobatches, profile in ((1, "no-overlap"), (2, "nanobatch")):
        psets, _notes = trace(work, nanobatches=nanobatches, layers=cfg.num_layers)
        options = instruction_options(
            psets, ev, [fmax], static, settings, default_profiles(psets, settings)
        )
        times[nanobatches] = sum(
            next(o.time_s for o in options[(0, kind)] if o.profile == profile)
            for kind in ("forward", "backward")
        )
        if nanobatches == 1:
            pset = psets[0]
            for kind in ("forward", "backward"):
                compute += emulator.ops(pset.outside(kind), fmax).time_s
                ops += pset.outside(kind)
                alone = Knobs(fmax, settings.no_overlap_sm_share, launch_slot=None)
                comm += sum(emulator.collective_time(c, alone) for c in pset.exposed.get(kind, ()))
    return ModelledStep(
        compute,
        times[1],
        times[2],
        comm,
        emulator.contention(tuple(ops), fmax, settings.default_sm_share),
    )


@dataclasses.dataclass
class Emulation:
    """The emulated group and the scale its durations run at (set once measured)."""

    gpu: str
    tp: int
    comm_scale: float
    group: EmulatedGroup
    modelled: ModelledStep | None
    scale: float = 0.0  # 0 until calibrated: collectives complete at once
    measured_compute_s: float = 0.0
    calibrated_with: str = ""

    @classmethod
    def make(
        cls,
        gpu: str,
        tp: int,
        comm_scale: float,
        modelled: ModelledStep | None,
        bytes_scale: float = 0.5,
    ) -> Emulation:
        """Register the group; its durations read the scale at each call."""
        priced = modelled_durations(gpu, tp=tp, bytes_scale=bytes_scale)
        holder: dict[str, Emulation] = {}

        def duration(kind: str, nbytes: int) -> float:
            em = holder["em"]
            return priced(kind, nbytes) * em.scale * em.comm_scale

        group = EmulatedGroup.register(duration)
        em = cls(gpu, tp, comm_scale, group, modelled)
        holder["em"] = em
        return em


def inductor_overlap_options(device: str) -> dict[str, Any]:
    """Inductor's options for its own overlap scheduling, made to run where it would not.

    Inductor's overlap scheduler prices each op by a roofline of the GPU it asks Triton
    about, and each collective by NCCL's formulas: on a CPU without Triton it fails. Here
    the roofline gets the CPU host model's rates (kareus's :class:`HostSpec`, the same
    kareus prices its split with), and each collective the duration its group declares (the
    emulated one), so the scheduler sees what runs. On CUDA, Inductor's own estimates stand
    but for the collectives' durations. Patches two functions of ``torch.utils``'s runtime
    estimation for this process (a benchmark's, never kareus's).
    """
    import torch.utils._runtime_estimation as estimation

    from kareus.hardware.host import HostSpec

    if device != "cuda":
        spec = HostSpec()
        estimation.get_gpu_dram_gbps = lambda: spec.memory_bytes_per_s / 1e9
        estimation.get_device_tflops = lambda dtype: spec.gemm_flops / 1e12

    return {
        "aten_distributed_optimizations.enable_overlap_scheduling": True,
        "aten_distributed_optimizations.compute_estimator": "analytical",
        "aten_distributed_optimizations.custom_runtime_estimation": emulated_collective_ms,
    }


_KINDS = {
    "all_reduce": "all_reduce", "all_gather_into_tensor": "all_gather",
    "reduce_scatter_tensor": "reduce_scatter", "all_to_all_single": "all_to_all",
}  # fmt: skip


def emulated_collective_ms(node: Any, override: Any = None) -> float | None:
    """Inductor's runtime estimate of a collective on an emulated group: its duration (ms)."""
    import torch

    from kareus.passes.links import declared_time

    name = getattr(getattr(node.target, "_schema", None), "name", "")
    kind = _KINDS.get(str(name).rsplit("::", 1)[-1])
    if kind is None or not node.args or not hasattr(node.args[0], "meta"):
        return None
    value = node.args[0].meta.get("val")
    group = next((a for a in reversed(node.args) if isinstance(a, str)), "")
    if not isinstance(value, torch.Tensor):
        return None
    seconds = declared_time(group, kind, value.numel() * value.element_size())
    return None if seconds is None else seconds * 1e3
