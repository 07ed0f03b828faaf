"""Check that the plan being applied was made for this model: compare fingerprints.

A plan's decisions are keyed by partition type and its clocks by instruction; applied to a
model it was not made for (another model, shape, parallel layout or stage), both would be
applied to the wrong work without a word. The plan carries the fingerprint of the workload
it was made for (per stage and direction, each partition type's op mix, collective and
count, :meth:`kareus.PartitionSet.fingerprint`); this pass compares it with the partitions
just cut from the graph. A difference is a :class:`~kareus.errors.PlanMismatchError` naming
every differing type; with ``Config(strict=False)`` it is a warning instead, and only the
decisions of matching types are kept.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.fx as fx

from kareus.errors import PlanMismatchError
from kareus.ir.partitions import Decision, PartitionSet
from kareus.ir.plan_file import Plan
from kareus.passes.base import GraphPass, PassContext, PassResult
from kareus.passes.findings import PlanCheck


class CheckPlan(GraphPass):
    """Compare the applied plan's fingerprint with this graph's partitions."""

    name = "check_plan"
    graphs = frozenset({"forward", "backward"})
    reads = frozenset({"cut_partitions", "find_blocks"})
    finds = "plan_check"

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        """Raise (or warn and drop decisions) when the plan does not fit; never rewrites."""
        plan: Plan | None = ctx.inputs.plan
        pset = ctx.findings.partitions
        stage = ctx.inputs.plan_stage
        if plan is None or pset is None or ctx.inputs.planned:
            return PassResult(gm, modified=False)
        blockset = ctx.findings.blocks
        if blockset is not None and not blockset.blocks and not pset.partitions:
            # A graph beside the layers' (a graph break before the loss, as in Hugging Face's
            # GPT-2): the plan was made for the graph holding the layers and decides nothing
            # here.
            note = (
                "this graph holds no layer blocks and no collective: the plan decides nothing "
                "in it, so it is not checked against the plan"
            )
            return PassResult(gm, modified=False, found=PlanCheck(_kept(ctx), note))
        check_group_sizes(plan, gm)
        if ctx.graph != "backward":  # the forward's inputs are the workload's
            check_workload(plan, gm)
        if not plan.fingerprint:
            return PassResult(gm, modified=False, found=PlanCheck(_kept(ctx)))
        if getattr(blockset, "whole_region", False):
            # One block compiled on its own: the plan is checked and applied per block type.
            differences, mapping = compare_block(plan, stage, ctx.graph, pset)
            if not differences:
                kept = _remapped(_kept(ctx), ctx.graph, mapping)
                return PassResult(gm, modified=False, found=PlanCheck(kept))
        else:
            differences = compare(plan, stage, ctx.graph, pset)
            layers = _layers_differ(plan, blockset)
            if layers and differences:
                raise PlanMismatchError(
                    f"the plan does not fit this model: {layers}. Make a plan for it: "
                    + _plan_command(plan, {})
                    + " (a model config of as many layers)"
                )
        if not differences:
            return PassResult(gm, modified=False, found=PlanCheck(_kept(ctx)))
        made_for = plan.workload.get("describe")
        message = (
            f"the plan was made for another workload than this model's stage {stage} "
            f"{ctx.graph}"
            + (f" (the plan's: {made_for})" if made_for else "")
            + ", partition types differ: "
            + "; ".join(differences[:6])
            + (f"; and {len(differences) - 6} more" if len(differences) > 6 else "")
            + ". Plan this model (kareus plan with its shape and parallel sizes), or pass "
            "strict=False to apply only the decisions of matching types"
            + _graphs_hint(plan, ctx.config.inductors_graphs)
        )
        if ctx.config.strict is not False:
            raise PlanMismatchError(message)
        warnings.warn(f"kareus: {message}", RuntimeWarning, stacklevel=2)
        kept = _kept(ctx)
        if kept is not None:
            want = plan.fingerprint.get(f"{stage}/{ctx.graph}", {})
            have = pset.fingerprint(ctx.graph)
            kept = {k: d for k, d in kept.items() if k == "*" or want.get(k) == have.get(k)}
        return PassResult(gm, modified=False, found=PlanCheck(kept))


def _graphs_hint(plan: Plan, inductors: bool) -> str:
    """Say which graphs to trace where the plan's are not the ones this run lowers ("")."""
    traced = plan.workload.get("graphs", "aot")
    if not plan.workload or inductors == (traced == "inductor"):
        return ""
    if inductors:
        return (
            ". The plan was traced on AOTAutograd's graphs and this run lowers Inductor's "
            "(its decompositions move collectives): trace those with kareus plan ... "
            "--graphs inductor"
        )
    return ". The plan was traced on Inductor's graphs: pass inductor_graphs=True"


_DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}

_FLAGS = {
    "TP degree": "--tp",
    "dtype": "--dtype",
    "micro-batch": "--microbatch-size",
    "sequence": "--seq-len",
}
"""The ``kareus plan`` option that sets each field a fit check compares."""


def check_workload(plan: Plan, gm: fx.GraphModule) -> None:
    """Raise when the model differs from the workload the plan was made for.

    Compares what a forward graph shows for certain (the dtype its matrix products run in;
    at the embedding, the micro-batch and sequence of the token ids and the hidden size)
    with the plan's workload record, field by field. Plans without a record (planned at
    compile time) are not checked here; the partition fingerprints are checked after.

    Raises:
        PlanMismatchError: one line naming each differing field with both values, and the
            ``kareus plan`` command that makes a fitting plan.
    """
    want = plan_facts(plan)
    have = model_facts(gm)
    differ = [f for f in want if f in have and want[f] != have[f]]
    if not differ:
        return
    fields = "; ".join(f"{f}: plan {want[f]}, model {have[f]}" for f in differ)
    command = _plan_command(plan, {f: have[f] for f in differ})
    raise PlanMismatchError(
        f"the plan does not fit this model: {fields}. Make a plan for it: {command}"
    )


def plan_facts(plan: Plan) -> dict[str, Any]:
    """Return the fields of the plan's workload a graph can be checked against.

    Plans that predate the workload's ``shape`` record are checked without hidden size and
    layers (their partition fingerprints still are).
    """
    work = plan.workload
    facts: dict[str, Any] = {}
    if isinstance(work.get("dtype"), str):
        facts["dtype"] = work["dtype"]
    if isinstance(work.get("microbatch_size"), int):
        facts["micro-batch"] = work["microbatch_size"]
    if isinstance(work.get("seq_len"), int):
        facts["sequence"] = work["seq_len"] // int(work.get("cp") or 1)
    shape = work.get("shape")
    if isinstance(shape, dict):
        facts["hidden"] = shape.get("hidden_size")
        if int(work.get("pp") or 1) == 1:
            facts["layers"] = shape.get("num_layers")
    return {k: v for k, v in facts.items() if v is not None}


def _layers_differ(plan: Plan, blockset: Any) -> str:
    """Say how the layers differ (a whole model's blocks against the plan's), or ""."""
    want = plan_facts(plan).get("layers")
    blocks = getattr(blockset, "blocks", None)
    if want is None or not blocks or getattr(blockset, "whole_region", False):
        return ""
    from collections import Counter

    have = Counter(b.family for b in blocks).most_common(1)[0][1]
    return f"layers: plan {want}, model {have}" if have != want else ""


def model_facts(gm: fx.GraphModule) -> dict[str, Any]:
    """Return what a forward graph shows of its workload for certain.

    The dtype most matrix products run in; at the token embedding, the hidden size (the
    table's width) and, when the token ids are an input of the graph, the micro-batch and
    the sequence (their shape).
    """
    from collections import Counter

    facts: dict[str, Any] = {}
    dtypes: Counter[str] = Counter()
    for node in gm.graph.nodes:
        val = node.meta.get("val")
        name = getattr(node.target, "__name__", "").split(".")[0]
        mm = name in ("mm", "addmm", "bmm")
        if mm and isinstance(val, torch.Tensor) and val.dtype in _DTYPE_NAMES:
            dtypes[_DTYPE_NAMES[val.dtype]] += 1
        if name == "embedding" and len(node.args) > 1 and "hidden" not in facts:
            weight, ids = (getattr(a, "meta", {}).get("val") for a in node.args[:2])
            if isinstance(weight, torch.Tensor) and weight.dim() == 2:
                facts["hidden"] = _int(weight.shape[-1])
            placeholder = getattr(node.args[1], "op", None) == "placeholder"
            if placeholder and isinstance(ids, torch.Tensor) and ids.dim() == 2:
                facts["micro-batch"], facts["sequence"] = map(_int, ids.shape)
    if dtypes:
        facts["dtype"] = dtypes.most_common(1)[0][0]
    return {k: v for k, v in facts.items() if v is not None}


def _int(size: Any) -> int | None:
    return None if isinstance(size, torch.SymInt) else int(size)


def _plan_command(plan: Plan, fixes: dict[str, Any]) -> str:
    work = plan.workload
    parts = ["kareus plan", _model_option(work.get("model"))]
    parts.append(f"--gpu {plan.gpu}")
    values = {
        "TP degree": work.get("tp"),
        "dtype": work.get("dtype"),
        "micro-batch": work.get("microbatch_size"),
        "sequence": work.get("seq_len"),
    } | {k: v for k, v in fixes.items() if k in _FLAGS}
    if "sequence" in fixes:
        values["sequence"] = fixes["sequence"] * int(work.get("cp") or 1)
    parts += [f"{_FLAGS[k]} {v}" for k, v in values.items() if v is not None]
    for key, flag in (("cp", "--cp"), ("pp", "--pp"), ("microbatches", "--microbatches")):
        if isinstance(work.get(key), int) and (work[key] > 1 or key == "microbatches"):
            parts.append(f"{flag} {work[key]}")
    for field in ("hidden", "layers"):
        if field in fixes:
            parts.append(f"(a model config with {fixes[field]} {field})")
    return " ".join(parts)


def _model_option(model: Any) -> str:
    """Return the ``kareus plan`` option naming the plan's model."""
    if isinstance(model, str):
        return f"--model {model}"
    if isinstance(model, dict) and isinstance(model.get("hf_config"), str):
        return f"--hf-config {model['hf_config']}"
    if isinstance(model, dict) and isinstance(model.get("factory"), str):
        return f"--factory {model['factory']}"
    return "--model ..."


def check_group_sizes(plan: Plan, gm: fx.GraphModule) -> None:
    """Raise when the plan's TP (or CP) size is not the size of this graph's groups.

    Raises:
        PlanMismatchError: naming the plan's sizes and the graph's groups.
    """
    from kareus.passes.census import census

    tp, cp = int(plan.parallel.get("tp", 1)), int(plan.parallel.get("cp", 1))
    groups = sorted({g for _side, _kind, g in census(gm) if g.startswith("ranks ")})
    sizes = {len(g.removeprefix("ranks ").split(",")) for g in groups}
    wanted = {n for n in (tp, cp) if n > 1}
    if not wanted or sizes == wanted:
        return
    if not groups:
        raise PlanMismatchError(
            f"the plan was made for TP {tp} x CP {cp}, but this model runs no collective "
            "across ranks (one process, or TP 1): run it on the ranks the plan was made "
            "for, or plan for this one (kareus plan --tp 1 ...)"
        )
    have = ", ".join(f"{len(g.split(','))} ({g})" for g in groups)
    raise PlanMismatchError(
        f"the plan was made for TP {tp} x CP {cp}, but this model's collectives run over "
        f"groups of sizes {have}: build the model on the mesh the plan was made for, or "
        f"plan for this one (kareus plan --tp {max(sizes, default=1)} ...)"
    )


def compare(plan: Plan, stage: int, kind: str, pset: PartitionSet) -> list[str]:
    """Return how this graph's partition types differ from the plan's (empty if they agree)."""
    want = plan.fingerprint.get(f"{stage}/{kind}")
    if want is None:
        return [f"the plan has no stage {stage} {kind} (stages {plan.stages()})"]
    have = pset.fingerprint(kind)
    if "whole" not in want:  # a plan made before whole instructions were told apart
        have.pop("whole", None)
    out = []
    for key in sorted(set(want) | set(have)):
        if key not in have:
            out.append(f"type {key}: plan {want[key]}, model has none")
        elif key not in want:
            out.append(f"type {key}: model {have[key]}, plan has none")
        elif want[key] != have[key]:
            out.append(f"type {key}: plan {want[key]}, model {have[key]}")
    return out


def compare_block(
    plan: Plan, stage: int, kind: str, pset: PartitionSet
) -> tuple[list[str], dict[str, str]]:
    """Compare one block's partition types with the plan's, by what they are, not how many.

    A region that is one block (compiled block by block, or between FSDP's hooks) holds a
    share of the plan's partitions: each of its types must be one of the plan's (same ops
    and collective), and an unsplit block's matmuls and collectives a whole fraction of the
    plan's. Counts over all blocks are not seen from one of them.

    Returns:
        The differences (empty if the block fits), and this block's type keys mapped to the
        plan's.
    """
    want = plan.fingerprint.get(f"{stage}/{kind}")
    if want is None:
        return [f"the plan has no stage {stage} {kind} (stages {plan.stages()})"], {}
    have = pset.fingerprint(kind)
    if "whole" in have:
        if "whole" in want and _fraction(want["whole"], have["whole"]):
            return [], {}
        return [f"block {have['whole']} is no share of the plan's {want.get('whole', want)}"], {}
    plan_types: dict[str, str] = {}
    for key, value in want.items():
        if key != "whole":
            plan_types.setdefault(value.rsplit(" x", 1)[0], key)
    out, mapping = [], {}
    for key, value in have.items():
        described = value.rsplit(" x", 1)[0]
        if described in plan_types:
            mapping[key] = plan_types[described]
        else:
            out.append(f"type {key} ({described}): the plan has no type like it")
    return out, mapping


def _items(text: str) -> dict[str, int]:
    """Parse "4 gemm, 1 attention ‖ all_reduce 0.8 KiB x2 x4" into item counts."""
    ops, _sep, colls = text.partition(" ‖ ")
    out: dict[str, int] = {}
    for item in ops.split(", "):
        count, _sp, name = item.partition(" ")
        if count.isdigit():
            out[name] = int(count)
    for item in colls.split(", "):
        name, _sp, count = item.rpartition(" x")
        if count.isdigit():
            out[name] = int(count)
    return out


def _fraction(whole: str, part: str) -> bool:
    """Whether ``part``'s counts are all the same whole fraction of ``whole``'s."""
    a, b = _items(whole), _items(part)
    if not b or a.keys() != b.keys():
        return False
    ratios = {a[k] / b[k] for k in a}
    return len(ratios) == 1 and (r := ratios.pop()) >= 1 and r == int(r)


def _kept(ctx: PassContext) -> dict[str, Decision] | None:
    """Return the decisions standing so far: the forward's, in the backward; else supplied.

    Each lowering of the region (one per batch size) checks its forward afresh.
    """
    check = ctx.findings.plan_check
    if ctx.graph == "backward" and check is not None and check.decisions is not None:
        return dict(check.decisions)
    return None if ctx.inputs.decisions is None else dict(ctx.inputs.decisions)


def _remapped(
    decisions: dict[str, Decision] | None, kind: str, mapping: dict[str, str]
) -> dict[str, Decision] | None:
    """Key ``kind``'s decisions by this block's type keys instead of the plan's."""
    if decisions is None:
        return None
    prefix = f"{kind}."
    planned = {k: d for k, d in decisions.items() if k.startswith(prefix)}
    kept = {k: d for k, d in decisions.items() if not k.startswith(prefix)}
    return kept | {mine: planned[theirs] for mine, theirs in mapping.items() if theirs in planned}
