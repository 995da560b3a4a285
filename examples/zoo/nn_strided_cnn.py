"""A small convnet that downsamples with stride-2 convolutions instead of pooling.

Images [B, 3, 32, 32] -> conv3x3 (32 ch) -> three stride-2 conv3x3 (32 -> 64 -> 64 -> 128 ch,
32x32 -> 4x4), each followed by ReLU -> nn.AdaptiveAvgPool2d(1) -> flatten -> dropout -> linear,
logits [B, classes].

Loss: cross entropy against integer labels [B] from ``example_targets``.
"""

import torch
import torch.nn.functional as F
from torch import nn


class StridedCNN(nn.Module):
    def __init__(self, channels: int, width: int, classes: int, dropout: float) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(channels, width, kernel_size=3, padding=1),
            nn.ReLU(inplace=True),
            nn.Conv2d(width, width, kernel_size=3, stride=2, padding=1),
            nn.ReLU(inplace=True),
            nn.Conv2d(width, 2 * width, kernel_size=3, stride=2, padding=1),
            nn.ReLU(inplace=True),
            nn.Conv2d(2 * width, 4 * width, kernel_size=3, stride=2, padding=1),
            nn.ReLU(inplace=True),
        )
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.drop = nn.Dropout(dropout)
        self.fc = nn.Linear(4 * width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool(self.features(x))
        x = torch.flatten(x, 1)
        return self.fc(self.drop(x))


def build_model(channels: int = 3, width: int = 32, classes: int = 10, dropout: float = 0.1, **_: object) -> nn.Module:
    return StridedCNN(channels, width, classes, dropout)


def example_inputs(batch_size: int, channels: int = 3, image_size: int = 32, **_: object):
    return (torch.randn(batch_size, channels, image_size, image_size),)


def example_targets(batch_size: int, classes: int = 10, **_: object):
    return (torch.randint(0, classes, (batch_size,)),)


def loss_fn(output, data):
    (labels,) = data
    return F.cross_entropy(output, labels)
