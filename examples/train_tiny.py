"""An ordinary training loop; the only kareus line is the compile call.

Run: python examples/train_tiny.py [--steps N] [--report PATH]
"""

import argparse
import pathlib

import torch

import kareus
from kareus.models import PRESETS, Llama

parser = argparse.ArgumentParser(description=__doc__)
parser.add_argument("--steps", type=int, default=5)
parser.add_argument("--report", type=pathlib.Path, default=pathlib.Path("kareus-out/explain.txt"))
args = parser.parse_args()

torch.manual_seed(0)
model = Llama(PRESETS["tiny"])
model = kareus.compile(model)  # instead of torch.compile(model)
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
args.report.parent.mkdir(parents=True, exist_ok=True)
args.report.write_text(str(report))
print(f"full report with the captured and rewritten graphs: {args.report}")
