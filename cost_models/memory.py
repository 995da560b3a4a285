"""Bytes per device: model state (parameters, gradients, optimizer state) and activations.

Model state per parameter (REFERENCES.md, "Memory per parameter"; ZeRO paper):

* ``adam-mixed`` — bf16/fp16 weights 2 B + gradients 2 B + fp32 master weights, momentum and
  variance 12 B = 16 B/param.
* ``adam-fp32`` — fp32 weights 4 B + gradients 4 B + momentum and variance 8 B = 16 B/param.
* ``sgd`` — weights 4 B + gradients 4 B; ``sgd-momentum`` adds 4 B of momentum.

:func:`model_state_bytes` divides each of the three parts by its own shard count, so ZeRO
stage 1 (``state_shards = d``), stage 2 (``grad_shards`` too) and stage 3 (``weight_shards``
too) and tensor-parallel sharding are all the same formula; :func:`zero_shards` gives the three
counts of a ZeRO level over ``d`` data-parallel replicas (Rajbhandari et al. 2020, ZeRO, §5: per
parameter of mixed-precision Adam ``2 + 2 + 12/d`` B at stage 1, ``2 + (2 + 12)/d`` at 2, ``16/d`` at 3).

Activations kept for backward (:func:`saved_activation_bytes`): each operator saves what its
backward needs — matmuls, convolutions, norms, attention and non-linear elementwise operators
their non-parameter tensor inputs; softmax its output; additions, views and sums nothing.
A tensor saved by several operators, or through a view of it, is counted once (views alias
their base). On a mixed-precision device floating activations take 2 bytes per element.
Dropout keeps its mask instead of its input: on a GPU one byte per element (``aten.native_dropout``
returns a ``bool`` mask that its backward multiplies by; :func:`dropout_mask`), whatever the
activation dtype; on a CPU, where ATen's ``dropout`` takes no fused kernel, the noise tensor it
multiplies by, in the activation dtype; a dropout with ``p = 0`` or ``train=False`` is the identity
and keeps nothing. An attention with dropout on a CPU runs its math path and keeps three score
matrices (:func:`attention_dropout_bytes`).

Beyond the tensors of its inputs and output an operator may keep (:mod:`planner.costing.stage_memory`
charges them on the activations' timeline): a max pooling its int64 indices, one per output element
(:func:`index_bytes`); a whole-sequence RNN its per-step gates (:func:`rnn_kept_bytes`,
:data:`RNN_STEP_UNITS`). Views, in-place operators and the identity dropout allocate nothing: they
alias their first input (:func:`aliases_input`).

Under recomputation (:func:`kept_under_recompute`) a checkpointed run of nodes keeps only its inputs and
its nodes' forward runs again in backward; the nodes outside every run keep what they keep. The bytes
kept are charged by the planner per value at its local size (:func:`planner.intra.stage_problem.kept_bytes`,
:func:`planner.costing.stage_work.stage_node_work`). The recomputed run's own activations exist again for
the moment of its backward (one run at a time, per layer at most one layer's): the search does not charge
that transient; the estimate of a plan does, at the backward of the run's last node
(:func:`planner.costing.stage_memory.stage_tape`).

What a device holds at its fullest — state, the executor's buffers, and these activations over the timeline of
a step with the loss and the gradients — is :mod:`planner.costing.stage_memory`'s, on
:mod:`cost_models.memory_timeline`; the loss's own tensors are measured by :mod:`cost_models.loss_memory`.
"""

from __future__ import annotations

from dataclasses import dataclass

from planner.errors import AutoplanError
from planner.ir.graph import NodeKind, OpGraph, OpNode, TensorMeta, ValueKind


@dataclass(frozen=True, kw_only=True, slots=True)
class OptimizerBytes:
    """Bytes per parameter of weights, gradients and optimizer state."""

    weights: int
    grads: int
    state: int

    @property
    def total(self) -> int:
        return self.weights + self.grads + self.state


OPTIMIZERS: dict[str, OptimizerBytes] = {
    "adam-mixed": OptimizerBytes(weights=2, grads=2, state=12),
    "adam-fp32": OptimizerBytes(weights=4, grads=4, state=8),
    "sgd": OptimizerBytes(weights=4, grads=4, state=0),
    "sgd-momentum": OptimizerBytes(weights=4, grads=4, state=4),
}


def optimizer_bytes(name: str) -> OptimizerBytes:
    if name not in OPTIMIZERS:
        raise AutoplanError(f"unknown optimizer {name!r}: use one of {', '.join(OPTIMIZERS)}")
    return OPTIMIZERS[name]


def model_state_bytes(
    num_params: float,
    *,
    optimizer: str,
    weight_shards: float = 1,
    grad_shards: float = 1,
    state_shards: float = 1,
) -> float:
    """Bytes one device holds for ``num_params`` parameters, each part split by its shard count."""
    per_param = optimizer_bytes(optimizer)
    return num_params * (
        per_param.weights / weight_shards + per_param.grads / grad_shards + per_param.state / state_shards
    )


def zero_shards(level: int, data_shards: int) -> tuple[int, int, int]:
    """(weight, gradient, optimizer-state) shard counts of ZeRO ``level`` over ``data_shards`` replicas:
    level 1 shards the optimizer state, 2 the gradients too, 3 the weights too; 0 shards nothing."""
    assert 0 <= level <= 3, level
    return (data_shards if level >= 3 else 1, data_shards if level >= 2 else 1, data_shards if level >= 1 else 1)


_SAVES_NOTHING = frozenset(
    {"add", "sub", "neg", "sum", "mean", "clone", "contiguous", "dropout", "zeros_like", "ones_like", "cat"}
)
_LINEAR_ELEMENTWISE = frozenset({"add", "sub", "neg", "rsub"})


def saved_inputs(node: OpNode) -> tuple[int, ...]:
    """Positions in ``node.inputs`` whose tensors the node's backward reads."""
    name = node.op_name.rstrip("_")
    if node.kind in (NodeKind.VIEW, NodeKind.CREATION) or name in _SAVES_NOTHING:
        return ()
    if node.kind == NodeKind.SOFTMAX:
        return ()
    if node.kind == NodeKind.REDUCTION and name in ("sum", "mean"):
        return ()
    return tuple(range(len(node.inputs)))


_DROPOUTS = frozenset({"dropout", "native_dropout", "feature_dropout", "alpha_dropout"})


def dropout_mask(node: OpNode, *, fused: bool = True) -> TensorMeta | None:
    """The mask a dropout keeps for backward (the shape of its output); None for any other operator and for
    ``p = 0``. ``fused`` (a GPU): ``aten.native_dropout``'s ``bool`` mask, one byte an element; else (a CPU,
    where ATen's ``dropout`` does not take the fused kernel) the scaled noise tensor ``_dropout`` multiplies
    by, in the input's dtype."""
    if node.op_name.rstrip("_") not in _DROPOUTS:
        return None
    kwargs = dict(node.kwargs)
    probability = node.args[1] if len(node.args) > 1 else kwargs.get("p", 0.5)
    train = node.args[2] if len(node.args) > 2 else kwargs.get("train", True)
    if (isinstance(probability, int | float) and probability == 0) or train is False:
        return None
    return TensorMeta(shape=node.output.shape, dtype="bool" if fused else node.output.dtype)


ATTENTION_DROPOUT_SCORES = 3  # softmax output, dropout noise, dropped probabilities: what the math path keeps


def attention_dropout_bytes(node: OpNode, *, fused: bool, itemsize: int | None = None) -> float:
    """What an attention with dropout keeps beyond its inputs and output where no fused kernel takes dropout
    (``fused`` False: a CPU, whose flash kernel has no dropout, so ``scaled_dot_product_attention`` runs its
    math path): :data:`ATTENTION_DROPOUT_SCORES` score matrices of ``B · heads · S_q · S_k`` elements. A fused
    kernel (FlashAttention, memory-efficient attention) keeps its random state instead: 0."""
    if fused or node.kind != NodeKind.ATTENTION or len(node.input_metas) < 2:
        return 0.0
    kwargs = dict(node.kwargs)
    probability = node.args[4] if len(node.args) > 4 else kwargs.get("dropout_p", 0.0)
    if not isinstance(probability, int | float) or probability <= 0:
        return 0.0
    query, key = node.input_metas[0], node.input_metas[1]
    if len(query.shape) < 2 or len(key.shape) < 2:
        return 0.0
    scores = query.numel // query.shape[-1] * key.shape[-2]
    element = itemsize if itemsize is not None and query.is_floating else query.itemsize
    return float(ATTENTION_DROPOUT_SCORES * scores * element)


def saves_output(node: OpNode) -> bool:
    return node.kind in (NodeKind.SOFTMAX, NodeKind.ATTENTION)


def aliases_input(node: OpNode) -> bool:
    """Whether the node's output is its first input's memory: a view (:func:`view_bases`), an in-place operator
    (``relu_``: ATen's trailing underscore) or a dropout that keeps every element (``p = 0`` or not training)."""
    if not node.inputs:
        return False
    if node.kind == NodeKind.VIEW and node.op_name not in _COPIES:
        return True
    name = node.op_name
    if name.endswith("_") and not name.startswith("_"):
        return True
    return name.rstrip("_") in _DROPOUTS and dropout_mask(node) is None


_COPIES = frozenset({"clone", "contiguous", "_to_copy"})
_MAX_POOLS = frozenset(
    {"max_pool1d", "max_pool2d", "max_pool3d", "adaptive_max_pool1d", "adaptive_max_pool2d", "adaptive_max_pool3d"}
)
INDEX_ITEMSIZE = 8  # int64 pooling indices


def index_bytes(node: OpNode) -> int:
    """A max pooling's indices, kept for its backward: one int64 per output element (``max_pool2d`` runs as
    ``max_pool2d_with_indices`` under autograd and saves them; :func:`saved_extra_bytes`)."""
    return node.output.numel * INDEX_ITEMSIZE if node.op_name in _MAX_POOLS else 0


# Tensors an RNN keeps per layer, direction and time step, in units of hidden size × batch (ATen's CPU cells,
# aten/src/ATen/native/RNN.cpp): an LSTM step keeps its 4 gates (the addmm output, activated in place), the cell
# state, its tanh and the new hidden state (7); a GRU step its 3 hidden-side gates (addmm output, in place), the
# copy of the new gate autograd takes before the in-place multiply, the new gate, and (h − n), which becomes the
# new hidden state (7, with the copy before its in-place multiply); a plain RNN step its pre-activation, which
# becomes the new hidden state in place (1). cuDNN's training reserve space holds the same per-step gates.
RNN_STEP_UNITS = {"lstm": 7, "gru": 7, "rnn_tanh": 1, "rnn_relu": 1}


def rnn_kept_bytes(node: OpNode, *, activation_itemsize: int | None = None) -> float:
    """What a whole-sequence RNN (``aten.lstm`` / ``gru`` / ``rnn_tanh`` / ``rnn_relu``) keeps for backward beyond
    its inputs and output (0 for other operators): ``layers · directions · T · B · units · H`` elements
    (:data:`RNN_STEP_UNITS`), plus each inner layer's output (the next layer's input, ``T · B · directions · H``)
    and, with dropout between layers, its one-byte mask."""
    units = RNN_STEP_UNITS.get(node.op_name)
    if units is None or len(node.args) < 9:
        return 0.0
    num_layers, dropout, train, bidirectional = node.args[4], node.args[5], node.args[6], node.args[7]
    if not isinstance(num_layers, int):
        return 0.0
    directions = 2 if bidirectional else 1
    output = node.output
    hidden = output.shape[-1] // directions
    rows = output.numel // output.shape[-1]  # time steps × batch
    itemsize = activation_itemsize if activation_itemsize is not None and output.is_floating else output.itemsize
    per_step = num_layers * directions * rows * units * hidden
    inner = (num_layers - 1) * rows * directions * hidden
    masks = inner if train and isinstance(dropout, int | float) and dropout > 0 else 0
    return float((per_step + inner) * itemsize + masks)


def _element_bytes(meta: TensorMeta, activation_itemsize: int | None) -> int:
    if activation_itemsize is not None and meta.is_floating:
        return meta.numel * activation_itemsize
    return meta.nbytes


def view_bases(graph: OpGraph) -> dict[str, str]:
    """Each view's base value (a view of a view resolved to the first base)."""
    base_of: dict[str, str] = {}
    for node in graph.nodes:
        if node.kind == NodeKind.VIEW and node.inputs and node.op_name not in ("clone", "contiguous", "_to_copy"):
            base_of[node.name] = base_of.get(node.inputs[0], node.inputs[0])
    return base_of


def saved_values(graph: OpGraph, *, nodes: list[OpNode] | None = None) -> set[str]:
    """Names of the values (views resolved to their base) that ``nodes`` keep for backward."""
    base_of = view_bases(graph)
    saved: set[str] = set()
    for node in graph.nodes if nodes is None else nodes:
        for position in saved_inputs(node):
            name = node.inputs[position]
            if graph.value_kind(name) not in (ValueKind.PARAM, ValueKind.BUFFER):
                saved.add(base_of.get(name, name))
        if saves_output(node):
            saved.add(node.name)
    return saved


def saved_activation_bytes(
    graph: OpGraph, *, nodes: list[OpNode] | None = None, activation_itemsize: int | None = None
) -> int:
    """Bytes of activations kept from forward to backward by ``nodes`` (default: all), dropout masks included."""
    values = sum(
        _element_bytes(_meta_of(graph, name), activation_itemsize) for name in saved_values(graph, nodes=nodes)
    )
    masks = (dropout_mask(node) for node in (graph.nodes if nodes is None else nodes))
    return values + sum(mask.nbytes for mask in masks if mask is not None)


def _meta_of(graph: OpGraph, name: str) -> TensorMeta:
    if graph.has_node(name):
        return graph.node(name).output
    return graph.value(name).meta


@dataclass(frozen=True, kw_only=True)
class KeptUnderRecompute:
    """What forward keeps for backward when runs of nodes are recomputed (:func:`kept_under_recompute`)."""

    values: frozenset[str]  # values kept (views resolved to their base), graph inputs included
    masked: frozenset[str]  # dropout nodes whose masks are kept (those outside the runs)
    recomputed: frozenset[str]  # nodes whose forward runs again in backward


def kept_under_recompute(graph: OpGraph, runs: tuple[tuple[str, ...], ...]) -> KeptUnderRecompute:
    """Activation checkpointing of ``runs`` (:mod:`planner.ir.recompute`): a node outside every run keeps what it
    keeps without recomputation (:func:`saved_values`, its dropout mask); a run keeps only the values entering it
    (its inputs that are not parameters or buffers: what ``torch.utils.checkpoint`` holds), and backward runs
    its forward again, so a node inside a run keeps nothing past it. The whole stage as one run keeps its
    inputs; one run per layer keeps each layer's input (Megatron's full recomputation)."""
    inside = {name for run in runs for name in run}
    outside = [node for node in graph.nodes if node.name not in inside]
    base_of = view_bases(graph)
    values = saved_values(graph, nodes=outside)
    for run in runs:
        members = set(run)
        for name in run:
            for value in graph.node(name).inputs:
                if value not in members and graph.value_kind(value) not in (ValueKind.PARAM, ValueKind.BUFFER):
                    values.add(base_of.get(value, value))
    masked = frozenset(node.name for node in outside if dropout_mask(node) is not None)
    return KeptUnderRecompute(values=frozenset(values), masked=masked, recomputed=frozenset(inside))
