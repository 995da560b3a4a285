"""GPT-2 as users write it: ``GPT2LMHeadModel(config)`` itself is the model, no wrapper.

``lm_head`` is tied to the token embeddings as transformers ties them; ``forward(input_ids)`` returns the
library's ``CausalLMOutputWithCrossAttentions`` (a ``ModelOutput``, a dict), and the loss reads
``output["logits"]`` — so the ranks must hand the loss the output's own structure, not a flat tuple.
Inputs ``(input_ids,)`` int64 [batch, seq]; targets ``(labels,)`` (the next tokens) [batch, seq].
"""

from __future__ import annotations

import torch.nn.functional as F
from _hf_zoo import random_tokens, transformers_module
from torch import Tensor, nn


def build_model(
    *, layers: int = 2, hidden: int = 64, heads: int = 4, seq: int = 16, vocab: int = 256, **_: object
) -> nn.Module:
    transformers = transformers_module()
    config = transformers.GPT2Config(
        n_layer=layers, n_embd=hidden, n_head=heads, n_positions=seq, vocab_size=vocab, use_cache=False
    )
    config.bos_token_id = config.eos_token_id = vocab - 1
    return transformers.GPT2LMHeadModel(config)


def example_inputs(batch_size: int, *, seq: int = 16, vocab: int = 256, **_: object) -> tuple[Tensor, ...]:
    return (random_tokens(batch_size, seq, vocab),)


def example_targets(batch_size: int, *, seq: int = 16, vocab: int = 256, **_: object) -> tuple[Tensor, ...]:
    return (random_tokens(batch_size, seq, vocab),)


def loss_fn(output, targets: tuple[Tensor, ...]) -> Tensor:
    """Cross entropy of ``output["logits"]`` against the labels."""
    logits = output["logits"]
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets[0].reshape(-1))
