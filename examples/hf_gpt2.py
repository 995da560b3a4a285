"""GPT-2 from Hugging Face ``transformers`` (``GPT2LMHeadModel``), built from a config.

Needs the optional dependency: ``pip install -e ".[hf]"``. No weights are downloaded: the
model is built from a ``GPT2Config`` with random initialization (``HF_HUB_OFFLINE=1`` is set
unless already set), so it also builds on the meta device. Dropout stays on (training mode).

Keyword arguments (``build_model``; ``seq`` and ``vocab`` also for ``example_inputs``):

- ``layers`` (2), ``hidden`` (64), ``heads`` (4): ``n_layer``, ``n_embd``, ``n_head``.
- ``seq`` (32): sequence length, also ``n_positions``.
- ``vocab`` (512): vocabulary size.
- ``attn`` (``"sdpa"``): ``attn_implementation``, ``"sdpa"`` or ``"eager"``.

The defaults make a tiny model; ``layers=12 hidden=768 heads=12 seq=1024 vocab=50257`` is
GPT-2 small. The HF model ties ``lm_head.weight`` to ``transformer.wte.weight``: the graph
names that parameter once, ``model.transformer.wte.weight``, as ``named_parameters()`` does.
Linear layers are HF ``Conv1D`` modules, captured as ``addmm``. ``use_cache`` is off.
"""

from __future__ import annotations

import os
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import Tensor, nn


def _transformers() -> ModuleType:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        import transformers
    except ImportError as error:
        raise ImportError(
            'examples/hf_gpt2.py needs Hugging Face transformers: install autoplan[hf] (pip install -e ".[hf]")'
        ) from error
    return transformers


class LogitsOnly(nn.Module):
    """Wraps an HF causal LM so that ``forward(input_ids)`` returns the logits tensor only."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: Tensor) -> Tensor:
        return self.model(input_ids=input_ids, use_cache=False, return_dict=True).logits


def build_model(
    *,
    layers: int = 2,
    hidden: int = 64,
    heads: int = 4,
    seq: int = 32,
    vocab: int = 512,
    attn: str = "sdpa",
    **_: object,
) -> nn.Module:
    """A randomly initialized HF GPT-2 returning logits [batch, seq, vocab]."""
    transformers = _transformers()
    config = transformers.GPT2Config(
        n_layer=int(layers),
        n_embd=int(hidden),
        n_head=int(heads),
        n_positions=int(seq),
        vocab_size=int(vocab),
        bos_token_id=int(vocab) - 1,
        eos_token_id=int(vocab) - 1,
        use_cache=False,
        attn_implementation=str(attn),
    )
    model = transformers.GPT2LMHeadModel(config)
    model.tie_weights()  # transformers 5.0 leaves them untied when built on the meta device
    return LogitsOnly(model)


def example_inputs(batch_size: int, *, seq: int = 32, vocab: int = 512, **_: object) -> tuple[Tensor, ...]:
    """One training step's inputs: ``(input_ids,)`` of shape [batch_size, seq]."""
    return (torch.randint(0, int(vocab), (batch_size, int(seq))),)


def loss_fn(output: Tensor, inputs: tuple[Tensor, ...]) -> Tensor:
    """Next-token cross entropy."""
    tokens = inputs[0]
    vocab = output.shape[-1]
    return F.cross_entropy(output[:, :-1].reshape(-1, vocab), tokens[:, 1:].reshape(-1))
