"""A transformer-style classifier built directly from nn.MultiheadAttention.

Input: a sequence of feature vectors [B, T, features] (e.g. frames or patches). A linear projection
to the hidden size plus learned positions, then 2 post-LN blocks of
``x = norm1(x + dropout(self_attn(x, x, x)))`` and ``x = norm2(x + dropout(mlp(x)))`` with
nn.MultiheadAttention(batch_first=True), mean pooling over time, and a linear classifier,
logits [B, classes].

Loss: cross entropy against integer labels [B] from ``example_targets``.
"""

import torch
import torch.nn.functional as F
from torch import nn


class AttentionBlock(nn.Module):
    def __init__(self, hidden: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(hidden, heads, dropout=dropout, batch_first=True)
        self.norm1 = nn.LayerNorm(hidden)
        self.mlp = nn.Sequential(
            nn.Linear(hidden, 4 * hidden),
            nn.GELU(),
            nn.Dropout(dropout),
            nn.Linear(4 * hidden, hidden),
        )
        self.norm2 = nn.LayerNorm(hidden)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        attn_out, _ = self.attn(x, x, x, need_weights=False)
        x = self.norm1(x + self.drop(attn_out))
        x = self.norm2(x + self.drop(self.mlp(x)))
        return x


class MHAClassifier(nn.Module):
    def __init__(
        self, features: int, hidden: int, heads: int, layers: int, seq: int, classes: int, dropout: float
    ) -> None:
        super().__init__()
        self.proj = nn.Linear(features, hidden)
        self.pos = nn.Parameter(torch.zeros(1, seq, hidden))
        self.blocks = nn.ModuleList([AttentionBlock(hidden, heads, dropout) for _ in range(layers)])
        self.classifier = nn.Linear(hidden, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.proj(x) + self.pos[:, : x.size(1)]
        for block in self.blocks:
            x = block(x)
        return self.classifier(x.mean(dim=1))


def build_model(
    features: int = 16,
    hidden: int = 32,
    heads: int = 4,
    layers: int = 2,
    seq: int = 16,
    classes: int = 10,
    dropout: float = 0.1,
    **_: object,
) -> nn.Module:
    return MHAClassifier(features, hidden, heads, layers, seq, classes, dropout)


def example_inputs(batch_size: int, features: int = 16, seq: int = 16, **_: object):
    return (torch.randn(batch_size, seq, features),)


def example_targets(batch_size: int, classes: int = 10, **_: object):
    return (torch.randint(0, classes, (batch_size,)),)


def loss_fn(output, data):
    (labels,) = data
    return F.cross_entropy(output, labels)
