"""Augmentation and normalisation as batched tensor ops on the device.

The DataLoader hands over uint8 CHW batches; this module turns them into normalised float
batches on whatever device they are already on. Doing it after the host-to-device copy
keeps the copy at one byte per pixel (4x less than float32) and takes per-image Python
work out of the DataLoader workers. Every op here is asynchronous on CUDA: the random
numbers are drawn on the device and the crop is a gather, so nothing waits for the GPU.

Example::

    augment = DeviceAugment(mean=CIFAR10_MEAN, std=CIFAR10_STD)
    x = augment(images_uint8, train=True)    # float32 [B, 3, 32, 32], cropped and flipped
    x = augment(images_uint8, train=False)   # normalised only
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

CIFAR10_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR10_STD = (0.2470, 0.2435, 0.2616)


class DeviceAugment(nn.Module):
    """Random crop with zero padding, random horizontal flip, then per-channel normalisation.

    ``channels_last=True`` returns the batch in channels-last memory format, which is what
    tensor-core convolutions want under mixed precision (the DataModule turns it on for
    CUDA batches).
    """

    def __init__(
        self,
        mean: Sequence[float] = CIFAR10_MEAN,
        std: Sequence[float] = CIFAR10_STD,
        padding: int = 4,
        flip: bool = True,
        channels_last: bool = False,
    ) -> None:
        super().__init__()
        if len(mean) != len(std):
            raise ValueError(f"mean and std need the same length, got {len(mean)} and {len(std)}")
        if padding < 0:
            raise ValueError(f"padding must be >= 0, got {padding}")
        std_t = torch.tensor(std, dtype=torch.float32)
        # x/255 then (x - mean)/std, folded into one multiply-add.
        self.register_buffer("scale", (1.0 / (255.0 * std_t)).view(1, -1, 1, 1), persistent=False)
        self.register_buffer(
            "shift", (-torch.tensor(mean) / std_t).view(1, -1, 1, 1), persistent=False
        )
        self.padding = padding
        self.flip = flip
        self.channels_last = channels_last

    def random_crop(self, images: torch.Tensor) -> torch.Tensor:
        """Pad by ``padding`` on each side and cut a random window of the original size."""
        batch, _, height, width = images.shape
        p = self.padding
        padded = F.pad(images, (p, p, p, p))
        offset_y = torch.randint(0, 2 * p + 1, (batch, 1), device=images.device)
        offset_x = torch.randint(0, 2 * p + 1, (batch, 1), device=images.device)
        rows = offset_y + torch.arange(height, device=images.device)  # [B, H]
        cols = offset_x + torch.arange(width, device=images.device)  # [B, W]
        b = torch.arange(batch, device=images.device).view(batch, 1, 1)
        # Integer-index gather: [B, H, W, C] -> [B, C, H, W]. No boolean mask, so no sync.
        return padded.permute(0, 2, 3, 1)[b, rows[:, :, None], cols[:, None, :]].permute(0, 3, 1, 2)

    def random_flip(self, images: torch.Tensor) -> torch.Tensor:
        flip = torch.rand(images.shape[0], 1, 1, 1, device=images.device) < 0.5
        return torch.where(flip, images.flip(-1), images)

    def forward(self, images: torch.Tensor, train: bool) -> torch.Tensor:
        if images.dtype != torch.uint8 or images.dim() != 4:
            raise TypeError(
                f"expected a uint8 batch [B, C, H, W], got {images.dtype} {tuple(images.shape)}"
            )
        if train:
            if self.padding:
                images = self.random_crop(images)
            if self.flip:
                images = self.random_flip(images)
        memory_format = torch.channels_last if self.channels_last else torch.contiguous_format
        # Reorder the uint8 bytes (cheap), then the float op keeps that layout.
        images = images.contiguous(memory_format=memory_format)
        out = torch.addcmul(self.shift, images.float(), self.scale)
        return out.contiguous(memory_format=memory_format)
