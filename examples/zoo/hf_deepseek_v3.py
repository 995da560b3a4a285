"""DeepSeek-V3 (``DeepseekV3ForCausalLM``), tiny and randomly initialized from a ``DeepseekV3Config``.

A decoder-only mixture-of-experts causal LM: inputs ``(input_ids,)`` int64 [batch, seq]; the model
returns logits [batch, seq, vocab]; the loss is next-token cross entropy computed from the inputs
(no router auxiliary loss: ``output_router_logits`` stays off). Multi-head latent attention
(low-rank q and kv projections, a decoupled rotary part of each head); the first ``first_dense``
layers have a dense SwiGLU MLP, the rest a MoE of ``experts`` routed experts (``top_k`` per token,
group-limited routing over 2 groups) plus one shared expert.
"""

from __future__ import annotations

from _hf_zoo import CausalLMLogits, next_token_loss, random_tokens, transformers_module
from torch import Tensor, nn


def build_model(
    *,
    layers: int = 2,
    hidden: int = 64,
    heads: int = 4,
    first_dense: int = 1,
    experts: int = 4,
    top_k: int = 2,
    seq: int = 16,
    vocab: int = 256,
    **_: object,
) -> nn.Module:
    transformers = transformers_module()
    config = transformers.DeepseekV3Config(
        num_hidden_layers=layers,
        hidden_size=hidden,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        q_lora_rank=hidden // 2,
        kv_lora_rank=hidden // 4,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=hidden // heads,
        intermediate_size=4 * hidden,
        moe_intermediate_size=2 * hidden,
        first_k_dense_replace=first_dense,
        n_routed_experts=experts,
        n_shared_experts=1,
        num_experts_per_tok=top_k,
        n_group=2,
        topk_group=1,
        max_position_embeddings=seq,
        vocab_size=vocab,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        use_cache=False,
        attn_implementation="sdpa",
    )
    return CausalLMLogits(transformers.DeepseekV3ForCausalLM(config))


def example_inputs(batch_size: int, *, seq: int = 16, vocab: int = 256, **_: object) -> tuple[Tensor, ...]:
    return (random_tokens(batch_size, seq, vocab),)


def loss_fn(output: Tensor, inputs: tuple[Tensor, ...]) -> Tensor:
    """Next-token cross entropy."""
    return next_token_loss(output, inputs[0])
