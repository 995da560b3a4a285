"""A 1-D convolutional audio classifier (keyword spotting style) over log-mel features.

Input: log-mel spectrograms [B, mels, T] (mels=16 channels, T=128 frames). Four blocks of
conv1d -> norm -> ReLU (the 2nd to 4th with stride 2, 128 -> 16 frames, 32 -> 64 channels), then
mean pooling over time -> dropout -> linear, logits [B, classes].

``norm="batch"`` (default) uses nn.BatchNorm1d (training mode, running stats); ``norm="layer"``
uses nn.LayerNorm over the channels (transposed to [B, T, C] and back).

Loss: cross entropy against integer labels [B] from ``example_targets``.
"""

import torch
import torch.nn.functional as F
from torch import nn


class ChannelLayerNorm(nn.Module):
    """LayerNorm over the channels of a [B, C, T] tensor."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x.transpose(1, 2)).transpose(1, 2)


def conv_block(in_ch: int, out_ch: int, kernel_size: int, stride: int, norm: str) -> nn.Sequential:
    norm_layer = nn.BatchNorm1d(out_ch) if norm == "batch" else ChannelLayerNorm(out_ch)
    return nn.Sequential(
        nn.Conv1d(in_ch, out_ch, kernel_size, stride=stride, padding=kernel_size // 2, bias=False),
        norm_layer,
        nn.ReLU(),
    )


class AudioCNN(nn.Module):
    def __init__(self, mels: int, width: int, classes: int, norm: str, dropout: float) -> None:
        super().__init__()
        if norm not in ("batch", "layer"):
            raise ValueError(f"norm must be 'batch' or 'layer', got {norm!r}")
        self.blocks = nn.Sequential(
            conv_block(mels, width, kernel_size=5, stride=1, norm=norm),
            conv_block(width, width, kernel_size=3, stride=2, norm=norm),
            conv_block(width, 2 * width, kernel_size=3, stride=2, norm=norm),
            conv_block(2 * width, 2 * width, kernel_size=3, stride=2, norm=norm),
        )
        self.drop = nn.Dropout(dropout)
        self.fc = nn.Linear(2 * width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.blocks(x)  # [B, C, T']
        x = x.mean(dim=-1)
        return self.fc(self.drop(x))


def build_model(
    mels: int = 16, width: int = 32, classes: int = 12, norm: str = "batch", dropout: float = 0.1, **_: object
) -> nn.Module:
    return AudioCNN(mels, width, classes, norm, dropout)


def example_inputs(batch_size: int, mels: int = 16, frames: int = 128, **_: object):
    return (torch.randn(batch_size, mels, frames),)


def example_targets(batch_size: int, classes: int = 12, **_: object):
    return (torch.randint(0, classes, (batch_size,)),)


def loss_fn(output, data):
    (labels,) = data
    return F.cross_entropy(output, labels)
