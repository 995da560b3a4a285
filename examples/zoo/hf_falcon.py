"""Falcon (``FalconForCausalLM``), tiny and randomly initialized from a ``FalconConfig``.

A decoder-only causal LM: inputs ``(input_ids,)`` int64 [batch, seq]; the model returns logits
[batch, seq, vocab]; the loss is next-token cross entropy computed from the inputs. Parallel attention and
MLP in each block, multi-query attention (one key/value head), rotary embeddings, ``lm_head`` tied to the
token embeddings (the Falcon default). Its attention scales by a constant tensor that ``torch.export`` lifts
out of the module (``lifted_tensor_0``): the graph holds it as a constant, which every rank must get.
"""

from __future__ import annotations

from _hf_zoo import next_token_loss, random_tokens, tiny_causal_lm
from torch import Tensor, nn


def build_model(
    *, layers: int = 2, hidden: int = 64, heads: int = 4, seq: int = 16, vocab: int = 256, **_: object
) -> nn.Module:
    return tiny_causal_lm("Falcon", layers=layers, hidden=hidden, heads=heads, seq=seq, vocab=vocab)


def example_inputs(batch_size: int, *, seq: int = 16, vocab: int = 256, **_: object) -> tuple[Tensor, ...]:
    return (random_tokens(batch_size, seq, vocab),)


def loss_fn(output: Tensor, inputs: tuple[Tensor, ...]) -> Tensor:
    """Next-token cross entropy."""
    return next_token_loss(output, inputs[0])
