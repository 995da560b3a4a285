"""A small hand-written ResNet built from BasicBlocks (ResNet-18 style).

The network is a 3x3 ``stem`` followed by ``stages`` stages of ``blocks``
BasicBlocks each.  Stage ``i`` has ``width * 2**i`` channels; every stage but
the first starts with a stride-2 block whose shortcut is a 1x1 convolution.
GroupNorm (``min(8, channels)`` groups) replaces BatchNorm so that the model
has no buffers (no running statistics).  An adaptive average ``pool`` and a
linear classifier ``fc`` finish it.

Keyword arguments:

- ``width``: channels of the stem and the first stage (default 16).
- ``blocks``: BasicBlocks per stage (default 2).
- ``stages``: number of stages (default 3).
- ``image_size``: height and width of the input images (default 32); the model
  itself works for any size, this only shapes ``example_inputs``.
- ``num_classes``: classifier outputs (default 10).
- ``in_channels``: channels of the input images (default 3).

Module paths look like ``stem.conv``, ``stages.1.0.conv1``,
``stages.1.0.shortcut.0``, ``fc``.
"""

import torch
import torch.nn.functional as F
from torch import Tensor, nn


def _norm(channels: int) -> nn.GroupNorm:
    return nn.GroupNorm(min(8, channels), channels)


class Stem(nn.Module):
    """3x3 convolution, normalization and ReLU."""

    def __init__(self, in_channels: int, channels: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(in_channels, channels, 3, padding=1, bias=False)
        self.norm = _norm(channels)

    def forward(self, x: Tensor) -> Tensor:
        return F.relu(self.norm(self.conv(x)))


class BasicBlock(nn.Module):
    """Two 3x3 convolutions with a residual connection."""

    def __init__(self, in_channels: int, channels: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, channels, 3, stride, padding=1, bias=False)
        self.norm1 = _norm(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.norm2 = _norm(channels)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or in_channels != channels:
            self.shortcut = nn.Sequential(nn.Conv2d(in_channels, channels, 1, stride, bias=False), _norm(channels))

    def forward(self, x: Tensor) -> Tensor:
        y = F.relu(self.norm1(self.conv1(x)))
        y = self.norm2(self.conv2(y))
        return F.relu(y + self.shortcut(x))


class ResNet(nn.Module):
    """Images [B, C, H, W] -> logits [B, num_classes]."""

    def __init__(self, width: int, blocks: int, stages: int, num_classes: int, in_channels: int) -> None:
        super().__init__()
        self.stem = Stem(in_channels, width)
        stage_list = []
        channels = width
        for i in range(stages):
            out = width * 2**i
            stage = []
            for j in range(blocks):
                stride = 2 if i > 0 and j == 0 else 1
                stage.append(BasicBlock(channels, out, stride))
                channels = out
            stage_list.append(nn.Sequential(*stage))
        self.stages = nn.Sequential(*stage_list)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(channels, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        x = self.stages(self.stem(x))
        return self.fc(torch.flatten(self.pool(x), 1))


def build_model(
    *,
    width: int = 16,
    blocks: int = 2,
    stages: int = 3,
    num_classes: int = 10,
    in_channels: int = 3,
    **_: object,
) -> nn.Module:
    """Build the ResNet described in the module docstring."""
    return ResNet(int(width), int(blocks), int(stages), int(num_classes), int(in_channels))


def example_inputs(batch_size: int, *, image_size: int = 32, in_channels: int = 3, **_: object) -> tuple[Tensor, ...]:
    """One training step's inputs: ``(images,)`` of shape [B, in_channels, S, S]."""
    size = int(image_size)
    return (torch.randn(batch_size, int(in_channels), size, size),)


def loss_fn(output: Tensor, inputs: tuple[Tensor, ...]) -> Tensor:
    """Cross entropy against the (deterministic) label 0 for every image."""
    labels = torch.zeros(output.shape[0], dtype=torch.long, device=output.device)
    return F.cross_entropy(output, labels)
