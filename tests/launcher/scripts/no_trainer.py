"""Scripts the launcher can attach nothing to: a plain PyTorch loop, or (``fabric``) the same
loop under Lightning Fabric.

    python no_trainer.py [fabric]
"""

import sys

import torch

model = torch.nn.Linear(8, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
if sys.argv[1:] == ["fabric"]:
    from lightning.fabric import Fabric

    fabric = Fabric(accelerator="cpu", devices=1)
    model, optimizer = fabric.setup(model, optimizer)
for _ in range(4):
    loss = model(torch.randn(16, 8)).pow(2).mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
print(f"loop done: loss {loss.item():.3f}")
