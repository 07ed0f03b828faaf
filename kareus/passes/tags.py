"""kareus's one metadata namespace on graph nodes.

What kareus attaches to a node lives under ``node.meta["custom"]["kareus"]``: ``custom`` is
the metadata key that PyTorch carries from Dynamo's graph into both AOTAutograd graphs, so
a tag set before autograd is still there on the forward and backward nodes it produced.
The stored value is a plain dict (it must survive copying); :func:`get_tag` reads it back
as a frozen :class:`NodeTag`.
"""

from __future__ import annotations

import dataclasses

import torch.fx as fx

_KEY = "kareus"


@dataclasses.dataclass(frozen=True)
class NodeTag:
    """Which block (and nanobatch copy, if split) a node belongs to."""

    block: str
    nanobatch: int | None = None


def get_tag(node: fx.Node) -> NodeTag | None:
    """Return the kareus tag of ``node``, or None."""
    custom = node.meta.get("custom")
    data = custom.get(_KEY) if isinstance(custom, dict) else None
    return NodeTag(**data) if isinstance(data, dict) else None


def set_tag(node: fx.Node, tag: NodeTag) -> None:
    """Attach ``tag`` to ``node`` (replacing any earlier kareus tag, keeping other keys)."""
    custom = dict(node.meta.get("custom") or {})
    custom[_KEY] = dataclasses.asdict(tag)
    node.meta["custom"] = custom
