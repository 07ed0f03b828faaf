"""The planner: per-partition-type frontier search and composition over the iteration.

Free of ``torch.fx`` by design: it reads the :class:`~kareus.ir.partitions.PartitionSet` the
passes produce and writes a :class:`~kareus.ir.plan_file.Plan`.
"""

from kareus.planner.compose import Composer
from kareus.planner.dag import chain, one_f_one_b
from kareus.planner.data_parallel import DataParallel, StageWeights
from kareus.planner.frontiers import METHODS
from kareus.planner.iteration import IterationInputs, plan_for_gpu, plan_iteration
from kareus.planner.knobs import KnobSpace, RecordingEvaluator, ReplayEvaluator, Setting
from kareus.planner.search import exhaustive, search
from kareus.planner.select import POLICIES, InfeasiblePlanError, Pick, select
from kareus.planner.settings import Parallelism, PlannerSettings

__all__ = [
    "METHODS",
    "POLICIES",
    "Composer",
    "DataParallel",
    "InfeasiblePlanError",
    "IterationInputs",
    "KnobSpace",
    "Parallelism",
    "Pick",
    "PlannerSettings",
    "RecordingEvaluator",
    "ReplayEvaluator",
    "Setting",
    "StageWeights",
    "chain",
    "exhaustive",
    "one_f_one_b",
    "plan_for_gpu",
    "plan_iteration",
    "search",
    "select",
]
