"""The names of kareus's passes, in the order they run: importing nothing.

``Config.disable_passes`` is validated against them without importing the passes (torch.fx,
the clock switch op); :mod:`kareus.passes.pipeline` holds the passes themselves, and a test
checks that the two agree (tests/test_pass_infra.py).
"""

PASS_NAMES: tuple[str, ...] = (
    "find_blocks",
    "split_nanobatches",
    "annotate_costs",
    "cut_partitions",
    "extract_partitions",
    "check_plan",
    "schedule_overlap",
    "insert_clock_switches",
)
"""Names accepted by ``Config.disable_passes``."""
