"""What a parity check compares: dropout off on both sides, and the plan's batch statistics.

*Dropout.* A plan draws its dropout masks per rank and per microbatch, one device draws one mask
for the whole batch: the random streams cannot agree, so ``--check-parity`` compares with dropout
off on both sides and says so. :func:`without_dropout` rewrites a captured graph so every dropout
(``aten.dropout``, ``native_dropout``, the feature and alpha variants, attention's ``dropout_p``)
has probability 0 — the operators stay, so node names and shapes are the plan's;
:class:`NoDropout` does the same for the user's own module in the single-process reference (a
``TorchFunctionMode`` that turns ``F.dropout`` and its variants into the identity and calls
``scaled_dot_product_attention`` with ``dropout_p=0``, and
:func:`quiet_dropout_modules` for what composite functions and fused operators read from modules).

*Batch statistics.* Batch normalization normalizes with statistics over the rows one call sees;
the plan says how many (``Plan.batch_stat_rows``: a data-parallel shard of a microbatch, or the
whole microbatch). The reference reproduces exactly that by running the batch in chunks of that
many rows, each chunk's loss scaled by ``1/chunks`` (the executors' own assumption for
microbatches: the loss is a mean over rows), see :class:`executors.parity.Reference`.
"""

from __future__ import annotations

import inspect
from dataclasses import replace
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from planner.ir.graph import OpGraph, OpNode
from planner.ir.node_call import resolve_target

DROPOUT_ARGUMENTS = ("p", "dropout_p", "dropout")  # the probability's name in the ATen schemas
_DROPOUT_FUNCTIONS = frozenset(
    {"dropout", "dropout1d", "dropout2d", "dropout3d", "alpha_dropout", "feature_alpha_dropout", "feature_dropout"}
)


def without_dropout(graph: OpGraph) -> OpGraph:
    """The graph with every dropout probability set to 0 (same nodes, same names)."""
    nodes = tuple(_zero_dropout(node) for node in graph.nodes)
    return graph if all(a is b for a, b in zip(nodes, graph.nodes, strict=True)) else replace(graph, nodes=nodes)


def _zero_dropout(node: OpNode) -> OpNode:
    name = node.target.split(".")[1] if node.target.startswith("aten.") else ""
    if not any(word in name for word in ("dropout", "attention", "lstm", "gru", "rnn")):
        return node
    schema = getattr(resolve_target(node.target), "_schema", None)
    if schema is None:
        return node
    names = [argument.name for argument in schema.arguments]
    for key in DROPOUT_ARGUMENTS:
        if key not in names:
            continue
        position = names.index(key)
        if position < len(node.args):
            args = list(node.args)
            args[position] = 0.0
            return replace(node, args=tuple(args))
        kwargs = dict(node.kwargs)
        if key in kwargs:
            kwargs[key] = 0.0
            return replace(node, kwargs=tuple(kwargs.items()))
    return node


class NoDropout(TorchFunctionMode):
    """Within it, ``F.dropout`` and its variants return their input and attention drops nothing."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = dict(kwargs or {})
        name = getattr(func, "__name__", "")
        if name in _DROPOUT_FUNCTIONS:
            return args[0] if args else kwargs["input"]
        if name == "scaled_dot_product_attention":
            bound = _sdpa_signature().bind(*args, **kwargs)
            bound.arguments["dropout_p"] = 0.0
            query, key, value, *_ = bound.args
            rest = {k: v for k, v in bound.arguments.items() if k not in ("query", "key", "value")}
            return func(query, key, value, **rest)
        return func(*args, **kwargs)


def quiet_dropout_modules(model: torch.nn.Module) -> None:
    """Set every dropout probability a module holds to 0, on the reference's own copy of the model:
    ``nn.Dropout``'s ``p``, and float attributes named like ``dropout`` (``nn.MultiheadAttention``,
    ``nn.LSTM``, HF attention's ``attention_dropout``) that composite functions and fused operators
    read without calling ``F.dropout`` where the mode would see it."""
    for module in model.modules():
        if isinstance(module, torch.nn.modules.dropout._DropoutNd):
            module.p = 0.0
        for name, value in list(vars(module).items()):
            if "dropout" in name.lower() and isinstance(value, float) and not isinstance(value, bool):
                setattr(module, name, 0.0)


def _sdpa_signature() -> inspect.Signature:
    def sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        return None

    return inspect.signature(sdpa)
