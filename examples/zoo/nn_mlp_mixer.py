"""A tiny MLP-Mixer image classifier.

Images [B, 3, 16, 16] -> non-overlapping 4x4 patches embedded by a stride-4 conv (16 patches of
hidden=32) -> 2 Mixer layers, each a token-mixing MLP across the patches (on the transposed
[B, hidden, patches] tensor) and a channel-mixing MLP, both pre-LayerNorm with residuals and
dropout -> LayerNorm -> mean over patches -> linear, logits [B, classes].

Loss: cross entropy against integer labels [B] from ``example_targets``.
"""

import torch
import torch.nn.functional as F
from torch import nn


class MLP(nn.Module):
    def __init__(self, dim: int, hidden: int, dropout: float) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.fc2(self.drop(F.gelu(self.fc1(x)))))


class MixerBlock(nn.Module):
    def __init__(self, patches: int, hidden: int, dropout: float) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(hidden)
        self.token_mlp = MLP(patches, 2 * patches, dropout)
        self.norm2 = nn.LayerNorm(hidden)
        self.channel_mlp = MLP(hidden, 4 * hidden, dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [B, patches, hidden]
        y = self.norm1(x).transpose(1, 2)  # [B, hidden, patches]
        x = x + self.token_mlp(y).transpose(1, 2)
        x = x + self.channel_mlp(self.norm2(x))
        return x


class MLPMixer(nn.Module):
    def __init__(
        self, channels: int, image_size: int, patch: int, hidden: int, layers: int, classes: int, dropout: float
    ) -> None:
        super().__init__()
        patches = (image_size // patch) ** 2
        self.patch_embed = nn.Conv2d(channels, hidden, kernel_size=patch, stride=patch)
        self.blocks = nn.Sequential(*[MixerBlock(patches, hidden, dropout) for _ in range(layers)])
        self.norm = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = self.patch_embed(images)  # [B, hidden, H/p, W/p]
        x = x.flatten(2).transpose(1, 2)  # [B, patches, hidden]
        x = self.blocks(x)
        x = self.norm(x).mean(dim=1)
        return self.head(x)


def build_model(
    channels: int = 3,
    image_size: int = 16,
    patch: int = 4,
    hidden: int = 32,
    layers: int = 2,
    classes: int = 10,
    dropout: float = 0.1,
    **_: object,
) -> nn.Module:
    return MLPMixer(channels, image_size, patch, hidden, layers, classes, dropout)


def example_inputs(batch_size: int, channels: int = 3, image_size: int = 16, **_: object):
    return (torch.randn(batch_size, channels, image_size, image_size),)


def example_targets(batch_size: int, classes: int = 10, **_: object):
    return (torch.randint(0, classes, (batch_size,)),)


def loss_fn(output, data):
    (labels,) = data
    return F.cross_entropy(output, labels)
