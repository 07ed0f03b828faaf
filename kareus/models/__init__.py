"""Reference models: a Llama/Qwen3-style decoder family used by tests, examples and planning."""

from kareus.models.llama import PRESETS, Llama, LlamaConfig, cp_shard, preset

__all__ = ["PRESETS", "Llama", "LlamaConfig", "cp_shard", "preset"]
