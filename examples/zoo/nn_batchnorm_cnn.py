"""A VGG-style convnet with nn.BatchNorm2d after every convolution.

Images [B, 3, 32, 32] -> three stages of [conv3x3 (no bias) -> BatchNorm2d -> ReLU] x 2 followed by
2x2 max pooling (32 -> 64 -> 128 ch, 32x32 -> 4x4) -> adaptive average pool -> dropout -> linear,
logits [B, classes]. The model trains in training mode, so BatchNorm normalizes with batch
statistics and updates its running_mean / running_var buffers.

Loss: cross entropy against integer labels [B] from ``example_targets``.
"""

import torch
import torch.nn.functional as F
from torch import nn


def conv_bn_relu(in_ch: int, out_ch: int) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(in_ch, out_ch, kernel_size=3, padding=1, bias=False),
        nn.BatchNorm2d(out_ch),
        nn.ReLU(inplace=True),
    )


class BatchNormCNN(nn.Module):
    def __init__(self, channels: int, width: int, classes: int, dropout: float) -> None:
        super().__init__()
        self.features = nn.Sequential(
            conv_bn_relu(channels, width),
            conv_bn_relu(width, width),
            nn.MaxPool2d(2),
            conv_bn_relu(width, 2 * width),
            conv_bn_relu(2 * width, 2 * width),
            nn.MaxPool2d(2),
            conv_bn_relu(2 * width, 4 * width),
            conv_bn_relu(4 * width, 4 * width),
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


def build_model(channels: int = 3, width: int = 32, classes: int = 10, dropout: float = 0.1, **_: object) -> nn.Module:
    model = BatchNormCNN(channels, width, classes, dropout)
    model.train()
    return model


def example_inputs(batch_size: int, channels: int = 3, image_size: int = 32, **_: object):
    return (torch.randn(batch_size, channels, image_size, image_size),)


def example_targets(batch_size: int, classes: int = 10, **_: object):
    return (torch.randint(0, classes, (batch_size,)),)


def loss_fn(output, data):
    (labels,) = data
    return F.cross_entropy(output, labels)
