"""What the passes of one compiled region found: one typed record, filled by the runner.

A pass that finds something returns it in its :class:`~kareus.passes.base.PassResult`
(``found``) and declares the field it fills (:attr:`GraphPass.finds`); the runner stores
it here. The passes after it, the compiler, ``kareus.explain`` and the tests read the
fields by name, typed: nothing reads a pass's result by a string.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from typing import Any

from kareus.ir.partitions import Decision, PartitionSet
from kareus.passes.blocks import BlockSet
from kareus.passes.programs import PartitionProgram


@dataclasses.dataclass(frozen=True)
class PlanCheck:
    """What ``check_plan`` found of the applied plan against one region.

    Attributes:
        decisions: the plan's overlap decisions that fit the region, keyed by its partition
            types (a block compiled alone: its types, not the plan's; ``strict=False``: the
            types that match only); None where the supplied ones stand as given.
        note: why a graph was not checked against the plan ("" where it was).
    """

    decisions: Mapping[str, Decision] | None = None
    note: str = ""

    def to_text(self) -> str:
        """Render the note, then the decisions kept, a line each."""
        lines = [self.note] if self.note else []
        if self.decisions is not None:
            lines.append("decisions kept for this region's partition types:")
            lines += [f"{k}: {v}" for k, v in self.decisions.items()] or ["none"]
        return "\n".join(lines)


@dataclasses.dataclass
class Findings:
    """The findings of one compiled region, one field per pass that finds something.

    Attributes:
        blocks: ``find_blocks``: the repeated layer blocks, their spans per graph and
            what the split did with each (``split_nanobatches`` records its verdicts on
            them).
        partitions: ``cut_partitions``: the partitions of the forward and backward graphs.
        programs: ``extract_partitions``: each partition type as a runnable program, by
            type key (with ``Config.extract_partitions``).
        plan_check: ``check_plan``: the plan's decisions that fit the region, and why a
            graph was not checked against the plan, where it was not.
        extra: what passes added to the pipeline (not kareus's own) found, by the name
            each declares (:attr:`GraphPass.finds`, else its own).
    """

    blocks: BlockSet | None = None
    partitions: PartitionSet | None = None
    programs: dict[str, PartitionProgram] = dataclasses.field(default_factory=dict)
    plan_check: PlanCheck | None = None
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)

    def store(self, name: str, value: Any) -> None:
        """Store a pass's finding: in its typed field, else under ``name`` in :attr:`extra`."""
        if name in _TYPED:
            setattr(self, name, value)
        else:
            self.extra[name] = value

    def items(self) -> Iterator[tuple[str, Any]]:
        """Yield (name, finding) for each finding held (``kareus.explain`` lists them)."""
        for name in _TYPED:
            value = getattr(self, name)
            if value is not None and value != {}:
                yield name, value
        yield from self.extra.items()


_TYPED = tuple(f.name for f in dataclasses.fields(Findings) if f.name != "extra")
