"""An ordinary training loop; the only kareus line is the compile call.

kareus finds the repeated layers (on one device they hold no collective to overlap, so
they are not split into nanobatches; `kareus.explain` says so) and, given a GPU type, plans
clocks for them with its hardware model and records them (a dry run: kareus changes clocks
only when asked, with `clocks="auto"` or a plan; no GPU is needed, and the energy printed is
modelled).

Run: python examples/train_tiny.py [--steps N] [--gpu a100-40gb] [--report PATH]
"""

import argparse
import pathlib

import torch

import kareus
from kareus.models import PRESETS, Llama

parser = argparse.ArgumentParser(description=__doc__)
parser.add_argument("--steps", type=int, default=5)
parser.add_argument("--gpu", default="a100-40gb", help="GPU type to plan for")
parser.add_argument("--report", type=pathlib.Path, default=pathlib.Path("kareus-out/explain.txt"))
args = parser.parse_args()

torch.manual_seed(0)
model = Llama(PRESETS["tiny"])
energy = []
model = kareus.compile(model, gpu=args.gpu, on_iteration=energy.append)  # was torch.compile
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)

data = torch.randint(0, 128, (2, 8, 33), generator=torch.Generator().manual_seed(0))
for step in range(args.steps):
    ids = data[step % 2]  # two fixed batches, so the loss visibly falls
    loss = model(ids[:, :-1], ids[:, 1:])
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    print(f"step {step}: loss {loss.item():.4f}")

report = kareus.explain(model)
print(report.summary())
for it in energy:
    print(f"iteration {it.iteration}: {it.time_s * 1e3:.3f} ms, {it.energy_j:.4f} J ({it.source})")
args.report.parent.mkdir(parents=True, exist_ok=True)
args.report.write_text(str(report))
print(f"full report with the captured and rewritten graphs: {args.report}")
