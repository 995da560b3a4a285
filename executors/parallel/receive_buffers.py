"""Pipeline stages whose receive buffers live only while a microbatch needs them.

``torch.distributed.pipelining`` gives every stage one buffer per microbatch for the activations it receives and
one per microbatch for the gradients sent back to it, allocated when the schedule first runs and kept for the
whole run: ``2·m`` activation-sized tensors per stage, which at Megatron-LM's microbatch counts (GPT-1T: 512) take
more memory than the model. :class:`ReleasingStage` allocates a microbatch's buffers when the schedule posts its
receive (``get_fwd_recv_ops`` / ``get_bwd_recv_ops``) and drops them once the microbatch's forward (backward) has
read them (``forward_one_chunk`` / ``backward_one_chunk``): the received activation lives on as the stage input
the autograd graph keeps until its backward — what the memory timeline charges for the microbatches in flight
(:mod:`planner.costing.stage_memory`) — and the received gradient until its backward has used it, as Megatron-LM
allocates what it receives. The plan's memory then holds no per-microbatch buffers
(``RuntimeProfile.kept_receive_buffers`` is False for ours, :mod:`planner.costing.runtime_profiles`).

Only public stage methods are wrapped, plus ``_prepare_forward_infra``/``_prepare_backward_infra`` (where torch
allocates every buffer on the first step; they are released at once): each buffer's size and dtype are read off the
buffer torch made, so the wrapper does not depend on torch's metadata types.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed import pipelining

Spec = tuple[torch.Size, torch.dtype, torch.device]


class ReleasingStage(pipelining.PipelineStage):
    """A ``PipelineStage`` that holds a receive buffer only from its receive until its microbatch has read it."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._forward_specs: dict[int, list[Spec | None]] = {}
        self._backward_specs: dict[int, list[Spec | None]] = {}

    def _prepare_forward_infra(self, *args: Any, **kwargs: Any) -> Any:
        prepared = super()._prepare_forward_infra(*args, **kwargs)
        for chunk in list(self.args_recv_info):
            _release(self.args_recv_info[chunk], self._forward_specs, chunk)
        return prepared

    def _prepare_backward_infra(self, *args: Any, **kwargs: Any) -> Any:
        prepared = super()._prepare_backward_infra(*args, **kwargs)
        for chunk in list(self.grad_recv_info):
            _release(self.grad_recv_info[chunk], self._backward_specs, chunk)
        return prepared

    def get_fwd_recv_ops(self, fwd_chunk_id: int) -> list[Any]:
        _allocate(self.args_recv_info[fwd_chunk_id], self._forward_specs.get(fwd_chunk_id))
        return super().get_fwd_recv_ops(fwd_chunk_id)

    def get_bwd_recv_ops(self, bwd_chunk_id: int) -> list[Any]:
        if bwd_chunk_id in self.grad_recv_info:
            _allocate(self.grad_recv_info[bwd_chunk_id], self._backward_specs.get(bwd_chunk_id))
        return super().get_bwd_recv_ops(bwd_chunk_id)

    def forward_one_chunk(self, fwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
        output = super().forward_one_chunk(fwd_chunk_id, *args, **kwargs)
        if not self.is_first:
            _release(self.args_recv_info[fwd_chunk_id], self._forward_specs, fwd_chunk_id)
        return output

    def backward_one_chunk(self, bwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
        result = super().backward_one_chunk(bwd_chunk_id, *args, **kwargs)
        if bwd_chunk_id in self.grad_recv_info:
            _release(self.grad_recv_info[bwd_chunk_id], self._backward_specs, bwd_chunk_id)
        return result

    def held_receive_buffers(self) -> int:
        """How many receive buffers the stage holds now (tests: none between steps)."""
        infos = [*self.args_recv_info.values(), *self.grad_recv_info.values()]
        return sum(1 for chunk in infos for info in chunk if _receives(info) and info.buffer is not None)


def _receives(info: Any) -> bool:
    return not getattr(info, "is_root_arg", False) and getattr(info, "source", None) is not None


def _release(infos: Any, specs: dict[int, list[Spec | None]], chunk: int) -> None:
    """Drop the chunk's receive buffers, keeping each one's size, dtype and device to make it again."""
    found = specs.setdefault(chunk, [None] * len(infos))
    for position, info in enumerate(infos):
        if _receives(info) and info.buffer is not None:
            found[position] = (info.buffer.shape, info.buffer.dtype, info.buffer.device)
            info.buffer = None


def _allocate(infos: Any, specs: list[Spec | None] | None) -> None:
    """Make the chunk's released receive buffers again, empty, for the receive about to be posted."""
    if specs is None:
        return
    for info, spec in zip(infos, specs, strict=True):
        if spec is not None and info.buffer is None:
            shape, dtype, device = spec
            info.buffer = torch.empty(shape, dtype=dtype, device=device)
