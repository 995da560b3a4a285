"""Swin Transformer (``SwinForImageClassification``), tiny and randomly initialized from a ``SwinConfig``.

An image classifier: inputs ``(pixel_values,)`` float32 [batch, 3, image, image]; the model returns
logits [batch, labels]; the loss is cross entropy against the class labels [batch] from
``example_targets``. 4x4 patches (8x8 tokens at 32x32), then two stages of two blocks each: window
attention over 4x4 windows (the second block of stage 1 shifts them), patch merging to 4x4 tokens
and twice the width (``hidden`` then ``2 * hidden``); mean-pooled head. Two blocks per stage so that
shifted windows occur.
"""

from __future__ import annotations

from _hf_zoo import ImageClassifierLogits, classification_loss, random_images, random_labels, transformers_module
from torch import Tensor, nn


def build_model(*, hidden: int = 32, heads: int = 4, image: int = 32, labels: int = 10, **_: object) -> nn.Module:
    transformers = transformers_module()
    config = transformers.SwinConfig(
        image_size=image,
        patch_size=4,
        embed_dim=hidden,
        depths=[2, 2],
        num_heads=[heads, heads],
        window_size=4,
        mlp_ratio=4.0,
        num_labels=labels,
        attn_implementation="sdpa",
    )
    return ImageClassifierLogits(transformers.SwinForImageClassification(config))


def example_inputs(batch_size: int, *, image: int = 32, **_: object) -> tuple[Tensor, ...]:
    return (random_images(batch_size, image),)


def example_targets(batch_size: int, *, labels: int = 10, **_: object) -> tuple[Tensor, ...]:
    return (random_labels(batch_size, labels),)


def loss_fn(output: Tensor, targets: tuple[Tensor, ...]) -> Tensor:
    """Cross entropy against the class labels."""
    return classification_loss(output, targets[0])
