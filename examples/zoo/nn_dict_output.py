"""A small transformer-style classifier whose ``forward`` returns a dict, as research models often do.

Tokens [B, T] -> embedding -> two pre-norm MLP blocks -> mean over the sequence; ``forward`` returns
``{"logits": [B, classes], "features": [B, hidden]}``. The loss reads ``output["logits"]`` (cross entropy
against ``example_targets``' labels [B]) and adds a small penalty on ``output["features"]``, so both
entries carry gradient.
"""

import torch
import torch.nn.functional as F
from torch import nn


class Block(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.up = nn.Linear(hidden, 4 * hidden)
        self.down = nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class DictOutputClassifier(nn.Module):
    def __init__(self, vocab: int, hidden: int, layers: int, classes: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.blocks = nn.ModuleList(Block(hidden) for _ in range(layers))
        self.head = nn.Linear(hidden, classes)

    def forward(self, tokens: torch.Tensor) -> dict[str, torch.Tensor]:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        features = x.mean(dim=1)
        return {"logits": self.head(features), "features": features}


def build_model(vocab: int = 128, hidden: int = 32, layers: int = 2, classes: int = 10, **_: object) -> nn.Module:
    return DictOutputClassifier(vocab, hidden, layers, classes)


def example_inputs(batch_size: int, vocab: int = 128, seq: int = 16, **_: object):
    return (torch.randint(0, vocab, (batch_size, seq)),)


def example_targets(batch_size: int, classes: int = 10, **_: object):
    return (torch.randint(0, classes, (batch_size,)),)


def loss_fn(output, targets):
    (labels,) = targets
    return F.cross_entropy(output["logits"], labels) + 1e-3 * output["features"].pow(2).mean()
