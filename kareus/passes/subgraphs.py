"""The bodies of higher-order ops, read by the census, the split and block finding.

They are the graphs an ``autograd_function_apply``, a checkpoint, a ``wrap`` or an
``invoke_subgraph`` node calls, which fx passes to them as ``get_attr`` arguments. Also the
graph copy the compiler and the outlining make.
"""

from __future__ import annotations

from collections.abc import Callable

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


def own_bodies(node: fx.Node, suffix: str, mark: Callable[[fx.Node], None]) -> None:
    """Give ``node`` copies of the bodies it calls (``<body>_<suffix>``), ``mark`` on each node.

    Two copies of a higher-order op (a checkpointed layer in each nanobatch) share their
    bodies as Dynamo made them: AOTAutograd carries each body node's metadata onto the ops
    it inlines from it, so a body of its own is what lets each copy's ops say which copy
    they belong to.
    """
    owner = node.graph.owning_module
    if owner is None:
        return
    for arg, sub in bodies(node):
        name = f"{arg.target}_{suffix}"
        body = fx.GraphModule(sub, copy_graph(sub.graph))
        for inner in body.graph.nodes:
            mark(inner)
        owner.add_submodule(name, body)
        with node.graph.inserting_before(node):
            node.replace_input_with(arg, node.graph.get_attr(name))


def copy_graph(graph: fx.Graph) -> fx.Graph:
    """Return a copy of ``graph`` (nodes, metadata and code generator; no module)."""
    new = fx.Graph(owning_module=graph.owning_module, tracer_cls=graph._tracer_cls)
    new.output(new.graph_copy(graph, {}))
    new._codegen = graph._codegen
    return new
