"""ConvNeXt (``ConvNextForImageClassification``), tiny and randomly initialized from a ``ConvNextConfig``.

An image classifier: inputs ``(pixel_values,)`` float32 [batch, 3, image, image]; the model returns
logits [batch, labels]; the loss is cross entropy against the class labels [batch] from
``example_targets``. A 4x4 patchify stem (8x8 at 32x32), then two stages of one block each (7x7
depthwise conv, LayerNorm, 4x inverted-bottleneck MLP, layer scale), downsampling to 4x4 and twice
the width (``hidden`` then ``2 * hidden``); mean-pooled head. No attention, so no
attn_implementation.
"""

from __future__ import annotations

from _hf_zoo import ImageClassifierLogits, classification_loss, random_images, random_labels, transformers_module
from torch import Tensor, nn


def build_model(*, hidden: int = 32, image: int = 32, labels: int = 10, **_: object) -> nn.Module:
    transformers = transformers_module()
    config = transformers.ConvNextConfig(
        image_size=image,
        patch_size=4,
        num_stages=2,
        hidden_sizes=[hidden, 2 * hidden],
        depths=[1, 1],
        num_labels=labels,
    )
    return ImageClassifierLogits(transformers.ConvNextForImageClassification(config))


def example_inputs(batch_size: int, *, image: int = 32, **_: object) -> tuple[Tensor, ...]:
    return (random_images(batch_size, image),)


def example_targets(batch_size: int, *, labels: int = 10, **_: object) -> tuple[Tensor, ...]:
    return (random_labels(batch_size, labels),)


def loss_fn(output: Tensor, targets: tuple[Tensor, ...]) -> Tensor:
    """Cross entropy against the class labels."""
    return classification_loss(output, targets[0])
