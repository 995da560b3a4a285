"""Llama (``LlamaForCausalLM``), tiny and randomly initialized from a ``LlamaConfig``.

A decoder-only causal LM: inputs ``(input_ids,)`` int64 [batch, seq]; the model returns logits
[batch, seq, vocab]; the loss is next-token cross entropy computed from the inputs. RMSNorm, rotary
embeddings, SwiGLU MLP, grouped-query attention (``kv_heads`` key/value heads); untied ``lm_head``
(the Llama default). ``intermediate`` sets the MLP width (default ``3·hidden``); Llama-3.1-405B's
shape is ``layers=126 hidden=16384 heads=128 kv_heads=8 intermediate=53248 vocab=128256 seq=8192``.
"""

from __future__ import annotations

from _hf_zoo import next_token_loss, random_tokens, tiny_causal_lm
from torch import Tensor, nn


def build_model(
    *,
    layers: int = 2,
    hidden: int = 64,
    heads: int = 4,
    kv_heads: int = 2,
    seq: int = 16,
    vocab: int = 256,
    intermediate: int | None = None,
    **_: object,
) -> nn.Module:
    return tiny_causal_lm(
        "Llama",
        layers=layers,
        hidden=hidden,
        heads=heads,
        seq=seq,
        vocab=vocab,
        num_key_value_heads=kv_heads,
        intermediate_size=3 * hidden if intermediate is None else intermediate,
    )


def example_inputs(batch_size: int, *, seq: int = 16, vocab: int = 256, **_: object) -> tuple[Tensor, ...]:
    return (random_tokens(batch_size, seq, vocab),)


def loss_fn(output: Tensor, inputs: tuple[Tensor, ...]) -> Tensor:
    """Next-token cross entropy."""
    return next_token_loss(output, inputs[0])
