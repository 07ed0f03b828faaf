"""The hardware model: time and energy of GPU work at any clock, SM share and launch slot.

Every figure it returns is *modelled* (``Estimate.source == "modelled"``). The model:

- **Kernel time** at clock f with n SMs: the roofline of compute
  (FLOPs / (peak · f/f_max · n/N · efficiency of the op class)) against memory
  (bytes / (bandwidth · efficiency)), where memory needs enough SMs and clock to saturate
  and does not otherwise scale with f; plus a launch overhead. A matmul's efficiency is
  also scaled by the share of the SMs its tiles fill (:func:`matmul_fill`).
- **Collective time**: the bus traffic of the algorithm (an all-reduce moves 2(p-1)/p of
  the tensor, all-gather and reduce-scatter (p-1)/p), copied by the collective's SMs at a
  rate that scales with their number and the clock, and carried by the link at its
  achieved bandwidth: a pipeline, whose rate is the slower stage's; plus latency. The link
  is NVLink for a group within a node, the node's network (``GPUSpec.network``) for one
  that spans nodes (``CollectiveCost.nodes``).
- **Overlap**: a partition is simulated as a timeline. Compute ops run in order; the
  collective starts when compute reaches its launch slot (a PyTorch collective waits on the
  compute stream). While both run, compute has N-n SMs and the memory bandwidth the
  collective leaves, and the collective copies 1/(1 + contention) as fast as alone at the
  top clock: its CTAs share SMs, issue slots and the memory system with the compute
  kernels' (a fitted constant); beside compute its rate scales with the clock as
  (f/f_max)^contended_clock_exponent (alone as f/f_max).
- **Power**: static power (a constant part and leakage, which scales with V(f)) plus the
  dynamic power of what is active — per-SM activity of each class scaled by f·V(f)², plus
  memory traffic. Above TDP the chip throttles: the clock drops until power fits, so a
  locked clock is then not reached.
- **Energy** is the integral of power over the timeline.
"""

from __future__ import annotations

import dataclasses
import math

from kareus.hardware.interconnects import InterconnectSpec
from kareus.hardware.specs import GPUSpec
from kareus.ir.costs import CollectiveCost, Estimate, Knobs, OpCost, PartitionWork

_MEM_SAT_SM_FRACTION = 0.35  # SMs needed to saturate memory bandwidth, as a fraction of all
_MIN_BW_LEFT = 0.15  # compute keeps at least this share of memory bandwidth


@dataclasses.dataclass(frozen=True)
class Harness:
    """How a measuring harness differs from a training job (data-set factors, never planned).

    The measured partitions (:mod:`kareus.hardware.calibrate`) came from a research harness
    whose kernels and collective behave differently from a training job's; these factors
    are fitted with the calibration to that data set only.

    Attributes:
        compute_slowdown: its kernels ran this many times as long as the model's (eager
            fp16 kernels of a hidden-2048 layer: small tiles, launch gaps). The extra time
            is stalls: the math pipes and memory are busy for the model's time only, so the
            kernel draws less power than an efficient one. The data identify it only as
            one sum (every row runs the same ops).
        stall_clock_share: the share of those stalls that lengthens as the clock falls
            (the rest, launch gaps and memory latency, does not): the 1200 MHz rows'
            time ratio identifies it.
        issue_s_per_op: host time to issue one op. Its custom collective kernel does not
            wait on the compute stream, so it starts when the host issues its launch slot's
            op (at slot x this), ahead of the GPU: launching it at the last op is measured
            to be about as fast as at the fifth. None: the collective starts when compute
            reaches its slot, as PyTorch's do.
    """

    compute_slowdown: float = 1.0
    issue_s_per_op: float | None = None
    stall_clock_share: float = 1.0


@dataclasses.dataclass(frozen=True)
class OpRun:
    """How one op runs under given resources: its duration and what it keeps busy."""

    time_s: float
    compute_util: float  # fraction of the time the math pipes are busy
    mem_bytes_per_s: float


_TILES = ((256, 128), (128, 256), (128, 128), (128, 64), (64, 128))
_SPLIT_K = (1, 2, 4, 8)
_MIN_SPLIT_K = 512


def matmul_fill(dims: tuple[int, ...], sms: int) -> float:
    """Return the share of the SMs' time a matmul's tiles fill (tile and wave quantization).

    A GEMM runs as tiles of its output, one CTA per tile (per K slice with split-K), in
    waves of one CTA per SM: the last wave, and the edge tiles, leave SMs idle (NVIDIA,
    "Matrix Multiplication Background" user's guide, "Dimension quantization effects").
    Of the tile shapes cuBLAS uses (same guide, "Typical tile dimensions in cuBLAS"), those
    of 128 x 64 and larger, and split-K into up to 8 slices of at least 512, the best fill
    is taken. Smaller tiles are left out: a 64 x 64 tile needs 64 bytes per clock per SM of
    operands at the full bf16 tensor rate (1024 MACs per clock per SM), more than the
    A100's L2 supplies (5120 bytes per clock for 108 SMs, 47; NVIDIA A100 whitepaper),
    where a 128 x 64 tile needs 48. ``dims`` is (batch, M, N, K).
    """
    batch, m, n, k = dims
    best = 0.0
    for tm, tn in _TILES:
        tiles = batch * math.ceil(m / tm) * math.ceil(n / tn)
        for sk in _SPLIT_K:
            if sk > 1 and k / sk < _MIN_SPLIT_K:
                break
            waves = math.ceil(tiles * sk / sms)
            best = max(best, batch * m * n * sk / (waves * sms * tm * tn))
    return min(1.0, best)


def ring_steps(coll: CollectiveCost) -> int:
    """Return the steps of ``coll`` around a ring of its ranks.

    An all-reduce takes 2(p - 1) (reduce-scatter, then all-gather), the others p - 1; each
    step moves 1/p of the tensor and pays the link's latency (NCCL's tuning model,
    src/graph/tuning.cc).
    """
    p = coll.world_size
    if p <= 1:
        return 0
    return 2 * (p - 1) if coll.kind == "all_reduce" else p - 1


def bus_bytes(coll: CollectiveCost) -> float:
    """Return the bytes each rank sends for ``coll`` (ring/NVLS algorithm traffic)."""
    return ring_steps(coll) / coll.world_size * coll.bytes


class Emulator:
    """Predict time and energy of work on one GPU of ``spec``; implements ``Evaluator``."""

    source = "modelled"

    def __init__(self, spec: GPUSpec, harness: Harness | None = None) -> None:
        """Model one GPU of ``spec`` in a training job, or under a measuring ``harness``."""
        self.spec = spec
        self.harness = harness or Harness()
        self.cal = spec.calibration
        self.p_dyn_max = spec.tdp_w - self.cal.static_power_w

    # ---- kernels -------------------------------------------------------------------------

    def run_op(self, op: OpCost, freq_mhz: float, sms: float, bw_fraction: float = 1.0) -> OpRun:
        """Return how ``op`` runs at ``freq_mhz`` with ``sms`` SMs and a share of bandwidth."""
        if op.op_class in ("view", "collective_issue", "collective_wait"):
            return OpRun(0.0, 0.0, 0.0)
        spec, cal = self.spec, self.cal
        speed = freq_mhz / spec.clock_max_mhz
        sm_frac = max(sms, 1.0) / spec.sm_count
        if op.op_class == "memory":
            peak, eff = spec.peak_tflops.get("fp32", 19.5) * 1e12, 1.0
        else:
            peak = spec.peak_flops(op.dtype)
            eff = cal.eff_gemm if op.op_class == "gemm" else cal.eff_attention
            if op.dims:  # a matmul whose shape is known: the SMs its tiles leave idle
                eff *= matmul_fill(op.dims, spec.sm_count)
        t_compute = op.flops / (peak * speed * sm_frac * eff)
        bw = spec.memory_bandwidth_gbs * 1e9 * cal.eff_memory * bw_fraction
        mem_speed = min(1.0, speed / cal.mem_clock_knee)
        bw *= min(1.0, sm_frac / _MEM_SAT_SM_FRACTION) * mem_speed
        t_memory = op.bytes / bw
        t_kernel = max(t_compute, t_memory)
        if self.harness.compute_slowdown != 1.0:
            t_at_max = max(t_compute * speed, t_memory * mem_speed)
            scaled = self.harness.stall_clock_share
            stall = (1 - scaled) * t_at_max + scaled * t_kernel
            t_kernel += (self.harness.compute_slowdown - 1.0) * stall
        total = t_kernel + cal.launch_overhead_us * 1e-6
        return OpRun(
            time_s=total,
            compute_util=t_compute / total,
            mem_bytes_per_s=op.bytes / total,
        )

    def link(self, coll: CollectiveCost | None = None) -> InterconnectSpec:
        """Return the link that carries ``coll``.

        The node's network where its group spans nodes (:attr:`CollectiveCost.nodes`), else
        the GPU's interconnect (NVLink).
        """
        if coll is not None and coll.nodes > 1 and self.spec.network is not None:
            return self.spec.network
        return self.spec.interconnect

    def collective_rate(
        self,
        knobs: Knobs,
        freq_mhz: float,
        beside_compute: bool = False,
        coll: CollectiveCost | None = None,
    ) -> float:
        """Return bus bytes per second of a collective with the knobs' SM share and CTAs.

        ``beside_compute``: compute kernels run at the same time (:attr:`Calibration.contention`).
        ``coll``: the collective, whose group sets the link (:meth:`link`; None: NVLink).
        """
        cal = self.cal
        speed = freq_mhz / self.spec.clock_max_mhz
        if beside_compute:
            speed **= cal.contended_clock_exponent
        per_sm = cal.comm_gbs_per_sm * 1e9 * speed
        per_sm *= (knobs.threads_per_block / 1024) ** cal.comm_thread_exponent
        link = self.link(coll).bandwidth_gbs * 1e9 * cal.comm_link_efficiency
        # The collective's SMs copy the bytes into the link, which carries them: the two run
        # as a pipeline, so the slower one sets the rate (NCCL's bus bandwidth grows with
        # its channels until the link saturates).
        rate = min(link, knobs.sm_share * per_sm)
        return rate / (1.0 + cal.contention) if beside_compute else rate

    def collective_time(self, coll: CollectiveCost, knobs: Knobs) -> float:
        """Return the time of ``coll`` alone (no overlap) at the knobs' clock and SM share."""
        rate = self.collective_rate(knobs, knobs.freq_mhz, coll=coll)
        return self._latency(coll) + bus_bytes(coll) / rate

    def _latency(self, coll: CollectiveCost) -> float:
        """Return a ring collective's latency: a base plus one link latency per ring step.

        At TP 8 on NVLink about 56 us for an all-reduce (:func:`ring_steps`), paid in full by
        a collective that runs alone and hidden by one that overlaps.
        """
        steps = ring_steps(coll)
        if steps == 0:
            return 0.0
        return (self.cal.comm_latency_us + steps * self.link(coll).latency_us) * 1e-6

    def contention(self, ops: tuple[OpCost, ...], freq_mhz: float, sm_share: int) -> float:
        """Return how much longer ``ops`` take beside a collective on ``sm_share`` SMs.

        The compute a collective takes from the kernels beside it: they keep the SMs and the
        memory bandwidth it leaves (as in a partition's timeline, without throttling). 1.0
        for no ops.
        """
        knobs = Knobs(freq_mhz, sm_share)
        hbm = (
            self.collective_rate(knobs, freq_mhz, beside_compute=True)
            * self.cal.comm_hbm_bytes_per_byte
        )
        left = self.spec.sm_count - min(sm_share, self.spec.sm_count - 1)
        bw_left = max(_MIN_BW_LEFT, 1 - hbm / (self.spec.memory_bandwidth_gbs * 1e9))
        alone = sum(self.run_op(op, freq_mhz, self.spec.sm_count).time_s for op in ops)
        beside = sum(self.run_op(op, freq_mhz, left, bw_left).time_s for op in ops)
        return beside / alone if alone > 0 else 1.0

    # ---- power ---------------------------------------------------------------------------

    def _sm_power(
        self,
        run: OpRun | None,
        op_class: str,
        sms: float,
        comm_sms: float,
        comm_load: float = 1.0,
    ) -> float:
        """Dynamic SM-side power at the maximum clock (scaled by f·V² by the caller).

        ``comm_load``: the collective's copy rate as a share of its rate alone. Its CTAs
        draw power for the bytes they move: slowed beside compute, they wait on memory and
        issue less, so a byte costs the same energy overlapped or not.
        """
        act = self.cal.activity
        power = 0.0
        if run is not None and run.time_s > 0:
            busy = run.compute_util
            cls = act.get(op_class, act["memory"])
            power += (
                self.p_dyn_max
                * sms
                / self.spec.sm_count
                * (cls * busy + act["memory"] * (1 - busy))
            )
        if comm_sms:
            power += self.p_dyn_max * comm_sms / self.spec.sm_count * act["comm"] * comm_load
        return power

    def static_power(self, freq_mhz: float) -> float:
        """Return the power drawn at ``freq_mhz`` with nothing running.

        ``spec.leakage_fraction`` of the static power at the maximum clock is leakage, which
        scales with the core voltage; ``calibration.static_clock_share`` is the clock network
        and idle logic switching at the locked clock, which scales with f·V² like any dynamic
        power; the rest (board, fans, memory refresh, I/O) does not. Planning charges idle
        time at the maximum clock's static power (:meth:`idle`); an op run at a lower clock
        saves the difference.
        """
        spec, clock = self.spec, self.cal.static_clock_share
        leak = spec.leakage_fraction * (1 - spec.voltage(freq_mhz))
        return self.cal.static_power_w * (1 - leak - clock * (1 - spec.dynamic_scale(freq_mhz)))

    def _mem_power(self, bytes_per_s: float) -> float:
        return self.cal.mem_power_w_per_tbs * bytes_per_s / 1e12

    def running_clock(self, op: OpCost, freq_mhz: float) -> float:
        """Return the clock ``op`` runs at, alone on every SM, when ``freq_mhz`` is asked for.

        Below ``freq_mhz`` where its power would pass the TDP: the power cap's clock (an
        H200 runs a large bf16 GEMM at about 1455 MHz of its 1980).
        """
        probe = self.run_op(op, freq_mhz, self.spec.sm_count)
        sm_p = self._sm_power(probe, op.op_class, self.spec.sm_count, 0)
        return self._throttled_clock(freq_mhz, sm_p, self._mem_power(probe.mem_bytes_per_s))

    def _throttled_clock(self, freq_mhz: float, sm_power_at_max: float, mem_power: float) -> float:
        """Return the clock the chip actually runs at: ``freq_mhz`` unless power exceeds TDP."""
        spec = self.spec
        budget = spec.tdp_w - self.static_power(freq_mhz) - mem_power
        if sm_power_at_max * spec.dynamic_scale(freq_mhz) <= budget:
            return freq_mhz
        lo, hi = float(spec.clock_min_mhz), float(freq_mhz)
        for _ in range(40):
            mid = (lo + hi) / 2
            if sm_power_at_max * spec.dynamic_scale(mid) <= budget:
                lo = mid
            else:
                hi = mid
        return lo

    # ---- timelines -----------------------------------------------------------------------

    def ops(self, ops: tuple[OpCost, ...], freq_mhz: float) -> Estimate:
        """Estimate ops run back to back with all SMs and nothing overlapping."""
        return self._timeline(PartitionWork(ops, None), Knobs(freq_mhz, 0, launch_slot=None))

    def idle(self, duration_s: float) -> Estimate:
        """Estimate a GPU that waits (a pipeline bubble, a blocked collective) for a while."""
        energy = self.cal.static_power_w * duration_s
        return Estimate(duration_s, energy, 0.0, "modelled")

    def partition(self, work: PartitionWork, knobs: Knobs) -> Estimate:
        """Estimate one partition under one knob setting (the planner's protocol)."""
        return self._timeline(work, knobs)

    def _timeline(self, work: PartitionWork, knobs: Knobs) -> Estimate:
        spec, cal = self.spec, self.cal
        static = cal.static_power_w
        coll = work.collective if work.collective and work.collective.world_size > 1 else None
        ops = list(work.ops)
        overlap = (
            coll is not None and knobs.launch_slot is not None and knobs.launch_slot < len(ops)
        )
        wait_after = len(ops) - 1 if knobs.wait_after is None else knobs.wait_after
        comm_left = bus_bytes(coll) if coll else 0.0
        lat_left = self._latency(coll) if coll else 0.0
        comm_on = False
        t = energy = 0.0
        issue_at = math.inf  # when the host issues the collective, if it runs ahead
        if overlap and self.harness.issue_s_per_op is not None:
            issue_at = knobs.launch_slot * self.harness.issue_s_per_op  # type: ignore[operator]
        throttled = False

        def comm_step(freq: float) -> tuple[float, float, float]:
            """(time to finish, rate, HBM bytes per second) of the collective beside compute."""
            rate = self.collective_rate(knobs, freq, beside_compute=True, coll=coll)
            return lat_left + comm_left / rate, rate, rate * cal.comm_hbm_bytes_per_byte

        # the collective's rate beside compute, as a share of its rate alone at the clock
        load = (
            self.collective_rate(knobs, knobs.freq_mhz, beside_compute=True, coll=coll)
            / self.collective_rate(knobs, knobs.freq_mhz, coll=coll)
            if coll is not None and knobs.sm_share
            else 1.0
        )
        for i, op in enumerate(ops):
            if overlap and i == knobs.launch_slot:
                comm_on = True
            remaining = 1.0
            while remaining > 1e-12:
                comm_on |= t >= issue_at - 1e-12  # (float rounding)
                active = comm_on and (lat_left > 0 or comm_left > 0)
                n_comm = min(knobs.sm_share, spec.sm_count - 1) if active else 0
                n_comp = spec.sm_count - n_comm
                comm_hbm = 0.0
                if active:
                    _, rate, comm_hbm = comm_step(knobs.freq_mhz)
                bw_left = max(_MIN_BW_LEFT, 1 - comm_hbm / (spec.memory_bandwidth_gbs * 1e9))
                probe = self.run_op(op, knobs.freq_mhz, n_comp, bw_left)
                sm_p = self._sm_power(probe, op.op_class, n_comp, n_comm, load)
                mem_p = self._mem_power(probe.mem_bytes_per_s + comm_hbm)
                freq = self._throttled_clock(knobs.freq_mhz, sm_p, mem_p)
                throttled |= freq < knobs.freq_mhz - 1e-6
                run = self.run_op(op, freq, n_comp, bw_left) if freq != knobs.freq_mhz else probe
                if run.time_s <= 0:
                    break
                dt_op = remaining * run.time_s
                dt_comm, rate, comm_hbm = comm_step(freq) if active else (math.inf, 0.0, 0.0)
                dt = min(dt_op, dt_comm, max(issue_at - t, 0.0) if not comm_on else math.inf)
                power = (
                    self.static_power(freq)
                    + self._sm_power(run, op.op_class, n_comp, n_comm, load)
                    * spec.dynamic_scale(freq)
                    + self._mem_power(run.mem_bytes_per_s + comm_hbm)
                )
                t += dt
                energy += power * dt
                remaining -= dt / run.time_s
                if active:
                    lat_left, comm_left = _advance(lat_left, comm_left, rate, dt)
            if comm_on and i >= wait_after and (lat_left > 0 or comm_left > 0):
                dt, e, th = self._comm_alone(knobs, lat_left, comm_left, coll)
                t, energy, throttled = t + dt, energy + e, throttled or th
                lat_left = comm_left = 0.0
        if coll is not None and (lat_left > 0 or comm_left > 0):  # not overlapped: after compute
            dt, e, th = self._comm_alone(knobs, lat_left, comm_left, coll)
            t, energy, throttled = t + dt, energy + e, throttled or th
        return Estimate(
            time_s=t,
            energy_j=energy,
            dynamic_energy_j=energy - static * t,
            source="modelled",
            throttled=throttled,
        )

    def _comm_alone(
        self, knobs: Knobs, lat_left: float, comm_left: float, coll: CollectiveCost | None
    ) -> tuple[float, float, bool]:
        n = min(knobs.sm_share, self.spec.sm_count)
        rate = self.collective_rate(knobs, knobs.freq_mhz, coll=coll)
        hbm = rate * self.cal.comm_hbm_bytes_per_byte
        sm_p = self._sm_power(None, "memory", 0, n)
        freq = self._throttled_clock(knobs.freq_mhz, sm_p, self._mem_power(hbm))
        if freq != knobs.freq_mhz:
            rate = self.collective_rate(knobs, freq, coll=coll)
            hbm = rate * self.cal.comm_hbm_bytes_per_byte
        dt = lat_left + comm_left / rate
        power = (
            self.static_power(freq) + sm_p * self.spec.dynamic_scale(freq) + self._mem_power(hbm)
        )
        return dt, power * dt, freq != knobs.freq_mhz


def _advance(lat_left: float, comm_left: float, rate: float, dt: float) -> tuple[float, float]:
    if lat_left >= dt:
        return lat_left - dt, comm_left
    dt -= lat_left
    left = comm_left - rate * dt
    return 0.0, left if left > 1e-3 else 0.0  # below a byte: done (float rounding)
