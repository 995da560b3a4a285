"""A small U-Net: an encoder-decoder convnet with skip connections, as image-to-image models use.

images [B, C, S, S] -> ``depth`` down stages of [conv3x3 -> GroupNorm -> SiLU] x 2 then 2x2 max pooling
(channels doubling from ``width``) -> a bottleneck block -> ``depth`` up stages of [2x upsample by a
transposed 2x2 convolution -> concatenate the encoder's skip tensor along channels -> [conv3x3 -> GroupNorm ->
SiLU] x 2] -> a 1x1 convolution back to C channels: a denoised image [B, C, S, S].

Loss: mean squared error against a target image from ``example_targets`` (a denoising objective).
"""

import torch
import torch.nn.functional as F
from torch import nn


def double_conv(in_ch: int, out_ch: int, groups: int) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(in_ch, out_ch, kernel_size=3, padding=1, bias=False),
        nn.GroupNorm(groups, out_ch),
        nn.SiLU(),
        nn.Conv2d(out_ch, out_ch, kernel_size=3, padding=1, bias=False),
        nn.GroupNorm(groups, out_ch),
        nn.SiLU(),
    )


class UpStage(nn.Module):
    def __init__(self, in_ch: int, out_ch: int, groups: int) -> None:
        super().__init__()
        self.up = nn.ConvTranspose2d(in_ch, out_ch, kernel_size=2, stride=2)
        self.conv = double_conv(2 * out_ch, out_ch, groups)

    def forward(self, x: torch.Tensor, skip: torch.Tensor) -> torch.Tensor:
        return self.conv(torch.cat([self.up(x), skip], dim=1))


class UNet(nn.Module):
    def __init__(self, channels: int, width: int, depth: int, groups: int) -> None:
        super().__init__()
        widths = [width * 2**i for i in range(depth + 1)]
        self.down = nn.ModuleList(
            double_conv(channels if i == 0 else widths[i - 1], widths[i], groups) for i in range(depth)
        )
        self.bottleneck = double_conv(widths[depth - 1], widths[depth], groups)
        self.up = nn.ModuleList(UpStage(widths[i + 1], widths[i], groups) for i in reversed(range(depth)))
        self.head = nn.Conv2d(width, channels, kernel_size=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skips = []
        for stage in self.down:
            x = stage(x)
            skips.append(x)
            x = F.max_pool2d(x, 2)
        x = self.bottleneck(x)
        for stage, skip in zip(self.up, reversed(skips), strict=True):
            x = stage(x, skip)
        return self.head(x)


def build_model(channels: int = 3, width: int = 16, depth: int = 2, groups: int = 4, **_: object) -> nn.Module:
    return UNet(channels, width, depth, groups)


def example_inputs(batch_size: int, channels: int = 3, image_size: int = 32, **_: object):
    return (torch.randn(batch_size, channels, image_size, image_size),)


def example_targets(batch_size: int, channels: int = 3, image_size: int = 32, **_: object):
    return (torch.randn(batch_size, channels, image_size, image_size),)


def loss_fn(output, data):
    (target,) = data
    return F.mse_loss(output, target)
