"""Reference models: a Llama/Qwen3-style decoder family used by tests, examples and planning."""

from kareus.models.config import PRESETS, LlamaConfig, preset
from kareus.models.llama import Llama, cp_shard

__all__ = ["PRESETS", "Llama", "LlamaConfig", "cp_shard", "preset"]
