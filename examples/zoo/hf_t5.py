"""T5 (``T5ForConditionalGeneration``), tiny and randomly initialized from a ``T5Config``.

An encoder-decoder LM: inputs ``(input_ids, decoder_input_ids)``, int64 [batch, seq] and [batch,
target_seq]; the model returns logits [batch, target_seq, vocab]; the loss is per-token cross
entropy against ``labels`` [batch, target_seq] from ``example_targets``. (In real training
``decoder_input_ids`` are the labels shifted right; here both are random tokens.) RMSNorm, relative
position buckets, ReLU MLP; ``lm_head`` is tied to the shared embeddings (the T5 default).
"""

from __future__ import annotations

from _hf_zoo import Seq2SeqLogits, random_tokens, token_loss, transformers_module
from torch import Tensor, nn


def build_model(*, layers: int = 2, hidden: int = 64, heads: int = 4, vocab: int = 256, **_: object) -> nn.Module:
    transformers = transformers_module()
    config = transformers.T5Config(
        num_layers=layers,
        num_decoder_layers=layers,
        d_model=hidden,
        num_heads=heads,
        d_kv=hidden // heads,
        d_ff=4 * hidden,
        vocab_size=vocab,
        pad_token_id=0,
        eos_token_id=1,
        decoder_start_token_id=0,
        use_cache=False,
        attn_implementation="sdpa",
    )
    return Seq2SeqLogits(transformers.T5ForConditionalGeneration(config), input_name="input_ids")


def example_inputs(
    batch_size: int, *, seq: int = 16, target_seq: int = 16, vocab: int = 256, **_: object
) -> tuple[Tensor, ...]:
    return random_tokens(batch_size, seq, vocab), random_tokens(batch_size, target_seq, vocab)


def example_targets(batch_size: int, *, target_seq: int = 16, vocab: int = 256, **_: object) -> tuple[Tensor, ...]:
    return (random_tokens(batch_size, target_seq, vocab),)


def loss_fn(output: Tensor, targets: tuple[Tensor, ...]) -> Tensor:
    """Per-token cross entropy against the labels."""
    return token_loss(output, targets[0])
