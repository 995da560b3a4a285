"""Which :class:`~planner.ir.graph.NodeKind` an operator is, from its short name and shapes.

The same table serves both capture paths: ATen names from ``torch.export`` (``linear``,
``_softmax``) and Python names from fx tracing (``linear``, ``softmax``, ``view``). An
operator in no table is ``ELEMENTWISE`` when its output has the broadcast shape of its
inputs, else ``OTHER`` (which later planners replicate, with a warning).
"""

from __future__ import annotations

import math

from planner.ir.graph import NodeKind, TensorMeta

# operators whose output depends on statistics over the batch rows they see (batch normalization)
BATCH_STATISTICS = frozenset(
    {
        "batch_norm",
        "native_batch_norm",
        "_native_batch_norm_legit",
        "_native_batch_norm_legit_functional",
        "_batch_norm_with_update",
        "_batch_norm_impl_index",
        "cudnn_batch_norm",
        "batch_norm_stats",
    }
)

# DTensor's batch-split group norm passes the global batch to the kernel: wrong gradients on 2-D meshes (torch
# 2.13); its convolution rule mis-sizes strided convolutions' outputs; slice_scatter's backward mixes in a plain
# zeros tensor. The tensor-parallel executor runs these on whole (all-gathered) inputs instead, or on local shards
# when every input and the output split at most the batch dim alike (executors.parallel.tensor_parallel), and the memory
# estimate charges them so (planner.costing.plan_memory).
CONVOLUTIONS = frozenset(
    {
        "convolution",
        "_convolution",
        "conv1d",
        "conv2d",
        "conv3d",
        "conv_transpose1d",
        "conv_transpose2d",
        "conv_transpose3d",
    }
)
WHOLE_UNDER_DTENSOR = frozenset({"group_norm", "slice_scatter"}) | BATCH_STATISTICS | CONVOLUTIONS

_KINDS: dict[NodeKind, frozenset[str]] = {
    NodeKind.MATMUL: frozenset(
        {"linear", "mm", "addmm", "bmm", "baddbmm", "matmul", "einsum", "_linear", "addbmm", "mv", "dot"}
    ),
    NodeKind.EMBEDDING: frozenset({"embedding", "embedding_bag", "_embedding_bag"}),
    # elementwise ops that also return a mask (so the broadcast-shape rule cannot tell)
    NodeKind.ELEMENTWISE: frozenset({"native_dropout"}),
    NodeKind.NORM: frozenset(
        {
            "layer_norm",
            "native_layer_norm",
            "group_norm",
            "native_group_norm",
            "batch_norm",
            "native_batch_norm",
            "_native_batch_norm_legit",
            "_native_batch_norm_legit_no_training",
            "instance_norm",
            "rms_norm",
            "_fused_rms_norm",
        }
    ),
    NodeKind.SOFTMAX: frozenset({"softmax", "_softmax", "log_softmax", "_log_softmax", "_safe_softmax"}),
    NodeKind.ATTENTION: frozenset(
        {
            "scaled_dot_product_attention",
            "_scaled_dot_product_flash_attention",
            "_scaled_dot_product_flash_attention_for_cpu",
            "_scaled_dot_product_efficient_attention",
            "_scaled_dot_product_cudnn_attention",
        }
    ),
    NodeKind.CONV: frozenset(
        {"conv1d", "conv2d", "conv3d", "convolution", "_convolution", "conv_transpose1d", "conv_transpose2d"}
    ),
    NodeKind.POOL: frozenset(
        {
            "max_pool1d",
            "max_pool2d",
            "max_pool3d",
            "max_pool2d_with_indices",
            "avg_pool1d",
            "avg_pool2d",
            "avg_pool3d",
            "adaptive_avg_pool1d",
            "adaptive_avg_pool2d",
            "_adaptive_avg_pool2d",
            "adaptive_max_pool2d",
        }
    ),
    NodeKind.VIEW: frozenset(
        {
            "view",
            "_unsafe_view",
            "reshape",
            "transpose",
            "permute",
            "t",
            "expand",
            "expand_as",
            "unsqueeze",
            "squeeze",
            "flatten",
            "unflatten",
            "contiguous",
            "clone",
            "slice",
            "select",
            "getitem",
            "split",
            "split_with_sizes",
            "chunk",
            "unbind",
            "alias",
            "detach",
            "view_as",
            "narrow",
            "movedim",
            "type_as",
            "to",
            "_to_copy",
            "float",
            "half",
            "bfloat16",
            "lift_fresh_copy",
            "size",
            "dim",
        }
    ),
    NodeKind.REDUCTION: frozenset(
        {
            "sum",
            "mean",
            "amax",
            "amin",
            "max",
            "min",
            "var",
            "std",
            "norm",
            "logsumexp",
            "prod",
            "all",
            "any",
            "var_mean",
        }
    ),
    NodeKind.INDEX: frozenset(
        {
            "gather",
            "scatter",
            "scatter_add",
            "index_select",
            "index",
            "index_put",
            "topk",
            "sort",
            "argmax",
            "argmin",
            "one_hot",
            "cross_entropy",
            "nll_loss",
            "nll_loss_forward",
            "masked_select",
            "nonzero",
            "cat",
            "stack",
            "pad",
            "constant_pad_nd",
        }
    ),
    NodeKind.CREATION: frozenset(
        {
            "arange",
            "zeros",
            "ones",
            "full",
            "empty",
            "zeros_like",
            "ones_like",
            "full_like",
            "empty_like",
            "randn",
            "rand",
            "randint",
            "tensor",
            "scalar_tensor",
            "tril",
            "triu",
            "new_ones",
            "new_zeros",
            "new_full",
            "new_empty",
        }
    ),
}
_BY_NAME = {name: kind for kind, names in _KINDS.items() for name in names}


def classify(op_name: str, inputs: tuple[TensorMeta, ...], outputs: tuple[TensorMeta, ...]) -> NodeKind:
    """The kind of the operator called ``op_name`` (``add_`` counts as ``add``)."""
    name = op_name.rstrip("_") if op_name.endswith("_") and not op_name.startswith("_") else op_name
    if name in _BY_NAME:
        return _BY_NAME[name]
    if not inputs:
        return NodeKind.CREATION
    if len(outputs) == 1 and _is_broadcast_of(outputs[0], inputs):
        return NodeKind.ELEMENTWISE
    return NodeKind.OTHER


def _is_broadcast_of(output: TensorMeta, inputs: tuple[TensorMeta, ...]) -> bool:
    """True when ``output`` has the broadcast shape of the tensor inputs."""
    try:
        shape = _broadcast_shapes([meta.shape for meta in inputs])
    except ValueError:
        return False
    return shape == output.shape and math.prod(shape) == output.numel


def _broadcast_shapes(shapes: list[tuple[int, ...]]) -> tuple[int, ...]:
    ndim = max(len(shape) for shape in shapes)
    result = [1] * ndim
    for shape in shapes:
        for offset, size in enumerate(reversed(shape)):
            position = ndim - 1 - offset
            if size != 1 and result[position] not in (1, size):
                raise ValueError(f"shapes {shapes} do not broadcast")
            result[position] = max(result[position], size)
    return tuple(result)
