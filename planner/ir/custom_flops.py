"""FLOPs of operators torch's FLOP counter does not know: libraries' own custom operators.

``FlopCounterMode`` counts ATen matmuls and convolutions; a custom operator (registered with
``torch.library``, such as transformers' ``grouped_mm_fallback`` that runs a mixture of experts'
matmuls) counts as 0 however much it computes. :func:`custom_flops` gives the forward FLOPs of the
ones we know from their shapes (backward: twice the forward, as for any matmul); any other custom
operator is reported once by :func:`planner.ir.capture.capture` as timed by its bytes alone.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from planner.ir.graph import TensorMeta


def _grouped_mm(inputs: Sequence[TensorMeta], outputs: Sequence[TensorMeta]) -> int:
    """``grouped_mm(input [T, K], weight [E, K, N] or [E, N, K], offsets)`` -> ``[T, N]``: 2·T·K·N."""
    rows, inner = inputs[0].shape[0], inputs[0].shape[-1]
    return 2 * rows * inner * math.prod(outputs[0].shape[1:])


ESTIMATES: dict[str, Callable[[Sequence[TensorMeta], Sequence[TensorMeta]], int]] = {
    "transformers.grouped_mm_fallback": _grouped_mm,
    "aten._grouped_mm": _grouped_mm,
}


def custom_flops(target: str, inputs: Sequence[TensorMeta], outputs: Sequence[TensorMeta]) -> int | None:
    """Forward FLOPs of ``target`` (``namespace.op.overload``) if we know its formula, else None."""
    estimate = ESTIMATES.get(".".join(target.split(".")[:2]))
    return estimate(inputs, outputs) if estimate is not None and inputs and outputs else None


def is_custom(target: str) -> bool:
    """An operator from a library's own ``torch.library`` namespace (not ATen, not a Python call)."""
    namespace = target.split(".")[0]
    return namespace not in ("aten", "Tensor", "torch", "builtins", "operator", "math", "_operator")
