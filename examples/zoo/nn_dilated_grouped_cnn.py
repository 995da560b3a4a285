"""A convnet mixing dilated, grouped and depthwise-separable convolutions.

Images [B, 3, 32, 32] -> stem conv3x3 (32 ch) -> dilated conv3x3 (dilation 2, then 4, padding kept
"same") -> grouped conv3x3 (groups=4) with stride 2 -> depthwise conv3x3 (groups=channels) +
pointwise conv1x1 (a depthwise-separable block) -> another grouped conv, each followed by ReLU ->
adaptive average pool -> dropout -> linear, logits [B, classes].

Loss: cross entropy against integer labels [B] from ``example_targets``.
"""

import torch
import torch.nn.functional as F
from torch import nn


class DepthwiseSeparable(nn.Module):
    def __init__(self, in_ch: int, out_ch: int, stride: int = 1) -> None:
        super().__init__()
        self.depthwise = nn.Conv2d(in_ch, in_ch, kernel_size=3, stride=stride, padding=1, groups=in_ch)
        self.pointwise = nn.Conv2d(in_ch, out_ch, kernel_size=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.pointwise(F.relu(self.depthwise(x))))


class DilatedGroupedCNN(nn.Module):
    def __init__(self, channels: int, width: int, groups: int, classes: int, dropout: float) -> None:
        super().__init__()
        self.stem = nn.Conv2d(channels, width, kernel_size=3, padding=1)
        self.dilated1 = nn.Conv2d(width, width, kernel_size=3, padding=2, dilation=2)
        self.dilated2 = nn.Conv2d(width, width, kernel_size=3, padding=4, dilation=4)
        self.grouped1 = nn.Conv2d(width, 2 * width, kernel_size=3, stride=2, padding=1, groups=groups)
        self.separable = DepthwiseSeparable(2 * width, 2 * width, stride=2)
        self.grouped2 = nn.Conv2d(2 * width, 4 * width, kernel_size=3, padding=1, groups=groups)
        self.pool = nn.AdaptiveAvgPool2d((1, 1))
        self.drop = nn.Dropout(dropout)
        self.fc = nn.Linear(4 * width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.stem(x))
        x = F.relu(self.dilated1(x))
        x = F.relu(self.dilated2(x))
        x = F.relu(self.grouped1(x))
        x = self.separable(x)
        x = F.relu(self.grouped2(x))
        x = self.pool(x).flatten(1)
        return self.fc(self.drop(x))


def build_model(
    channels: int = 3, width: int = 32, groups: int = 4, classes: int = 10, dropout: float = 0.1, **_: object
) -> nn.Module:
    return DilatedGroupedCNN(channels, width, groups, classes, dropout)


def example_inputs(batch_size: int, channels: int = 3, image_size: int = 32, **_: object):
    return (torch.randn(batch_size, channels, image_size, image_size),)


def example_targets(batch_size: int, classes: int = 10, **_: object):
    return (torch.randint(0, classes, (batch_size,)),)


def loss_fn(output, data):
    (labels,) = data
    return F.cross_entropy(output, labels)
