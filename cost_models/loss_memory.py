"""What a model file's loss holds at its peak, measured on the meta device.

The loss runs outside the captured graph (the runner calls the model file's ``loss_fn`` on the stage
outputs, :meth:`executors.session.Workload.loss`), yet it is often the largest thing a step holds: a
language model's cross entropy keeps the log-softmax of every logit for its backward and then makes two
more logit-sized gradients (of the log-softmax, of the logits), and a slice such as ``logits[:, :-1]``
copies before it reshapes. :func:`loss_peak_bytes` runs the loss forward and backward once on meta tensors
of the outputs' shapes under a dispatch mode that counts every storage an operator allocates until it is
freed (:class:`AllocationCounter`: a weak reference to each storage, which autograd's saved tensors keep
alive), and returns the most held at once beyond the outputs and the data it reads — its saved tensors,
its transients and the outputs' gradient it hands back. :func:`loss_bytes_per_output_element` divides by
the outputs' elements: the figure scales with the batch, and a stage's estimate multiplies it by the
elements of the outputs it holds (:func:`planner.costing.stage_memory.loss_bytes`). Outputs are given in
float32: a mixed-precision run computes its losses in float32 too (``torch.autocast`` runs
``cross_entropy``, ``log_softmax``, ``nll_loss`` and ``mse_loss`` in float32; PyTorch AMP op reference,
"CUDA ops that can autocast to float32").

Without a ``loss_fn`` the runner takes the mean of the first output (:func:`executors.session.default_loss`):
:data:`DEFAULT_BYTES_PER_OUTPUT_ELEMENT`, the float32 gradient of the output.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

DEFAULT_BYTES_PER_OUTPUT_ELEMENT = 4.0  # the mean's backward: a float32 gradient of the output


class AllocationCounter(TorchDispatchMode):
    """Counts the bytes of storages operators allocate while they live (``peak_bytes``: the most at once);
    storages registered with :meth:`known` beforehand are not counted."""

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, int] = {}
        self.live_bytes = 0
        self.peak_bytes = 0

    def known(self, tensor: torch.Tensor) -> None:
        self.live.setdefault(tensor.untyped_storage()._cdata, 0)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for value in tree_leaves(out):
            if isinstance(value, torch.Tensor):
                self._count(value)
        return out

    def _count(self, tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        key = storage._cdata
        if key in self.live:
            return
        num_bytes = storage.nbytes()
        self.live[key] = num_bytes
        self.live_bytes += num_bytes
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        weakref.finalize(storage, self._free, key)

    def _free(self, key: int) -> None:
        self.live_bytes -= self.live.pop(key, 0)


def loss_peak_bytes(loss_fn: Callable[[Any, Any], torch.Tensor], outputs: Sequence[torch.Tensor], data: Any) -> int:
    """The most bytes ``loss_fn(outputs, data)`` and its backward hold at once beyond ``outputs`` and ``data``
    (meta tensors; the floating outputs require grad)."""
    leaves = [o.detach().requires_grad_(o.is_floating_point()) for o in outputs]
    counter = AllocationCounter()
    for tensor in [*leaves, *(v for v in tree_leaves(data) if isinstance(v, torch.Tensor))]:
        counter.known(tensor)
    with counter:
        loss = loss_fn(leaves[0] if len(leaves) == 1 else tuple(leaves), data)
        if loss.requires_grad:
            loss.backward()
    return counter.peak_bytes


def loss_bytes_per_output_element(
    loss_fn: Callable[[Any, Any], torch.Tensor] | None, outputs: Sequence[torch.Tensor], data: Any
) -> float:
    """:func:`loss_peak_bytes` per element of the floating outputs (module docstring); the default loss's
    figure without a ``loss_fn``."""
    elements = sum(o.numel() for o in outputs if o.is_floating_point())
    if loss_fn is None or not elements:
        return DEFAULT_BYTES_PER_OUTPUT_ELEMENT
    floats = [o.float() if o.is_floating_point() else o for o in outputs]
    return loss_peak_bytes(loss_fn, floats, data) / elements
