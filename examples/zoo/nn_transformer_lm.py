"""A small causal transformer language model built from nn.TransformerEncoder.

Tokens [B, T] -> token embedding + learned position embedding -> dropout -> 2-layer
nn.TransformerEncoder (batch_first=True, pre-LN, causal mask from
nn.Transformer.generate_square_subsequent_mask) -> LayerNorm -> output head whose weight is tied
to the token embedding (``self.head.weight = self.embed.weight``), logits [B, T, vocab].

Loss: next-token cross entropy from the inputs (shifted in ``loss_fn``); no ``example_targets``.
"""

import torch
import torch.nn.functional as F
from torch import nn


class TransformerLM(nn.Module):
    def __init__(self, vocab: int, hidden: int, heads: int, layers: int, seq: int, dropout: float) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.pos = nn.Embedding(seq, hidden)
        self.drop = nn.Dropout(dropout)
        layer = nn.TransformerEncoderLayer(
            d_model=hidden,
            nhead=heads,
            dim_feedforward=4 * hidden,
            dropout=dropout,
            activation="gelu",
            batch_first=True,
            norm_first=True,
        )
        self.encoder = nn.TransformerEncoder(layer, num_layers=layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, vocab, bias=False)
        self.head.weight = self.embed.weight  # tied input/output embeddings
        nn.init.normal_(self.embed.weight, std=0.02)
        nn.init.normal_(self.pos.weight, std=0.02)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        T = tokens.size(1)
        positions = torch.arange(T, device=tokens.device)
        x = self.drop(self.embed(tokens) + self.pos(positions))
        mask = nn.Transformer.generate_square_subsequent_mask(T, device=tokens.device)
        x = self.encoder(x, mask=mask, is_causal=True)
        return self.head(self.norm(x))


def build_model(
    vocab: int = 128,
    hidden: int = 32,
    heads: int = 4,
    layers: int = 2,
    seq: int = 16,
    dropout: float = 0.1,
    **_: object,
) -> nn.Module:
    return TransformerLM(vocab, hidden, heads, layers, seq, dropout)


def example_inputs(batch_size: int, vocab: int = 128, seq: int = 16, **_: object):
    return (torch.randint(0, vocab, (batch_size, seq)),)


def loss_fn(output, data):
    (tokens,) = data
    logits = output[:, :-1]
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), tokens[:, 1:].reshape(-1))
