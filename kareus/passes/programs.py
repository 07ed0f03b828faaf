"""A partition type as a runnable program (``extract_partitions``'s finding).

Plain records (no pass machinery): the region's typed findings
(:class:`~kareus.passes.findings.Findings`) hold them, and ``kareus profile`` runs them.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.fx as fx

from kareus.ir.costs import PartitionWork
from kareus.ir.partitions import Partition


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """Shape, strides and dtype of one input, to make a random tensor like it."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype

    def make(self, device: torch.device | str, generator: torch.Generator) -> torch.Tensor:
        """Return a tensor of this layout: normal values for floats, zeros otherwise.

        Zeros keep integer inputs (indices, positions) in range.
        """
        size = 1 + sum((s - 1) * st for s, st in zip(self.shape, self.stride, strict=True))
        flat = torch.zeros(max(size, 1), dtype=self.dtype, device=device)
        if self.dtype.is_floating_point:
            flat.copy_(torch.randn(flat.shape, generator=generator).to(self.dtype))
        return flat.as_strided(self.shape, self.stride)


@dataclasses.dataclass
class PartitionProgram:
    """A partition type, or a piece of the work outside partitions, as a runnable program.

    Attributes:
        key: what it stands for: a partition type's key (``KEY/collective``: its
            collective alone), or ``KIND/outside``, ``KIND/block/BLOCK``,
            ``KIND/exposed/NODE`` for work outside partitions.
        partition: the copied partition (its node names are the program's); None outside.
        work: the program's cost, equal to what the partition set records for it.
        gm: the program, in captured order (issue and wait after the compute).
        inputs: one spec per placeholder, in order.
        group_name: the process group its collective was traced on, or None.
    """

    key: str
    partition: Partition | None
    work: PartitionWork
    gm: fx.GraphModule
    inputs: tuple[TensorSpec, ...]
    group_name: str | None

    def make_inputs(self, device: torch.device | str, seed: int = 0) -> list[torch.Tensor]:
        """Return random inputs of the captured layouts on ``device`` (same seed, same data)."""
        gen = torch.Generator().manual_seed(seed)
        return [spec.make(device, gen) for spec in self.inputs]


def class_name(key: str) -> str:
    """Return the class name of the program standing for ``key``."""
    return "Program_" + "".join(c if c.isalnum() else "_" for c in key)
