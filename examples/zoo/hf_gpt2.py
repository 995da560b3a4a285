"""GPT-2 (``GPT2LMHeadModel``), tiny and randomly initialized from a ``GPT2Config``.

A decoder-only causal LM: inputs ``(input_ids,)`` int64 [batch, seq]; the model returns logits
[batch, seq, vocab]; the loss is next-token cross entropy computed from the inputs. ``lm_head`` is
tied to the token embeddings (the HF default). ``attention="eager"`` runs HF's unfused attention (``Q·Kᵀ``,
mask, softmax, dropout, ``·V`` as separate operators) instead of SDPA.
"""

from __future__ import annotations

from _hf_zoo import CausalLMLogits, next_token_loss, random_tokens, transformers_module
from torch import Tensor, nn


def build_model(
    *,
    layers: int = 2,
    hidden: int = 64,
    heads: int = 4,
    seq: int = 16,
    vocab: int = 256,
    attention: str = "sdpa",
    **_: object,
) -> nn.Module:
    transformers = transformers_module()
    config = transformers.GPT2Config(
        n_layer=layers,
        n_embd=hidden,
        n_head=heads,
        n_inner=4 * hidden,
        n_positions=seq,
        vocab_size=vocab,
        bos_token_id=vocab - 1,
        eos_token_id=vocab - 1,
        use_cache=False,
        attn_implementation=attention,
    )
    return CausalLMLogits(transformers.GPT2LMHeadModel(config))


def example_inputs(batch_size: int, *, seq: int = 16, vocab: int = 256, **_: object) -> tuple[Tensor, ...]:
    return (random_tokens(batch_size, seq, vocab),)


def loss_fn(output: Tensor, inputs: tuple[Tensor, ...]) -> Tensor:
    """Next-token cross entropy."""
    return next_token_loss(output, inputs[0])
