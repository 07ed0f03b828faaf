"""A Hugging Face transformers model trained with kareus (tiny random Llama, offline).

Run: python examples/train_hf.py [--steps N]
"""

import argparse
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
import transformers

import kareus

parser = argparse.ArgumentParser(description=__doc__)
parser.add_argument("--steps", type=int, default=4)
args = parser.parse_args()

torch.manual_seed(0)
config = transformers.LlamaConfig(
    vocab_size=128,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    attn_implementation="sdpa",
)
model = transformers.LlamaForCausalLM(config)
model = kareus.compile(model)  # was torch.compile(model)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)

data = torch.randint(0, 128, (2, 8, 16), generator=torch.Generator().manual_seed(0))
for step in range(args.steps):
    out = model(input_ids=data[step % 2], labels=data[step % 2])
    out.loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    print(f"step {step}: loss {out.loss.item():.4f}")

print(kareus.explain(model).summary())
