"""An embedded, CIFAR-10-shaped dataset of drawn shapes, so the default run needs no download.

Each image is 3x32x32 uint8. The class is the *shape* (disk, ring, square, ...); position,
size, colours, stripe period and pixel noise are drawn at random, so a model has to learn
the shape itself, not a colour or a position. Generation is vectorised and deterministic:
the same seed gives the same bytes on every machine and every rank.

Example::

    images, labels = make_shapes(1024, seed=0)   # uint8 [1024, 3, 32, 32], int64 [1024]
"""

from __future__ import annotations

import torch

CLASSES = (
    "disk", "ring", "square", "frame", "triangle", "cross", "h-stripes", "v-stripes",
    "diagonal", "checker",
)  # fmt: skip
IMAGE_SIZE = 32


def make_shapes(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw ``n`` images with balanced labels; returns ``(uint8 [n,3,32,32], int64 [n])``."""
    if n <= 0:
        raise ValueError(f"the synthetic dataset needs a positive size, got {n}")
    g = torch.Generator().manual_seed(seed)

    def uniform(lo: float, hi: float) -> torch.Tensor:
        return lo + (hi - lo) * torch.rand(n, 1, 1, generator=g)

    labels = torch.arange(n) % len(CLASSES)
    labels = labels[torch.randperm(n, generator=g)]

    coords = torch.arange(IMAGE_SIZE, dtype=torch.float32)
    y, x = coords.view(1, -1, 1), coords.view(1, 1, -1)
    cy, cx = uniform(10, 22), uniform(10, 22)
    radius = uniform(6, 10)
    dy, dx = y - cy, x - cx
    dist = torch.sqrt(dy**2 + dx**2)
    box = torch.maximum(dy.abs(), dx.abs())
    period = uniform(4, 8)
    phase = uniform(0, 8)
    thickness = uniform(0.2, 0.35) * radius

    shapes = [
        dist <= radius,
        (dist <= radius) & (dist >= radius - thickness),
        box <= radius * 0.85,
        (box <= radius * 0.85) & (box >= radius * 0.85 - thickness),
        (dy <= radius * 0.7) & (dx.abs() <= (dy + radius * 0.7) * 0.6),
        ((dx.abs() <= thickness * 0.6) | (dy.abs() <= thickness * 0.6)) & (box <= radius),
        torch.remainder(y + phase, period) < period / 2,
        torch.remainder(x + phase, period) < period / 2,
        torch.remainder(x + y + phase, period * 1.4) < period * 0.7,
        (torch.floor((x + phase) * 2 / period) + torch.floor((y + phase) * 2 / period)) % 2 == 0,
    ]
    assert len(shapes) == len(CLASSES)
    mask = torch.zeros(n, IMAGE_SIZE, IMAGE_SIZE, dtype=torch.bool)
    for index, shape in enumerate(shapes):
        mask |= (labels == index).view(n, 1, 1) & shape
    mask = mask.unsqueeze(1).float()  # [n, 1, H, W]

    # Foreground and background colours far enough apart that the shape is visible.
    background = torch.rand(n, 3, 1, 1, generator=g)
    shift = 0.45 + 0.4 * torch.rand(n, 3, 1, 1, generator=g)
    foreground = torch.remainder(background + shift, 1.0)
    images = mask * foreground + (1 - mask) * background
    images = images + 0.06 * torch.randn(n, 3, IMAGE_SIZE, IMAGE_SIZE, generator=g)
    images = (images.clamp(0, 1) * 255).round().to(torch.uint8)
    return images.contiguous(), labels
