"""DeiT (``DeiTForImageClassification``), tiny and randomly initialized from a ``DeiTConfig``.

An image classifier: inputs ``(pixel_values,)`` float32 [batch, 3, image, image]; the model returns
logits [batch, labels]; the loss is cross entropy against the class labels [batch] from
``example_targets``. A ViT: 4x4 patches (64 tokens at 32x32) plus [CLS] and distillation tokens,
pre-norm blocks; the head reads the [CLS] token. (The distilled ``...WithTeacher`` variant is
inference only.)
"""

from __future__ import annotations

from _hf_zoo import ImageClassifierLogits, classification_loss, random_images, random_labels, transformers_module
from torch import Tensor, nn


def build_model(
    *, layers: int = 2, hidden: int = 64, heads: int = 4, image: int = 32, labels: int = 10, **_: object
) -> nn.Module:
    transformers = transformers_module()
    config = transformers.DeiTConfig(
        image_size=image,
        patch_size=4,
        num_hidden_layers=layers,
        hidden_size=hidden,
        num_attention_heads=heads,
        intermediate_size=4 * hidden,
        num_labels=labels,
        attn_implementation="sdpa",
    )
    return ImageClassifierLogits(transformers.DeiTForImageClassification(config))


def example_inputs(batch_size: int, *, image: int = 32, **_: object) -> tuple[Tensor, ...]:
    return (random_images(batch_size, image),)


def example_targets(batch_size: int, *, labels: int = 10, **_: object) -> tuple[Tensor, ...]:
    return (random_labels(batch_size, labels),)


def loss_fn(output: Tensor, targets: tuple[Tensor, ...]) -> Tensor:
    """Cross entropy against the class labels."""
    return classification_loss(output, targets[0])
