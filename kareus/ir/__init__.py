"""The data between compiler, planner and jobs: plan file, partition sets, costs, schema.

Plain, frozen dataclasses that round-trip through JSON; nothing here imports ``torch.fx``.
"""
