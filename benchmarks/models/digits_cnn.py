"""A small convnet on scikit-learn's handwritten digits (1,797 8×8 images, 10 classes): real data for the gradient
sync evidence (``benchmarks/compression_accuracy.py``; needs the ``evidence`` extra, scikit-learn).

The first :data:`TRAIN_SHARE` of the images (in the dataset's order) train, the rest test. A batch draws images at
random from the training part with a generator seeded from torch's current seed, so that ``example_inputs`` and
``example_targets`` (called one after the other under the same seed by the data feed) pick the same images.
"""

from __future__ import annotations

from functools import cache

import torch
import torch.nn.functional as F
from torch import Tensor, nn

TRAIN_SHARE = 0.8


@cache
def digits() -> tuple[Tensor, Tensor]:
    """(images [N, 1, 8, 8] scaled to [0, 1], labels [N]) of the whole dataset."""
    from sklearn.datasets import load_digits

    data = load_digits()
    images = torch.tensor(data.images, dtype=torch.float32, device="cpu").unsqueeze(1) / 16.0
    return images, torch.tensor(data.target, dtype=torch.long, device="cpu")


def split(part: str) -> tuple[Tensor, Tensor]:
    images, labels = digits()
    cut = int(TRAIN_SHARE * len(labels))
    return (images[:cut], labels[:cut]) if part == "train" else (images[cut:], labels[cut:])


class DigitsCNN(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, width, 3, padding=1)
        self.conv2 = nn.Conv2d(width, 2 * width, 3, padding=1)
        self.head = nn.Linear(2 * width * 2 * 2, 10)

    def forward(self, x: Tensor) -> Tensor:
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.head(torch.flatten(x, 1))


def build_model(*, width: int = 16, **_: object) -> nn.Module:
    return DigitsCNN(int(width))


def _rows(batch_size: int) -> Tensor:
    generator = torch.Generator().manual_seed(torch.initial_seed())
    return torch.randint(0, len(split("train")[1]), (batch_size,), generator=generator, device="cpu")


def _on_meta() -> bool:
    """Planning builds inputs on the meta device (shapes only): no data is read there."""
    return torch.empty(0).device.type == "meta"


def example_inputs(batch_size: int, **_: object) -> tuple[Tensor, ...]:
    if _on_meta():
        return (torch.empty(batch_size, 1, 8, 8),)
    return (split("train")[0][_rows(batch_size)],)


def example_targets(batch_size: int, **_: object) -> tuple[Tensor, ...]:
    if _on_meta():
        return (torch.empty(batch_size, dtype=torch.long),)
    return (split("train")[1][_rows(batch_size)],)


def loss_fn(output: Tensor, targets: tuple[Tensor, ...]) -> Tensor:
    (labels,) = targets
    return F.cross_entropy(output, labels)


def evaluate(model: nn.Module) -> dict[str, float]:
    """Test accuracy and loss of ``model`` on the held-out images."""
    images, labels = split("test")
    with torch.no_grad():
        logits = model(images)
    return {
        "accuracy": float((logits.argmax(1) == labels).float().mean()),
        "test_loss": float(F.cross_entropy(logits, labels)),
    }
