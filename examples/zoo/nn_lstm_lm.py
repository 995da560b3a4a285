"""A 2-layer LSTM language model trained against labels, as users write it.

Tokens [B, T] -> nn.Embedding -> 2-layer nn.LSTM(batch_first=True) -> nn.Linear to the vocabulary,
logits [B, T, vocab]. Unlike ``nn_lstm.py`` (next-token loss from the inputs, dropout) the labels come
from ``example_targets`` (the next tokens, [B, T]) and the LSTM's final states are returned by the
module and dropped by ``forward`` (their ``getitem`` nodes read nothing later).
"""

import torch
import torch.nn.functional as F
from torch import nn


class LSTMLanguageModel(nn.Module):
    def __init__(self, vocab: int, hidden: int, layers: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.lstm = nn.LSTM(hidden, hidden, num_layers=layers, batch_first=True)
        self.head = nn.Linear(hidden, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        out, _ = self.lstm(self.embed(tokens))
        return self.head(out)


def build_model(vocab: int = 256, hidden: int = 64, layers: int = 2, **_: object) -> nn.Module:
    return LSTMLanguageModel(vocab, hidden, layers)


def example_inputs(batch_size: int, vocab: int = 256, seq: int = 16, **_: object):
    return (torch.randint(0, vocab, (batch_size, seq)),)


def example_targets(batch_size: int, vocab: int = 256, seq: int = 16, **_: object):
    return (torch.randint(0, vocab, (batch_size, seq)),)


def loss_fn(output, targets):
    (labels,) = targets
    return F.cross_entropy(output.reshape(-1, output.size(-1)), labels.reshape(-1))
