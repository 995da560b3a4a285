"""A small character-level GPT on the text Python ships with itself (``pydoc_data.topics``: the language reference's
help topics, about 465,000 characters): real data for the gradient-sync evidence
(``benchmarks/compression_accuracy.py``).

Characters are bytes below 128 (others become ``?``); the first :data:`TRAIN_SHARE` of the text trains, the rest
tests. A batch is random windows of ``seq`` characters from the training part (a generator seeded from torch's
current seed); the model is ``examples/gpt.py``'s GPT at the sizes of :data:`SIZES`; the loss is next-character
cross entropy, its exponential the perplexity.
"""

from __future__ import annotations

import math
from functools import cache
from pathlib import Path

import torch
from torch import Tensor, nn

from planner.ir.model_file import load_model_file

TRAIN_SHARE = 0.9
SIZES = {"layers": 2, "hidden": 64, "heads": 4, "seq": 64, "vocab": 128}
EVAL_WINDOWS = 256
GPT = Path(__file__).resolve().parents[2] / "examples" / "gpt.py"


@cache
def text() -> Tensor:
    import pydoc_data.topics

    joined = "\n".join(pydoc_data.topics.topics[key] for key in sorted(pydoc_data.topics.topics))
    codes = [ord(c) if ord(c) < SIZES["vocab"] else ord("?") for c in joined]
    return torch.tensor(codes, dtype=torch.long, device="cpu")


def split(part: str) -> Tensor:
    codes = text()
    cut = int(TRAIN_SHARE * len(codes))
    return codes[:cut] if part == "train" else codes[cut:]


def build_model(**_: object) -> nn.Module:
    return load_model_file(GPT).build_model(**SIZES)


def windows(codes: Tensor, starts: Tensor) -> Tensor:
    return codes[starts.unsqueeze(1) + torch.arange(SIZES["seq"], device="cpu")]


def example_inputs(batch_size: int, **_: object) -> tuple[Tensor, ...]:
    if torch.empty(0).device.type == "meta":  # planning: shapes only, no data read
        return (torch.zeros(batch_size, SIZES["seq"], dtype=torch.long),)
    generator = torch.Generator().manual_seed(torch.initial_seed())
    codes = split("train")
    starts = torch.randint(0, len(codes) - SIZES["seq"], (batch_size,), generator=generator, device="cpu")
    return (windows(codes, starts),)


def loss_fn(output: Tensor, inputs: tuple[Tensor, ...]) -> Tensor:
    tokens, vocab = inputs[0], output.shape[-1]
    return nn.functional.cross_entropy(output[:, :-1].reshape(-1, vocab), tokens[:, 1:].reshape(-1))


def evaluate(model: nn.Module) -> dict[str, float]:
    """Held-out loss and perplexity over :data:`EVAL_WINDOWS` evenly spaced test windows."""
    codes = split("test")
    starts = torch.linspace(0, len(codes) - SIZES["seq"] - 1, EVAL_WINDOWS).long()
    tokens = windows(codes, starts)
    with torch.no_grad():
        loss = float(loss_fn(model(tokens), (tokens,)))
    return {"test_loss": loss, "perplexity": math.exp(loss)}
