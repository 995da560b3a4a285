"""Qwen3-MoE (``Qwen3MoeForCausalLM``), tiny and randomly initialized from a ``Qwen3MoeConfig``.

A decoder-only mixture-of-experts causal LM: inputs ``(input_ids,)`` int64 [batch, seq]; the model
returns logits [batch, seq, vocab]; the loss is next-token cross entropy computed from the inputs
(no router auxiliary loss: ``output_router_logits`` stays off). Qwen3 attention (q/k RMSNorm,
grouped-query attention with ``kv_heads`` key/value heads); every layer's MLP is a sparse MoE of
``experts`` SwiGLU experts, ``top_k`` per token.
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
    experts: int = 4,
    top_k: int = 2,
    seq: int = 16,
    vocab: int = 256,
    **_: object,
) -> nn.Module:
    return tiny_causal_lm(
        "Qwen3Moe",
        layers=layers,
        hidden=hidden,
        heads=heads,
        seq=seq,
        vocab=vocab,
        num_key_value_heads=kv_heads,
        head_dim=hidden // heads,
        intermediate_size=2 * hidden,
        moe_intermediate_size=2 * hidden,
        num_experts=experts,
        num_experts_per_tok=top_k,
    )


def example_inputs(batch_size: int, *, seq: int = 16, vocab: int = 256, **_: object) -> tuple[Tensor, ...]:
    return (random_tokens(batch_size, seq, vocab),)


def loss_fn(output: Tensor, inputs: tuple[Tensor, ...]) -> Tensor:
    """Next-token cross entropy."""
    return next_token_loss(output, inputs[0])
