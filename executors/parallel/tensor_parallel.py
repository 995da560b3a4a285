"""A stage's per-node shardings -> DTensor on the stage's device mesh (1-D or 2-D).

Every value inside a tensor-parallel stage is a DTensor with the *global* shape the graph was
captured at, so the graph's shape arguments (a ``view``'s sizes) stay right. :class:`StageSharding`

* distributes each parameter exactly as the plan's ``param_placements`` say
  (:meth:`StageSharding.distribute_params`; each rank keeps its own slice, no communication);
* runs each node (:meth:`StageSharding.call_node`) as the plan's record of it says
  (:class:`~planner.plan.NodeSharding`): its activation inputs are redistributed to the record's
  ``input_specs``, a parameter held in another placement than its record names is redistributed
  too (a tied weight), the operator runs on DTensors, and the output is redistributed to the
  record's ``output_spec`` — a contraction split leaves a partial sum, which this turns into the
  planned ``R`` or ``S(d)`` (the all-reduce, or under sequence parallelism the reduce-scatter, the
  record lists as the node's own collective);
* runs sequence parallelism's gathered tensors (``R*``: replicated, the gradient handed back partial;
  :mod:`planner.sharding.sequence_parallel`) as the records say: an ``R*`` output is computed on sequence
  shards and all-gathered, and its gradient, handed back partial by every reader, reduce-scattered once
  (:meth:`StageSharding._as_planned`, :func:`executors.parallel.dtensor_edges.node_edges`);
* runs operators that DTensor has no sharding rule for without it: attention (CPU flash attention)
  on the local shards — its batch or head split is local compute that its arguments do not name —
  and anything else on whole (all-gathered) inputs, its output then sliced to the planned spec —
  correct for any operator, at the price of communication the plan did not charge; tensors made
  from no DTensor (``arange``, ``zeros``) are wrapped as replicated;
* keeps every DTensor's local shard laid out as its strides claim: an operator run on local shards hands
  back a contiguous shard, and each node's output gradient is made contiguous before the node's backward reads
  it (:func:`~executors.parallel.dtensor_edges.contiguous_local_grad`) — else a ``view``'s backward fails with
  "view size is not compatible" (a tied GPT-2, an LSTM language model);
* enters stage inputs as replicated DTensors and leaves outputs as whole tensors
  (:meth:`StageSharding.enter`, :meth:`StageSharding.leave`) — or, on a last stage whose plan says the outputs are
  batch-major, as this rank's rows of them for the loss (:meth:`StageSharding.leave_rows`,
  :func:`planner.plan.stage.loss_row_axes`), and across a pipeline boundary between meshes of one shape, the
  values a stage computed as the shards its output specs leave them in (:meth:`StageSharding.leave_shards`,
  :meth:`StageSharding.enter_shards`, :func:`planner.plan.stage.boundary_spec`);
* a one-device stage skips DTensor altogether (:class:`SingleDeviceSharding`: plain tensors, the
  model's own parameters), which keeps pipelines of single-device stages as fast as hand-written
  ones (``benchmarks/executor_overhead.py``);
* after backward, turns each parameter gradient (a partial sum on data-parallel axes) into the
  parameter's placement (:meth:`StageSharding.sync_grads`): the gradient all-reduce.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard, distribute_tensor
from torch.utils._pytree import tree_flatten, tree_map

from executors.graph_module import call_node_plain, compile_node
from executors.parallel.dtensor_edges import (
    Edge,
    GradAsPlanned,
    SliceKeepingPartialGradient,
    contiguous_local_grad,
    contiguous_stride,
    local_grad_placements,
    node_edges,
    to_placements,
)
from planner.ir.graph import NodeKind, OpGraph, OpNode, ValueKind
from planner.ir.node_call import is_inplace
from planner.ir.op_kinds import BATCH_STATISTICS, WHOLE_UNDER_DTENSOR
from planner.plan import GATHERED, NodeSharding

# Operators run on whole inputs or local shards instead of DTensor: planner.ir.op_kinds.WHOLE_UNDER_DTENSOR
AVOID_DTENSOR = WHOLE_UNDER_DTENSOR


def make_mesh(devices: Sequence[int], mesh_shape: Sequence[int], *, device_type: str) -> DeviceMesh:
    """The stage's mesh; every rank must build every stage's mesh, in the same order. On CPU, DTensor's notice
    that gloo has no all-to-all (it gathers and slices instead, the same result) is kept off the user's screen."""
    if device_type == "cpu":
        logging.getLogger("torch.distributed.tensor._collective_utils").setLevel(logging.ERROR)
    layout = torch.tensor(list(devices), dtype=torch.int64).reshape(tuple(mesh_shape))
    return DeviceMesh(device_type, layout)


class StageSharding:
    """The DTensor side of one stage: its mesh and the plan's record of every node."""

    def __init__(
        self, *, mesh: DeviceMesh, strategies: Mapping[str, NodeSharding], graph: OpGraph, device: str = "cpu"
    ) -> None:
        self.mesh = mesh
        self.outputs = {name: to_placements(record.output_spec) for name, record in strategies.items()}
        self.input_placements = {  # parsed once: the hot path only compares placements
            name: tuple(to_placements(spec) if spec is not None else None for spec in record.input_specs)
            for name, record in strategies.items()
        }
        self.edges = {name: node_edges(graph.node(name), record, strategies) for name, record in strategies.items()}
        self.gathered_outputs = {  # a gathered output's gradient comes back partial, to be reduce-scattered
            name: tuple(
                Partial() if text == GATHERED else placement
                for text, placement in zip(record.output_spec, self.outputs[name], strict=True)
            )
            for name, record in strategies.items()
            if GATHERED in record.output_spec
        }
        held = (ValueKind.PARAM, ValueKind.BUFFER)
        self.held_inputs = {  # positions of parameters and buffers: placed once, not per call
            name: frozenset(i for i, value in enumerate(graph.node(name).inputs) if graph.value_kind(value) in held)
            for name in strategies
        }
        self.device = device
        self.inplace = {graph.node(name).target for name in strategies if is_inplace(graph.node(name).target)}
        self.local_nodes: set[str] = set()  # nodes DTensor had no rule for, run on local shards
        self._callers: dict[str, Any] = {}  # node name -> its compiled call
        self._replicated = (Replicate(),) * mesh.ndim

    def distribute_params(
        self, params: Mapping[str, torch.Tensor], placements: Mapping[str, Sequence[str]]
    ) -> dict[str, nn.Parameter]:
        """Each parameter as a DTensor parameter with its planned placement (replicated if unnamed)."""
        result = {}
        for name, tensor in params.items():
            spec = to_placements(placements[name]) if name in placements else self._replicated
            local = distribute_tensor(tensor.detach(), self.mesh, spec, src_data_rank=None)
            result[name] = nn.Parameter(local, requires_grad=tensor.requires_grad)
        return result

    def distribute_buffers(self, buffers: Mapping[str, torch.Tensor]) -> dict[str, DTensor]:
        return {name: self.replicate(tensor) for name, tensor in buffers.items()}

    def replicate(self, tensor: torch.Tensor) -> DTensor:
        return DTensor.from_local(tensor, self.mesh, self._replicated, run_check=False)

    def enter(self, value: Any) -> Any:
        """A stage input (the whole tensor on every rank) as a replicated DTensor."""
        return self.replicate(value) if isinstance(value, torch.Tensor) and not isinstance(value, DTensor) else value

    def enter_shards(self, value: torch.Tensor, spec: Sequence[str]) -> DTensor:
        """A stage input that crossed the boundary as this rank's shard of it in ``spec``
        (:func:`planner.plan.stage.boundary_spec`); its gradient goes back in the same spec."""
        return DTensor.from_local(value, self.mesh, to_placements(spec), run_check=False)

    def leave_shards(self, value: Any, spec: Sequence[str]) -> Any:
        """A stage output as this rank's shard of it in ``spec``, sent so to the next stage
        (:func:`planner.plan.stage.boundary_spec`); its gradient comes back in the same spec."""
        return self._local_in(value, to_placements(spec))

    def leave(self, value: Any) -> Any:
        """A stage output as the whole tensor on every rank (gradients come back whole too)."""
        if not isinstance(value, DTensor):
            return value
        return value.redistribute(self.mesh, self._replicated).to_local()

    def leave_rows(self, value: Any, axes: Sequence[int]) -> Any:
        """A last stage's output as this rank's rows of it: dim 0 split over ``axes``, whole over the other axes
        (:func:`planner.plan.stage.loss_row_axes`); its gradient comes back split the same way."""
        return self._local_in(value, self._rows(axes))

    def _local_in(self, value: Any, placements: tuple[Placement, ...]) -> Any:
        """This rank's local tensor of ``value`` redistributed to ``placements`` (a plain tensor: whole)."""
        if not isinstance(value, torch.Tensor):
            return value
        value = value if isinstance(value, DTensor) else self.replicate(value)
        return value.redistribute(self.mesh, placements).to_local()

    def rows_of(self, value: Any, axes: Sequence[int], *, rows: int) -> Any:
        """This rank's rows of a whole loss input, cut as :meth:`leave_rows` cuts the outputs: those whose dim 0 is
        the microbatch's ``rows`` (as microbatches are cut, :func:`executors.session.split_batch`); others whole."""
        if not isinstance(value, torch.Tensor) or value.dim() == 0 or value.shape[0] != rows:
            return value
        return self.leave_rows(value, axes)

    def sum_over(self, value: torch.Tensor, axes: Sequence[int]) -> torch.Tensor:
        """``value`` summed over the ranks of ``axes`` (every rank of the stage calls it)."""
        for axis in axes:
            dist.all_reduce(value, group=self.mesh.get_group(axis))
        return value

    def _rows(self, axes: Sequence[int]) -> tuple[Placement, ...]:
        return tuple(Shard(0) if axis in axes else Replicate() for axis in range(self.mesh.ndim))

    def call_node(self, node: OpNode, tensors: list[Any]) -> Any:
        wanted = self.input_placements[node.name]
        held, edges = self.held_inputs[node.name], self.edges[node.name]
        inputs = [
            self._hold(tensor, placements) if i in held else self._arrive(tensor, placements, edges[i])
            for i, (tensor, placements) in enumerate(zip(tensors, wanted, strict=True))
        ]
        if node.target in self.inplace and inputs and isinstance(inputs[0], DTensor) and inputs[0].requires_grad:
            inputs[0] = inputs[0].clone()  # relu_ on the edge's own view: write into a copy instead
        if node.op_name in AVOID_DTENSOR or node.kind == NodeKind.ATTENTION or self._rows_on_shards(node, inputs):
            self.local_nodes.add(node.name)
        if node.name in self.local_nodes:
            result = self._call_local(node, inputs)
        else:
            try:
                if node.name not in self._callers:
                    self._callers[node.name] = compile_node(node, device=self.device)
                result = self._callers[node.name](inputs)
            except NotImplementedError as error:
                if "sharding strategy" not in str(error):
                    raise
                self.local_nodes.add(node.name)
                result = self._call_local(node, inputs)
        return self._as_planned(node, result)

    def _arrive(self, tensor: Any, placements: tuple[Placement, ...] | None, edge: Edge) -> Any:
        """An activation in the record's placements, its gradient pinned to them (or as
        :func:`executors.parallel.dtensor_edges.node_edges` says where gathered ``R*`` tensors are involved)."""
        if not isinstance(tensor, torch.Tensor):
            return tensor
        tensor = self.enter(tensor)
        if placements is None:
            return tensor
        grad = tensor.requires_grad
        if edge.source_pin is not None and grad:  # from a gathered output: hand the gradient back partial
            tensor = GradAsPlanned.apply(tensor, edge.source_pin)
        if edge.sliced is not None:
            tensor = (
                SliceKeepingPartialGradient.apply(tensor, edge.sliced)
                if grad
                else tensor.redistribute(self.mesh, edge.sliced)
            )
        if tuple(tensor.placements) != placements:
            tensor = tensor.redistribute(self.mesh, placements)
        return GradAsPlanned.apply(tensor, edge.own_pin or placements) if grad else tensor

    def _hold(self, tensor: Any, placements: tuple[Placement, ...] | None) -> Any:
        """A parameter or buffer: as distributed, unless the record reads it in other placements."""
        if placements is None or not isinstance(tensor, DTensor) or tuple(tensor.placements) == placements:
            return tensor
        return tensor.redistribute(self.mesh, placements)

    def _call_local(self, node: OpNode, inputs: list[Any]) -> Any:
        """Run without DTensor. Attention splits batch or heads, which its arguments do not name, so it
        runs on the local shards and its output takes the planned spec; any other operator (whose
        arguments may name the split dim's size, like group norm's groups) runs on whole inputs."""
        rows = self._rows_on_shards(node, inputs)
        on_shards = (
            rows
            or node.kind == NodeKind.ATTENTION
            or (node.op_name not in BATCH_STATISTICS and self._batch_split_only(node, inputs))
        )
        if not on_shards:
            inputs = [t.redistribute(self.mesh, self._replicated) if isinstance(t, DTensor) else t for t in inputs]
        placements = self.outputs.get(node.name, self._replicated) if on_shards else self._replicated
        local = [
            tensor.to_local(grad_placements=local_grad_placements(tensor, placements))
            if isinstance(tensor, DTensor)
            else tensor
            for tensor in inputs
        ]
        result = call_node_plain(node, local, device=self.device)
        shapes = iter(node.outputs)

        def wrap(value: Any) -> Any:
            if not isinstance(value, torch.Tensor):
                return value
            meta = next(shapes)
            return DTensor.from_local(
                value.contiguous(),  # claimed contiguous below: an LSTM's batch-first output is a transpose
                self.mesh,
                placements,
                run_check=False,
                shape=torch.Size(meta.shape),
                stride=contiguous_stride(meta.shape),
            )

        return tree_map(wrap, result)

    def _rows_on_shards(self, node: OpNode, inputs: list[Any]) -> bool:
        """A linear whose input splits one leading dim over several mesh axes, with a whole weight and bias.

        DTensor runs ``linear`` as flatten, mm, unflatten, and in torch 2.13 cannot unflatten a dim split
        over two axes (``_StridedShard``). Rows are independent, so each rank runs its own rows and the
        output keeps the input's placements; the weight's and bias's gradients are partial sums."""
        if node.op_name != "linear" or not inputs or not isinstance(inputs[0], DTensor):
            return False
        spec = tuple(inputs[0].placements)
        dims = [p.dim for p in spec if isinstance(p, Shard)]
        if len(dims) == len(set(dims)) or any(dim >= inputs[0].ndim - 1 for dim in dims):
            return False
        if any(not (isinstance(p, Shard) or p.is_replicate()) for p in spec):
            return False
        whole = all(not isinstance(t, DTensor) or all(p.is_replicate() for p in t.placements) for t in inputs[1:])
        return whole and self.outputs.get(node.name) == spec

    def _batch_split_only(self, node: OpNode, inputs: list[Any]) -> bool:
        """Every input and the planned output split at most dim 0 (the batch), and agree on it."""
        specs = [tuple(t.placements) for t in inputs if isinstance(t, DTensor) and t.ndim > 0]
        specs.append(self.outputs.get(node.name, self._replicated))
        allowed = {Replicate(), Shard(0)}
        return all(set(spec) <= allowed for spec in specs) and len(set(specs)) == 1

    def _as_planned(self, node: OpNode, result: Any) -> Any:
        flat, _ = tree_flatten(result)
        tensors = [value for value in flat if isinstance(value, torch.Tensor)]
        if len(tensors) != 1:  # several outputs: the getitem nodes that read them take their specs
            return tree_map(self.enter, result)
        value = self.enter(result)
        planned = self.outputs.get(node.name)
        if planned is not None and tuple(value.placements) != planned:
            value = value.redistribute(self.mesh, planned)
        partial = self.gathered_outputs.get(node.name)
        if value.requires_grad:
            value = GradAsPlanned.apply(value, partial) if partial is not None else value
            if value.grad_fn is not None:  # not a parameter passed through (a hook on it would stay)
                value.register_hook(contiguous_local_grad)
        return value

    def sync_grads(self, params: Sequence[nn.Parameter]) -> None:
        """Bring every gradient to its parameter's placement (all-reduce of partial sums)."""
        for param in params:
            grad = param.grad
            if isinstance(grad, DTensor) and tuple(grad.placements) != tuple(param.placements):
                param.grad = grad.redistribute(param.device_mesh, param.placements)


class SingleDeviceSharding:
    """A one-device stage: plain tensors, the model's own parameters, no DTensor on the hot path."""

    def __init__(self, *, device: str = "cpu") -> None:
        self.device = device
        self._callers: dict[str, Any] = {}  # node name -> its compiled call

    def distribute_params(
        self, params: Mapping[str, torch.Tensor], placements: Mapping[str, Sequence[str]]
    ) -> dict[str, nn.Parameter]:
        return {
            name: tensor if isinstance(tensor, nn.Parameter) else nn.Parameter(tensor)
            for name, tensor in params.items()
        }

    def distribute_buffers(self, buffers: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return dict(buffers)

    def enter(self, value: Any) -> Any:
        return value

    def leave(self, value: Any) -> Any:
        return value

    def call_node(self, node: OpNode, tensors: list[Any]) -> Any:
        if node.name not in self._callers:
            self._callers[node.name] = compile_node(node, device=self.device)
        return self._callers[node.name](tensors)

    def sync_grads(self, params: Sequence[nn.Parameter]) -> None:
        return None
