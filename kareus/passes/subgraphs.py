"""The bodies of higher-order ops, read by the census, the split and block finding.

They are the graphs an ``autograd_function_apply``, a checkpoint or a ``wrap`` node calls,
which fx passes to them as ``get_attr`` arguments.
"""

from __future__ import annotations

import torch.fx as fx


def bodies(node: fx.Node) -> list[tuple[fx.Node, fx.GraphModule]]:
    """Return the (``get_attr`` node, graph module) of each body ``node`` calls, in order."""
    owner = node.graph.owning_module
    if owner is None or node.op != "call_function":
        return []
    out = []
    for arg in node.args:
        if isinstance(arg, fx.Node) and arg.op == "get_attr":
            sub = getattr(owner, str(arg.target), None)
            if isinstance(sub, fx.GraphModule):
                out.append((arg, sub))
    return out
