"""kareus: cut the energy of training by choosing GPU clocks and overlap together.

``model = kareus.compile(model)`` where you would write ``torch.compile(model)``;
``print(kareus.explain(model))`` shows what kareus captured and did.
"""

from kareus.compiler.backend import KareusBackend, compile
from kareus.compiler.config import Config
from kareus.compiler.explain import JobEnergy, Report, explain, job_energy
from kareus.errors import (
    ConfigError,
    FileFormatError,
    KareusError,
    NotCompiledError,
    NotYetCapturedError,
    PassError,
    PlanMismatchError,
    install_excepthook,
)
from kareus.ir.partitions import Decision, PartitionSet
from kareus.ir.plan_file import Plan

__version__ = "0.1.0"

install_excepthook()

__all__ = [
    "Config",
    "ConfigError",
    "Decision",
    "FileFormatError",
    "JobEnergy",
    "KareusBackend",
    "KareusError",
    "NotCompiledError",
    "NotYetCapturedError",
    "PartitionSet",
    "PassError",
    "Plan",
    "PlanMismatchError",
    "Report",
    "compile",
    "explain",
    "job_energy",
]
