"""The partition set: what the analysis passes hand to the planner, as plain data.

A *partition* is the compute of one nanobatch's segment overlapped with one collective of
the other nanobatch; partitions with the same op-class sequence and collective share a
*type* (all layers do), and a decision is made once per type. Nothing here refers to fx:
node names are strings, costs are :class:`~kareus.ir.costs.OpCost`, and the whole set
round-trips through JSON.
"""

from __future__ import annotations

import collections
import dataclasses
import json
from collections.abc import Mapping
from typing import Any

from kareus._table import render_table
from kareus.ir.costs import CollectiveCost, OpCost


@dataclasses.dataclass(frozen=True)
class Slot:
    """A launch slot: a GEMM or attention op, or a run of memory-bound ops.

    ``first`` names the node the collective is issued before when launched at this slot.
    """

    first: str
    ops: tuple[OpCost, ...]

    @property
    def label(self) -> str:
        """Short description, e.g. ``gemm`` or ``memory x3``."""
        kinds = collections.Counter(o.op_class for o in self.ops)
        return ", ".join(k if n == 1 else f"{k} x{n}" for k, n in kinds.items())


@dataclasses.dataclass(frozen=True)
class PartitionType:
    """Identical partitions of all layers; one decision is made per type.

    Attributes:
        key: stable name, e.g. ``forward.1``.
        instruction: ``forward`` or ``backward``.
        compute: the costs of the compute ops (views excluded), in order.
        slot_labels: what each launch slot holds.
        collective: the collective in flight, or None.
    """

    key: str
    instruction: str
    compute: tuple[OpCost, ...]
    slot_labels: tuple[str, ...]
    collective: CollectiveCost | None

    def describe(self, *, exact: bool = False) -> str:
        """One line: the op mix and the collective.

        Args:
            exact: the collective's size in KiB to one decimal, as plan fingerprints
                record it (a format plan files depend on), instead of a readable unit.
        """
        mix = collections.Counter(o.op_class for o in self.compute)
        ops = ", ".join(f"{n} {k}" for k, n in sorted(mix.items()))
        coll = describe_collective(self.collective, exact) if self.collective else "no collective"
        return f"{ops} ‖ {coll}"


def describe_collective(coll: CollectiveCost, exact: bool = False) -> str:
    """Return "kind size xGROUP" ("... over N nodes" where the group spans nodes).

    ``exact``: the size in KiB to one decimal (fingerprints).
    """
    size = f"{coll.bytes / 2**10:.1f} KiB" if exact else format_bytes(coll.bytes)
    across = f" over {coll.nodes} nodes" if coll.nodes > 1 else ""
    return f"{coll.kind} {size} x{coll.world_size}{across}"


def format_bytes(n: float) -> str:
    """Return ``n`` bytes in the largest binary unit that keeps it at least 1 ("96 MiB")."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            value = n / scale
            return f"{value:.0f} {unit}" if value == round(value) else f"{value:.1f} {unit}"
    return f"{n:.0f} B"


@dataclasses.dataclass(frozen=True)
class Partition:
    """One partition in one graph.

    Attributes:
        instruction: ``forward`` or ``backward``.
        block, nanobatch, segment: where its compute comes from.
        type_key: its :class:`PartitionType`.
        compute: names of its compute nodes (views included), in order.
        slots: its launch slots, in order.
        collective: (issue node, wait node) of the collective it overlaps, or None.
        whole: its compute is a run of a block left whole (between the block's own
            collectives), and its collective another run's, issued early or waited for
            late (``cut_partitions``'s windows); ``nanobatch`` and ``segment`` are then 0.
    """

    instruction: str
    block: str
    nanobatch: int
    segment: int
    type_key: str
    compute: tuple[str, ...]
    slots: tuple[Slot, ...]
    collective: tuple[str, str] | None
    whole: bool = False


@dataclasses.dataclass(frozen=True)
class Decision:
    """What to do with the partitions of one type.

    Attributes:
        launch_slot: the slot at whose start the collective is issued; None runs it
            without overlap (right after the compute that produces its input).
        sm_share: SMs for the collective (selects a communicator); None keeps the default.
    """

    launch_slot: int | None = 0
    sm_share: int | None = None


@dataclasses.dataclass
class PartitionSet:
    """Partitions and their types per instruction, and the work outside partitions.

    Attributes:
        partitions: every partition, in execution order per instruction.
        types: the partition types by key.
        other: per instruction, the compute outside partitions and outside blocks
            (embedding, head, loss; a stage whose layers are not found as blocks).
        block_other: per instruction and block, the block's compute outside partitions (a
            split block's weight gradients of both nanobatches and the last one's residual
            tail; a block left whole entirely). Kept per block so that counting repeated
            layers counts it too.
        exposed: per instruction, collectives that overlap no compute.
        block_exposed: per instruction and block, those of :attr:`exposed` that a block
            runs (a block left whole runs its collectives alone): kept per block so that
            counting repeated layers, and activation recompute, count them too.
        notes: per instruction, why its graph has no partitions; ``recompute``: what the
            recompute mode could not tell apart (:meth:`recomputed`).
        recompute: per instruction, compute it re-runs for activation recompute (the
            backward re-running its forward: :meth:`recomputed`); it overlaps nothing.
        recompute_collectives: per instruction, collectives it re-runs, alone.
    """

    partitions: list[Partition] = dataclasses.field(default_factory=list)
    types: dict[str, PartitionType] = dataclasses.field(default_factory=dict)
    other: dict[str, tuple[OpCost, ...]] = dataclasses.field(default_factory=dict)
    block_other: dict[str, dict[str, tuple[OpCost, ...]]] = dataclasses.field(default_factory=dict)
    exposed: dict[str, tuple[CollectiveCost, ...]] = dataclasses.field(default_factory=dict)
    block_exposed: dict[str, dict[str, tuple[CollectiveCost, ...]]] = dataclasses.field(
        default_factory=dict
    )
    notes: dict[str, str] = dataclasses.field(default_factory=dict)
    recompute: dict[str, tuple[OpCost, ...]] = dataclasses.field(default_factory=dict)
    recompute_collectives: dict[str, tuple[CollectiveCost, ...]] = dataclasses.field(
        default_factory=dict
    )

    def recomputed(self, mode: str) -> PartitionSet:
        """Return a copy whose backward re-runs forward work, as activation recompute does.

        ``full``: the layers' forward, as Megatron-LM's full recompute checkpoints each
        transformer layer: every op of the forward's partitions and of its blocks outside
        them (:attr:`block_other`), and the collectives of both (the partitions', and
        :attr:`block_exposed`: those of blocks left whole); the embedding, head and
        loss (:attr:`other`) are not re-run. A forward with no layer blocks found (a stage of
        one layer) re-runs all of its forward, collectives included: kareus cannot tell its
        layer from the rest there, and says so in :attr:`notes`. ``selective``: the attention
        ops only; ``none``: nothing. The re-run work is kept apart from the rest
        (:attr:`recompute`), run without overlap at the backward's clock; applying a mode
        twice gives the same set.
        """
        if mode not in ("none", "full", "selective"):
            raise ValueError(f"recompute={mode!r} must be none, full or selective")
        forward = [p for p in self.partitions if p.instruction == "forward"]
        blocks = self.block_other.get("forward", {})
        ops = tuple(o for p in forward for slot in p.slots for o in slot.ops) + tuple(
            o for block_ops in blocks.values() for o in block_ops
        )
        overlapped = [self.types[p.type_key].collective for p in forward]
        colls = tuple(c for c in overlapped if c is not None) + tuple(
            c for block in self.block_exposed.get("forward", {}).values() for c in block
        )
        notes = {k: v for k, v in self.notes.items() if k != "recompute"}
        if not ops:  # no layer blocks found: the whole forward
            ops, colls = self.other.get("forward", ()), self.exposed.get("forward", ())
            if mode == "full" and ops:
                notes["recompute"] = (
                    "no layer blocks found in the forward: its whole forward (embedding, head "
                    "and loss included) is re-run"
                )
        if mode == "selective":
            ops, colls = tuple(o for o in ops if o.op_class == "attention"), ()
        elif mode == "none":
            ops, colls = (), ()
        return dataclasses.replace(
            self,
            recompute={"backward": ops} if ops else {},
            recompute_collectives={"backward": colls} if colls else {},
            notes=notes,
        )

    def counts(self, instruction: str) -> dict[str, int]:
        """Return how many partitions of each type one ``instruction`` contains."""
        return dict(
            collections.Counter(p.type_key for p in self.partitions if p.instruction == instruction)
        )

    def fingerprint(self, instruction: str) -> dict[str, str]:
        """Return each type of ``instruction`` as "op mix ‖ collective xCOUNT".

        Two workloads with equal fingerprints have the same partitions: the same layers,
        shapes, collectives and parallel sizes. Plans carry it (:attr:`kareus.Plan.fingerprint`).
        An instruction without partitions (the original graphs, or nothing split) is told by
        its layer blocks' matmuls and collectives instead, under the key ``whole``: as the
        types, the blocks only (the embedding, head and loss may run outside the compiled
        model, as under a pipeline schedule), and no memory-bound ops (which differ with
        what fusion leaves).
        """
        counts = self.counts(instruction)
        out = {
            key: f"{t.describe(exact=True)} x{counts.get(key, 0)}"
            for key, t in self.types.items()
            if t.instruction == instruction
        }
        if out:
            return out
        mix = collections.Counter(
            o.op_class
            for ops in self.block_other.get(instruction, {}).values()
            for o in ops
            if o.op_class in ("gemm", "attention")
        )
        colls = collections.Counter(
            describe_collective(c, exact=True)
            for block in self.block_exposed.get(instruction, {}).values()
            for c in block
        )
        ops = ", ".join(f"{n} {k}" for k, n in sorted(mix.items())) or "no matmul"
        alone = ", ".join(f"{k} x{n}" for k, n in sorted(colls.items())) or "no collective"
        return {"whole": f"{ops} ‖ {alone}"}

    def outside(self, instruction: str) -> tuple[OpCost, ...]:
        """All compute of one instruction outside partitions (``other`` and ``block_other``)."""
        blocks = self.block_other.get(instruction, {})
        return self.other.get(instruction, ()) + tuple(c for ops in blocks.values() for c in ops)

    def to_dict(self) -> dict[str, Any]:
        """Return the set as JSON-ready data."""
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        """Return the set as JSON."""
        return json.dumps(self.to_dict())

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> PartitionSet:
        """Rebuild a set from :meth:`to_dict` output (validated as :meth:`from_json`)."""
        return cls.from_json(json.dumps(data), "partition set data")

    @classmethod
    def from_json(cls, text: str, source: str = "partition set JSON") -> PartitionSet:
        """Validate a set's JSON against the schema and build it.

        Raises:
            FileFormatError: malformed JSON or a field of the wrong type (named).
        """
        from kareus.ir.schema import parse

        pset: PartitionSet = parse(cls, text, source, "kareus partition set")
        return pset

    def to_text(self) -> str:
        """Render the types and their counts as a table (used by ``kareus.explain``)."""
        rows = []
        for key, t in self.types.items():
            count = sum(1 for p in self.partitions if p.type_key == key)
            slots = " | ".join(f"{i}:{s}" for i, s in enumerate(t.slot_labels))
            rows.append((key, t.instruction, count, t.describe(), slots))
        lines = (
            [
                render_table(
                    "partition types (count: partitions of the type in one forward or backward; "
                    "slots: where its collective can be launched)",
                    ("type", "instruction", "count", "compute ‖ collective", "slots"),
                    rows,
                )
            ]
            if rows
            else [
                "no partitions: no split block holds a collective, and no collective can "
                "overlap a block left whole"
            ]
        )
        for instr in self.other:
            ops = self.outside(instr)
            flops = sum(o.flops for o in ops)
            lines.append(f"{instr}: {len(ops)} ops outside partitions ({flops / 1e9:.3f} GFLOP)")
        for instr in dict.fromkeys(p.instruction for p in self.partitions if p.whole):
            n = sum(1 for p in self.partitions if p.whole and p.instruction == instr)
            lines.append(
                f"{instr}: {n} collective(s) overlap compute of a block left whole (issued "
                "before compute they do not read, or waited for after compute that does "
                "not read them)"
            )
        for instr, colls in self.exposed.items():
            if colls:
                lines.append(f"{instr}: {len(colls)} collective(s) overlap no compute")
        for instr, ops in self.recompute.items():
            flops = sum(o.flops for o in ops)
            colls = self.recompute_collectives.get(instr, ())
            lines.append(
                f"{instr}: re-runs {len(ops)} forward ops ({flops / 1e9:.3f} GFLOP) and "
                f"{len(colls)} collective(s) for activation recompute, without overlap"
            )
        lines.extend(f"{instr}: {note}" for instr, note in self.notes.items())
        return "\n".join(lines)
