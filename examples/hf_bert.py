"""BERT from Hugging Face ``transformers`` (``BertForMaskedLM``), built from a config.

Needs the optional dependency: ``pip install -e ".[hf]"``. No weights are downloaded: the
model is built from a ``BertConfig`` with random initialization (``HF_HUB_OFFLINE=1`` is set
unless already set), so it also builds on the meta device. Dropout stays on (training mode).

Keyword arguments (``build_model``; ``seq`` and ``vocab`` also for ``example_inputs``):

- ``layers`` (2), ``hidden`` (64), ``heads`` (4): ``num_hidden_layers``, ``hidden_size``,
  ``num_attention_heads``; the feed-forward width is ``4 * hidden``.
- ``seq`` (32): sequence length, also ``max_position_embeddings``.
- ``vocab`` (512): vocabulary size.
- ``attn`` (``"sdpa"``): ``attn_implementation``, ``"sdpa"`` or ``"eager"``.

The defaults make a tiny model; ``layers=12 hidden=768 heads=12 seq=512 vocab=30522`` is
BERT-base. Inputs are ``input_ids`` and an all-ones ``attention_mask``. The MLM decoder ties
its weight to the word embeddings: the graph names that parameter once, as
``named_parameters()`` does (``model.bert.embeddings.word_embeddings.weight``).
"""

from __future__ import annotations

import os
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import Tensor, nn


def _transformers() -> ModuleType:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        import transformers
    except ImportError as error:
        raise ImportError(
            'examples/hf_bert.py needs Hugging Face transformers: install autoplan[hf] (pip install -e ".[hf]")'
        ) from error
    return transformers


class LogitsOnly(nn.Module):
    """Wraps an HF masked LM so that ``forward(input_ids, attention_mask)`` returns the logits only."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        return self.model(input_ids=input_ids, attention_mask=attention_mask, return_dict=True).logits


def build_model(
    *,
    layers: int = 2,
    hidden: int = 64,
    heads: int = 4,
    seq: int = 32,
    vocab: int = 512,
    attn: str = "sdpa",
    **_: object,
) -> nn.Module:
    """A randomly initialized HF BERT masked LM returning logits [batch, seq, vocab]."""
    transformers = _transformers()
    config = transformers.BertConfig(
        num_hidden_layers=int(layers),
        hidden_size=int(hidden),
        num_attention_heads=int(heads),
        intermediate_size=4 * int(hidden),
        max_position_embeddings=int(seq),
        vocab_size=int(vocab),
        attn_implementation=str(attn),
    )
    model = transformers.BertForMaskedLM(config)
    model.tie_weights()  # transformers 5.0 leaves them untied when built on the meta device
    return LogitsOnly(model)


def example_inputs(batch_size: int, *, seq: int = 32, vocab: int = 512, **_: object) -> tuple[Tensor, ...]:
    """One training step's inputs: ``(input_ids, attention_mask)``, both [batch_size, seq]."""
    input_ids = torch.randint(0, int(vocab), (batch_size, int(seq)))
    attention_mask = torch.ones(batch_size, int(seq), dtype=torch.long)
    return input_ids, attention_mask


def loss_fn(output: Tensor, inputs: tuple[Tensor, ...]) -> Tensor:
    """Masked-LM cross entropy against the input tokens (every position is a target)."""
    vocab = output.shape[-1]
    return F.cross_entropy(output.reshape(-1, vocab), inputs[0].reshape(-1))
