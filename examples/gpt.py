"""A GPT-2 style decoder-only transformer.

Sizes follow the Alpa/Megatron GPT benchmarks, ``SIZES[name] = (layers,
hidden, heads)``.  All named sizes use sequence length 1024 and vocabulary
51200, except ``tiny`` (2 layers, hidden 64, 4 heads, seq 32, vocab 512).

Keyword arguments (for both ``build_model`` and ``example_inputs``):

- ``size``: one of ``SIZES`` (default ``"tiny"``).
- ``layers``, ``hidden``, ``heads``, ``seq``, ``vocab``: optional overrides of
  the values taken from ``size``.
- ``attention``: ``"sdpa"`` (default: ``F.scaled_dot_product_attention``, a
  fused kernel) or ``"unfused"`` (Megatron-LM's 2019/2021 layer: ``Q·Kᵀ``, the
  causal mask, softmax, dropout and ``·V`` as separate operators).
- ``dropout``: attention-probability and hidden dropout (default 0.0: none;
  Megatron-LM's GPT runs used 0.1).

Module layout: ``wte`` (token embedding), ``wpe`` (position embedding),
``blocks.{i}`` with ``ln_1``, ``attn.{q,k,v,proj}``, ``ln_2``,
``mlp.{fc,proj}``, then ``ln_f`` and an untied ``lm_head``.  Pre-LN residuals,
no dropout unless ``dropout`` is set.  The attention derives its head count from the width of ``q``'s
output, so column-sharding ``q``/``k``/``v`` shards the heads.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

# name -> (layers, hidden, heads)
SIZES: dict[str, tuple[int, int, int]] = {
    "tiny": (2, 64, 4),
    "125m": (12, 768, 12),
    "350m": (24, 1024, 16),
    "760m": (24, 1536, 16),
    "1.3b": (24, 2048, 32),
    "2.6b": (32, 2560, 32),
    "6.7b": (32, 4096, 32),
    "15b": (48, 5120, 40),
    "39b": (48, 8192, 64),
}
TINY_SEQ, TINY_VOCAB = 32, 512
DEFAULT_SEQ, DEFAULT_VOCAB = 1024, 51200


@dataclass(frozen=True)
class GPTConfig:
    """Shape of a GPT model."""

    layers: int
    hidden: int
    heads: int
    seq: int
    vocab: int

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


def config_for(
    size: str = "tiny",
    *,
    layers: int | None = None,
    hidden: int | None = None,
    heads: int | None = None,
    seq: int | None = None,
    vocab: int | None = None,
) -> GPTConfig:
    """The configuration of a named size, with optional overrides."""
    size = str(size).lower()
    if size not in SIZES:
        raise ValueError(f"unknown GPT size {size!r}; valid sizes: {', '.join(SIZES)}")
    n_layers, n_hidden, n_heads = SIZES[size]
    tiny = size == "tiny"
    cfg = GPTConfig(
        layers=int(layers) if layers is not None else n_layers,
        hidden=int(hidden) if hidden is not None else n_hidden,
        heads=int(heads) if heads is not None else n_heads,
        seq=int(seq) if seq is not None else (TINY_SEQ if tiny else DEFAULT_SEQ),
        vocab=int(vocab) if vocab is not None else (TINY_VOCAB if tiny else DEFAULT_VOCAB),
    )
    if cfg.hidden % cfg.heads != 0:
        raise ValueError(f"hidden ({cfg.hidden}) must be divisible by heads ({cfg.heads})")
    return cfg


class Attention(nn.Module):
    """Causal multi-head self-attention with separate q/k/v projections."""

    def __init__(self, hidden: int, heads: int, *, unfused: bool = False, dropout: float = 0.0) -> None:
        super().__init__()
        self.head_dim = hidden // heads
        self.unfused, self.dropout = unfused, dropout
        self.q = nn.Linear(hidden, hidden)
        self.k = nn.Linear(hidden, hidden)
        self.v = nn.Linear(hidden, hidden)
        self.proj = nn.Linear(hidden, hidden)

    def forward(self, x: Tensor) -> Tensor:
        B, T = x.shape[0], x.shape[1]
        q, k, v = self.q(x), self.k(x), self.v(x)
        num_heads = q.shape[-1] // self.head_dim
        q = q.view(B, T, num_heads, self.head_dim).transpose(1, 2)
        k = k.view(B, T, num_heads, self.head_dim).transpose(1, 2)
        v = v.view(B, T, num_heads, self.head_dim).transpose(1, 2)
        y = self._unfused(q, k, v) if self.unfused else F.scaled_dot_product_attention(q, k, v, is_causal=True)
        y = y.transpose(1, 2).reshape(B, T, num_heads * self.head_dim)
        return self.proj(y)

    def _unfused(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """Causal attention as separate operators, as Megatron-LM ran it before fused attention kernels."""
        T = q.shape[-2]
        scores = (q * self.head_dim**-0.5) @ k.transpose(-2, -1)
        future = torch.ones(T, T, dtype=torch.bool, device=q.device).triu(1)
        probs = F.softmax(scores.masked_fill(future, float("-inf")), dim=-1)
        if self.dropout > 0:
            probs = F.dropout(probs, self.dropout, training=self.training)
        return probs @ v


class FeedForward(nn.Module):
    """``proj(gelu_tanh(fc(x)))`` with a 4x expansion."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.fc = nn.Linear(hidden, 4 * hidden)
        self.act = nn.GELU(approximate="tanh")
        self.proj = nn.Linear(4 * hidden, hidden)

    def forward(self, x: Tensor) -> Tensor:
        return self.proj(self.act(self.fc(x)))


class Block(nn.Module):
    """A pre-LN transformer block."""

    def __init__(self, hidden: int, heads: int, *, unfused: bool = False, dropout: float = 0.0) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(hidden)
        self.attn = Attention(hidden, heads, unfused=unfused, dropout=dropout)
        self.ln_2 = nn.LayerNorm(hidden)
        self.mlp = FeedForward(hidden)
        self.dropout = dropout

    def forward(self, x: Tensor) -> Tensor:
        x = x + self._drop(self.attn(self.ln_1(x)))
        return x + self._drop(self.mlp(self.ln_2(x)))

    def _drop(self, x: Tensor) -> Tensor:
        return F.dropout(x, self.dropout, training=self.training) if self.dropout > 0 else x


class GPT(nn.Module):
    """Decoder-only transformer: tokens [B, T] -> logits [B, T, vocab]."""

    def __init__(self, cfg: GPTConfig, *, unfused: bool = False, dropout: float = 0.0) -> None:
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab, cfg.hidden)
        self.wpe = nn.Embedding(cfg.seq, cfg.hidden)
        self.blocks = nn.ModuleList(
            Block(cfg.hidden, cfg.heads, unfused=unfused, dropout=dropout) for _ in range(cfg.layers)
        )
        self.ln_f = nn.LayerNorm(cfg.hidden)
        self.lm_head = nn.Linear(cfg.hidden, cfg.vocab, bias=False)

    def forward(self, tokens: Tensor) -> Tensor:
        T = tokens.shape[1]
        x = self.wte(tokens) + self.wpe.weight[:T]
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def build_model(
    size: str = "tiny",
    *,
    layers: int | None = None,
    hidden: int | None = None,
    heads: int | None = None,
    seq: int | None = None,
    vocab: int | None = None,
    attention: str = "sdpa",
    dropout: float = 0.0,
    **_: object,
) -> nn.Module:
    """Build a GPT of the given size (see module docstring for the kwargs)."""
    cfg = config_for(size, layers=layers, hidden=hidden, heads=heads, seq=seq, vocab=vocab)
    if attention not in ("sdpa", "unfused"):
        raise ValueError(f"attention must be 'sdpa' or 'unfused', got {attention!r}")
    return GPT(cfg, unfused=attention == "unfused", dropout=float(dropout))


def example_inputs(
    batch_size: int,
    *,
    size: str = "tiny",
    seq: int | None = None,
    vocab: int | None = None,
    **_: object,
) -> tuple[Tensor, ...]:
    """One training step's inputs: ``(tokens,)`` of shape [batch_size, seq]."""
    cfg = config_for(size, seq=seq, vocab=vocab)
    return (torch.randint(0, cfg.vocab, (batch_size, cfg.seq)),)


def loss_fn(output: Tensor, inputs: tuple[Tensor, ...]) -> Tensor:
    """Next-token cross entropy."""
    tokens = inputs[0]
    vocab = output.shape[-1]
    return F.cross_entropy(output[:, :-1].reshape(-1, vocab), tokens[:, 1:].reshape(-1))
