"""Shared helpers for the Hugging Face model zoo (``examples/zoo/hf_*.py``).

Not a model file itself: the ``hf_<family>.py`` files beside it import it (a model file's folder
is on ``sys.path``). It holds

* :func:`transformers_module`: imports ``transformers`` with ``HF_HUB_OFFLINE=1`` (nothing is
  downloaded; every model is built from its config class with random weights);
* :func:`tiny_causal_lm`: a decoder LM family (``Llama``, ``Mistral``, ...) from its config class with
  the zoo's common settings and the family's own;
* wrappers that make an HF model's ``forward`` take plain positional tensors and return one
  logits tensor: :class:`CausalLMLogits`, :class:`ClassifierLogits`, :class:`Seq2SeqLogits`,
  :class:`ImageClassifierLogits`;
* random example data: :func:`random_tokens`, :func:`random_labels`, :func:`random_images`;
* losses: :func:`next_token_loss`, :func:`token_loss`, :func:`classification_loss`.

Needs the optional dependency: ``pip install -e ".[hf]"``.
"""

from __future__ import annotations

import os
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import Tensor, nn


def transformers_module() -> ModuleType:
    """``import transformers``, offline."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        import transformers
    except ImportError as error:
        raise ImportError('the examples/zoo models need Hugging Face transformers: pip install -e ".[hf]"') from error
    return transformers


class CausalLMLogits(nn.Module):
    """``forward(input_ids) -> logits [batch, seq, vocab]`` of an HF causal LM, no KV cache."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: Tensor) -> Tensor:
        return self.model(input_ids=input_ids, use_cache=False, return_dict=True).logits


def tiny_causal_lm(
    family: str, *, layers: int, hidden: int, heads: int, seq: int, vocab: int, **config: object
) -> nn.Module:
    """``{family}ForCausalLM`` built from ``{family}Config`` (random weights, no KV cache, SDPA attention,
    special tokens 0-2), wrapped to return logits; ``config`` adds the family's own settings."""
    transformers = transformers_module()
    settings = {
        "num_hidden_layers": layers,
        "hidden_size": hidden,
        "num_attention_heads": heads,
        "max_position_embeddings": seq,
        "vocab_size": vocab,
        "pad_token_id": 0,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "use_cache": False,
        "attn_implementation": "sdpa",
        **config,
    }
    model_class = getattr(transformers, f"{family}ForCausalLM")
    return CausalLMLogits(model_class(getattr(transformers, f"{family}Config")(**settings)))


class ClassifierLogits(nn.Module):
    """``forward(input_ids) -> logits [batch, num_labels]`` of an HF sequence classifier."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: Tensor) -> Tensor:
        return self.model(input_ids=input_ids, return_dict=True).logits


class Seq2SeqLogits(nn.Module):
    """``forward(encoder_input, decoder_input_ids) -> logits [batch, target_seq, vocab]``.

    ``input_name`` is the encoder's keyword: ``"input_ids"`` (T5) or ``"input_features"`` (Whisper).
    """

    def __init__(self, model: nn.Module, input_name: str = "input_ids") -> None:
        super().__init__()
        self.model = model
        self.input_name = input_name

    def forward(self, encoder_input: Tensor, decoder_input_ids: Tensor) -> Tensor:
        inputs = {self.input_name: encoder_input}
        return self.model(**inputs, decoder_input_ids=decoder_input_ids, use_cache=False, return_dict=True).logits


class ImageClassifierLogits(nn.Module):
    """``forward(pixel_values) -> logits [batch, num_labels]`` of an HF image classifier."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, pixel_values: Tensor) -> Tensor:
        return self.model(pixel_values=pixel_values, return_dict=True).logits


def random_tokens(batch_size: int, seq: int, vocab: int) -> Tensor:
    """Token ids, int64 [batch_size, seq], uniform in ``[0, vocab)``."""
    return torch.randint(0, int(vocab), (batch_size, int(seq)))


def random_labels(batch_size: int, num_labels: int) -> Tensor:
    """Class labels, int64 [batch_size]."""
    return torch.randint(0, int(num_labels), (batch_size,))


def random_images(batch_size: int, image_size: int, channels: int = 3) -> Tensor:
    """Images, float32 [batch_size, channels, image_size, image_size]."""
    return torch.randn(batch_size, int(channels), int(image_size), int(image_size))


def next_token_loss(logits: Tensor, input_ids: Tensor) -> Tensor:
    """Causal-LM cross entropy: position ``t`` predicts token ``t + 1`` of ``input_ids``."""
    vocab = logits.shape[-1]
    return F.cross_entropy(logits[:, :-1].reshape(-1, vocab), input_ids[:, 1:].reshape(-1))


def token_loss(logits: Tensor, labels: Tensor) -> Tensor:
    """Per-token cross entropy: ``logits`` [batch, seq, vocab] against ``labels`` [batch, seq]."""
    vocab = logits.shape[-1]
    return F.cross_entropy(logits.reshape(-1, vocab), labels.reshape(-1))


def classification_loss(logits: Tensor, labels: Tensor) -> Tensor:
    """Cross entropy: ``logits`` [batch, num_labels] against ``labels`` [batch]."""
    return F.cross_entropy(logits, labels)
