"""RoBERTa (``RobertaForSequenceClassification``), tiny and randomly initialized from a ``RobertaConfig``.

A text encoder with a sequence-classification head (a dense + tanh head on the first token): inputs
``(input_ids,)`` int64 [batch, seq] (no padding, so no attention mask); the model returns logits
[batch, labels]; the loss is cross entropy against the class labels [batch] from
``example_targets``. BERT-style blocks; positions start after ``pad_token_id`` (1), so there are
``seq + 2`` of them.
"""

from __future__ import annotations

from _hf_zoo import ClassifierLogits, classification_loss, random_labels, random_tokens, transformers_module
from torch import Tensor, nn


def build_model(
    *, layers: int = 2, hidden: int = 64, heads: int = 4, seq: int = 16, vocab: int = 256, labels: int = 4, **_: object
) -> nn.Module:
    transformers = transformers_module()
    config = transformers.RobertaConfig(
        num_hidden_layers=layers,
        hidden_size=hidden,
        num_attention_heads=heads,
        intermediate_size=4 * hidden,
        max_position_embeddings=seq + 2,
        vocab_size=vocab,
        num_labels=labels,
        attn_implementation="sdpa",
    )
    return ClassifierLogits(transformers.RobertaForSequenceClassification(config))


def example_inputs(batch_size: int, *, seq: int = 16, vocab: int = 256, **_: object) -> tuple[Tensor, ...]:
    return (random_tokens(batch_size, seq, vocab),)


def example_targets(batch_size: int, *, labels: int = 4, **_: object) -> tuple[Tensor, ...]:
    return (random_labels(batch_size, labels),)


def loss_fn(output: Tensor, targets: tuple[Tensor, ...]) -> Tensor:
    """Cross entropy against the class labels."""
    return classification_loss(output, targets[0])
