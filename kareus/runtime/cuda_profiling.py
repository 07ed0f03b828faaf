"""A CUDA GPU as a profiling device for :class:`kareus.planner.profiler.ProfilerEvaluator`.

Runs a synthetic workload built from a partition's costs (GEMMs and copies of the same
FLOPs and bytes, the collective on a side stream from its launch slot) and reads energy
through Zeus's monitor. Needs a CUDA GPU; never changes clocks itself.
"""

from __future__ import annotations

from kareus.costs import Knobs, OpCost, PartitionWork


class CudaProfilingDevice:  # pragma: no cover - needs a CUDA GPU
    """A CUDA GPU: synthetic kernels with the partition's FLOPs and bytes; Zeus energy."""

    source = "measured"

    def __init__(self, gpu_index: int = 0, dtype: str = "bfloat16") -> None:
        import torch
        from zeus.monitor import ZeusMonitor

        self.torch = torch
        self.device = torch.device("cuda", gpu_index)
        self.dtype = getattr(torch, dtype)
        self.monitor = ZeusMonitor(gpu_indices=[gpu_index])
        self.side = torch.cuda.Stream(self.device)
        self._cache: dict[object, object] = {}
        self.monitor.begin_window("kareus-profiler", sync_execution=True)

    def _tensors(self, op: OpCost) -> tuple[object, ...]:
        t = self.torch
        if op not in self._cache:
            if op.op_class in ("gemm", "attention"):
                n = max(round((op.flops / 2) ** (1 / 3) / 64) * 64, 64)
                self._cache[op] = (t.randn(n, n, device=self.device, dtype=self.dtype),)
            else:
                numel = max(int(op.bytes / 2 / 2), 1)
                self._cache[op] = (t.empty(numel, device=self.device, dtype=self.dtype),)
        return self._cache[op]  # type: ignore[return-value]

    def run(self, work: PartitionWork, knobs: Knobs) -> None:
        """Enqueue the synthetic workload; the collective starts at its launch slot."""
        t = self.torch
        for i, op in enumerate(work.ops):
            if work.collective is not None and knobs.launch_slot == i:
                self._collective(work)
            (x,) = self._tensors(op)
            if op.op_class in ("gemm", "attention"):
                x @ x  # type: ignore[operator]
            else:
                x.copy_(x)  # type: ignore[attr-defined]
        if work.collective is not None and knobs.launch_slot is None:
            self._collective(work)
        t.cuda.current_stream(self.device).wait_stream(self.side)

    def _collective(self, work: PartitionWork) -> None:
        import torch.distributed as dist

        if not dist.is_initialized() or work.collective is None:
            return
        buf = self._cache.setdefault(
            ("coll", work.collective.bytes),
            self.torch.empty(int(work.collective.bytes // 2), device=self.device, dtype=self.dtype),
        )
        self.side.wait_stream(self.torch.cuda.current_stream(self.device))
        with self.torch.cuda.stream(self.side):
            dist.all_reduce(buf)  # type: ignore[arg-type]

    def synchronize(self) -> None:
        """Wait for the GPU."""
        self.torch.cuda.synchronize(self.device)

    def now_s(self) -> float:
        """Return wall time (the GPU is synchronised before reads)."""
        import time

        return time.perf_counter()

    def energy_j(self) -> float:
        """Return the GPU's cumulative energy through Zeus's monitor."""
        m = self.monitor.end_window("kareus-profiler", sync_execution=True)
        self.monitor.begin_window("kareus-profiler", sync_execution=True)
        self._total = getattr(self, "_total", 0.0) + m.total_energy
        return self._total
