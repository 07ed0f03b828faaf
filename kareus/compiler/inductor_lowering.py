"""Lowering a region through TorchInductor, with kareus's passes where AOTAutograd partitions.

Inductor's custom partitioner hook (:class:`KareusPartitioner`) runs Inductor's own min-cut
partition, then kareus's passes on the forward and backward together, before Inductor
compiles either; Inductor's fusion choices are kept from joining the two nanobatches'
kernels (:func:`keep_nanobatches_apart`). What the passes are and what happens once both
graphs exist are the caller's, as in :mod:`kareus.compiler.lowering`.
"""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.fx as fx

from kareus._torch_internals import (
    custom_partitioner_base,
    functorch_config,
    inductor_choices_handler,
    inductor_choices_type,
    inductor_compilers,
    inductor_config,
)
from kareus.compiler.lowering import (
    Compiled,
    OnPartition,
    RunPasses,
    check_lowered,
    drop_dead_collectives,
    partition_function,
    specialise_ints,
    symbols,
    tracing_context,
)
from kareus.passes.census import Key, census
from kareus.passes.tags import get_tag


def lower_with_inductor(
    gm: fx.GraphModule,
    example_inputs: Sequence[Any],
    *,
    run_passes: RunPasses,
    on_graphs: Callable[[Compiled], None],
    options: Mapping[str, Any] | None = None,
    min_cut: bool = True,
    on_partition: OnPartition | None = None,
) -> Callable[..., Any]:
    """Hand the Dynamo graph to TorchInductor with kareus's passes; return what runs.

    kareus's passes run where AOTAutograd has just partitioned the joint graph (Inductor's
    custom partitioner hook), on the forward and the backward together, before Inductor
    compiles either: ``on_graphs`` (compile-time planning) sees both graphs at once and may
    replace them, so Inductor compiles the planned graphs, once. An inference graph gets
    its passes in Inductor's inner compile. ``options`` are Inductor's config options
    (``torch.compile``'s ``options=`` and those of its ``mode=``); ``min_cut``: the
    partitioner (``Config.min_cut``); ``on_partition`` sees the forward and backward as
    partitioned, before any pass (it may raise to stop the lowering).

    Raises:
        LostCollectivesError: as :func:`~kareus.compiler.lowering.lower_with_aot`.
    """
    compile_fx, compile_fx_inner = inductor_compilers()
    expected = census(gm)
    compiled: Compiled = {}

    def inner(g: fx.GraphModule, inputs: Sequence[Any], **kwargs: Any) -> Any:
        if kwargs.get("is_inference"):
            check_lowered(g, expected, "inference")
            compiled["inference"] = (g, inputs, run_passes("inference", g, inputs))
            g = compiled["inference"][2]
        # The backward compiles at the first backward, outside the patch below: both are
        # set here too, so that the cache key holds the partitioner (its uuid names the
        # fusion rule) for every graph.
        with (
            inductor_config().patch(custom_partitioner_fn=partitioner),
            keep_nanobatches_apart(),
        ):
            return compile_fx_inner(g, inputs, **kwargs)

    partitioner = _partitioner_type()(
        expected, compiled, run_passes, on_graphs, min_cut, on_partition
    )
    if example_inputs and not symbols(example_inputs):
        gm = specialise_ints(gm, example_inputs)
    # kareus's passes run after AOTAutograd's trace: its cache, keyed by the graph before
    # them, would skip them silently on a hit, so it stays off. Inductor's FX graph cache
    # is keyed by the graph compile_fx_inner receives, the one the passes made (plan,
    # clock switches and overlap order in it): a hit reuses the code generated for exactly
    # that graph. It needs a shape environment, which a region lowered per batch size
    # (outside Dynamo's tracing context) lacks: give it one (without it every graph
    # bypassed the cache: "No shape env").
    with (
        tracing_context(static_inputs=example_inputs),
        functorch_config().patch(enable_autograd_cache=False),
        inductor_config().patch(custom_partitioner_fn=partitioner),
    ):
        return compile_fx(  # type: ignore[return-value]
            gm, example_inputs, inner_compile=inner, config_patches=dict(options or {})
        )


class KareusPartitioner:
    """Inductor's partitioner, then kareus's passes on the forward and backward it made.

    Inductor's own min-cut partition decides what the forward saves and what the backward
    recomputes (as under ``torch.compile``; AOTAutograd's default partition with
    ``min_cut=False``, ``Config.partitioner``); the joint graph's collectives are counted
    first, and dead copies of collectives the partition left in the backward are removed,
    as :func:`~kareus.compiler.lowering.checked_partition` does.
    """

    def __init__(
        self,
        expected: Counter[Key],
        compiled: Compiled,
        run_passes: RunPasses,
        on_graphs: Callable[[Compiled], None],
        min_cut: bool = True,
        on_partition: OnPartition | None = None,
    ) -> None:
        self._min_cut = min_cut
        self._on_partition = on_partition
        self._expected = expected
        self._compiled = compiled
        self._run_passes = run_passes
        self._on_graphs = on_graphs

    def __call__(
        self, gm: fx.GraphModule, joint_inputs: Sequence[object], **kwargs: Any
    ) -> tuple[fx.GraphModule, fx.GraphModule]:
        """Partition ``gm`` (a joint graph), run the passes on both sides, plan, return them."""
        check_lowered(gm, self._expected, "joint", joint=True)
        forward, backward = partition_function(self._min_cut)(gm, joint_inputs, **kwargs)
        drop_dead_collectives(backward)
        if self._on_partition is not None:
            self._on_partition({"forward": forward, "backward": backward})
        for kind, g in (("forward", forward), ("backward", backward)):
            inputs = [n.meta.get("val") for n in g.graph.find_nodes(op="placeholder")]
            self._compiled[kind] = (g, inputs, self._run_passes(kind, g, inputs))
        self._on_graphs(self._compiled)  # may plan, and replace both rewritten graphs
        return self._compiled["forward"][2], self._compiled["backward"][2]

    def uuid(self) -> Any:
        """Return the partitioner's part of Inductor's FX graph cache key.

        The graphs the passes made, which Inductor compiles, key the cache already.
        """
        kind = "min-cut" if self._min_cut else "default"
        return f"kareus-partitioner-4 ({kind}, nanobatches kept apart)"

    def __reduce__(self) -> tuple[Any, ...]:
        # Inductor pickles its config into the FX graph cache key; the passes this
        # partitioner runs are closures, so it stands there as its uuid.
        return (str, (self.uuid(),))


def keep_nanobatches_apart() -> Any:
    """Return a context in which Inductor fuses no kernel of one nanobatch with the other's.

    Inductor fuses independent kernels that read the same data (horizontal fusion), and a
    producer into its consumer (vertical): the two nanobatches' RMSNorms, which read one
    weight, became one kernel, and in the backward both RMSNorm gradients joined the sum
    of their weight gradients; either kernel then waited for the collective of the
    nanobatch it was meant to overlap. Inductor's fusion heuristics (``InductorChoices``)
    are the hook: a fusion that would join nodes of both nanobatches (by their kareus
    tags) is refused; every other fusion is Inductor's own choice.
    """
    import contextlib

    handler = _nanobatch_choices()
    if handler is None:
        return contextlib.nullcontext()
    return inductor_choices_handler(handler)


@functools.cache
def _nanobatch_choices() -> Any:
    """Return Inductor's fusion heuristics that keep nanobatches apart (None: no hook)."""
    InductorChoices = inductor_choices_type()
    if InductorChoices is None or not hasattr(InductorChoices, "can_fuse"):
        return None

    def nanobatches(node: Any) -> set[int]:
        found: set[int] = set()
        for sub in node.get_nodes():
            ir = getattr(sub, "node", None)
            for origin in getattr(ir, "origins", ()) or ():
                tag = get_tag(origin)
                if tag is not None and tag.nanobatch is not None:
                    found.add(tag.nanobatch)
        return found

    class NanobatchChoices(InductorChoices):  # type: ignore[misc,valid-type]
        @staticmethod
        def can_fuse(scheduler: Any, node1: Any, node2: Any, shared_data_score: int) -> bool:
            if len(nanobatches(node1) | nanobatches(node2)) > 1:
                return False
            return bool(InductorChoices.can_fuse(scheduler, node1, node2, shared_data_score))

    return NanobatchChoices()


@functools.cache
def _partitioner_type() -> type[KareusPartitioner]:
    """Return :class:`KareusPartitioner` as the Inductor partitioner type it must be."""
    base = custom_partitioner_base()
    if base is None:  # torch>=2.11 (pyproject) has it: an unexpected build
        raise RuntimeError(
            f"torch {torch.__version__} has no torch._inductor.config.custom_partitioner_fn, "
            "which codegen='inductor' needs: install torch>=2.11 or pass codegen='python'"
        )
    return type("KareusPartitioner", (KareusPartitioner, base), {})


def inductor_inference(gm: fx.GraphModule, inputs: Sequence[Any]) -> Callable[..., Any]:
    """Compile an aten graph run without gradients with Inductor.

    For ``kareus profile``'s partitions: the fused kernels training runs, not one kernel
    per aten op. Returns a callable taking the graph's inputs and returning its outputs as a list.
    """
    compile_fx, _inner = inductor_compilers()
    with torch.no_grad():
        return compile_fx(gm, list(inputs))  # type: ignore[return-value]
