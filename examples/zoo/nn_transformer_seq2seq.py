"""A small encoder-decoder transformer (nn.Transformer) for sequence-to-sequence.

Two inputs: source tokens [B, S] and decoder input tokens [B, T] (the target shifted right, as in
teacher forcing). Both go through a shared token embedding plus learned positions, then
nn.Transformer (2 encoder and 2 decoder layers, batch_first=True, causal mask on the decoder) and a
linear head to the target vocabulary, logits [B, T, vocab].

Loss: cross entropy of the logits against the target tokens [B, T] from ``example_targets``.
"""

import torch
import torch.nn.functional as F
from torch import nn


class Seq2SeqTransformer(nn.Module):
    def __init__(self, vocab: int, hidden: int, heads: int, layers: int, seq: int, dropout: float) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.pos = nn.Embedding(seq, hidden)
        self.drop = nn.Dropout(dropout)
        self.transformer = nn.Transformer(
            d_model=hidden,
            nhead=heads,
            num_encoder_layers=layers,
            num_decoder_layers=layers,
            dim_feedforward=4 * hidden,
            dropout=dropout,
            batch_first=True,
        )
        self.head = nn.Linear(hidden, vocab)

    def embed_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.size(1), device=tokens.device)
        return self.drop(self.embed(tokens) + self.pos(positions))

    def forward(self, src: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
        tgt_mask = nn.Transformer.generate_square_subsequent_mask(tgt.size(1), device=tgt.device)
        out = self.transformer(self.embed_tokens(src), self.embed_tokens(tgt), tgt_mask=tgt_mask, tgt_is_causal=True)
        return self.head(out)


def build_model(
    vocab: int = 128,
    hidden: int = 32,
    heads: int = 4,
    layers: int = 2,
    seq: int = 16,
    dropout: float = 0.1,
    **_: object,
) -> nn.Module:
    return Seq2SeqTransformer(vocab, hidden, heads, layers, seq, dropout)


def example_inputs(batch_size: int, vocab: int = 128, seq: int = 16, **_: object):
    src = torch.randint(0, vocab, (batch_size, seq))
    tgt_in = torch.randint(0, vocab, (batch_size, seq))
    return src, tgt_in


def example_targets(batch_size: int, vocab: int = 128, seq: int = 16, **_: object):
    return (torch.randint(0, vocab, (batch_size, seq)),)


def loss_fn(output, data):
    (tgt_out,) = data
    return F.cross_entropy(output.reshape(-1, output.size(-1)), tgt_out.reshape(-1))
