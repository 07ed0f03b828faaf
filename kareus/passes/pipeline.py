"""The pipeline: every pass, in the order it runs.

Structural passes run on Dynamo's graph before autograd; analysis and codegen passes run on
AOTAutograd's forward, backward and inference graphs. Each pass declares which graphs it
applies to; the runner (:func:`kareus.passes.base.run_passes`) skips the others.
"""

from __future__ import annotations

from kareus.passes.annotate_costs import AnnotateCosts
from kareus.passes.base import GraphPass, check_order
from kareus.passes.check_plan import CheckPlan
from kareus.passes.cut_partitions import CutPartitions
from kareus.passes.extract_partitions import ExtractPartitions
from kareus.passes.find_blocks import FindBlocks
from kareus.passes.insert_clock_switches import InsertClockSwitches
from kareus.passes.schedule_overlap import ScheduleOverlap
from kareus.passes.split_nanobatches import SplitNanobatches

PIPELINE: tuple[GraphPass, ...] = (
    FindBlocks(),
    SplitNanobatches(),
    AnnotateCosts(),
    CutPartitions(),
    ExtractPartitions(),
    CheckPlan(),
    ScheduleOverlap(),
    InsertClockSwitches(),
)
"""Every pass, in the order it runs."""

check_order(PIPELINE)  # a pass out of its declared order fails at import, not in a model
