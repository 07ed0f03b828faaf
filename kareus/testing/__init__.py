"""Helpers shared by kareus's tests, examples and benchmarks: tiny models and training loops.

Public so that users can check their own models the way kareus checks its own:
``compare_training(make_model, kareus.compile)`` trains a model and its compiled copy side by
side and returns both histories. The helpers live in rooms by what they do: training and
comparing (:mod:`~kareus.testing.training`), reading what kareus did to a region
(:mod:`~kareus.testing.graph_checks`), tiny models (:mod:`~kareus.testing.tiny_models`),
several ranks in one test (:mod:`~kareus.testing.ranks`), hand-built partition sets
(:mod:`~kareus.testing.partition_sets`) and per-sample verdicts
(:mod:`~kareus.testing.verdicts`); each name is here too.
"""

from kareus.testing.graph_checks import (
    Window,
    blocks_run,
    clocks_on_device,
    flying_when_run,
    inductor_buffers,
    inductor_windows,
    node_lines,
    overlap_problems,
    overlapped_collectives,
    split_blocks,
)
from kareus.testing.partition_sets import (
    megatron_partition_set,
    random_options,
    tradeoff_options,
)
from kareus.testing.ranks import free_port, run_ranks
from kareus.testing.tiny_models import (
    HF_CONFIG_KINDS,
    HF_KINDS,
    HF_TP_PLANS,
    InplaceTPLayer,
    InplaceTPNet,
    SleepyLayer,
    SleepyStack,
    hf_config_file,
    hf_tiny,
    sleepy,
    source_training,
)
from kareus.testing.training import (
    Batch,
    History,
    assert_same_history,
    compare_training,
    gradients,
    token_batches,
    train,
)
from kareus.testing.verdicts import PerSampleVerdict, per_sample_verdict

__all__ = [
    "HF_CONFIG_KINDS",
    "HF_KINDS",
    "HF_TP_PLANS",
    "Batch",
    "History",
    "InplaceTPLayer",
    "InplaceTPNet",
    "PerSampleVerdict",
    "SleepyLayer",
    "SleepyStack",
    "Window",
    "assert_same_history",
    "blocks_run",
    "clocks_on_device",
    "compare_training",
    "flying_when_run",
    "free_port",
    "gradients",
    "hf_config_file",
    "hf_tiny",
    "inductor_buffers",
    "inductor_windows",
    "megatron_partition_set",
    "node_lines",
    "overlap_problems",
    "overlapped_collectives",
    "per_sample_verdict",
    "random_options",
    "run_ranks",
    "sleepy",
    "source_training",
    "split_blocks",
    "token_batches",
    "tradeoff_options",
    "train",
]
