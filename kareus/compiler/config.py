"""kareus's configuration: one frozen, keyword-only dataclass, validated on construction.

Every field has a docstring, units in its name where it has units, and a check that raises
:class:`~kareus.errors.ConfigError` naming the field, the value and what is allowed.
The config round-trips through JSON so that a plan can record the settings it was made with.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable, Mapping
from typing import Any

from kareus.errors import ConfigError

_CODEGENS = ("python", "inductor")
SPLIT_WHEN = ("pays", "communicates")
"""The rules ``Config.split_when`` names."""
SPLIT_ALONG = ("auto", "batch", "sequence")
"""The dimensions ``Config.split_along`` names."""
PARTITIONERS = ("min_cut", "default")
"""How AOTAutograd's joint graph is split into forward and backward (:attr:`Config.partitioner`)."""
GRAPHS: dict[str, dict[str, Any]] = {
    "aot": {"inductor_graphs": False},  # and so AOTAutograd's partition (Config.min_cut)
    "inductor": {"inductor_graphs": True},  # and so Inductor's min-cut partition
}
"""The graphs a plan is traced on (``kareus plan --graphs``), as the Config fields that run
them: a plan records its own, and applying one traced on Inductor's fills those fields the
config leaves open."""


CODEGEN_ENV = "KAREUS_CODEGEN"
"""The environment variable that picks the default codegen (``python`` to debug a job)."""


def _field(default: Any, allowed: str, check: Callable[[Any], bool], doc: str) -> Any:
    metadata = {"allowed": allowed, "check": check, "doc": doc}
    if callable(default):
        return dataclasses.field(default_factory=default, metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def _default_codegen() -> str:
    return os.environ.get(CODEGEN_ENV, "").strip().lower() or "inductor"


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _known_gpu(name: Any) -> bool:
    from kareus.hardware.specs import known_gpu

    return isinstance(name, str) and known_gpu(name) is not None


def _known_pass_names() -> tuple[str, ...]:
    from kareus.passes.names import PASS_NAMES

    return PASS_NAMES


@dataclasses.dataclass(frozen=True, kw_only=True)
class Config:
    """Settings of one ``kareus.compile`` call.

    Build one with keywords (``Config(nanobatches=1)``) or pass the same keywords straight to
    :func:`kareus.compile`. Change one with :meth:`replace`.
    """

    nanobatches: int | None = _field(
        None,
        "None (split where it pays, see split_when), 1 (no split) or 2",
        lambda v: v is None or (_is_int(v) and v in (1, 2)),
        "How many nanobatches each repeated block is split into along the batch dimension. "
        "None (default): two where split_when says so; 2: every block that can be split; "
        "1 turns the split off.",
    )
    split_when: str = _field(
        "pays",
        f"one of {SPLIT_WHEN}",
        lambda v: v in SPLIT_WHEN,
        "Which blocks nanobatches=None splits. 'pays' (default): a block whose collectives "
        "can fly beside compute, where kareus's cost model for the device the model runs "
        "on (the hardware model of the GPU named by gpu= or found, else a CPU host's) "
        "predicts its forward and backward get faster split; kareus.explain gives each "
        "block's prediction. 'communicates': every block that holds a collective on "
        "batch-carrying data (a block without one has nothing to overlap), unpriced; "
        "`kareus plan` traces so, and prices split and whole itself.",
    )
    batch_dim: int | None = _field(
        None,
        "None (detect) or a non-negative int",
        lambda v: v is None or (_is_int(v) and v >= 0),
        "The batch dimension of the model's inputs; None detects it from the inputs "
        "(dimension 0, or 1 for a Megatron-style [seq, batch, hidden] layout).",
    )
    split_along: str = _field(
        "auto",
        f"one of {SPLIT_ALONG}",
        lambda v: v in SPLIT_ALONG,
        "Which dimension a block is split along. 'auto' (default): the batch where it holds "
        "at least 4 sequences, else the sequence (the dimension beside the batch: 1 for "
        "[batch, seq, ...] inputs, 0 for [seq, batch, ...]), the two halves of each "
        "sequence as the nanobatches, for causal attention only (the second half's "
        "attention reads the first half's keys and values); 'batch' or 'sequence': that "
        "one only. kareus.explain says which dimension each split block was split along.",
    )
    allow_random_split: bool = _field(
        False,
        "True or False",
        lambda v: isinstance(v, bool),
        "Split blocks that contain random ops (dropout). Their random streams then differ "
        "from the unsplit model's, so results are statistically, not bitwise, equal.",
    )
    disable_passes: tuple[str, ...] = _field(
        (),
        "a tuple of pass names (see kareus.passes.names.PASS_NAMES)",
        lambda v: isinstance(v, tuple) and all(p in _known_pass_names() for p in v),
        "Passes to skip; a skipped pass is recorded in the pass history.",
    )
    codegen: str = _field(
        _default_codegen,
        f"one of {_CODEGENS}",
        lambda v: v in _CODEGENS,
        "How the rewritten graphs run. 'inductor' (default): TorchInductor compiles them "
        "after kareus's passes, as torch.compile would (fused kernels). 'python': they run "
        "op by op as eager PyTorch's kernels, a debugging aid (every op steppable). The "
        f"environment variable {CODEGEN_ENV} sets the default.",
    )
    fuse_memory_ops: bool | None = _field(
        None,
        "None (as the codegen runs them), True or False",
        lambda v: v is None or isinstance(v, bool),
        "Cost each run of consecutive memory-bound ops as one fused kernel that reads its "
        "outside inputs and writes its outside outputs once (as Inductor runs them); False "
        "costs every op as eager PyTorch runs it. None: True with codegen='inductor', "
        "False with 'python': the model prices the kernels that run.",
    )
    partitioner: str | None = _field(
        None,
        f"None or one of {PARTITIONERS}",
        lambda v: v is None or v in PARTITIONERS,
        "How the joint graph is split into forward and backward, which decides what the "
        "forward saves and what the backward computes again. 'min_cut': Inductor's min-cut "
        "rematerialisation (as torch.compile); 'default': AOTAutograd's default (the "
        "backward recomputes nothing it could be given). None: 'min_cut' on Inductor's "
        "graphs (codegen='inductor', inductor_graphs, a plan traced `--graphs inductor`) "
        "and 'default' on AOTAutograd's.",
    )
    inductor_graphs: bool | None = _field(
        None,
        "None, True or False",
        lambda v: v is None or isinstance(v, bool),
        "With codegen='python', run the graphs Inductor would compile (its decompositions "
        "and joint-graph passes, then the partitioner) op by op instead of AOTAutograd's "
        "plain ones; `kareus plan --graphs inductor` traces so. None: True for a plan "
        "traced so, else False (codegen='inductor' always compiles Inductor's).",
    )
    trace_blocks_once: bool | None = _field(
        None,
        "None, True or False",
        lambda v: v is None or isinstance(v, bool),
        "Trace a repeated block through AOTAutograd once and reuse its graphs for its "
        "siblings and nanobatch copies (codegen='python'); the graphs the passes see are "
        "the same. None (default): when one block is called at least 16 times (8 layers "
        "split in two), where it is faster; True: whenever blocks repeat; False: never.",
    )
    gpu: str | None = _field(
        None,
        "None or a GPU type of kareus.hardware.GPUS (or an alias such as 'a100-40gb')",
        lambda v: v is None or _known_gpu(v),
        "The GPU type compile plans for when given neither a plan nor decisions (with the "
        "hardware model, once both graphs of a region are captured). None: the GPU this "
        "process runs on, when kareus knows its type; without one, nothing is planned.",
    )
    gpus_per_node: int | None = _field(
        None,
        "None or a positive int",
        lambda v: v is None or (_is_int(v) and v >= 1),
        "GPUs one node's NVLink joins: a collective whose group's ranks span more than one "
        "node is priced on the node's network (the GPU's spec), else on NVLink. None: "
        "torchrun's LOCAL_WORLD_SIZE where it is set, else 8.",
    )
    select: str = _field(
        "iso_time",
        "a policy of kareus.planner.POLICIES without a parameter",
        lambda v: v in ("iso_time", "max_throughput", "min_energy"),
        "How compile picks its own plan from the frontier (see kareus.planner.select).",
    )
    extract_partitions: bool = _field(
        False,
        "True or False",
        lambda v: isinstance(v, bool),
        "Keep one runnable program per partition type (its compute and the collective it "
        "overlaps, with the captured input layouts), as `kareus profile` measures them.",
    )
    strict: bool | None = _field(
        None,
        "None, True or False",
        lambda v: v is None or isinstance(v, bool),
        "True: raise when a pass fails. None (default) and False: the graph runs as "
        "captured (unchanged) and the failure is recorded and shown by kareus.explain. A "
        "plan made for another workload than the model is an error unless strict=False, "
        "which warns and applies only the decisions of matching partition types.",
    )

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if not f.metadata["check"](value):
                allowed = f.metadata["allowed"]
                if f.name == "disable_passes":
                    allowed += f"; known passes: {', '.join(_known_pass_names())}"
                raise ConfigError(f.name, value, allowed)

    @property
    def fuses_memory_ops(self) -> bool:
        """Whether runs of memory-bound ops are costed as fused kernels (see the field)."""
        if self.fuse_memory_ops is None:
            return self.codegen == "inductor"
        return self.fuse_memory_ops

    @property
    def inductors_graphs(self) -> bool:
        """Whether the passes see Inductor's graphs (its decompositions and joint passes)."""
        return self.codegen == "inductor" or bool(self.inductor_graphs)

    @property
    def min_cut(self) -> bool:
        """Whether the joint graph is split by Inductor's min-cut partition (see the field)."""
        if self.partitioner is None:
            return self.inductors_graphs
        return self.partitioner == "min_cut"

    def replace(self, **changes: Any) -> Config:
        """Return a copy with ``changes`` applied (validated like the constructor).

        Raises:
            ConfigError: a name is not a field, or a value is not allowed.
        """
        _check_names(changes)
        return dataclasses.replace(self, **_coerce(changes))

    def to_dict(self) -> dict[str, Any]:
        """Return the fields as JSON-ready values (tuples become lists)."""
        return {
            f.name: list(v) if isinstance(v := getattr(self, f.name), tuple) else v
            for f in dataclasses.fields(self)
        }

    def to_json(self) -> str:
        """Return the config as a JSON object."""
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Config:
        """Build a config from :meth:`to_dict` output.

        Raises:
            ConfigError: an unknown field or a value that is not allowed.
        """
        _check_names(data)
        return cls(**_coerce(data))

    @classmethod
    def from_json(cls, text: str) -> Config:
        """Build a config from :meth:`to_json` output."""
        data = json.loads(text)
        if not isinstance(data, dict):
            raise ConfigError("<json>", data, "a JSON object of Config fields")
        return cls.from_dict(data)

    @staticmethod
    def describe() -> str:
        """Return one line per field: name, default, allowed values and meaning."""
        return "\n".join(
            f"{f.name} (default {_default_of(f)!r}; {f.metadata['allowed']}): {f.metadata['doc']}"
            for f in dataclasses.fields(Config)
        )


def _default_of(f: dataclasses.Field[Any]) -> Any:
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return f.default


COMPILE_OPTIONS = [
    "config",
    "decisions",
    "plan",
    "stage",
    "clocks",
    "journal",
    "on_iteration",
    "measure",
    "schedule",
    "mode",
    "options",
    "fullgraph",
    "dynamic",
    "disable",
]
"""The keywords of ``kareus.compile`` and ``KareusBackend`` besides the Config fields."""


def _check_names(data: Mapping[str, Any]) -> None:
    import difflib

    names = {f.name for f in dataclasses.fields(Config)}
    for key, value in data.items():
        if key not in names:
            close = difflib.get_close_matches(key, [*names, *COMPILE_OPTIONS], n=1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            raise ConfigError(
                key,
                value,
                f"a Config field or a kareus.compile option{hint}; the Config fields: "
                + ", ".join(sorted(names)),
            )


def _coerce(data: Mapping[str, Any]) -> dict[str, Any]:
    # JSON has no tuples; accept lists for the tuple-valued fields.
    return {k: tuple(v) if isinstance(v, list) else v for k, v in data.items()}
