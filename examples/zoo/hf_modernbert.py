"""ModernBERT (``ModernBertForSequenceClassification``), tiny and randomly initialized from a ``ModernBertConfig``.

A text encoder with a sequence-classification head (the [CLS] token through a dense + GELU + norm
head): inputs ``(input_ids,)`` int64 [batch, seq] (no padding, so no attention mask); the model
returns logits [batch, labels]; the loss is cross entropy against the class labels [batch] from
``example_targets``. Pre-norm blocks without biases, rotary embeddings, GeGLU MLP; layers alternate
global and local (sliding-window, ``local_attention`` tokens) attention. The special token ids are
moved inside the tiny vocabulary.
"""

from __future__ import annotations

from _hf_zoo import ClassifierLogits, classification_loss, random_labels, random_tokens, transformers_module
from torch import Tensor, nn


def build_model(
    *, layers: int = 2, hidden: int = 64, heads: int = 4, seq: int = 16, vocab: int = 256, labels: int = 4, **_: object
) -> nn.Module:
    transformers = transformers_module()
    config = transformers.ModernBertConfig(
        num_hidden_layers=layers,
        hidden_size=hidden,
        num_attention_heads=heads,
        intermediate_size=3 * hidden,
        max_position_embeddings=seq,
        local_attention=8,
        pad_token_id=0,
        bos_token_id=1,
        cls_token_id=1,
        eos_token_id=2,
        sep_token_id=2,
        vocab_size=vocab,
        num_labels=labels,
        attn_implementation="sdpa",
    )
    return ClassifierLogits(transformers.ModernBertForSequenceClassification(config))


def example_inputs(batch_size: int, *, seq: int = 16, vocab: int = 256, **_: object) -> tuple[Tensor, ...]:
    return (random_tokens(batch_size, seq, vocab),)


def example_targets(batch_size: int, *, labels: int = 4, **_: object) -> tuple[Tensor, ...]:
    return (random_labels(batch_size, labels),)


def loss_fn(output: Tensor, targets: tuple[Tensor, ...]) -> Tensor:
    """Cross entropy against the class labels."""
    return classification_loss(output, targets[0])
