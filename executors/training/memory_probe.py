"""Measured memory of a rank, in the terms the estimate uses (``cost_models/memory.py``).

CPU tensors have no allocator statistics, so a run measures what the estimate models:

* *model state* (:func:`model_state_bytes`): the bytes of every parameter, gradient and optimizer
  state tensor this rank holds (its local shards), each storage counted once;
* *activations* (:class:`ActivationMeter`): the peak, over the step, of the bytes of tensors saved
  for backward that are still alive — counted by a ``saved_tensors_hooks`` pack hook when autograd
  saves a tensor, and released by a weak-reference callback when the last reference to it goes.

Their sum is what :meth:`executors.training.parallel_model.ParallelModel.memory_bytes` reports. It leaves out
what the estimate leaves out too: transient outputs not saved for backward, the interpreter, torch's
libraries, communication buffers.

On a CUDA device the caching allocator also keeps its own high-water marks (:func:`allocator_peak`):
``torch.cuda.max_memory_allocated`` (every live tensor at its worst moment, transients included) and
``torch.cuda.max_memory_reserved`` (what the allocator took from the driver, fragmentation included),
since the process started. CPU tensors have no such statistics: there it is None and the figure above
stands alone.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.tensor import DTensor


def storage_of(tensor: torch.Tensor) -> tuple[int, int] | None:
    local = tensor._local_tensor if isinstance(tensor, DTensor) else tensor
    if local.device.type == "meta":
        return None
    storage = local.untyped_storage()
    return storage.data_ptr(), storage.nbytes()


def model_state_bytes(params: list[torch.Tensor], optimizer: torch.optim.Optimizer | None) -> int:
    """Bytes of the parameters, their gradients and the optimizer's state, each storage once."""
    seen: dict[int, int] = {}
    tensors: list[Any] = [*params, *(p.grad for p in params if p.grad is not None)]
    if optimizer is not None:
        tensors += [v for p in params for v in optimizer.state.get(p, {}).values() if isinstance(v, torch.Tensor)]
    for tensor in tensors:
        found = storage_of(tensor)
        if found is not None:
            seen.setdefault(*found)
    return sum(seen.values())


@dataclass(frozen=True, kw_only=True)
class AllocatorPeak:
    """The CUDA caching allocator's high-water marks of one device, in bytes."""

    allocated_bytes: int
    reserved_bytes: int


def allocator_peak(device: str) -> AllocatorPeak | None:
    """``max_memory_allocated`` and ``max_memory_reserved`` of ``device`` ("cuda:0"); None for "cpu"."""
    if not device.startswith("cuda"):
        return None
    return AllocatorPeak(
        allocated_bytes=int(torch.cuda.max_memory_allocated(device)),
        reserved_bytes=int(torch.cuda.max_memory_reserved(device)),
    )


class ActivationMeter:
    """``with meter:`` around forward and backward; ``meter.peak_bytes`` after."""

    def __init__(self) -> None:
        self.live: dict[int, int] = {}  # storage pointer -> bytes
        self.refs: dict[int, int] = {}  # storage pointer -> saved tensors alive on it
        self.live_bytes = 0
        self.peak_bytes = 0
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda packed: packed)

    def __enter__(self) -> ActivationMeter:
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._hooks.__exit__(*exc)

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        found = storage_of(tensor) if not isinstance(tensor, torch.nn.Parameter) else None
        if found is None:
            return tensor
        pointer, nbytes = found
        self.refs[pointer] = self.refs.get(pointer, 0) + 1
        if pointer not in self.live:
            self.live[pointer] = nbytes
            self.live_bytes += nbytes
            self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        weakref.finalize(tensor, self._release, pointer)
        return tensor

    def _release(self, pointer: int) -> None:
        self.refs[pointer] -= 1
        if self.refs[pointer] == 0:
            del self.refs[pointer]
            self.live_bytes -= self.live.pop(pointer)
