"""Find the repeated layer blocks of a model and map them onto every graph of a region.

On Dynamo's graph, blocks come from the module hierarchy recorded on each node
(``nn_module_stack``): a *family* is a container path (a ``ModuleList`` or ``Sequential``)
with two or more indexed children of one module type — derived from the graph, whatever the
model calls its layers (``layers``, ``model.layers``, ``h``, ``blocks``...). Blocks of one
family must be structurally equal (the same op sequence); one that is not (a graph break
inside it, a different structure) is recorded as such and later left whole. Block nodes are
tagged (:mod:`kareus.passes.tags`), which PyTorch carries into the AOT graphs.

On the AOT forward, backward and inference graphs the pass maps nodes back to blocks: by the
tag, else by ``nn_module_stack`` (forward) or ``fwd_nn_module_stack`` (backward), else by
``seq_nr`` (the backward node of a forward op shares its number), else by data flow (nodes
such as gradient-accumulation adds whose block-mapped inputs all lie in one block).

A region may also *be* one block: compiled block by block (``kareus.compile`` on each layer,
as torchtitan applies ``torch.compile``) or cut at every layer by FSDP2's hooks, a region is
one call of a layer's ``forward``, and holds no family of its own. Such a region (Dynamo
traced a method ``<Class>.forward`` and found no family in it) is one block of the family
``<Class>``: it is split and its collectives overlapped by the same passes and checks as a
block of a whole-model graph. Only the overlap across layers (a collective of one layer
beside the next layer's compute) needs two layers in one graph.
"""

from __future__ import annotations

import collections
import re
from collections.abc import Iterable

import torch
import torch.fx as fx

from kareus._torch_internals import SEQ_NR, seq_nr_pairs
from kareus.passes.base import GraphPass, PassContext, PassResult
from kareus.passes.blocks import Block, BlockSet
from kareus.passes.census import is_functional_collective
from kareus.passes.subgraphs import bodies
from kareus.passes.tags import NodeTag, get_tag, set_tag

_INDEXED = re.compile(r"^(?P<prefix>.+?)(?:\.(?P<dot>\d+)|\[(?P<br>\d+)\])$")
_PARAMETRIZATION = re.compile(r"\.parametrizations\.\w+$")
"""The list of a parametrized tensor's parametrizations (``torch.nn.utils.parametrize``, as
SimpleFSDP gathers a weight): indexed, but not a list of layers."""
_ROOT = re.compile(r"^L\[['\"]\w+['\"]\](?:\[\d+\])*\.?")
_COMPUTE = ("call_function", "call_method", "call_module")
# (``size``: Dynamo reads a symbolic size where a block first meets it, in the first layer
# only, and reuses it in the next)
_PLUMBING = frozenset({"getitem", "autograd_function_apply", "view_as", "size"})


def _sized(node: fx.Node) -> bool:
    """Whether ``node`` computes a size, not a tensor.

    Such as ``s0 // 2`` where a block first needs it: Dynamo computes it once, in the
    first layer, and the next layers reuse it.
    """
    return isinstance(node.meta.get("example_value"), (torch.SymInt, torch.SymBool, int))


class FindBlocks(GraphPass):
    """Find repeated blocks in Dynamo's graph; map them onto the AOT graphs."""

    name = "find_blocks"
    graphs = frozenset({"dynamo", "forward", "backward", "inference"})
    finds = "blocks"

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        """Record the blocks (Dynamo graph) or their spans (AOT graphs); never rewrites."""
        if ctx.graph == "dynamo":
            blockset = find_blocks(
                gm.graph,
                ctx.inputs.code,
                compiled_autograd=ctx.inputs.compiled_autograd,
            )
            for b in blockset.blocks:
                nodes = set(b.nodes)
                for node in gm.graph.nodes:
                    if node.name in nodes:
                        set_tag(node, NodeTag(b.name))
            return PassResult(gm, modified=False, found=blockset)
        found = ctx.findings.blocks
        if found is not None:
            found.spans[ctx.graph] = map_blocks(gm.graph, found, ctx.graph)
        return PassResult(gm, modified=False, found=found)


def _family_name(prefix: str) -> str:
    return _ROOT.sub("", prefix) or prefix


def _indexed_paths(node: fx.Node) -> list[tuple[str, str, int, str]]:
    """Return (path, prefix, index, module type) of each indexed module on the stack.

    A higher-order op called from outside the layers (``checkpoint(layer, x)`` in the
    model's loop, as Hugging Face and torchtitan do) has the modules its body runs in: the
    stack its body's ops share.
    """
    stack = node.meta.get("nn_module_stack") or _body_stack(node)
    out = []
    for path, typ in stack.values():
        m = _INDEXED.match(path)
        if m and not _PARAMETRIZATION.search(m.group("prefix")):
            idx = int(m.group("dot") or m.group("br"))
            out.append((path, m.group("prefix"), idx, getattr(typ, "__name__", str(typ))))
    return out


COMPILED_AUTOGRAD = (
    "no layer blocks in compiled autograd's backward graph: it records the autograd graph's "
    "ops without the modules that ran them, so kareus cannot tell the layers apart to split "
    "them; its collectives (the gradient all-reduces DDP's python reducer puts here) "
    "overlap the compute beside them as in a block left whole"
)
"""Why compiled autograd's graph (``torch._dynamo.compiled_autograd``) has no blocks."""


def _why_none(compute: list[fx.Node]) -> str:
    """Name a higher-order op whose body holds several layers (they cannot be told apart)."""
    for node in compute:
        for _arg, sub in bodies(node):
            paths = {p for n in sub.graph.nodes for p, *_rest in _indexed_paths(n)}
            if len(paths) >= 2:
                return (
                    f"no layer blocks to split: {node.name} ({_signature(node)[1]}) runs several "
                    f"layers in one body ({', '.join(sorted(paths)[:3])}...), as when "
                    "activation checkpointing wraps a group of layers; checkpoint each layer on "
                    "its own (torch.utils.checkpoint per layer, or checkpoint_wrapper per layer) "
                    "so that kareus can split them"
                )
    return ""


def _body_stack(node: fx.Node) -> dict[str, tuple[str, type]]:
    """Return the module-stack entries shared by every op of ``node``'s bodies, if any."""
    shared: dict[str, tuple[str, type]] | None = None
    for _arg, sub in bodies(node):
        for inner in sub.graph.nodes:
            if inner.op not in _COMPUTE:
                continue
            stack = inner.meta.get("nn_module_stack") or _body_stack(inner)
            if shared is None:
                shared = dict(stack)
            else:
                shared = {k: v for k, v in shared.items() if k in stack}
    return shared or {}


def _signature(node: fx.Node) -> tuple[str, str]:
    target = node.target
    name = target if isinstance(target, str) else getattr(target, "__name__", str(target))
    return node.op, name


def find_blocks(
    graph: fx.Graph, region_code: str | None = None, *, compiled_autograd: bool = False
) -> BlockSet:
    """Find the repeated blocks of a Dynamo graph (pure: does not change the graph).

    Args:
        graph: the Dynamo graph.
        region_code: the qualified name of the code Dynamo traced (``Layer.forward``); a
            region that is one call of a module's ``forward`` and holds no family is one
            block of that module's type.
        compiled_autograd: the graph is compiled autograd's backward (its ops carry no
            module stack: when none is found, the reason says so).

    Returns:
        The blocks in graph order, with structurally odd ones listed in ``mismatched``.
    """
    compute = [n for n in graph.nodes if n.op in _COMPUTE]
    # 1. Families: container paths with >= 2 indexed children of one module type.
    children: dict[tuple[str, str], set[int]] = collections.defaultdict(set)
    for node in compute:
        for _path, prefix, idx, typ in _indexed_paths(node):
            children[(prefix, typ)].add(idx)
    families = {prefix for (prefix, _t), idxs in children.items() if len(idxs) >= 2}
    # 2. Each node joins the outermost block of a family on its stack; an element of a
    # block node's tuple output (a higher-order op's result) joins that node's block.
    members: dict[str, list[fx.Node]] = collections.defaultdict(list)
    info: dict[str, tuple[str, int, str]] = {}
    owner: dict[fx.Node, str] = {}
    for node in compute:
        for path, prefix, idx, typ in _indexed_paths(node):
            if prefix in families:
                members[path].append(node)
                info[path] = (_family_name(prefix), idx, typ)
                owner[node] = path
                break
        else:
            source = node.args[0] if node.args else None
            if _signature(node)[1] == "getitem" and source in owner:
                members[owner[source]].append(node)
                owner[node] = owner[source]
    blocks = [
        Block(info[p][0], info[p][1], p, info[p][2], tuple(n.name for n in nodes))
        for p, nodes in members.items()
    ]
    blockset = BlockSet(blocks=blocks)
    if not blocks:
        blockset.why_none = COMPILED_AUTOGRAD if compiled_autograd else _why_none(compute)
        if not blockset.why_none:
            return _region_block(compute, region_code) or blockset
    # 3. Structural equality within a family (autograd plumbing aside: Dynamo inlines an
    # autograd.Function whose inputs need no gradient, as in the first layer, and wraps it
    # in autograd_function_apply elsewhere; both compute the same).
    sigs = {
        p: tuple(sig for n in nodes if (sig := _signature(n))[1] not in _PLUMBING and not _sized(n))
        for p, nodes in members.items()
    }
    for family, fblocks in blockset.families().items():
        counts = collections.Counter(sigs[b.path] for b in fblocks)
        canonical = max(counts, key=lambda s: (counts[s], len(s)))
        if counts[canonical] < 2:  # no two blocks agree: none can be trusted to be whole
            canonical = ()
        for b in fblocks:
            if sigs[b.path] != canonical:
                blockset.mismatched[b.name] = (
                    f"its op sequence ({len(sigs[b.path])} ops) is not shared with another "
                    f"{family} block: a graph break inside the block, or a different structure"
                )
    return blockset


_FORWARD = re.compile(r"^(?P<cls>[A-Za-z_]\w*)\.forward$")


def _region_block(compute: list[fx.Node], region_code: str | None) -> BlockSet | None:
    """Return the region as one block, when it is one call of a module's ``forward``.

    A region holding a member of a layer container (``layers.0``: a pipeline stage of one
    layer with its head, say) is a model, not a layer: it is not taken as a block.
    """
    m = _FORWARD.match(region_code or "")
    if m is None or not compute or any(_indexed_paths(n) for n in compute):
        return None
    cls = m.group("cls")
    block = Block(cls, 0, "L['self']", cls, tuple(n.name for n in compute))
    return BlockSet(blocks=[block], whole_region=True)


def map_blocks(
    graph: fx.Graph, blockset: BlockSet, kind: str
) -> dict[str, dict[int | None, list[str]]]:
    """Map the nodes of an AOT graph to blocks and nanobatches.

    Returns:
        Per block name, per nanobatch (None for an unsplit block), the node names in order.
    """
    by_path = {b.path: b.name for b in blockset.blocks}
    stack_key = "fwd_nn_module_stack" if kind == "backward" else "nn_module_stack"
    where: dict[fx.Node, NodeTag] = {}
    order = {n: i for i, n in enumerate(graph.nodes)}
    for node in graph.nodes:
        if node.op not in _COMPUTE:
            continue
        tag = get_tag(node) or _tag_from_stack(node, stack_key, by_path)
        seq_nr = node.meta.get(SEQ_NR) if seq_nr_pairs() else None
        by_seq_nr = None
        if tag is None and kind == "backward" and seq_nr is not None:
            by_seq_nr = blockset._by_seq_nr.get(seq_nr)
        stackless = _untraceable(node) or not node.meta.get(stack_key)
        if not stackless:
            tag = tag or by_seq_nr
        from_inputs = _tag_from_inputs(node.all_input_nodes, where, kind == "backward", order)
        if is_functional_collective(node) and from_inputs is not None:
            # Collectives traced inside an autograd.Function's backward carry neither tag
            # nor module stack; they belong to the block copy whose data they move.
            tag = from_inputs
        elif tag is None and stackless:
            # No module information (an autograd.Function's backward, accumulation adds):
            # the node belongs to the block copy whose data it reads; its sequence number
            # counts only when the inputs tell nothing (in the backward of blocks left
            # whole, every layer's accumulation adds share that of the first block run).
            tag = from_inputs if from_inputs is not None else by_seq_nr
        elif (
            tag is not None
            and tag.nanobatch is None
            and from_inputs is not None
            and from_inputs.block == tag.block
        ):
            # Ops traced inside an autograd.Function (tensor-parallel collectives) lose the
            # tag; their nanobatch is that of the block's nodes that feed them.
            tag = from_inputs
        if tag is None:
            continue
        where[node] = tag
        if kind != "backward" and seq_nr is not None:
            blockset._by_seq_nr.setdefault(seq_nr, tag)
    # Nodes of a split block that still lack a nanobatch (ops inside an autograd.Function
    # whose inputs come from the previous block) take the one of the block nodes they feed.
    for node in reversed(list(where)):
        tag = where[node]
        if tag.nanobatch is None:
            users = {where[u] for u in node.users if u in where and where[u].block == tag.block}
            if len(users) == 1 and (user_tag := users.pop()).nanobatch is not None:
                where[node] = user_tag
    spans: dict[str, dict[int | None, list[str]]] = {}
    for node, tag in where.items():
        spans.setdefault(tag.block, {}).setdefault(tag.nanobatch, []).append(node.name)
    return spans


def _tag_from_stack(node: fx.Node, key: str, by_path: dict[str, str]) -> NodeTag | None:
    stack = node.meta.get(key) or {}
    for path, _typ in stack.values():
        if path in by_path:
            return NodeTag(by_path[path])
    return None


def _untraceable(node: fx.Node) -> bool:
    # Nodes that carry no module or sequence information (gradient-accumulation adds, for
    # instance) belong to a block when all their block-mapped inputs do.
    meta = node.meta
    if meta.get("is_gradient_acc"):
        return True
    return not (meta.get("nn_module_stack") or meta.get("fwd_nn_module_stack") or SEQ_NR in meta)


def _tag_from_inputs(
    inputs: Iterable[fx.Node],
    where: dict[fx.Node, NodeTag],
    joint: bool = False,
    order: dict[fx.Node, int] | None = None,
) -> NodeTag | None:
    """Return the tag shared by the mapped inputs, or None.

    With ``joint`` (backward graphs; ``order`` gives node positions), nodes that join two
    nanobatches or two blocks get a tag too (see the comments below).
    """
    mapped = [n for n in inputs if n in where]
    tags = {where[n] for n in mapped}
    if len(tags) <= 1 or not joint or order is None:
        return tags.pop() if len(tags) == 1 else None
    blocks = {t.block for t in tags}
    if len(blocks) == 1:  # both nanobatches of one block (their weight gradients' sum)
        return NodeTag(blocks.pop())
    nanobatches = {t.nanobatch for t in tags}
    if len(nanobatches) == 1 and None not in nanobatches:
        # One nanobatch's data from two blocks (the residual gradient between layers):
        # the block that produced its latest input.
        return where[max(mapped, key=lambda n: order[n])]
    return None
