"""Calling one captured operator again: on meta tensors (shapes and FLOPs) or real ones.

An :class:`~planner.ir.graph.OpNode` records its target as a dotted string and its call with
tensors replaced by :class:`~planner.ir.graph.TensorArg`. :func:`resolve_target` turns the
string back into a callable; :func:`bind_call` puts tensors back into the call;
:func:`trace_on_meta` runs forward and backward on meta tensors under
``torch.utils.flop_counter.FlopCounterMode`` to get output shapes and FLOPs without
allocating memory.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils.flop_counter import FlopCounterMode

from planner.errors import AutoplanError
from planner.ir.graph import TensorArg, TensorMeta, op_base_name

_DEVICE_KWARGS = ("device",)


@functools.cache
def resolve_target(target: str) -> Callable[..., Any]:
    """``aten.linear.default``, ``Tensor.view``, ``torch.nn.functional.gelu`` -> callable."""
    parts = target.split(".")
    if parts[0] == "aten":
        found: Any = torch.ops.aten
        for part in parts[1:]:
            found = getattr(found, part)
        return found
    if parts[0] == "Tensor":
        return getattr(torch.Tensor, parts[1])
    try:
        found = importlib.import_module(parts[0])
        for position, part in enumerate(parts[1:], start=1):
            try:
                found = getattr(found, part)
            except AttributeError:
                found = importlib.import_module(".".join(parts[: position + 1]))
    except (ImportError, AttributeError):
        custom = _custom_op(parts)  # a library's own operator: transformers.grouped_mm_fallback.default
        if custom is None:
            raise
        return custom
    return found


def _custom_op(parts: list[str]) -> Any:
    """``namespace.op.overload`` registered with torch.library (``torch.ops.namespace.op.overload``)."""
    if len(parts) != 3:
        return None
    try:
        return getattr(getattr(getattr(torch.ops, parts[0]), parts[1]), parts[2])
    except (AttributeError, RuntimeError):
        return None


def target_name(target: Any, *, is_method: bool = False) -> str:
    """The dotted string :func:`resolve_target` reads back, for an fx or export target."""
    if is_method:
        return f"Tensor.{target}"
    if isinstance(target, torch._ops.OpOverload):
        return str(target)
    module = getattr(target, "__module__", None) or "builtins"
    name = getattr(target, "__name__", str(target))
    for candidate in (f"{module}.{getattr(target, '__qualname__', name)}", f"{module}.{name}", f"torch.{name}"):
        try:
            if resolve_target(candidate) is target:
                return candidate
        except (AttributeError, ImportError):
            continue
    raise AutoplanError(f"cannot name operator {target!r} so that it can be called again; try --tracer export")


def bind_call(
    args: Sequence[Any], kwargs: Sequence[tuple[str, Any]], tensors: Sequence[torch.Tensor], *, device: str
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Put ``tensors`` back where the ``TensorArg`` markers stand; move device arguments."""

    def fill(value: Any) -> Any:
        if isinstance(value, TensorArg):
            return tensors[value.index]
        if isinstance(value, torch.device):  # positional too: aten.to.device(self, device, dtype, ...)
            return torch.device(device)
        return value

    bound_args = tuple(tree_map(fill, list(args)))
    bound_kwargs = {key: tree_map(fill, value) for key, value in kwargs}
    for key in _DEVICE_KWARGS:
        if key in bound_kwargs and bound_kwargs[key] is not None:
            bound_kwargs[key] = torch.device(device)
    return bound_args, bound_kwargs


def tensor_meta(tensor: torch.Tensor) -> TensorMeta:
    return TensorMeta(shape=tuple(int(size) for size in tensor.shape), dtype=str(tensor.dtype).removeprefix("torch."))


def torch_dtype(name: str) -> torch.dtype:
    return getattr(torch, name)


@dataclass(frozen=True, kw_only=True, slots=True)
class MetaResult:
    """What one call on meta tensors tells: output metas and forward/backward FLOPs."""

    outputs: tuple[TensorMeta, ...]
    flops_fwd: int
    flops_bwd: int


def trace_on_meta(
    target: str,
    args: Sequence[Any],
    kwargs: Sequence[tuple[str, Any]],
    input_metas: Sequence[TensorMeta],
    *,
    frozen: Sequence[bool] = (),
) -> MetaResult:
    """Run ``target`` forward and backward on meta tensors, counting FLOPs.

    Backward FLOPs are those of ``torch.autograd.grad`` of every floating output with respect
    to every floating input (parameters included) but the ``frozen`` ones (buffers, such as batch
    normalization's running statistics). An operator whose backward cannot run on meta tensors
    (in-place updates of leaves, say) is charged twice its forward FLOPs.
    """
    function = resolve_target(target)
    frozen = tuple(frozen) or (False,) * len(input_metas)
    inputs = [_meta_tensor(meta, grad=not held) for meta, held in zip(input_metas, frozen, strict=True)]
    # an in-place operator (add_) may not update a leaf that requires grad: hand it copies
    operands = [tensor.clone() for tensor in inputs] if is_inplace(target) else inputs
    call_args, call_kwargs = bind_call(args, kwargs, operands, device="meta")
    try:
        with FlopCounterMode(display=False) as forward_counter:
            result = function(*call_args, **call_kwargs)
    except RuntimeError as error:  # an integer output (cumsum to int32) cannot carry gradients
        if "Autograd not support dtype" not in str(error):
            raise
        inputs = [tensor.detach() for tensor in inputs]
        call_args, call_kwargs = bind_call(args, kwargs, inputs, device="meta")
        with FlopCounterMode(display=False) as forward_counter:
            result = function(*call_args, **call_kwargs)
    flat, _ = tree_flatten(result)
    outputs = [value for value in flat if isinstance(value, torch.Tensor)]
    flops_fwd = int(forward_counter.get_total_flops())
    return MetaResult(
        outputs=tuple(tensor_meta(out) for out in outputs),
        flops_fwd=flops_fwd,
        flops_bwd=_backward_flops(inputs, outputs, fallback=2 * flops_fwd),
    )


def is_inplace(target: str) -> bool:
    """``aten.add_.Tensor``, ``Tensor.mul_``: ATen's trailing underscore marks in-place operators."""
    name = op_base_name(target)
    return name.endswith("_") and not name.startswith("_")


def _meta_tensor(meta: TensorMeta, *, grad: bool = True) -> torch.Tensor:
    tensor = torch.empty(meta.shape, dtype=torch_dtype(meta.dtype), device="meta")
    if meta.is_floating and grad:
        tensor.requires_grad_(True)
    return tensor


def _backward_flops(inputs: list[torch.Tensor], outputs: list[torch.Tensor], *, fallback: int) -> int:
    wrt = [tensor for tensor in inputs if tensor.requires_grad]
    differentiable = [out for out in outputs if out.requires_grad and out.grad_fn is not None]
    if not wrt or not differentiable:
        return 0
    try:
        with FlopCounterMode(display=False) as counter:
            torch.autograd.grad(
                differentiable,
                wrt,
                grad_outputs=[torch.empty_like(out) for out in differentiable],
                allow_unused=True,
            )
    except RuntimeError:
        return fallback
    return int(counter.get_total_flops())
