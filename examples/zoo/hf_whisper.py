"""Whisper (``WhisperForConditionalGeneration``), tiny and randomly initialized from a ``WhisperConfig``.

A speech encoder-decoder: inputs ``(input_features, decoder_input_ids)``, log-mel features float32
[batch, mel_bins, 2 * frames] and tokens int64 [batch, target_seq]; two convolutions (the second
with stride 2) turn the features into ``frames`` encoder positions. The model returns logits [batch,
target_seq, vocab]; the loss is per-token cross entropy against ``labels`` [batch, target_seq] from
``example_targets``. (In real training ``decoder_input_ids`` are the labels shifted right; here both
are random tokens.) ``proj_out`` is tied to the decoder token embeddings (the Whisper default).
"""

from __future__ import annotations

import torch
from _hf_zoo import Seq2SeqLogits, random_tokens, token_loss, transformers_module
from torch import Tensor, nn


def build_model(
    *,
    layers: int = 2,
    hidden: int = 64,
    heads: int = 4,
    mel_bins: int = 16,
    frames: int = 16,
    target_seq: int = 16,
    vocab: int = 256,
    **_: object,
) -> nn.Module:
    transformers = transformers_module()
    config = transformers.WhisperConfig(
        encoder_layers=layers,
        decoder_layers=layers,
        d_model=hidden,
        encoder_attention_heads=heads,
        decoder_attention_heads=heads,
        encoder_ffn_dim=4 * hidden,
        decoder_ffn_dim=4 * hidden,
        num_mel_bins=mel_bins,
        max_source_positions=frames,
        max_target_positions=target_seq,
        vocab_size=vocab,
        pad_token_id=vocab - 1,
        bos_token_id=vocab - 1,
        eos_token_id=vocab - 1,
        decoder_start_token_id=vocab - 2,
        begin_suppress_tokens=None,
        use_cache=False,
        attn_implementation="sdpa",
    )
    return Seq2SeqLogits(transformers.WhisperForConditionalGeneration(config), input_name="input_features")


def example_inputs(
    batch_size: int, *, mel_bins: int = 16, frames: int = 16, target_seq: int = 16, vocab: int = 256, **_: object
) -> tuple[Tensor, ...]:
    features = torch.randn(batch_size, mel_bins, 2 * frames)
    return features, random_tokens(batch_size, target_seq, vocab)


def example_targets(batch_size: int, *, target_seq: int = 16, vocab: int = 256, **_: object) -> tuple[Tensor, ...]:
    return (random_tokens(batch_size, target_seq, vocab),)


def loss_fn(output: Tensor, targets: tuple[Tensor, ...]) -> Tensor:
    """Per-token cross entropy against the labels."""
    return token_loss(output, targets[0])
