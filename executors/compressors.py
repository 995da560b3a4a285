"""Gradient compressors of the bandwidth-bound training literature, as pure tensor functions (no process group).

Each compressor turns a gradient into the payload a rank would send (:class:`Payload`: the tensors on the wire,
whose bytes are the wire size) and back into a dense tensor; :class:`ErrorFeedback` keeps what a lossy
compressor dropped and adds it to the next gradient. The gradient-sync hooks that send the payloads (issue 35)
are built on these; here each is a function of its input and a ``torch.Generator`` for the random ones.

* :class:`TopK` — Aji & Heafield (2017), "Sparse Communication for Distributed Gradient Descent": keep the
  ``k = ⌈ratio·n⌉`` largest-magnitude elements (values and int32 indices), drop the rest. Contractive:
  ``‖g − D(C(g))‖² ≤ (1 − k/n)·‖g‖²`` (the dropped ones are the smallest). With :class:`ErrorFeedback` the dropped
  residual is accumulated locally and sent later (their "residual accumulation"); Deep Gradient Compression
  (Lin et al. 2018) adds momentum correction on top of it.
* :class:`OneBit` — Seide et al. (2014), "1-Bit Stochastic Gradient Descent ...": each element becomes one bit, its
  sign; each column gets two reconstruction values, the means of its non-negative and of its negative elements
  (the "column-wise scale"), so a column's sum is kept exactly. Always used with error feedback.
* :class:`Threshold` — Strom (2015), "Scalable Distributed DNN Training Using Commodity GPU Cloud Computing": only
  elements with ``|x| ≥ τ`` are sent, as ``±τ`` (an index and a sign bit each); everything else, including the
  part of a sent element beyond ``τ``, stays in the residual (error feedback).
* :class:`TernGrad` — Wen et al. (2017): ``s = max|g|``; element ``i`` becomes ``s·sign(g_i)·b_i`` with
  ``b_i ~ Bernoulli(|g_i| / s)``: three levels, 2 bits an element and one scale; unbiased, ``E[D(C(g))] = g``.
* :class:`QSGD` — Alistarh et al. (2017): with ``s`` levels, ``‖g‖₂·sign(g_i)·ξ_i / s`` where ``ξ_i`` rounds
  ``s·|g_i| / ‖g‖₂`` down or up at random so its mean is that value: unbiased, with variance
  ``E‖D(C(g)) − g‖² ≤ min(n / s², √n / s)·‖g‖²`` (their Lemma 3.1).
* :class:`SignSGD` — Bernstein et al. (2019), "signSGD with Majority Vote": each worker sends ``sign(g)`` (1 bit an
  element) and its mean magnitude ``‖g‖₁ / n``; the aggregate is the sign of the sum of the workers' signs, their
  majority vote (:func:`majority_vote`), scaled by the mean of their magnitudes (so an optimizer tuned for the
  gradient's size takes steps of that size; the sign is the paper's).

Codes are unsigned integers (a sign bit, ``sign + 1`` for ternary levels, ``level + s`` for QSGD) packed
``8 / code_bits`` to a byte (:func:`pack_codes`); :meth:`Payload.to_bytes` lays a payload out as one ``uint8``
buffer (tensors by name, codes packed, indices int32, the rest fp32) and :meth:`Payload.from_bytes` reads it back.
Its length is :meth:`Payload.wire_bytes`, the formula the cost model prices
(:func:`planner.costing.sync.wire_bytes.payload_bytes`; no entropy coding).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from planner.costing.sync.wire_bytes import code_width

INDEX_BYTES = 4  # int32 element indices
SCALE_BYTES = 4  # fp32 scales and reconstruction values


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """``codes`` (unsigned, below ``2**bits``; ``bits`` 1, 2, 4 or 8) packed ``8 / bits`` to a ``uint8``."""
    per_byte = 8 // bits
    flat = codes.reshape(-1).to(torch.uint8)
    padded = torch.nn.functional.pad(flat, (0, (-flat.numel()) % per_byte)).reshape(-1, per_byte)
    shifts = torch.arange(per_byte, dtype=torch.uint8, device=codes.device) * bits
    return (padded << shifts).sum(1, dtype=torch.uint8)


def unpack_codes(packed: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    """The first ``count`` codes of :func:`pack_codes`'s output, as ``uint8``."""
    per_byte = 8 // bits
    shifts = torch.arange(per_byte, dtype=torch.uint8, device=packed.device) * bits
    mask = (1 << bits) - 1
    return ((packed.reshape(-1, 1) >> shifts) & mask).reshape(-1)[:count]


@dataclass(frozen=True, kw_only=True)
class Payload:
    """What one rank sends for one gradient: ``tensors`` by name, the dense shape, and the bits per element of the
    packed ``codes`` (0 when there are none)."""

    shape: tuple[int, ...]
    tensors: dict[str, torch.Tensor]
    code_bits: int = 0  # bits per element of tensors["codes"] once packed (signs 1, ternary 2, QSGD levels)

    def wire_bytes(self) -> int:
        """Bytes on the wire: codes packed at ``code_bits`` each, indices int32, every other tensor fp32."""
        total = 0
        for name, tensor in self.tensors.items():
            if name == "codes":
                total += math.ceil(tensor.numel() * self.code_bits / 8)
            else:
                total += tensor.numel() * (INDEX_BYTES if name == "indices" else SCALE_BYTES)
        return total

    def to_bytes(self) -> torch.Tensor:
        """The payload as one ``uint8`` buffer of :meth:`wire_bytes` bytes (tensors in name order)."""
        parts = []
        for name in sorted(self.tensors):
            tensor = self.tensors[name].reshape(-1)
            if name == "codes":
                parts.append(pack_codes(tensor, self.code_bits))
            else:
                wire_dtype = torch.int32 if name == "indices" else torch.float32
                parts.append(tensor.to(wire_dtype).view(torch.uint8))
        return torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8)

    @classmethod
    def from_bytes(cls, buffer: torch.Tensor, *, like: Payload) -> Payload:
        """The payload :meth:`to_bytes` wrote, read with the tensor sizes of ``like`` (same compressor and shape;
        threshold: the same number of sent elements)."""
        tensors, offset = {}, 0
        for name in sorted(like.tensors):
            count = like.tensors[name].numel()
            if name == "codes":
                size = math.ceil(count * like.code_bits / 8)
                tensors[name] = unpack_codes(buffer[offset : offset + size], like.code_bits, count)
            else:
                wire_dtype = torch.int32 if name == "indices" else torch.float32
                size = count * 4
                tensors[name] = buffer[offset : offset + size].clone().view(wire_dtype)
            offset += size
        assert offset == buffer.numel(), f"payload of {buffer.numel()} bytes read as {offset}"
        return cls(shape=like.shape, tensors=tensors, code_bits=like.code_bits)


def _dense(grad: torch.Tensor) -> torch.Tensor:
    return grad.detach().reshape(-1).float()


@dataclass(frozen=True, kw_only=True)
class TopK:
    """Aji & Heafield's top-k sparsification (module docstring)."""

    ratio: float

    def __post_init__(self) -> None:
        if not 0 < self.ratio <= 1:
            raise ValueError(f"top-k ratio must be in (0, 1], got {self.ratio}")

    def compress(self, grad: torch.Tensor, generator: torch.Generator | None = None) -> Payload:
        flat = _dense(grad)
        k = max(1, math.ceil(self.ratio * flat.numel()))
        indices = flat.abs().topk(k, sorted=False).indices
        return Payload(shape=tuple(grad.shape), tensors={"values": flat[indices], "indices": indices.int()})

    def decompress(self, payload: Payload) -> torch.Tensor:
        values = payload.tensors["values"]
        flat = values.new_zeros(math.prod(payload.shape))
        flat[payload.tensors["indices"].long()] = values
        return flat.reshape(payload.shape)

    def add_into(self, total: torch.Tensor, payload: Payload) -> None:
        """Scatter-add the payload into a flat ``total`` (a sum of several ranks' payloads)."""
        total.index_add_(0, payload.tensors["indices"].long(), payload.tensors["values"])


def _columns(grad: torch.Tensor) -> torch.Tensor:
    """``grad`` as a matrix: a 2-D or larger tensor as ``shape[0]`` rows of the rest, a 1-D one as one column."""
    tensor = grad.detach().float()
    return tensor.reshape(-1, 1) if tensor.dim() < 2 else tensor.reshape(tensor.shape[0], -1)


@dataclass(frozen=True, kw_only=True)
class OneBit:
    """Seide et al.'s 1-bit quantization with column-wise reconstruction values (module docstring)."""

    def compress(self, grad: torch.Tensor, generator: torch.Generator | None = None) -> Payload:
        matrix = _columns(grad)
        positive = matrix >= 0
        count_positive = positive.sum(0)
        count_negative = matrix.shape[0] - count_positive
        sum_positive = torch.where(positive, matrix, 0.0).sum(0)
        sum_negative = matrix.sum(0) - sum_positive
        high = torch.where(count_positive > 0, sum_positive / count_positive.clamp(min=1), 0.0)
        low = torch.where(count_negative > 0, sum_negative / count_negative.clamp(min=1), 0.0)
        return Payload(
            shape=tuple(grad.shape),
            tensors={"codes": positive.reshape(-1).to(torch.uint8), "high": high, "low": low},
            code_bits=1,
        )

    def decompress(self, payload: Payload) -> torch.Tensor:
        high, low = payload.tensors["high"], payload.tensors["low"]
        bits = payload.tensors["codes"].reshape(-1, high.numel()).bool()
        return torch.where(bits, high, low).reshape(payload.shape)


@dataclass(frozen=True, kw_only=True)
class Threshold:
    """Strom's threshold quantization: ``±τ`` where ``|x| ≥ τ`` (module docstring)."""

    tau: float

    def __post_init__(self) -> None:
        if self.tau <= 0:
            raise ValueError(f"threshold must be positive, got {self.tau}")

    def compress(self, grad: torch.Tensor, generator: torch.Generator | None = None) -> Payload:
        flat = _dense(grad)
        indices = (flat.abs() >= self.tau).nonzero().reshape(-1)
        return Payload(
            shape=tuple(grad.shape),
            tensors={"indices": indices.int(), "codes": (flat[indices] >= 0).to(torch.uint8)},
            code_bits=1,
        )

    def decompress(self, payload: Payload) -> torch.Tensor:
        signs = payload.tensors["codes"].float() * 2 - 1
        flat = signs.new_zeros(math.prod(payload.shape))
        flat[payload.tensors["indices"].long()] = signs * self.tau
        return flat.reshape(payload.shape)

    def add_into(self, total: torch.Tensor, payload: Payload) -> None:
        """Scatter-add the payload's ``±τ`` into a flat ``total`` (a sum of several ranks' payloads)."""
        signs = payload.tensors["codes"].float() * 2 - 1
        total.index_add_(0, payload.tensors["indices"].long(), signs * self.tau)


@dataclass(frozen=True, kw_only=True)
class TernGrad:
    """Wen et al.'s stochastic ternary levels ``{−s, 0, s}``, ``s = max|g|`` (module docstring)."""

    def compress(self, grad: torch.Tensor, generator: torch.Generator | None = None) -> Payload:
        flat = _dense(grad)
        scale = flat.abs().max()
        probability = flat.abs() / scale if scale > 0 else torch.zeros_like(flat)
        keep = torch.rand(flat.shape, generator=generator, device=flat.device) < probability
        codes = (torch.sign(flat) * keep + 1).to(torch.uint8)  # 0, 1, 2 for −s, 0, s
        return Payload(shape=tuple(grad.shape), tensors={"codes": codes, "scale": scale.reshape(1)}, code_bits=2)

    def decompress(self, payload: Payload) -> torch.Tensor:
        return ((payload.tensors["codes"].float() - 1) * payload.tensors["scale"]).reshape(payload.shape)


@dataclass(frozen=True, kw_only=True)
class QSGD:
    """Alistarh et al.'s stochastic quantization to ``levels`` levels of ``‖g‖₂`` (module docstring)."""

    levels: int

    def __post_init__(self) -> None:
        if not 1 <= self.levels <= 127:
            raise ValueError(f"QSGD takes 1 to 127 levels (a signed level in 8 bits), got {self.levels}")

    def compress(self, grad: torch.Tensor, generator: torch.Generator | None = None) -> Payload:
        flat = _dense(grad)
        norm = flat.norm()
        scaled = flat.abs() / norm * self.levels if norm > 0 else torch.zeros_like(flat)
        lower = scaled.floor()
        level = lower + (torch.rand(flat.shape, generator=generator, device=flat.device) < scaled - lower)
        codes = (torch.sign(flat) * level + self.levels).to(torch.uint8)  # a signed level in −s..s, offset by s
        return Payload(
            shape=tuple(grad.shape),
            tensors={"codes": codes, "norm": norm.reshape(1)},
            code_bits=code_width(self.levels),
        )

    def decompress(self, payload: Payload) -> torch.Tensor:
        codes, norm = payload.tensors["codes"].float() - self.levels, payload.tensors["norm"]
        return (codes * norm / self.levels).reshape(payload.shape)


@dataclass(frozen=True, kw_only=True)
class SignSGD:
    """Bernstein et al.'s signSGD: one bit an element and the mean magnitude (module docstring); ``decompress``
    gives ``±scale``."""

    def compress(self, grad: torch.Tensor, generator: torch.Generator | None = None) -> Payload:
        flat = _dense(grad)
        codes = (flat >= 0).to(torch.uint8)
        return Payload(
            shape=tuple(grad.shape), tensors={"codes": codes, "scale": flat.abs().mean().reshape(1)}, code_bits=1
        )

    def decompress(self, payload: Payload) -> torch.Tensor:
        return (signs(payload) * payload.tensors["scale"]).reshape(payload.shape)


def signs(payload: Payload) -> torch.Tensor:
    """A sign payload's ``±1`` per element (flat)."""
    return payload.tensors["codes"].float() * 2 - 1


def majority_vote(votes: list[torch.Tensor]) -> torch.Tensor:
    """signSGD's aggregate: the sign of the sum of the workers' ``±1`` signs (0 only on a tie)."""
    return torch.sign(torch.stack(votes).sum(0))


Compressor = TopK | OneBit | Threshold | TernGrad | QSGD | SignSGD


@dataclass(kw_only=True)
class ErrorFeedback:
    """Error feedback (Seide et al. 2014; Aji & Heafield's residual; Karimireddy et al. 2019): compress
    ``g + e`` and keep ``e ← g + e − D(C(g + e))`` for the next step, so every part of every gradient is sent
    eventually: after ``T`` steps ``Σ sent = Σ g − e_T``. One per gradient (or bucket) a rank sends."""

    compressor: Compressor
    residual: torch.Tensor | None = field(default=None)

    def step(self, grad: torch.Tensor, generator: torch.Generator | None = None) -> Payload:
        corrected = grad.detach().float() + (self.residual if self.residual is not None else 0.0)
        payload = self.compressor.compress(corrected, generator)
        self.residual = corrected - self.compressor.decompress(payload)
        return payload
