"""The repeated layer blocks of a compiled region, as ``find_blocks`` finds them.

Plain records (no pass machinery): the region's typed findings
(:class:`~kareus.passes.findings.Findings`) hold them, and the passes after
``find_blocks`` read them.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Mapping

from kareus._table import render_table
from kareus.passes.tags import NodeTag


@dataclasses.dataclass(frozen=True)
class Block:
    """One repeated layer as found in Dynamo's graph."""

    family: str
    index: int
    path: str
    module_type: str
    nodes: tuple[str, ...]

    @property
    def name(self) -> str:
        """Short name, e.g. ``layers.3``."""
        return f"{self.family}.{self.index}"


@dataclasses.dataclass
class BlockSet:
    """The blocks of one compiled region, their node spans per graph, and split decisions.

    Attributes:
        blocks: every block found, in graph order.
        mismatched: blocks whose op sequence differs from their family's, with the reason.
        split: names of the blocks split into nanobatches.
        split_along: what each split block's nanobatches halve: "batch" or "sequence".
        skipped: names of blocks left whole, with the reason.
        spans: per graph kind, per block name, per nanobatch (None when unsplit), the names
            of the block's nodes in that graph.
    """

    NO_BLOCKS = (
        "no repeated layer blocks in this graph, so nothing is split: the model has no "
        "ModuleList/Sequential of two or more layers of one type here, or a graph break "
        "inside the layers cut them across graphs (TORCH_LOGS=graph_breaks shows where)"
    )

    blocks: list[Block] = dataclasses.field(default_factory=list)
    why_none: str = ""
    whole_region: bool = False
    mismatched: dict[str, str] = dataclasses.field(default_factory=dict)
    split: list[str] = dataclasses.field(default_factory=list)
    split_along: dict[str, str] = dataclasses.field(default_factory=dict)
    skipped: dict[str, str] = dataclasses.field(default_factory=dict)
    spans: dict[str, dict[str, dict[int | None, list[str]]]] = dataclasses.field(
        default_factory=dict
    )
    _by_seq_nr: dict[int, NodeTag] = dataclasses.field(default_factory=dict, repr=False)

    def families(self) -> dict[str, list[Block]]:
        """Return the blocks grouped by family."""
        out: dict[str, list[Block]] = collections.defaultdict(list)
        for b in self.blocks:
            out[b.family].append(b)
        return dict(out)

    def block(self, name: str) -> Block:
        """Return the block called ``name`` (e.g. ``layers.0``)."""
        for b in self.blocks:
            if b.name == name:
                return b
        raise KeyError(f"no block {name!r}; blocks: {[b.name for b in self.blocks]}")

    def to_text(self, notes: Mapping[str, str] | None = None) -> str:
        """Render the blocks as a table (used by ``kareus.explain``).

        ``notes``: what to say of a split block (why it was split), by name.
        """
        if not self.blocks:
            return self.why_none or self.NO_BLOCKS
        kinds = [k for k in ("forward", "backward", "inference") if k in self.spans]
        rows = []
        for b in self.blocks:
            cells = [b.family, b.index, b.module_type, len(b.nodes)]
            for kind in kinds:
                span = self.spans[kind].get(b.name, {})
                per_nb = "/".join(
                    str(len(span[nb])) for nb in sorted(n for n in span if n is not None)
                )
                if not per_nb:  # a whole block: all its nodes, none per nanobatch
                    cells.append(str(len(span.get(None, ()))))
                    continue
                shared = f" +{len(span[None])} shared" if span.get(None) else ""
                cells.append(per_nb + shared)
            if b.name in self.split:
                along = self.split_along.get(b.name, "batch")
                cells += [f"split ({along})", (notes or {}).get(b.name, "")]
            else:
                cells += ["whole", self.skipped.get(b.name, self.mismatched.get(b.name, ""))]
            rows.append(cells)
        cols = ["family", "block", "module", "dynamo nodes", *(f"{k} nodes" for k in kinds)]
        head = ""
        if self.whole_region:
            b = self.blocks[0]
            head = (
                f"this region is one call of {b.module_type}.forward (compiled block by block, "
                "or cut at the layer by hooks such as FSDP's): the region is the block. Only "
                "overlap across layers (a collective of one layer beside the next layer's "
                "compute) needs the layers in one graph, and is not done here\n"
            )
        return head + render_table(
            "blocks (graph nodes; of a split block, per nanobatch, nb0/nb1, and shared: nodes "
            "of both, such as the split's narrow and cat and the sums of weight gradients)",
            [*cols, "nanobatches", "reason"],
            rows,
        )
