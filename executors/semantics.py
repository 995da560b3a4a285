"""What a parity check compares: dropout off on both sides, and the plan's batch statistics.

*Dropout.* A plan draws its dropout masks per rank and per microbatch, one device draws one mask
for the whole batch: the random streams cannot agree, so ``--check-parity`` compares with dropout
off on both sides and says so; other random draws (stochastic depth's ``torch.rand``, noise from
``randn``, ``bernoulli``) take one fixed value on both sides (0.5, 0, 1: masks keep, noise is 0).
:func:`without_dropout` rewrites a captured graph so every dropout
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


# Random draws other than dropout (stochastic depth's ``floor(keep + rand)``, router noise): fixed
# values on both sides — rand 0.5, randn 0, bernoulli 1 — so every mask keeps and every noise is 0.
_FIXED_DRAWS = {
    "aten.rand.default": ("aten.full.default", 0.5),
    "aten.rand_like.default": ("aten.full_like.default", 0.5),
    "aten.randn.default": ("aten.full.default", 0.0),
    "aten.randn_like.default": ("aten.full_like.default", 0.0),
    "aten.bernoulli.default": ("aten.full_like.default", 1.0),
    "aten.bernoulli.p": ("aten.full_like.default", 1.0),
}
_FIXED_FUNCTIONS = {"rand": 0.5, "randn": 0.0, "rand_like": 0.5, "randn_like": 0.0, "bernoulli": 1.0}


def without_dropout(graph: OpGraph) -> OpGraph:
    """The graph with every dropout probability set to 0 and other random draws fixed (same nodes,
    same names)."""
    nodes = tuple(_fixed_draw(_zero_dropout(node)) for node in graph.nodes)
    return graph if all(a is b for a, b in zip(nodes, graph.nodes, strict=True)) else replace(graph, nodes=nodes)


def _fixed_draw(node: OpNode) -> OpNode:
    if node.target not in _FIXED_DRAWS:
        return node
    target, value = _FIXED_DRAWS[node.target]
    keep = tuple((k, v) for k, v in node.kwargs if k in ("dtype", "layout", "device", "pin_memory"))
    return replace(node, target=target, args=(node.args[0], value), kwargs=keep)


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
        if name in _FIXED_FUNCTIONS:
            return _fixed(name, args, kwargs)
        if name == "scaled_dot_product_attention":
            bound = _SDPA.bind(*args, **kwargs)
            bound.arguments["dropout_p"] = 0.0
            query, key, value, *_ = bound.args
            rest = {k: v for k, v in bound.arguments.items() if k not in ("query", "key", "value")}
            return func(query, key, value, **rest)
        return func(*args, **kwargs)


def _fixed(name: str, args: tuple, kwargs: dict) -> torch.Tensor:
    """``torch.rand(2, 3)``, ``torch.rand_like(x)``, ``torch.bernoulli(p)``: the same fixed value."""
    value = _FIXED_FUNCTIONS[name]
    options = {k: v for k, v in kwargs.items() if k in ("dtype", "device", "layout")}
    if name.endswith("_like") or name == "bernoulli":
        return torch.full_like(args[0] if args else kwargs["input"], value, **options)
    sizes = args[0] if len(args) == 1 and isinstance(args[0], list | tuple | torch.Size) else args
    return torch.full(tuple(sizes or kwargs.get("size", ())), value, **options)


def quiet_dropout_modules(model: torch.nn.Module) -> None:
    """Set every dropout probability a module holds to 0, on the reference's own copy of the model:
    ``nn.Dropout``'s ``p``, and float attributes named like ``dropout`` (``nn.MultiheadAttention``,
    ``nn.LSTM``, HF attention's ``attention_dropout``) that composite functions and fused operators
    read without calling ``F.dropout`` where the mode would see it."""
    for module in model.modules():
        if isinstance(module, torch.nn.modules.dropout._DropoutNd):
            module.p = 0.0
        for name, value in list(vars(module).items()):
            if "dropout" in name.lower() and isinstance(value, float):
                setattr(module, name, 0.0)


def _sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """``F.scaled_dot_product_attention``'s signature, to find ``dropout_p`` however it was passed."""


_SDPA = inspect.signature(_sdpa)
