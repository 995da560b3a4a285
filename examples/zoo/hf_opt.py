"""OPT (``OPTForCausalLM``), tiny and randomly initialized from a ``OPTConfig``.

A decoder-only causal LM: inputs ``(input_ids,)`` int64 [batch, seq]; the model returns logits
[batch, seq, vocab]; the loss is next-token cross entropy computed from the inputs. Learned
positions; ``lm_head`` is tied to the token embeddings (the HF default).
"""

from __future__ import annotations

from _hf_zoo import CausalLMLogits, next_token_loss, random_tokens, transformers_module
from torch import Tensor, nn


def build_model(
    *, layers: int = 2, hidden: int = 64, heads: int = 4, seq: int = 16, vocab: int = 256, **_: object
) -> nn.Module:
    transformers = transformers_module()
    config = transformers.OPTConfig(
        num_hidden_layers=layers,
        hidden_size=hidden,
        num_attention_heads=heads,
        ffn_dim=4 * hidden,
        word_embed_proj_dim=hidden,
        max_position_embeddings=seq,
        vocab_size=vocab,
        pad_token_id=0,
        bos_token_id=vocab - 1,
        eos_token_id=vocab - 1,
        use_cache=False,
        attn_implementation="sdpa",
    )
    return CausalLMLogits(transformers.OPTForCausalLM(config))


def example_inputs(batch_size: int, *, seq: int = 16, vocab: int = 256, **_: object) -> tuple[Tensor, ...]:
    return (random_tokens(batch_size, seq, vocab),)


def loss_fn(output: Tensor, inputs: tuple[Tensor, ...]) -> Tensor:
    """Next-token cross entropy."""
    return next_token_loss(output, inputs[0])
