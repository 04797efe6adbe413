"""ResNets for 32x32 inputs, built from torchvision's residual blocks.

torchvision's ResNet-18 downsamples 4x in its stem (7x7 stride-2 conv, then max-pool),
which throws away most of a 32x32 image. The CIFAR variant used here keeps the resolution
in the stem (one 3x3 stride-1 conv, no pool), as in He et al.'s CIFAR experiments. Its
stage widths scale with ``width`` (64 gives the standard ResNet-18 channel counts), so the
same network can be made narrow enough to train in minutes on a laptop CPU.

Example::

    net = cifar_resnet(num_classes=10)               # ResNet-18, 11.2 M parameters
    small = cifar_resnet(num_classes=10, width=16)   # same depth, 16x fewer FLOPs
    logits = net(torch.randn(8, 3, 32, 32))          # [8, 10]
"""

from __future__ import annotations

from torch import nn
from torchvision.models.resnet import BasicBlock

# Blocks per stage, as in torchvision's resnet18 / resnet34.
DEPTHS = {18: (2, 2, 2, 2), 34: (3, 4, 6, 3)}


def _stage(in_channels: int, out_channels: int, blocks: int, stride: int) -> nn.Sequential:
    downsample = None
    if stride != 1 or in_channels != out_channels:
        downsample = nn.Sequential(
            nn.Conv2d(in_channels, out_channels, 1, stride=stride, bias=False),
            nn.BatchNorm2d(out_channels),
        )
    layers = [BasicBlock(in_channels, out_channels, stride, downsample)]
    layers += [BasicBlock(out_channels, out_channels) for _ in range(blocks - 1)]
    return nn.Sequential(*layers)


def cifar_resnet(num_classes: int, depth: int = 18, width: int = 64) -> nn.Sequential:
    """A ResNet-``depth`` for 32x32 images whose first stage has ``width`` channels."""
    if depth not in DEPTHS:
        raise ValueError(f"depth must be one of {sorted(DEPTHS)}, got {depth}")
    if width < 1:
        raise ValueError(f"width must be positive, got {width}")
    widths = [width * 2**i for i in range(4)]
    stages = []
    in_channels = width
    for i, (out_channels, blocks) in enumerate(zip(widths, DEPTHS[depth], strict=True)):
        stages.append(_stage(in_channels, out_channels, blocks, stride=1 if i == 0 else 2))
        in_channels = out_channels
    net = nn.Sequential(
        nn.Conv2d(3, width, 3, padding=1, bias=False),
        nn.BatchNorm2d(width),
        nn.ReLU(inplace=True),
        *stages,
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(widths[-1], num_classes),
    )
    for m in net.modules():
        if isinstance(m, nn.Conv2d):
            nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
    # Zero-init the last BN of each residual branch: every block starts as the identity,
    # which speeds up early training (Goyal et al., "Accurate, Large Minibatch SGD").
    for m in net.modules():
        if isinstance(m, BasicBlock):
            nn.init.zeros_(m.bn2.weight)
    return net
