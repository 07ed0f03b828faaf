"""Which blocks of transformers' own models kareus splits, and why the others stay whole.

For each tiny random causal LM of :data:`kareus.testing.HF_KINDS` (Llama, Qwen3, Mistral,
Gemma, GPT-2, GPT-NeoX, Mixtral; built offline from a config), one training step compiled
with ``nanobatches=2`` against eager: the blocks split, the reason each other block stays
whole (as ``kareus.explain`` gives it, naming the op), and the largest difference of loss
and gradients from eager's (measured on this machine's CPU). The test suite runs a sample
of these models (``tests/test_split_nanobatches.py``); this script runs them all.

Run: python benchmarks/hf_blocks.py [KIND ...]
"""

from __future__ import annotations

import copy
import sys

import torch

import kareus
from kareus.testing import HF_KINDS, hf_tiny


def one(kind: str) -> None:
    torch._dynamo.reset()
    torch.manual_seed(1)
    model = hf_tiny(kind)
    ref = copy.deepcopy(model)
    ids = torch.randint(0, 128, (6, 16), generator=torch.Generator().manual_seed(0))
    compiled = kareus.compile(model, nanobatches=2)
    loss = compiled(input_ids=ids, labels=ids).loss
    loss.backward()
    want = ref(input_ids=ids, labels=ids).loss
    want.backward()
    grads = dict(ref.named_parameters())
    worst = max(
        (p.grad - grads[n].grad).abs().max().item()
        for n, p in model.named_parameters()
        if p.grad is not None
    )
    split, whole = [], {}
    for region in kareus.explain(compiled).regions:
        found = region.findings.blocks
        split += list(getattr(found, "split", []))
        whole |= dict(getattr(found, "skipped", {}) or {})
    print(f"{kind}: {len(split)} block(s) split {split}; loss {abs(loss - want).item():.2e} "
          f"and gradients {worst:.2e} from eager's (measured)")  # fmt: skip
    for block, reason in whole.items():
        print(f"  whole: {block}: {reason}")


def main() -> None:
    for kind in sys.argv[1:] or HF_KINDS:
        one(kind)


if __name__ == "__main__":
    main()
