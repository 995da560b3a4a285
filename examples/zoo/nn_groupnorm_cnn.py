"""A VGG-style convnet with nn.GroupNorm after every convolution.

The same shape as nn_batchnorm_cnn.py, with nn.GroupNorm(8 groups) in place of BatchNorm2d, so the
normalization is per sample and there are no running-statistics buffers:
images [B, 3, 32, 32] -> three stages of [conv3x3 (no bias) -> GroupNorm -> ReLU] x 2 followed by
2x2 max pooling (32 -> 64 -> 128 ch, 32x32 -> 4x4) -> adaptive average pool -> dropout -> linear,
logits [B, classes].

Loss: cross entropy against integer labels [B] from ``example_targets``.
"""

import torch
import torch.nn.functional as F
from torch import nn


def conv_gn_relu(in_ch: int, out_ch: int, groups: int) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(in_ch, out_ch, kernel_size=3, padding=1, bias=False),
        nn.GroupNorm(groups, out_ch),
        nn.ReLU(inplace=True),
    )


class GroupNormCNN(nn.Module):
    def __init__(self, channels: int, width: int, groups: int, classes: int, dropout: float) -> None:
        super().__init__()
        self.features = nn.Sequential(
            conv_gn_relu(channels, width, groups),
            conv_gn_relu(width, width, groups),
            nn.MaxPool2d(2),
            conv_gn_relu(width, 2 * width, groups),
            conv_gn_relu(2 * width, 2 * width, groups),
            nn.MaxPool2d(2),
            conv_gn_relu(2 * width, 4 * width, groups),
            conv_gn_relu(4 * width, 4 * width, groups),
            nn.MaxPool2d(2),
        )
        self.classifier = nn.Sequential(
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
            nn.Dropout(dropout),
            nn.Linear(4 * width, classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))


def build_model(
    channels: int = 3, width: int = 32, groups: int = 8, classes: int = 10, dropout: float = 0.1, **_: object
) -> nn.Module:
    return GroupNormCNN(channels, width, groups, classes, dropout)


def example_inputs(batch_size: int, channels: int = 3, image_size: int = 32, **_: object):
    return (torch.randn(batch_size, channels, image_size, image_size),)


def example_targets(batch_size: int, classes: int = 10, **_: object):
    return (torch.randint(0, classes, (batch_size,)),)


def loss_fn(output, data):
    (labels,) = data
    return F.cross_entropy(output, labels)
