"""A model file for loss-curve tests: a causal LM on sequences it can learn (``tests/test_lossy_sync.py``).

``family``: ``gpt`` (``examples/gpt.py``) or ``llama`` (Hugging Face ``LlamaForCausalLM``,
``examples/zoo/hf_llama.py``), tiny. Each row counts up from a random start modulo ``vocab`` (``t_{i+1} = t_i + 1``),
so next-token cross entropy can fall from about ``log(vocab)`` towards 0; on random tokens it cannot fall below
``log(vocab)``, and a loss curve would show nothing.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor, nn

from planner.ir.model_file import ModelFile, load_model_file

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
SIZES = {"layers": 2, "hidden": 32, "heads": 4, "seq": 16, "vocab": 16}


def _example(relative: str) -> ModelFile:
    return load_model_file(EXAMPLES / relative)  # imported as `plan` imports it: the zoo's helpers beside it


def _family(family: str) -> ModelFile:
    if family not in ("gpt", "llama"):
        raise ValueError(f"family must be 'gpt' or 'llama', got {family!r}")
    return _example("gpt.py" if family == "gpt" else "zoo/hf_llama.py")


def build_model(*, family: str = "gpt", **_: object) -> nn.Module:
    extra = {"kv_heads": 2} if family == "llama" else {}
    return _family(family).build_model(**SIZES, **extra)


def example_inputs(batch_size: int, **_: object) -> tuple[Tensor, ...]:
    start = torch.randint(0, SIZES["vocab"], (batch_size, 1))
    return ((start + torch.arange(SIZES["seq"])) % SIZES["vocab"],)


def loss_fn(output: Tensor, inputs: tuple[Tensor, ...]) -> Tensor:
    """Next-token cross entropy."""
    tokens, vocab = inputs[0], output.shape[-1]
    return nn.functional.cross_entropy(output[:, :-1].reshape(-1, vocab), tokens[:, 1:].reshape(-1))
