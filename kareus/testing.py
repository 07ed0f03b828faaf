"""Helpers shared by kareus's tests, examples and benchmarks: tiny models and training loops.

Public so that users can check their own models the way kareus checks its own:
``compare_training(make_model, kareus.compile)`` trains a model and its compiled copy side by
side and returns both histories.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import pathlib
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Union

import torch
from torch import nn

from kareus.passes.census import collective_kind, is_functional_collective, is_wait

Batch = Union[tuple[Any, ...], Mapping[str, Any]]  # noqa: UP007 (runtime alias on 3.10)


@dataclasses.dataclass
class History:
    """Losses per optimizer step and the gradients seen before each step, by parameter name."""

    losses: list[torch.Tensor]
    grads: list[dict[str, torch.Tensor]]


def token_batches(
    count: int, batch: int, seq: int, vocab: int, *, seed: int = 0
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Return ``count`` random (ids, labels) pairs of shape [batch, seq]."""
    gen = torch.Generator().manual_seed(seed)
    return [
        (
            torch.randint(0, vocab, (batch, seq), generator=gen),
            torch.randint(0, vocab, (batch, seq), generator=gen),
        )
        for _ in range(count)
    ]


def train(
    model: nn.Module,
    batches: Sequence[Batch],
    *,
    accumulate: int = 1,
    loss_fn: Callable[..., torch.Tensor] | None = None,
    lr: float = 1e-2,
) -> History:
    """Train with AdamW, one optimizer step per ``accumulate`` batches.

    Args:
        model: called as ``model(*batch)`` (``model(**batch)`` for a dict); returns the
            loss unless ``loss_fn`` is given.
        batches: the inputs, one tuple or dict per micro-batch.
        accumulate: micro-batches per optimizer step (gradient accumulation).
        loss_fn: maps the model's output and the batch to a scalar loss.
        lr: learning rate.
    """
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    hist = History([], [])
    for i, batch in enumerate(batches):
        out = model(**batch) if isinstance(batch, Mapping) else model(*batch)
        loss = loss_fn(out, batch) if loss_fn is not None else out
        (loss / accumulate).backward()
        hist.losses.append(loss.detach().clone())
        if (i + 1) % accumulate == 0:
            hist.grads.append(_grads(model))
            opt.step()
            opt.zero_grad(set_to_none=True)
    return hist


def compare_training(
    make_model: Callable[[], nn.Module],
    compile_fn: Callable[[nn.Module], nn.Module],
    batches: Sequence[Batch],
    *,
    resync: bool = False,
    accumulate: int = 1,
    loss_fn: Callable[..., torch.Tensor] | None = None,
    lr: float = 1e-2,
) -> tuple[History, History]:
    """Train an eager model and a compiled copy side by side on the same batches.

    Both start from the same weights and each has its own AdamW optimizer.

    Args:
        make_model: builds the eager model; the compiled one is a deep copy of it.
        compile_fn: compiles the copy, e.g. ``kareus.compile``.
        batches: the micro-batches (tuples, or dicts of keyword arguments).
        resync: after each optimizer step, copy the eager weights into the compiled model, so
            that every step compares both models on identical weights. Use it when the
            compiled model sums gradients in another order (nanobatches): otherwise rounding
            differences of one step grow through the optimizer into the next step's loss.
        accumulate: micro-batches per optimizer step.
        loss_fn: maps the model's output and the batch to a scalar loss.
        lr: learning rate.

    Returns:
        The eager history and the compiled history.
    """
    eager = make_model()
    compiled = compile_fn(copy.deepcopy(eager))
    models = (eager, compiled)
    opts = [torch.optim.AdamW(m.parameters(), lr=lr) for m in models]
    hists = (History([], []), History([], []))
    for i, batch in enumerate(batches):
        for model, hist in zip(models, hists, strict=True):
            out = model(**batch) if isinstance(batch, Mapping) else model(*batch)
            loss = loss_fn(out, batch) if loss_fn is not None else out
            (loss / accumulate).backward()
            hist.losses.append(loss.detach().clone())
        if (i + 1) % accumulate:
            continue
        for model, hist, opt in zip(models, hists, opts, strict=True):
            hist.grads.append(_grads(model))
            opt.step()
            opt.zero_grad(set_to_none=True)
        if resync:
            with torch.no_grad():
                for p, q in zip(eager.parameters(), compiled.parameters(), strict=True):
                    q.copy_(p)
    return hists


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {
        _plain(n): p.grad.detach().clone()
        for n, p in model.named_parameters()
        if p.grad is not None
    }


def assert_same_history(
    ref: History, got: History, *, bitwise_loss: bool = True, rtol: float = 1e-5, atol: float = 1e-6
) -> None:
    """Assert equal losses (bitwise by default) and gradients within fp32 rounding."""
    assert len(ref.losses) == len(got.losses) and len(ref.grads) == len(got.grads)
    for step, (a, b) in enumerate(zip(ref.losses, got.losses, strict=True)):
        if bitwise_loss:
            assert torch.equal(a, b), f"loss differs at step {step}: {a.item()} vs {b.item()}"
        else:
            torch.testing.assert_close(b, a, rtol=rtol, atol=atol)
    for step, (ga, gb) in enumerate(zip(ref.grads, got.grads, strict=True)):
        assert ga.keys() == gb.keys(), f"parameters with gradients differ at step {step}"
        for name in ga:
            torch.testing.assert_close(
                gb[name],
                ga[name],
                rtol=rtol,
                atol=atol,
                msg=functools.partial(_where, name, step),
            )


def overlap_problems(region: Any) -> list[str]:
    """Say where a compiled region's graphs do not overlap its partitions' collectives.

    For each partition, its collective must be issued before the last of the partition's
    compute and waited for after all of it, in the graph as it runs (empty: all are).
    ``region``: one of ``kareus.explain(model).regions``.
    """
    problems = []
    pset = region.findings["cut_partitions"]
    lines = {kind: node_lines(graph.final_code) for kind, graph in region.graphs.items()}
    for part in (p for p in pset.partitions if p.collective):
        at = lines[part.instruction]
        issue, wait = part.collective
        ran = [at[n] for n in part.compute if n in at]
        if not ran or not (at[issue] < max(ran) and at[wait] > max(ran)):
            problems.append(
                f"{part.instruction} {part.block}: {issue}/{wait} not around its compute"
            )
    return problems


def _running_graph(region: Any, kind: str | None) -> torch.fx.GraphModule | None:
    """Return the rewritten graph of ``kind`` that runs (default: forward, else inference)."""
    for k in (kind,) if kind else ("forward", "inference"):
        record = region.graphs.get(k)
        if record is not None and record.final is not None:
            return record.final  # type: ignore[no-any-return]
    return None


def split_blocks(region: Any, kind: str | None = None) -> list[str]:
    """Return the blocks the region's graph computes as two nanobatch copies, as it runs.

    Read from the rewritten graph that runs (the forward's, or ``kind``'s), not from what
    the split pass recorded: a block is split when its compute ops appear tagged with
    nanobatch 0 and with nanobatch 1, the same ops in both copies. In graph order. For a
    block whose tags AOTAutograd dropped (an activation-checkpointed body), the rewritten
    Dynamo graph it was traced from is read instead. ``region``: one of
    ``kareus.explain(model).regions``.
    """
    gm = _running_graph(region, kind)
    if gm is None:
        return []
    copies = _nanobatch_copies(gm)
    dynamo = region.graphs.get("dynamo")
    if kind is None and dynamo is not None and dynamo.final is not None:
        for block, pair in _nanobatch_copies(dynamo.final).items():
            copies.setdefault(block, pair)  # a block whose tags AOTAutograd dropped
    return [b for b, (first, second) in copies.items() if first and first == second]


def _nanobatch_copies(gm: torch.fx.GraphModule) -> dict[str, tuple[Any, Any]]:
    """Count each block's compute ops per nanobatch copy (graphs it calls included)."""
    from collections import Counter

    from kareus.passes.annotate_costs import moves_freely
    from kareus.passes.tags import get_tag

    copies: dict[str, tuple[Counter[str], Counter[str]]] = {}
    nodes = [n for m in gm.modules() if isinstance(m, torch.fx.GraphModule) for n in m.graph.nodes]
    for node in nodes:
        tag = get_tag(node)
        if node.op != "call_function" or tag is None or tag.nanobatch not in (0, 1):
            continue
        body = isinstance(node.target, torch._ops.HigherOrderOperator)  # a checkpointed body
        if (moves_freely(node) and not body) or is_functional_collective(node):
            continue
        copies.setdefault(tag.block, (Counter(), Counter()))[tag.nanobatch][str(node.target)] += 1
    return copies


def blocks_run(region: Any) -> Any:
    """Return the region's blocks (``findings["find_blocks"]``) once the graph confirms them.

    The blocks kareus records as split must be the blocks the graph that runs computes in
    two nanobatch copies (:func:`split_blocks`): a record the graph does not bear out fails
    here (AssertionError). Tests read what was split through it, never the record alone.
    """
    recorded = region.findings["find_blocks"]
    if _running_graph(region, None) is not None:
        ran = split_blocks(region)
        assert set(ran) == set(recorded.split), (
            f"kareus records {recorded.split} as split; the graph that runs splits {ran}"
        )
    return recorded


def clocks_on_device(runtime: Any) -> list[float]:
    """Return the clocks the runtime's device was set to, in order (resets left out).

    Read from the device (an emulated GPU's ``history``), not the runtime's records: a
    runtime that records a switch and sets nothing shows nothing here.
    """
    history = getattr(runtime.controller, "history", None)
    assert history is not None, (
        f"the {runtime.controller.name} controller keeps no history: test on an emulated GPU"
    )
    return [f for f in history if f is not None]


def overlapped_collectives(region: Any, kind: str = "forward") -> list[str]:
    """Return the collectives of the running ``kind`` graph that fly over the other copy.

    A collective flies over the other nanobatch's compute when a compute op of the other
    nanobatch runs between its issue and its wait.

    Read from the order of the rewritten graph that runs (what the python codegen runs op
    by op, and what Inductor is given); :func:`inductor_windows` reads Inductor's code.
    """
    from kareus.passes.annotate_costs import moves_freely
    from kareus.passes.tags import get_tag

    gm = _running_graph(region, kind)
    if gm is None:
        return []
    nodes = list(gm.graph.nodes)
    at = {n: i for i, n in enumerate(nodes)}
    flying = []
    for node in nodes:
        if collective_kind(node) is None:
            continue
        nanobatch = _nanobatch_of(node)
        waits = [u for u in node.users if is_wait(u)]
        if nanobatch is None or not waits:
            continue
        between = nodes[at[node] + 1 : min(at[w] for w in waits)]
        other = [
            n
            for n in between
            if n.op == "call_function"
            and not moves_freely(n)
            and not is_functional_collective(n)
            and (t := get_tag(n)) is not None
            and t.nanobatch == 1 - nanobatch
        ]
        if other:
            flying.append(node.name)
    return flying


def _nanobatch_of(node: torch.fx.Node) -> int | None:
    """Return the nanobatch of the nearest tagged ops ``node`` reads (collectives have none)."""
    from kareus.passes.tags import get_tag

    seen, frontier = set(), list(node.all_input_nodes)
    while frontier:
        found = {t.nanobatch for n in frontier if (t := get_tag(n)) and t.nanobatch in (0, 1)}
        if found:
            return found.pop() if len(found) == 1 else None
        seen.update(frontier)
        frontier = [i for n in frontier for i in n.all_input_nodes if i not in seen]
    return None


@dataclasses.dataclass
class Window:
    """One collective in Inductor's code: its line, its nanobatch, what runs while it flies.

    Attributes:
        issue: the line that launches the collective.
        nanobatch: the nanobatch it belongs to (None: unknown or shared).
        overlapped: the kernel lines of the other nanobatch between its launch and wait.
        waited: whether its wait follows in the same code.
    """

    issue: str
    nanobatch: int | None
    overlapped: list[str]
    waited: bool


_ISSUE = re.compile(r"(?:(\w+) = )?torch\.ops\._c10d_functional\.(\w+)\.default\(([^,)]*)")
_CALL = re.compile(r"^\s*(?:extern_kernels\.\w+|cpp_fused_\w+|triton_\w+\.run|torch\.ops\.\w+)")
_BUFFER = re.compile(r"\bbuf\d+\b")


@contextlib.contextmanager
def inductor_buffers() -> Iterator[list[dict[str, list[torch.fx.Node]]]]:
    """Record, meanwhile, the graph nodes each buffer of Inductor's code was made from.

    Yields a list that gets one dict per graph Inductor schedules, in the order it compiles
    them (as ``run_and_get_code`` lists their code), by buffer name as in its code: read
    one with :func:`inductor_windows`. Inductor's FX graph cache is off meanwhile (a cache
    hit schedules nothing).
    """
    import torch._inductor.config as inductor_config

    graphs: list[dict[str, list[torch.fx.Node]]] = []

    def record(nodes: list[Any]) -> list[Any]:
        made: dict[str, list[torch.fx.Node]] = {}
        graphs.append(made)
        for fused in nodes:
            for node in fused.get_nodes():
                origins = list(getattr(getattr(node, "node", None), "origins", ()) or ())
                for name in node.get_buffer_names():
                    made[name] = origins
        return nodes

    with inductor_config.patch(_post_fusion_custom_pass=record, fx_graph_cache=False):
        yield graphs


def inductor_windows(code: str, made: Mapping[str, Sequence[torch.fx.Node]]) -> list[Window]:
    """Return the collectives of Inductor's ``code``, each with what overlaps it.

    ``made``: the graph nodes each buffer was made from (:func:`inductor_buffers`). A
    kernel's nanobatch is that of the ops (their kareus tags) that made the buffers it
    reads and writes; a collective's, that of its buffer; its wait is the
    ``wait_tensor`` of that buffer.
    """
    from kareus.passes.annotate_costs import moves_freely
    from kareus.passes.tags import get_tag

    def nanobatch(line: str) -> int | None:
        nodes = [n for b in _BUFFER.findall(line) for n in made.get(b, ())]
        nodes = [n for n in nodes if not is_functional_collective(n)]
        # Views serve both nanobatches: the ops that compute say which one a kernel is,
        # unless none is tagged.
        computing = [n for n in nodes if n.op == "call_function" and not moves_freely(n)]
        for group in (computing, nodes):
            found = {t.nanobatch for n in group if (t := get_tag(n)) and t.nanobatch is not None}
            if found:
                return found.pop() if len(found) == 1 else None
        return None

    events: list[tuple[str, int | None, str, str]] = []  # (kind, nanobatch, buffer, line)
    for line in code.splitlines():
        if not _CALL.match(line):
            continue
        op = _ISSUE.search(line)
        if op is None:
            events.append(("compute", nanobatch(line), "", line.strip()))
        elif op.group(2) == "wait_tensor":
            events.append(("wait", None, _buffer(op.group(3)), line.strip()))
        else:
            buffer = _buffer(op.group(3))
            events.append(("issue", nanobatch(buffer), op.group(1) or buffer, line.strip()))
    windows = []
    for i, (kind, nb, buffer, line) in enumerate(events):
        if kind != "issue":
            continue
        end = next(
            (j for j in range(i + 1, len(events)) if events[j][0::2] == ("wait", buffer)), None
        )
        between = events[i + 1 : end] if end is not None else []
        other = [t for k, n, _b, t in between if k == "compute" and nb is not None and n == 1 - nb]
        windows.append(Window(line, nb, other, end is not None))
    return windows


def _buffer(arg: str) -> str:
    """Return the buffer an argument of Inductor's code names (``reinterpret_tensor(buf3``)."""
    return arg.replace("reinterpret_tensor(", "").strip()


def node_lines(code: str) -> dict[str, int]:
    """Return the line of each node's assignment in a graph's code (its place in the order)."""
    at = {}
    for i, line in enumerate(code.splitlines()):
        name, _, rest = line.strip().partition(" = ")
        if rest and name.isidentifier():
            at[name] = i
    return at


def _where(name: str, step: int, message: str) -> str:
    return f"gradient of {name} at step {step}: {message}"


def _plain(name: str) -> str:
    # torch.compile's and checkpoint_wrapper's wrappers, at any depth
    return name.replace("_orig_mod.", "").replace("_checkpoint_wrapped_module.", "")


_GPT2: dict[str, Any] = dict(
    n_positions=64, attn_implementation="sdpa", resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0
)

HF_KINDS = ("llama", "qwen3", "mistral", "gemma", "gpt2", "gpt_neox", "mixtral")
"""The tiny Hugging Face causal LMs :func:`hf_tiny` builds (transformers' own model code)."""


def hf_tiny(kind: str) -> nn.Module:
    """Build a tiny random Hugging Face causal LM offline, one of :data:`HF_KINDS`.

    Raises:
        ImportError: transformers is not installed (``pip install kareus[hf]``).
        ValueError: an unknown kind.
    """
    import transformers

    common: dict[str, Any] = dict(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        attn_implementation="sdpa",
    )
    gqa = {k: v for k, v in common.items() if k != "num_key_value_heads"}
    builders: dict[str, Callable[[], nn.Module]] = {
        "llama": lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(**common)),
        "qwen3": lambda: transformers.Qwen3ForCausalLM(
            transformers.Qwen3Config(head_dim=8, **common)
        ),
        "mistral": lambda: transformers.MistralForCausalLM(
            transformers.MistralConfig(sliding_window=16, **common)
        ),
        "gemma": lambda: transformers.GemmaForCausalLM(
            transformers.GemmaConfig(head_dim=8, **common)
        ),
        "gpt2": lambda: transformers.GPT2LMHeadModel(
            transformers.GPT2Config(vocab_size=128, n_embd=32, n_layer=2, n_head=4, **_GPT2)
        ),
        "gpt_neox": lambda: transformers.GPTNeoXForCausalLM(transformers.GPTNeoXConfig(**gqa)),
        "mixtral": lambda: transformers.MixtralForCausalLM(
            transformers.MixtralConfig(num_local_experts=4, num_experts_per_tok=2, **common)
        ),
    }
    if kind not in builders:
        raise ValueError(f"unknown HF model kind {kind!r}: use one of {', '.join(HF_KINDS)}")
    return builders[kind]()


HF_CONFIG_KINDS = ("phi3", "olmo", "stablelm", "gpt2", "bert")
"""Hugging Face architectures :func:`hf_config_file` writes, none of them a kareus preset."""


def hf_config_file(kind: str, directory: str | pathlib.Path) -> pathlib.Path:
    """Write a tiny ``config.json`` of a Hugging Face architecture (4 layers); return its path.

    Raises:
        ValueError: a kind not in :data:`HF_CONFIG_KINDS`.
    """
    import transformers

    common: dict[str, Any] = dict(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        max_position_embeddings=64,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    made: dict[str, tuple[Any, str]] = {
        "phi3": (transformers.Phi3Config(num_key_value_heads=4, **common), "Phi3ForCausalLM"),
        "olmo": (transformers.OlmoConfig(num_key_value_heads=2, **common), "OlmoForCausalLM"),
        "stablelm": (
            transformers.StableLmConfig(num_key_value_heads=4, **common),
            "StableLmForCausalLM",
        ),
        "gpt2": (
            transformers.GPT2Config(vocab_size=128, n_embd=64, n_layer=4, n_head=4, **_GPT2),
            "GPT2LMHeadModel",
        ),
        "bert": (
            transformers.BertConfig(
                hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, **common
            ),
            "BertForMaskedLM",
        ),
    }
    if kind not in made:
        raise ValueError(f"unknown config kind {kind!r}: use one of {', '.join(made)}")
    config, architecture = made[kind]
    config.architectures = [architecture]
    path = pathlib.Path(directory) / f"{kind}.json"
    config.to_json_file(str(path))
    return path


def source_training(
    source: Any,
    tp: int,
    plan: str | None,
    steps: int = 3,
    *,
    microbatch_size: int = 4,
    seq_len: int = 16,
) -> tuple[History, Any]:
    """Train ``source``'s model (seed 0) on random tokens in this process's TP group.

    Built as ``kareus plan`` traced it (:meth:`~kareus.models.sources.HFModel.build` on a
    ``(tp,)`` CPU mesh); with ``plan``, compiled by ``kareus.compile(model, plan=plan)`` on
    the emulated GPU's clocks. Returns the history and the compiled model (or the eager one).
    """
    import kareus
    from kareus.models.sources import step_loss
    from kareus.runtime.clocks import EmulatedClocks

    mesh = None
    if tp > 1:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (tp,))
    torch.manual_seed(0)
    model, inputs = source.build(
        layers=None,
        tp_mesh=mesh,
        microbatch_size=microbatch_size,
        seq_len=seq_len,
        dtype=torch.float32,
    )
    if plan is not None:
        model = kareus.compile(model, plan=plan, clocks=EmulatedClocks())
    vocab = 64  # token ids every model of these tests embeds (the smallest vocabulary)
    batches = []
    for ids, labels in token_batches(steps, microbatch_size, seq_len, vocab, seed=1):
        swap = iter((ids, labels))
        kwargs = {
            k: next(swap) if isinstance(v, torch.Tensor) else v for k, v in inputs.kwargs.items()
        }
        args = tuple(next(swap) if isinstance(v, torch.Tensor) else v for v in inputs.args)
        batches.append((args, kwargs))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    hist = History([], [])
    for args, kwargs in batches:
        loss = step_loss(model(*args, **kwargs))
        loss.backward()
        hist.losses.append(loss.detach().clone())
        hist.grads.append(_grads(model))
        opt.step()
        opt.zero_grad(set_to_none=True)
    return hist, model


def free_port() -> int:
    """Return a TCP port that is free on 127.0.0.1 now."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rank_main(
    rank: int,
    fn: Callable[..., Any],
    world: int,
    port: int,
    out: str,
    args: Any,
    timeout_s: float,
    environ: dict[str, str],
) -> None:
    import datetime
    import faulthandler
    import os
    import sys

    import torch.distributed as dist

    # A forkserver's child inherits the server's environment, not the caller's: the caller's
    # (as a spawned child would have it) replaces it.
    os.environ.clear()
    os.environ.update(environ)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_WORLD_SIZE=str(world),
    )
    torch.set_num_threads(1)
    # A rank stuck past the timeout prints where every thread waits, then exits: a hang
    # becomes a failure that names each rank and its line. Every rank dumps before any
    # exits (an exit makes the parent kill the others).
    print(f"[rank {rank}] stack dump follows if it hangs past {timeout_s:g} s", file=sys.stderr)
    faulthandler.dump_traceback_later(timeout_s, exit=False)
    import threading

    killer = threading.Timer(timeout_s + 10, os._exit, args=(1,))
    killer.daemon = True
    killer.start()
    dist.init_process_group(
        "gloo",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    try:
        try:
            result = fn(rank, *args)
        except BaseException:
            import traceback

            # Printed now: if tearing the group down hangs, the error is still seen.
            print(f"[rank {rank}] failed:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
            raise
        torch.save(result, f"{out}.{rank}")
    finally:
        faulthandler.cancel_dump_traceback_later()
        killer.cancel()
        dist.destroy_process_group()


_PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "kareus", "kareus.testing"]


def run_ranks(
    fn: Callable[..., Any], *args: Any, world: int = 2, timeout_s: float = 180.0
) -> list[Any]:
    """Run ``fn(rank, *args)`` in ``world`` processes joined by a gloo group.

    ``fn`` must be importable (defined at module level). Returns each rank's return value
    (anything ``torch.save`` can store). Raises if any rank fails. A rank that is still
    running after ``timeout_s`` prints every thread's stack (where it waits) and exits, and
    a collective that waits that long raises in its rank: a hang fails with the place.

    Ranks are forked from a server process that has imported torch and kareus once
    (``forkserver``), with the caller's working directory, ``sys.path`` and environment, as
    spawned ones would have: a spawned rank spent about 3 s importing them (an empty run of
    8 ranks took 12.9 s on 2 cores).
    """
    import multiprocessing.forkserver
    import os
    import tempfile

    import torch.multiprocessing as mp

    multiprocessing.forkserver.set_forkserver_preload(_PRELOAD)
    with tempfile.TemporaryDirectory() as tmp:
        out = f"{tmp}/result"
        mp.start_processes(
            _rank_main,
            args=(fn, world, free_port(), out, args, timeout_s, dict(os.environ)),
            nprocs=world,
            start_method="forkserver",
        )
        return [torch.load(f"{out}.{r}", weights_only=False) for r in range(world)]


@torch.library.custom_op("kareus_testing::sleepy", mutates_args=(), tags=(torch.Tag.pointwise,))
def sleepy(x: torch.Tensor, ms: float) -> torch.Tensor:
    """Return ``x * 2`` after sleeping ``ms``: a stand-in for GPU compute on CPU.

    Sleeping leaves the cores free, so a collective running in the communication library's
    thread really overlaps it (real matmuls would take both cores of a small machine).
    """
    import time

    time.sleep(ms / 1000)
    return x * 2


@sleepy.register_fake
def _(x: torch.Tensor, ms: float) -> torch.Tensor:
    return torch.empty_like(x)


def _sleepy_backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
    return sleepy(grad, ctx.ms), None


def _sleepy_setup(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
    ctx.ms = inputs[1]


sleepy.register_autograd(_sleepy_backward, setup_context=_sleepy_setup)


class SleepyLayer(nn.Module):
    """Compute that sleeps, then an all-reduce of the activation across the TP group.

    Megatron-shaped: "f" before (all-reduce of the gradient in the backward), "g" after
    (all-reduce forward), so both directions have one collective per nanobatch and layer.
    """

    def __init__(self, width: int, ms: float) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(width))
        self.ms = ms

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Return ``x`` plus the all-reduced, slowly computed update."""
        from kareus.models.parallel import copy_to_tp, reduce_from_tp

        return x + reduce_from_tp(sleepy(copy_to_tp(x) * self.scale, self.ms))


class SleepyStack(nn.Module):
    """Layers of :class:`SleepyLayer`; the loss is the mean square of the output."""

    def __init__(self, layers: int = 4, width: int = 1 << 18, ms: float = 20.0) -> None:
        super().__init__()
        self.layers = nn.ModuleList(SleepyLayer(width, ms) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Return the loss."""
        for layer in self.layers:
            x = layer(x)
        return x.pow(2).mean()


def _megatron_layer_ops(
    *, hidden: int, ffn: int, heads: int, seq: int, rows: int, tp: int, dtype: str
) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
    """Return one layer's attention and MLP ops for ``rows`` sequences, forward."""
    from kareus.ir.costs import OpCost

    tokens = rows * seq
    b = 2 if dtype in ("bf16", "fp16") else 4
    act = tokens * hidden * b
    hd = hidden // heads
    h_tp = heads // tp

    def mem(name: str, nbytes: float) -> OpCost:
        return OpCost("memory", nbytes / b, nbytes, dtype, name)

    def gemm(name: str, m: int, k: int, n: int) -> OpCost:
        return OpCost("gemm", 2.0 * m * k * n, float((m * k + k * n + m * n) * b), dtype, name)

    attn_ops = (
        mem("norm", 2 * act),
        gemm("qkv", tokens, hidden, 3 * hidden // tp),
        mem("rope", 4 * tokens * 2 * hidden // tp * b),
        OpCost(
            "attention",
            4.0 * rows * h_tp * seq * seq * hd / 2,
            4.0 * tokens * hidden // tp * b,
            dtype,
            "attention",
        ),
        gemm("out_proj", tokens, hidden // tp, hidden),
    )
    mlp_ops = (
        mem("residual_norm", 3 * act),
        gemm("gate_up", tokens, hidden, 2 * ffn // tp),
        mem("swiglu", 3 * tokens * ffn // tp * b),
        gemm("down", tokens, ffn // tp, hidden),
    )
    return attn_ops, mlp_ops


def _add_split_type(
    pset: Any, kind: str, label: str, ops: tuple[Any, ...], coll: Any, layers: int
) -> None:
    """Add one partition type (a slot per op) and its partitions, two per layer, to ``pset``."""
    from kareus.ir.partitions import Partition, PartitionType, Slot

    key = f"{kind}.{label}"
    slots = tuple(Slot(f"{key}.{i}", (o,)) for i, o in enumerate(ops))
    pset.types[key] = PartitionType(key, kind, ops, tuple(s.label for s in slots), coll)
    for layer in range(layers):
        for nb in (0, 1):
            pset.partitions.append(
                Partition(
                    kind,
                    f"layers.{layer}",
                    nb,
                    0,
                    key,
                    tuple(s.first for s in slots),
                    slots,
                    (f"issue{layer}{nb}{label}", f"wait{layer}{nb}{label}"),
                )
            )


def tradeoff_options(
    group: tuple[int, str], freqs: Sequence[float], stage_step: float = 0.1
) -> list[Any]:
    """Return made-up options of one group: two profiles whose hulls cross.

    Profile "b" is 10 % faster at 10 % more energy; dynamic energy is worth saving against
    static power; a backward is 1.5 times its forward, each stage ``stage_step`` larger
    than the one before.
    """
    from kareus.planner.dag import Option

    size = 1.0 + 0.5 * (group[1] == "backward") + stage_step * group[0]
    return [
        Option(
            f,
            p,
            size * (1000 / f) * (0.9 if p == "b" else 1.0),
            size * 300 * (f / 1000) ** 2 * (1.1 if p == "b" else 1.0),
        )
        for f in freqs
        for p in ("a", "b")
    ]


def megatron_partition_set(
    *,
    hidden: int,
    ffn: int,
    heads: int,
    seq: int,
    microbatch: int,
    layers: int,
    tp: int,
    dtype: str = "bf16",
    vocab: int = 32000,
    nanobatches: int = 2,
) -> Any:
    """Return a partition set for Megatron-style layers, from shapes alone (no tracing).

    For planner tests and benchmarks: per layer and direction, an attention and an MLP
    partition per nanobatch, each overlapping a tensor-parallel all-reduce of the other
    nanobatch's activation. Backward ops cost twice the forward (input and weight grads).
    ``nanobatches=1``: the original graphs' set instead, each layer whole (its ops at the
    whole micro-batch, outside partitions) with its two all-reduces alone.
    """
    from kareus.ir.costs import CollectiveCost, OpCost
    from kareus.ir.partitions import PartitionSet

    tokens = microbatch // nanobatches * seq  # one nanobatch (or the whole micro-batch)
    b = 2 if dtype in ("bf16", "fp16") else 4
    act = tokens * hidden * b
    attn_ops, mlp_ops = _megatron_layer_ops(
        hidden=hidden,
        ffn=ffn,
        heads=heads,
        seq=seq,
        rows=microbatch // nanobatches,
        tp=tp,
        dtype=dtype,
    )

    def mem(name: str, nbytes: float) -> OpCost:
        return OpCost("memory", nbytes / b, nbytes, dtype, name)

    def gemm(name: str, m: int, k: int, n: int) -> OpCost:
        return OpCost("gemm", 2.0 * m * k * n, float((m * k + k * n + m * n) * b), dtype, name)

    coll = CollectiveCost("all_reduce", float(act), tp)

    def backward(ops: tuple[OpCost, ...]) -> tuple[OpCost, ...]:
        return tuple(
            dataclasses.replace(o, flops=2 * o.flops, bytes=2 * o.bytes) for o in reversed(ops)
        )

    pset = PartitionSet()
    whole = microbatch * seq
    head = (
        gemm("lm_head", whole, hidden, vocab // tp),
        mem("loss", whole * vocab // tp * 4),
    )
    for kind, attn, mlp in (
        ("forward", attn_ops, mlp_ops),
        ("backward", backward(mlp_ops), backward(attn_ops)),
    ):
        pset.other[kind] = head if kind == "forward" else backward(head)
        if nanobatches == 1:
            blocks = [f"layers.{layer}" for layer in range(layers)]
            pset.block_other[kind] = {b: attn + mlp for b in blocks}
            pset.block_exposed[kind] = {b: (coll, coll) for b in blocks}
            pset.exposed[kind] = (coll,) * (2 * layers)
            continue
        for label, ops in (("a", attn), ("b", mlp)):
            _add_split_type(pset, kind, label, ops, coll, layers)
        pset.exposed[kind] = (coll,)
    return pset


class _InplaceReduce(torch.autograd.Function):
    """Megatron's "g" as TP libraries write it: an in-place ``dist.all_reduce``."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        x = x.clone()
        dist.all_reduce(x)
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad


class _InplaceCopy(torch.autograd.Function):
    """Megatron's "f": identity forward, in-place ``dist.all_reduce`` of the gradient."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        grad = grad.clone()
        dist.all_reduce(grad)
        return grad


def _gather_seq(x: torch.Tensor) -> torch.Tensor:
    import torch.distributed as dist

    moved = x.transpose(0, 1).contiguous()
    out = moved.new_empty((moved.shape[0] * dist.get_world_size(), *moved.shape[1:]))
    dist.all_gather_into_tensor(out, moved)
    return out.transpose(0, 1)


def _scatter_seq(x: torch.Tensor) -> torch.Tensor:
    import torch.distributed as dist

    moved = x.transpose(0, 1).contiguous()
    out = moved.new_empty((moved.shape[0] // dist.get_world_size(), *moved.shape[1:]))
    dist.reduce_scatter_tensor(out, moved)
    return out.transpose(0, 1)


class _InplaceGather(torch.autograd.Function):
    """Sequence parallelism: all-gather the sequence forward, reduce-scatter backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return _gather_seq(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return _scatter_seq(grad)


class _InplaceScatter(torch.autograd.Function):
    """Sequence parallelism: reduce-scatter the sequence forward, all-gather backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return _scatter_seq(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return _gather_seq(grad)


class InplaceTPLayer(nn.Module):
    """A tensor-parallel MLP layer with in-place ``dist`` collectives in autograd.Functions.

    This is how Megatron-style TP libraries write their collectives.

    With ``sequence_parallel``, activations are split along dimension 1 between layers:
    all-gathered before the column-parallel matmul, reduce-scattered after the row-parallel
    one (the gradients the other way round); without it, "f" and "g" all-reduces.
    """

    def __init__(self, width: int, sequence_parallel: bool) -> None:
        super().__init__()
        self.sequence_parallel = sequence_parallel
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, width)
        self.down = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Return ``x`` plus the layer's update."""
        h = self.norm(x)
        h = _InplaceGather.apply(h) if self.sequence_parallel else _InplaceCopy.apply(h)
        h = self.down(torch.relu(self.up(h)))
        h = _InplaceScatter.apply(h) if self.sequence_parallel else _InplaceReduce.apply(h)
        return x + h


class InplaceTPNet(nn.Module):
    """Layers of :class:`InplaceTPLayer`; called as ``net(x, target)``, returns the MSE."""

    def __init__(self, layers: int = 3, width: int = 16, sequence_parallel: bool = False) -> None:
        super().__init__()
        self.layers = nn.ModuleList(InplaceTPLayer(width, sequence_parallel) for _ in range(layers))

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """Return the mean squared error of the output against ``target``."""
        for layer in self.layers:
            x = layer(x)
        return ((x - target) ** 2).mean()


@dataclasses.dataclass(frozen=True)
class PerSampleVerdict:
    """kareus's verdict on a function over a batch, and whether the numbers bear it out.

    Attributes:
        claimed: kareus would split it (every op of its graph acts per sample).
        reason: why not, when not claimed (the first op's reason), or why nothing was checked.
        holds: the halves' outputs, joined, equal the whole batch's (None: not checked).
    """

    claimed: bool
    reason: str
    holds: bool | None

    @property
    def unsound(self) -> bool:
        """Kareus would split it, and splitting changes the result."""
        return self.claimed and self.holds is False


def per_sample_verdict(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> PerSampleVerdict:
    """Ask kareus whether ``fn(*args, **kwargs)`` acts per sample along dimension 0; check it.

    The first tensor among ``args`` carries the batch; the other arguments are the same for
    every sample (as weights are). ``fn`` is captured by Dynamo with that dimension
    symbolic, and every op of the graph is put to
    :func:`kareus.passes.per_sample.why_not_per_sample`. Where kareus says
    yes, the function is run on the two halves and on the whole, and the outputs compared:
    a claim the numbers refute is unsound.
    """
    from kareus.passes.per_sample import draws_random, why_not_per_sample

    first = next((i for i, a in enumerate(args) if isinstance(a, torch.Tensor)), None)
    if first is None or args[first].dim() == 0 or args[first].shape[0] < 4:
        return PerSampleVerdict(False, "no batch of 4 or more in the first tensor", None)
    size = args[first].shape[0]
    batched = [i == first for i in range(len(args))]  # the others are the same for all
    graphs: list[torch.fx.GraphModule] = []

    def capture(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        graphs.append(gm)
        return gm.forward

    def call(*batch: Any) -> Any:
        it = iter(batch)
        return fn(*(next(it) if b else a for a, b in zip(args, batched, strict=True)), **kwargs)

    inputs = [a.clone() for a, b in zip(args, batched, strict=True) if b]
    for t in inputs:
        torch._dynamo.maybe_mark_dynamic(t, 0)
    torch._dynamo.reset()
    try:
        torch.compile(call, backend=capture, fullgraph=True)(*inputs)
    except Exception as err:  # a function Dynamo cannot capture whole: nothing to judge
        return PerSampleVerdict(False, f"not captured: {type(err).__name__}", None)
    finally:
        torch._dynamo.reset()
    if not graphs:
        return PerSampleVerdict(False, "no graph captured", None)
    gm = graphs[0]
    dims0 = [
        v.shape[0]
        for n in gm.graph.nodes
        if n.op == "placeholder"
        and isinstance(v := n.meta.get("example_value"), torch.Tensor)
        and v.dim() == inputs[0].dim()
        and isinstance(v.shape[0], torch.SymInt)
    ]
    if not dims0:
        return PerSampleVerdict(False, "the batch size was specialised", None)
    dim0 = dims0[0]
    sym = dim0.node.expr
    if not dim0.node.shape_env.replace(sym).free_symbols:
        return PerSampleVerdict(False, "the batch size was specialised while tracing", None)
    for node in gm.graph.nodes:
        if reason := why_not_per_sample(node, sym):
            return PerSampleVerdict(False, reason, None)
    if any(draws_random(n) for n in gm.graph.nodes):
        return PerSampleVerdict(True, "random: not compared", None)
    if any("empty" in str(n.target) for n in gm.graph.nodes if n.op != "placeholder"):
        return PerSampleVerdict(True, "uninitialised memory: not compared", None)
    return _compare_halves(gm, sym, call, inputs, size)


def _compare_halves(
    gm: torch.fx.GraphModule, sym: Any, call: Callable[..., Any], inputs: list[Any], size: int
) -> PerSampleVerdict:
    """Run ``call`` on the halves of the batch and on the whole; compare the outputs."""
    from kareus.passes.per_sample import batch_dim_of

    outputs = next(n for n in gm.graph.nodes if n.op == "output").args[0]
    dims = [
        batch_dim_of(o.meta.get("example_value"), sym) if isinstance(o, torch.fx.Node) else None
        for o in torch.utils._pytree.tree_leaves(outputs)
    ]
    half = size // 2
    whole = torch.utils._pytree.tree_leaves(call(*inputs))
    try:
        first_half = torch.utils._pytree.tree_leaves(call(*(t[:half] for t in inputs)))
        second_half = torch.utils._pytree.tree_leaves(call(*(t[half:] for t in inputs)))
    except Exception as err:  # the function itself refuses a smaller batch
        return PerSampleVerdict(True, f"halves not run: {type(err).__name__}", None)
    for w, a, b, d in zip(whole, first_half, second_half, dims, strict=False):
        if not isinstance(w, torch.Tensor) or not isinstance(d, int):
            continue
        if a.shape[:d] + a.shape[d + 1 :] != b.shape[:d] + b.shape[d + 1 :]:
            return PerSampleVerdict(True, "the halves' outputs differ in shape", False)
        joined = torch.cat([a, b], dim=d)
        if joined.shape != w.shape or not torch.allclose(
            joined.double(), w.double(), rtol=1e-4, atol=1e-5, equal_nan=True
        ):
            return PerSampleVerdict(True, "", False)
    return PerSampleVerdict(True, "", True)
