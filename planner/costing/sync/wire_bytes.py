"""Bytes one rank puts on the wire for one gradient under a gathered gradient sync (:attr:`GradSync.gathered`).

The executor (:mod:`executors.compressed_sync`) compresses every gradient of a bucket on its own (a layer's
scale, its columns, its top-k: as the papers do, per layer) and sends the bucket's payloads as one byte buffer;
the cost model prices that buffer's all-gather. For a gradient of ``n`` elements (shape ``(r, …)``) the payload
is — :func:`payload_bytes`:

* ``topk`` ρ (and ``dgc`` ρ, after its sparsity warm-up): ``k = max(1, ⌈ρ·n⌉)`` fp32 values and int32 indices:
  ``8·k``;
* ``onebit``: ``n`` sign bits packed, and two fp32 reconstruction values per column (``n / r`` columns of a
  matrix, one for a vector): ``⌈n/8⌉ + 8·columns``;
* ``threshold`` τ: an int32 index and a sign bit per sent element: ``4·s + ⌈s/8⌉`` (``s`` depends on the data:
  the executor counts it, the cost model assumes :data:`planner.costing.sync.gathered.THRESHOLD_DENSITY`);
* ``terngrad``: 2 bits an element and one fp32 scale: ``⌈2n/8⌉ + 4``;
* ``qsgd`` ``s`` levels: a sign and a level, ``2s + 1`` values, packed in :func:`code_width` bits (1, 2, 4 or
  8: whole codes per byte) and one fp32 norm: ``⌈w·n/8⌉ + 4``;
* ``signsgd``: a sign bit an element and the fp32 mean magnitude: ``⌈n/8⌉ + 4``.
"""

from __future__ import annotations

import math

from planner.plan import GradSync

VALUE_BYTES = 4  # values, scales and reconstruction values travel in fp32
INDEX_BYTES = 4  # int32 element indices
PACK_WIDTHS = (1, 2, 4, 8)  # code widths that fit whole codes in a byte


def code_width(levels: int) -> int:
    """Bits per QSGD code: the narrowest packing width that holds ``2·levels + 1`` values (signed levels)."""
    needed = math.ceil(math.log2(2 * levels + 1))
    return next(width for width in PACK_WIDTHS if width >= needed)


def columns(shape: tuple[int, ...]) -> int:
    """The columns of a gradient viewed as ``shape[0]`` rows of the rest (a vector is one column)."""
    if len(shape) < 2:
        return 1
    return math.prod(shape) // max(shape[0], 1)


def topk_count(ratio: float, numel: int) -> int:
    """Elements top-k sends of a gradient of ``numel``."""
    return max(1, math.ceil(ratio * numel))


def payload_bytes(grad_sync: GradSync, shape: tuple[int, ...], *, sent: int | None = None) -> int:
    """One gradient's payload under ``grad_sync`` (module docstring); ``sent``: threshold's sent elements."""
    numel = math.prod(shape)
    kind = grad_sync.kind
    if kind in ("topk", "dgc"):
        return topk_count(grad_sync.ratio, numel) * (VALUE_BYTES + INDEX_BYTES)
    if kind == "onebit":
        return math.ceil(numel / 8) + 2 * VALUE_BYTES * columns(shape)
    if kind == "threshold":
        assert sent is not None, "threshold's payload depends on how many elements are sent"
        return INDEX_BYTES * sent + math.ceil(sent / 8)
    if kind == "terngrad":
        return math.ceil(2 * numel / 8) + VALUE_BYTES
    if kind == "qsgd":
        return math.ceil(code_width(grad_sync.levels) * numel / 8) + VALUE_BYTES
    if kind == "signsgd":
        return math.ceil(numel / 8) + VALUE_BYTES
    raise AssertionError(f"{kind} does not all-gather payloads (a bug: ask for payload bytes of gathered kinds only)")
