"""GPU and interconnect specifications and the emulator that models time and energy."""

from kareus.hardware.emulator import Emulator
from kareus.hardware.interconnects import InterconnectSpec
from kareus.hardware.specs import (
    GPUS,
    Calibration,
    GPUSpec,
    clock_range,
    gpu,
)

__all__ = [
    "GPUS",
    "Calibration",
    "Emulator",
    "GPUSpec",
    "InterconnectSpec",
    "clock_range",
    "gpu",
]
