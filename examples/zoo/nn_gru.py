"""A bidirectional GRU sequence classifier.

Tokens [B, T] -> nn.Embedding -> 2-layer bidirectional nn.GRU(batch_first=True) -> the output at the
last time step [B, 2 * hidden] -> dropout -> nn.Linear to the classes, logits [B, classes].

Loss: cross entropy against integer labels [B] from ``example_targets``.
"""

import torch
import torch.nn.functional as F
from torch import nn


class GRUClassifier(nn.Module):
    def __init__(self, vocab: int, hidden: int, layers: int, classes: int, dropout: float) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.gru = nn.GRU(hidden, hidden, num_layers=layers, batch_first=True, bidirectional=True, dropout=dropout)
        self.drop = nn.Dropout(dropout)
        self.fc = nn.Linear(2 * hidden, classes)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        out, _ = self.gru(self.embed(tokens))
        last = out[:, -1, :]
        return self.fc(self.drop(last))


def build_model(
    vocab: int = 128, hidden: int = 32, layers: int = 2, classes: int = 10, dropout: float = 0.1, **_: object
) -> nn.Module:
    return GRUClassifier(vocab, hidden, layers, classes, dropout)


def example_inputs(batch_size: int, vocab: int = 128, seq: int = 16, **_: object):
    return (torch.randint(0, vocab, (batch_size, seq)),)


def example_targets(batch_size: int, classes: int = 10, **_: object):
    return (torch.randint(0, classes, (batch_size,)),)


def loss_fn(output, data):
    (labels,) = data
    return F.cross_entropy(output, labels)
