"""GPU and interconnect specifications, each number with its source.

Datasheet numbers are fixed here. What datasheets do not give (op-class efficiencies, the
per-SM copy rate of a collective, activity factors of power) lives in :class:`Calibration`,
fitted to measurements by :mod:`kareus.hardware.calibrate` and loaded from
``calibration/*.json`` with its provenance. GPUs without measurements of their own borrow
the A100's fitted factors, their GEMM and attention efficiencies scaled by the published
ceilings of their kernels (:attr:`GPUSpec.gemm_ceiling`, :attr:`GPUSpec.attention_ceiling`);
:attr:`GPUSpec.calibration_source` says so.
"""

from __future__ import annotations

import dataclasses
import json
from importlib import resources
from typing import Any

from kareus.errors import KareusError
from kareus.hardware.interconnects import (
    DATASHEET_A100,
    DATASHEET_H100,
    IB_HDR,
    IB_NDR,
    NVLINK3,
    NVLINK4,
    PCIE4,
    InterconnectSpec,
)

_DATASHEET_A100 = DATASHEET_A100
_DATASHEET_H100 = DATASHEET_H100
_DATASHEET_H200 = "NVIDIA H200 Tensor Core GPU datasheet (2024)"
_DATASHEET_A40 = "NVIDIA A40 datasheet (2021)"
_SMI = "nvidia-smi -q -d SUPPORTED_CLOCKS on the GPU (graphics clocks in 15 MHz steps)"
_STATIC_A100 = (
    "measurement: power of an A100-SXM4-40GB blocked on communication at a locked clock "
    "(Perseus, SOSP'24; kareus design notes), about 85 W"
)
_VF = (
    "shape assumption: voltage flat below a knee, then rising linearly to the maximum "
    "(DVFS measurements of NVIDIA GPUs: Mei et al., 'A survey and measurement study of GPU "
    "DVFS on energy conservation', 2017); not published per GPU by NVIDIA"
)
_LEAK = (
    "assumption: a quarter of the static power is leakage, which scales with the core "
    "voltage (leakage power = V x leakage current, first order); the rest (board, memory "
    "refresh, I/O) is constant. No vendor figure is published"
)
_MAMF = (
    "maximum achievable matmul FLOP/s (bf16, best of a brute-force shape search) over the dense "
    "peak: A100 SXM 267.9 of 312 TFLOP/s = 0.859 (CUDA 12.1), H100 SXM 792.1 of 989 = 0.801 "
    "(CUDA 12.1); S. Bekman, 'Machine Learning Engineering', MAMF comparison table "
    "(github.com/stas00/ml-engineering, compute/accelerator)"
)
_FLASH = (
    "best FlashAttention-2 utilization of the dense peak, the kernel PyTorch's "
    "scaled_dot_product_attention runs by default (its backend priority puts FlashAttention "
    "first; huggingface/transformers PR 48163): 0.73 on A100 (Dao, 'FlashAttention-2', ICLR "
    "2024), 0.35 on H100 (Shah et al., 'FlashAttention-3', NeurIPS 2024, abstract). cuDNN's "
    "attention is 1.7-2.3x faster on Hopper (same PR)"
)
_VF_A100 = (
    f"{_VF}. A100 floor: fitted by kareus.hardware.calibrate to the partition measured at "
    "1200 MHz and at the default clock (they fix the voltage at 1200 MHz; the fitted floor is "
    "in the calibration and replaces the 0.80 here). Knee 0.82 (1156 MHz): chosen among "
    "0.70-0.85 on the 75 unflagged reference A100 pipeline plans, by the Perseus frontier "
    "slopes it reproduces, then the plans' energy error (in-sample; with each configuration "
    "left out in turn, the same knee for 4 of 4: docs/fidelity.md, 'The A100 voltage curve')"
)


PRIORS = {
    "eff_gemm": (
        "large bf16/fp16 GEMMs reach 70-80 % of the dense tensor-core peak with cuBLAS (NVIDIA "
        "Deep Learning Performance guide, 'Matrix Multiplication Background'; A100 about "
        "230-250 of 312 TFLOP/s)"
    ),
    "eff_attention": (
        "FlashAttention-2 reaches 50-73 % of the A100's peak forward and about 63 % in "
        "training (Dao, 'FlashAttention-2', ICLR 2024, figures 4-6)"
    ),
    "eff_memory": (
        "element-wise kernels stream at 80-90 % of HBM bandwidth (STREAM-like copy on A100: "
        "about 1.3-1.4 of 1.56 TB/s; NVIDIA A100 whitepaper, memory section)"
    ),
    "launch_overhead_us": (
        "back-to-back kernel launches cost a few microseconds each (Zhang et al., "
        "'Understanding the Overheads of Launching CUDA Kernels', ICPP 2019 poster: 2-5 us)"
    ),
    "comm_link_efficiency": (
        "NCCL all-reduce reaches a bus bandwidth of about 230 GB/s of NVLink 3's 300 GB/s per "
        "direction on 8 A100-SXM4 (nccl-tests all_reduce_perf on DGX A100, large messages; "
        "NVIDIA DGX A100 user guide and NCCL performance reports): 0.77. The measured "
        "partition cannot identify it: its collective never reaches the link (20 SMs copy "
        "about 130 GB/s)"
    ),
    "mem_clock_knee": (
        "assumption: memory-bound kernels keep HBM saturated down to about half the maximum SM "
        "clock. Checked on the reference A100 pipeline plans: 1.0 (memory-bound ops slowing "
        "with any clock cut) fits the TP 8 plans' times best but worsens the held-out CP 2 "
        "plans' (time |error| median 7.3 -> 9.8 %), so 0.45 stays"
    ),
    "comm_latency_us": (
        "NCCL's base latency of a ring collective with its Simple protocol (the one large "
        "messages use), 8.4 us; each ring step adds the link's latency (InterconnectSpec."
        "latency_us): NCCL's own tuning model, NVIDIA/nccl src/graph/tuning.cc (baseLat, "
        "hwLat)"
    ),
    "static_power_w": (
        f"{_STATIC_A100}. Checked on the partition data: the slow single-SM collectives "
        "there add about 86 W per GPU per second of their run at the default clock and 69 W "
        "at 1200 MHz (their marginal power), the level and the clock response "
        "static_clock_share gives. Fitted freely, the partition puts it at 64 W, with the "
        "difference moved to the kernels' power"
    ),
    "comm_hbm_bytes_per_byte": (
        "a ring all-reduce step reads the local chunk and the received one and writes their "
        "sum: 3 bytes of HBM traffic per byte sent. Fitted, the partition runs it to its "
        "lower bound"
    ),
    "mem_power_w_per_tbs": (
        "HBM2 draws about 4 pJ per bit (JEDEC HBM2; O'Connor et al., 'Fine-grained DRAM', "
        "MICRO 2017): 32 W per TB/s, 40 with the memory controller. Fitted, the partition "
        "runs it to its upper bound (64): it cannot tell memory power from the kernels'"
    ),
    "activity.gemm": (
        "assumption: a GEMM keeping every SM's tensor cores busy at the maximum clock draws the "
        "TDP (A100s power-throttle under large GEMMs); the partition's kernels, stretched by "
        "their harness, cannot tell the kernels' activity from their stalls"
    ),
    "activity.attention": "assumption: 0.9 of a GEMM's (FlashAttention's softmax stalls)",
    "contended_clock_exponent": (
        "chosen on the reference A100 pipeline plans, in-sample, by the clock response of "
        "nanobatching's instructions (python benchmarks/pipeline_fidelity.py "
        "--fit-contended-clock; docs/fidelity.md): among 0-1, 0.25 brings the share of a "
        "nanobatched instruction's time that does not scale with the clock within 0.05 of "
        "the reference's in the three plan sets one response fits (1: 0.08-0.10 short); "
        "each configuration left out chooses 0.25 or 0. The partition's custom TP 2 kernel "
        "fitted freely puts it at 1.1, with its median errors the same from 0 to 1.1: it "
        "cannot tell, and NCCL at TP 4-8 is what kareus plans"
    ),
}
"""Datasheet-like factors of :class:`Calibration` that the measured partitions cannot
identify (they vary communication knobs only), kept at published values, with sources; the
calibration fits the rest (:data:`kareus.hardware.calibrate.FREE`)."""


class UnknownGPUError(KareusError, KeyError):
    """A GPU name that kareus has no specification for."""


@dataclasses.dataclass(frozen=True)
class Calibration:
    """Factors no datasheet gives, fitted to measurements (see ``calibrate.py``).

    Attributes:
        eff_gemm: achieved fraction of the tensor-core peak for GEMMs.
        eff_attention: achieved fraction of the peak for fused attention.
        eff_memory: achieved fraction of memory bandwidth for memory-bound ops.
        mem_clock_knee: fraction of the maximum SM clock below which memory-bound ops slow
            in proportion to the clock (the SMs no longer issue loads fast enough).
        launch_overhead_us: fixed cost per kernel.
        comm_gbs_per_sm: bytes a collective moves per second per SM at the maximum clock,
            with 1024-thread CTAs.
        comm_thread_exponent: a CTA of t threads copies (t/1024)**exponent as fast.
        comm_latency_us: fixed cost of one collective, beside the per-step link latency.
        comm_link_efficiency: achieved fraction of the datasheet link bandwidth.
        comm_hbm_bytes_per_byte: local memory traffic per byte the collective moves.
        contention: a collective copies 1/(1 + contention) as fast while compute kernels run
            beside it (they share SMs, issue slots and the memory system).
        contended_clock_exponent: beside compute, a collective's rate scales with the clock
            as (f / f_max) ** this (alone it scales as f / f_max, its SMs copying at the
            clock): 1, its stalls beside compute are clock cycles; 0, they are waits on
            what the SM clock does not set (the memory system and the link it shares,
            its peers).
        static_power_w: power drawn at the maximum clock while blocked on communication.
        static_clock_share: the share of ``static_power_w`` that is the clock network and
            idle logic switching at the locked clock: it falls with f·V(f)² as the clock is
            lowered (an idle GPU at a lower locked clock draws less).
        v_floor: the voltage floor fitted with these factors, replacing the spec's prior;
            None keeps the spec's.
        activity: dynamic power of each class at full activity and maximum clock, as a
            fraction of (TDP - static power): gemm, attention, memory (SM side), comm.
        mem_power_w_per_tbs: power of memory traffic, watts per TB/s.
        source: where the numbers come from.
    """

    eff_gemm: float = 0.75
    eff_attention: float = 0.65
    eff_memory: float = 0.85
    mem_clock_knee: float = 0.45
    launch_overhead_us: float = 4.0
    comm_gbs_per_sm: float = 10.0
    comm_thread_exponent: float = 1.0
    comm_latency_us: float = 8.4
    comm_link_efficiency: float = 0.77
    comm_hbm_bytes_per_byte: float = 3.0
    contention: float = 0.3
    contended_clock_exponent: float = 0.25
    static_power_w: float = 85.0
    static_clock_share: float = 0.0
    v_floor: float | None = None
    activity: dict[str, float] = dataclasses.field(
        default_factory=lambda: {"gemm": 1.0, "attention": 0.9, "memory": 0.3, "comm": 0.2}
    )
    mem_power_w_per_tbs: float = 40.0
    source: str = "uncalibrated priors"

    def to_dict(self) -> dict[str, Any]:
        """Return the fields as JSON-ready values."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Calibration:
        """Build from :meth:`to_dict` output (unknown keys are an error)."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - names
        if unknown:
            raise ValueError(
                f"unknown calibration fields {sorted(unknown)}; known: {sorted(names)}"
            )
        return cls(**data)


CLOCK_SWITCH_SOURCE = (
    "prior, not measured here: arXiv 2502.20075 (Velicka et al., 2025) measures NVIDIA clock "
    "changes on A100 and GH200 taking from about a millisecond to hundreds, set mostly by "
    "the target clock. The GPU keeps computing meanwhile, at the old clock, so a change "
    "costs a fraction of its latency; kareus charges 1 ms of GPU time at the instruction's "
    "highest dynamic power per change. `kareus doctor --try-switch --json F` measures this "
    "GPU, and `kareus plan --gpu-profile F` charges the measured transition whole instead"
)


@dataclasses.dataclass(frozen=True)
class GPUSpec:
    """One GPU model. Peaks are dense (no sparsity) at ``peak_clock_mhz``."""

    name: str
    sm_count: int
    clock_min_mhz: int
    clock_max_mhz: int
    clock_step_mhz: int
    peak_tflops: dict[str, float]
    peak_clock_mhz: int
    memory_bandwidth_gbs: float
    memory_gb: float
    tdp_w: float
    interconnect: InterconnectSpec
    vf_knee: float  # fraction of the max clock below which voltage stays at its floor
    v_floor: float  # voltage at and below the knee, as a fraction of the max voltage
    leakage_fraction: float  # share of the static power that is leakage, scaling with voltage
    gemm_ceiling: float  # best measured matmul FLOP/s over the dense peak (MAMF)
    attention_ceiling: float  # best flash-attention utilization of the dense peak
    sources: dict[str, str]
    calibration: Calibration = dataclasses.field(default_factory=Calibration)
    calibration_source: str = "uncalibrated priors"
    clock_switch_s: float = 0.001  # GPU time a clock change costs (see CLOCK_SWITCH_SOURCE)
    network: InterconnectSpec | None = None  # between nodes; None: the interconnect's
    clock_switch_source: str = ""

    def __post_init__(self) -> None:
        if not self.clock_switch_source:
            object.__setattr__(self, "clock_switch_source", CLOCK_SWITCH_SOURCE)

    def clocks_mhz(self) -> list[int]:
        """Return the supported SM clocks, highest first."""
        return list(range(self.clock_max_mhz, self.clock_min_mhz - 1, -self.clock_step_mhz))

    def peak_flops(self, dtype: str) -> float:
        """Return dense tensor-core FLOP/s at the maximum clock for ``dtype``.

        Raises:
            KeyError: the GPU has no tensor-core peak for that dtype.
        """
        key = {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32", "half": "fp16"}.get(
            dtype, dtype
        )
        if key not in self.peak_tflops:
            raise KeyError(
                f"{self.name} has no peak for dtype {dtype!r}; known {sorted(self.peak_tflops)}"
            )
        return self.peak_tflops[key] * 1e12 * self.clock_max_mhz / self.peak_clock_mhz

    def voltage(self, freq_mhz: float) -> float:
        """Return the core voltage at ``freq_mhz`` as a fraction of the voltage at max clock."""
        x = freq_mhz / self.clock_max_mhz
        if x <= self.vf_knee:
            return self.v_floor
        return self.v_floor + (1 - self.v_floor) * (x - self.vf_knee) / (1 - self.vf_knee)

    def dynamic_scale(self, freq_mhz: float) -> float:
        """Return f·V(f)² relative to its value at the maximum clock."""
        return freq_mhz / self.clock_max_mhz * self.voltage(freq_mhz) ** 2

    def with_calibration(self, calibration: Calibration, source: str) -> GPUSpec:
        """Return a copy that uses ``calibration`` (and its voltage floor, if it has one)."""
        floor = self.v_floor if calibration.v_floor is None else calibration.v_floor
        return dataclasses.replace(
            self, calibration=calibration, calibration_source=source, v_floor=floor
        )


def _a100(name: str, memory_gb: float, bandwidth_gbs: float, bw_source: str) -> GPUSpec:
    return GPUSpec(
        name=name,
        sm_count=108,
        clock_min_mhz=210,
        clock_max_mhz=1410,
        clock_step_mhz=15,
        peak_tflops={"fp16": 312.0, "bf16": 312.0, "tf32": 156.0, "fp32": 19.5},
        peak_clock_mhz=1410,
        memory_bandwidth_gbs=bandwidth_gbs,
        memory_gb=memory_gb,
        tdp_w=400.0,
        interconnect=NVLINK3,
        network=IB_HDR,
        vf_knee=0.82,
        v_floor=0.80,
        leakage_fraction=0.25,
        gemm_ceiling=0.859,
        attention_ceiling=0.73,
        sources={
            "sm_count, peak_tflops, peak_clock_mhz, tdp_w": _DATASHEET_A100,
            "clocks": _SMI,
            "memory_bandwidth_gbs": bw_source,
            "static_power_w": _STATIC_A100,
            "vf_knee, v_floor": _VF_A100,
            "leakage_fraction": _LEAK,
            "gemm_ceiling": _MAMF,
            "attention_ceiling": _FLASH,
        },
    )


_H100_SOURCES = {
    "sm_count, peak_tflops, tdp_w": _DATASHEET_H100,
    "peak_clock_mhz": "Hopper whitepaper: tensor-core peaks are quoted at the 1830 MHz boost",
    "clocks": f"{_SMI}; 1980 MHz max measured on the project's H200 check machine",
    "static_power_w": "estimate: A100's measured 85 W scaled by TDP (700/400); uncalibrated",
    "vf_knee, v_floor": _VF,
    "leakage_fraction": _LEAK,
    "gemm_ceiling": _MAMF,
    "attention_ceiling": _FLASH,
}


def _hopper(name: str, memory_gb: float, bandwidth_gbs: float, sources: dict[str, str]) -> GPUSpec:
    return GPUSpec(
        name=name,
        sm_count=132,
        clock_min_mhz=345,
        clock_max_mhz=1980,
        clock_step_mhz=15,
        peak_tflops={"fp16": 989.4, "bf16": 989.4, "fp8": 1978.9, "tf32": 494.7, "fp32": 66.9},
        peak_clock_mhz=1830,
        memory_bandwidth_gbs=bandwidth_gbs,
        memory_gb=memory_gb,
        tdp_w=700.0,
        interconnect=NVLINK4,
        network=IB_NDR,
        vf_knee=0.55,
        v_floor=0.70,
        leakage_fraction=0.25,
        gemm_ceiling=0.801,
        attention_ceiling=0.35,
        sources={**_H100_SOURCES, **sources},
    )


@dataclasses.dataclass(frozen=True)
class KnownGPU:
    """One GPU kareus knows: the one place a GPU is added.

    Attributes:
        spec: its datasheet figures and priors, before calibration.
        aliases: short names :func:`gpu` also accepts (``a100-40gb``).
        device_words: the words of a CUDA device name (as torch reports it) that make it
            this type, one tuple per spelling; the entry of the most words found wins, so
            the order of the table does not matter, and a word matches whole ("a40" is not
            the RTX A4000).
        calibration: the file in ``calibration/`` measured on this GPU, or None (it borrows
            the A100's, scaled).
    """

    spec: GPUSpec
    aliases: tuple[str, ...] = ()
    device_words: tuple[tuple[str, ...], ...] = ()
    calibration: str | None = None


KNOWN_GPUS: dict[str, KnownGPU] = {
    "a100-sxm4-40gb": KnownGPU(
        _a100("A100-SXM4-40GB", 40, 1555.0, f"{_DATASHEET_A100}: HBM2, 1555 GB/s"),
        aliases=("a100", "a100-40gb"),
        device_words=(("a100",),),
        calibration="a100_sxm4",
    ),
    "a100-sxm4-80gb": KnownGPU(
        _a100("A100-SXM4-80GB", 80, 2039.0, f"{_DATASHEET_A100}: HBM2e, 2039 GB/s"),
        aliases=("a100-80gb",),
        device_words=(("a100", "80gb"),),
        calibration="a100_sxm4",
    ),
    "h100-sxm": KnownGPU(
        _hopper(
            "H100-SXM5-80GB",
            80,
            3350.0,
            {"memory_bandwidth_gbs": f"{_DATASHEET_H100}: HBM3, 3.35 TB/s"},
        ),
        aliases=("h100", "h100-80gb"),
        device_words=(("h100",),),
    ),
    "h200": KnownGPU(
        _hopper(
            "H200-SXM-141GB",
            141,
            4800.0,
            {
                "sm_count, peak_tflops, tdp_w": (
                    f"{_DATASHEET_H200} (same GH100 compute as H100 SXM)"
                ),
                "gemm_ceiling": f"{_MAMF}. H200: the H100's (the same GH100 die and 700 W); the "
                "table's GH200, with a larger power budget, reaches 0.830",
                "memory_bandwidth_gbs": f"{_DATASHEET_H200}: HBM3e, 4.8 TB/s",
            },
        ),
        aliases=("h200-141gb",),
        device_words=(("h200",),),
        calibration="h200",
    ),
    "a40": KnownGPU(
        GPUSpec(
            name="A40",
            sm_count=84,
            clock_min_mhz=210,
            clock_max_mhz=1740,
            clock_step_mhz=15,
            peak_tflops={"fp16": 149.7, "bf16": 149.7, "tf32": 74.8, "fp32": 37.4},
            peak_clock_mhz=1740,
            memory_bandwidth_gbs=696.0,
            memory_gb=48,
            tdp_w=300.0,
            interconnect=PCIE4,
            vf_knee=0.55,
            v_floor=0.70,
            leakage_fraction=0.25,
            gemm_ceiling=0.859,
            attention_ceiling=0.73,
            sources={
                "sm_count, peak_tflops, tdp_w, memory_bandwidth_gbs": _DATASHEET_A40,
                "clocks": _SMI,
                "static_power_w": "estimate: A100's measured 85 W scaled by TDP (300/400)",
                "vf_knee, v_floor": _VF,
                "leakage_fraction": _LEAK,
                "gemm_ceiling, attention_ceiling": "no published figure: the A100's (Ampere too)",
            },
        ),
        device_words=(("a40",),),
    ),
}
"""Every GPU kareus knows, by kareus name (``--gpu``): add a GPU here and nowhere else.

Calibrated on measurements of their own: ``a100_sxm4`` (:mod:`kareus.hardware.calibrate`,
partitions measured on two A100s) and ``h200`` (:mod:`kareus.hardware.calibrate_check`, a
gpu_check run on one H200); the others borrow the A100's, scaled."""

GPUS: dict[str, GPUSpec] = {name: known.spec for name, known in KNOWN_GPUS.items()}
"""Each known GPU's spec before calibration (a view of :data:`KNOWN_GPUS`)."""
"""Known GPUs by kareus name (``--gpu``), before calibration is applied."""

CALIBRATIONS = {n: k.calibration for n, k in KNOWN_GPUS.items() if k.calibration}
"""GPUs calibrated on measurements of their own: the file in ``calibration/`` of each (a
view of :data:`KNOWN_GPUS`)."""

_BASE = "a100_sxm4"
"""The calibration other GPUs borrow (it has none to borrow itself)."""


def load_calibration(name: str = "a100_sxm4") -> tuple[Calibration, str]:
    """Return the calibration stored as ``calibration/<name>.json`` and its provenance."""
    path = resources.files("kareus.hardware") / "calibration" / f"{name}.json"
    data = json.loads(path.read_text())
    cal = Calibration.from_dict(data["calibration"])
    return cal, data["provenance"]


ALIASES = {alias: name for name, known in KNOWN_GPUS.items() for alias in known.aliases}
"""Short names accepted by :func:`gpu` (a view of :data:`KNOWN_GPUS`)."""

DEVICE_NAMES = tuple((words, n) for n, known in KNOWN_GPUS.items() for words in known.device_words)
"""CUDA device names' words to kareus GPU types (:attr:`KnownGPU.device_words`)."""


def spec_name_for_device(device_name: str) -> str | None:
    """Return the kareus GPU type of a CUDA device name (as torch reports it), or None."""
    import re

    words = set(re.findall(r"[a-z0-9]+", device_name.lower()))
    found = [
        (len(need), name)
        for name, known in KNOWN_GPUS.items()
        for need in known.device_words
        if words.issuperset(need)
    ]
    return max(found)[1] if found else None


def _key(name: str) -> str:
    """Return the key of :data:`KNOWN_GPUS` a name (any case, an alias) names, else itself."""
    key = name.lower().replace("_", "-")
    return next((n for n, known in KNOWN_GPUS.items() if key in known.aliases), key)


def known_gpu(name: str) -> str | None:
    """Return the kareus GPU type ``name`` (or its alias) names, or None for an unknown one."""
    key = _key(name)
    return key if key in KNOWN_GPUS else None


def clock_range(name: str) -> tuple[float, float] | None:
    """Return the (min, max) MHz a GPU's clocks may be set to, or None for an unknown GPU.

    What :meth:`kareus.ir.plan_file.Plan.load` checks a plan's clocks against.
    """
    specs = [k.spec for k in KNOWN_GPUS.values()]
    known = KNOWN_GPUS.get(_key(name))
    spec = known.spec if known else next((g for g in specs if g.name == name), None)
    if spec is None:
        return None
    clocks = spec.clocks_mhz()
    return (min(clocks), max(clocks))


def gpu(name: str, *, own_calibration: bool = True) -> GPUSpec:
    """Return the calibrated spec of a GPU by kareus name (case-insensitive).

    ``own_calibration=False``: the A100's calibration scaled to this GPU, even where one
    was measured on it (what :mod:`kareus.hardware.calibrate_check` starts from).

    Raises:
        UnknownGPUError: the name is not one of :data:`GPUS`.
    """
    key = _key(name)
    if key not in KNOWN_GPUS:
        aliases = sorted(a for known in KNOWN_GPUS.values() for a in known.aliases)
        raise UnknownGPUError(
            f"unknown GPU {name!r}; known GPUs: {', '.join(sorted(KNOWN_GPUS))} "
            f"(also {', '.join(aliases)})"
        )
    spec = KNOWN_GPUS[key].spec
    own = KNOWN_GPUS[key].calibration
    if own is not None and (own_calibration or own == _BASE):  # measured on this GPU
        return spec.with_calibration(*load_calibration(own))
    cal, provenance = load_calibration()
    # Other GPUs: the A100's fitted factors, with the GEMM and attention efficiencies scaled
    # by what each GPU's kernels reach of its peak against the A100's, static power by TDP.
    a100 = KNOWN_GPUS["a100-sxm4-40gb"].spec
    scaled = dataclasses.replace(
        cal,
        eff_gemm=cal.eff_gemm * spec.gemm_ceiling / a100.gemm_ceiling,
        eff_attention=cal.eff_attention * spec.attention_ceiling / a100.attention_ceiling,
        static_power_w=cal.static_power_w * spec.tdp_w / a100.tdp_w,
        v_floor=None,  # the A100's voltage floor is the A100's: this GPU keeps its prior
    )
    return spec.with_calibration(
        scaled,
        f"borrowed from the A100 calibration ({provenance}); GEMM and attention efficiencies "
        "scaled by this GPU's published kernel ceilings against the A100's, static power by "
        "TDP; not measured on this GPU",
    )
