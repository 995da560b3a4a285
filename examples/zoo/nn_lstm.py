"""A 2-layer LSTM language model.

Tokens [B, T] -> nn.Embedding -> 2-layer nn.LSTM(batch_first=True) -> dropout -> nn.Linear to the
vocabulary, logits [B, T, vocab].

Loss: next-token cross entropy computed from the inputs themselves (logits at step t predict the
token at step t + 1), so there is no ``example_targets``.
"""

import torch
import torch.nn.functional as F
from torch import nn


class LSTMLanguageModel(nn.Module):
    def __init__(self, vocab: int, hidden: int, layers: int, dropout: float) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.lstm = nn.LSTM(hidden, hidden, num_layers=layers, batch_first=True, dropout=dropout)
        self.drop = nn.Dropout(dropout)
        self.head = nn.Linear(hidden, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.drop(self.embed(tokens))
        out, _ = self.lstm(x)
        return self.head(self.drop(out))


def build_model(vocab: int = 128, hidden: int = 32, layers: int = 2, dropout: float = 0.1, **_: object) -> nn.Module:
    return LSTMLanguageModel(vocab, hidden, layers, dropout)


def example_inputs(batch_size: int, vocab: int = 128, seq: int = 16, **_: object):
    return (torch.randint(0, vocab, (batch_size, seq)),)


def loss_fn(output, data):
    (tokens,) = data
    logits = output[:, :-1]
    labels = tokens[:, 1:]
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), labels.reshape(-1))
