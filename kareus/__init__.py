"""kareus: cut the energy of training by choosing GPU clocks and overlap together.

``model = kareus.compile(model)`` where you would write ``torch.compile(model)``;
``print(kareus.explain(model))`` shows what kareus captured and did.
"""

from kareus.api import KareusBackend, compile
from kareus.config import Config
from kareus.errors import (
    ConfigError,
    FileFormatError,
    KareusError,
    NotCompiledError,
    NotYetCapturedError,
    PassError,
)
from kareus.explain import JobEnergy, Report, explain, job_energy
from kareus.partitions import Decision, PartitionSet
from kareus.plan import Plan

__version__ = "0.1.0"

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
    "Report",
    "compile",
    "explain",
    "job_energy",
]
