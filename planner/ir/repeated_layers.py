"""Capture once per repeated block: a stack of N identical layers is exported at a few layers and written out at N.

Exporting Llama-3-405B's 126 decoder layers takes about 30 s on one core, and every layer after the first few
is the same operators on other weights. When a model holds such a stack (an ``nn.ModuleList`` or
``nn.Sequential`` of at least :data:`MIN_LAYERS` children, :func:`find_layer_stack`), :func:`capture_repeated`
exports the model with the stack cut to its first ``h + 2`` and ``h + 3`` layers (``h``: the head of layers that
differ from the rest, such as DeepSeek-V3's dense layers before its MoE ones; the stack's ``ModuleList`` holds
fewer children during each export, :func:`truncated`) and writes the graph at N from the first, by
:class:`LayerRule`:

* the **template** is the last layer of the short graph (layer ``h + 1``), which reads the layer before it
  (layer ``h``); layer ``i > h + 1`` is the template with every parameter, buffer and lifted constant of layer
  ``h + 1`` renamed to layer ``i``'s (``…layers.{h+1}.…`` → ``…layers.{i}.…``), its module paths likewise, every
  value it reads of layer ``h`` read of layer ``i − 1`` instead, and what it reads from before the stack (the
  embedding, rotary tables, masks) read as it is;
* **names** follow ``torch.fx``'s namespace, one counter per base name (``linear``, ``linear_1``, …): a layer
  adds ``c_b`` to the counter of each base ``b`` it uses (learned between layers ``h + 1`` and ``h + 2`` of the
  longer export, :meth:`LayerRule.learn`), so the node at position ``p`` of layer ``i`` is named
  ``b_{a_p + (i − h − 1)·c_b}`` and a node after the stack ``b_{a + (N − h − 2)·c_b}``
  (``a``: its number in the short graph);
* values after the stack (the final norm, the head, the outputs) read the last layer where they read the
  template.

**What proves the instances are identical.** Layers ``h + 1 … N − 1`` must have one structural fingerprint
(:func:`layer_signature`: every submodule's class, parameter and buffer shapes and dtypes, and hooks; and every
plain attribute, :func:`_attributes`, where one that equals its layer's index in every layer, such as Hugging
Face's ``layer_idx``, reads as the index), share no parameter, and the model's config may hold no per-layer list
whose entries differ (Hugging Face's ``layer_types``, ``no_rope_layers``).
Then the rule written at ``h + 3`` layers from the short export must equal the longer export exactly (every
node, name, wiring, shape, parameter and output: :func:`capture_repeated`). Anything else — a stack the rule
cannot describe, a model that cannot be cut, a mismatch — returns None and the caller exports the whole model.
What this cannot see is a forward that branches on its own index where no attribute or config list shows it
(``if self.layer_idx > 40``); the ranks export the whole model and check its fingerprint against the plan's before
any step (:mod:`executors.session`), so such a model stops at start with the fingerprint's error rather than
running another graph.
"""

from __future__ import annotations

import contextlib
import re
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from planner.ir.graph import OpGraph, OpNode, OutputTree

MIN_LAYERS = 8  # below this, the two short exports (h + 2 and h + 3 layers) save too little
_NUMBERED = re.compile(r"^(.*)_(\d+)$")


@dataclass(frozen=True, kw_only=True, slots=True)
class LayerStack:
    """``path``: the qualified name of the stack's module; ``count`` layers, of which the first ``head`` differ."""

    path: str
    count: int
    head: int


def find_layer_stack(model: torch.nn.Module) -> LayerStack | None:
    """The outermost ``ModuleList``/``Sequential`` of at least :data:`MIN_LAYERS` layers whose layers after a
    head share one signature, or None."""
    if _has_uneven_config_lists(model):
        return None
    found = []
    for path, module in model.named_modules():
        if type(module) not in (torch.nn.ModuleList, torch.nn.Sequential) or len(module) < MIN_LAYERS:
            continue
        head = _head_length(list(module))
        if head is not None and len(module) - head >= MIN_LAYERS // 2:
            found.append(LayerStack(path=path, count=len(module), head=head))
    return min(found, key=lambda stack: (stack.path.count("."), -stack.count), default=None)


def _head_length(layers: list[torch.nn.Module]) -> int | None:
    """How many first layers differ from the identical run that ends the stack; None when layers share weights."""
    if len({id(p) for layer in layers for p in layer.parameters()}) != sum(
        len(list(layer.parameters())) for layer in layers
    ):
        return None
    attributes = [_attributes(layer) for layer in layers]
    index_keys = {key for key in attributes[0] if all(a.get(key) == i for i, a in enumerate(attributes))}
    signatures = [
        (layer_signature(layer), {k: "<index>" if k in index_keys else v for k, v in a.items()})
        for layer, a in zip(layers, attributes, strict=True)
    ]
    head = len(layers) - 1
    while head > 0 and signatures[head - 1] == signatures[-1]:
        head -= 1
    return head


def _attributes(layer: torch.nn.Module) -> dict[tuple[str, str], Any]:
    """Every plain attribute of the layer's modules (numbers, strings, flags, tuples of them)."""
    return {
        (name, key): value
        for name, module in layer.named_modules(remove_duplicate=False)
        for key, value in vars(module).items()
        if not key.startswith("_") and _is_plain(value)
    }


def layer_signature(layer: torch.nn.Module) -> tuple[Any, ...]:
    """What shapes a layer's graph besides its plain attributes: submodules' classes, hooks, parameter and
    buffer shapes and dtypes."""
    parts: list[Any] = [
        (name, type(module).__qualname__, len(module._forward_hooks), len(module._forward_pre_hooks))
        for name, module in layer.named_modules(remove_duplicate=False)
    ]
    parts.extend(
        (name, tuple(p.shape), str(p.dtype), p.requires_grad)
        for name, p in layer.named_parameters(remove_duplicate=False)
    )
    parts.extend((name, tuple(b.shape), str(b.dtype)) for name, b in layer.named_buffers(remove_duplicate=False))
    return tuple(parts)


def _is_plain(value: Any) -> bool:
    if isinstance(value, (bool, int, float, str, type(None))):
        return True
    return isinstance(value, (tuple, list)) and all(_is_plain(item) for item in value)


def _has_uneven_config_lists(model: torch.nn.Module) -> bool:
    """A config (Hugging Face's) with a per-layer list whose entries differ: layers configured one by one."""
    for module in model.modules():
        config = getattr(module, "config", None)
        if config is None or not hasattr(config, "__dict__"):
            continue
        for value in vars(config).values():
            per_layer = isinstance(value, (list, tuple)) and len(value) >= MIN_LAYERS and _is_plain(value)
            if per_layer and len({repr(v) for v in value}) > 1:
                return True
    return False


@contextlib.contextmanager
def truncated(model: torch.nn.Module, stack: LayerStack, count: int) -> Iterator[None]:
    """The stack holds its first ``count`` layers while inside."""
    module = model.get_submodule(stack.path)
    saved = module._modules
    module._modules = OrderedDict(list(saved.items())[:count])
    try:
        yield
    finally:
        module._modules = saved


def _split(name: str) -> tuple[str, int]:
    match = _NUMBERED.match(name)
    return (match[1], int(match[2])) if match else (name, 0)


def _join(base: str, number: int) -> str:
    return f"{base}_{number}" if number else base


def _in_layer(module_path: str, prefix: str) -> bool:
    return module_path == prefix or module_path.startswith(prefix + ".")


@dataclass(frozen=True, kw_only=True)
class _Parts:
    """A captured graph cut at the stack: before it, its layers in order, after it."""

    before: tuple[OpNode, ...]
    layers: tuple[tuple[OpNode, ...], ...]
    after: tuple[OpNode, ...]


def _cut(graph: OpGraph, path: str, count: int) -> _Parts | None:
    """The graph's nodes as ``before + layer 0 + … + layer count−1 + after``; None when a layer's nodes are not
    one contiguous run in order."""
    owner = []
    for node in graph.nodes:
        owner.append(next((i for i in range(count) if _in_layer(node.module_path, f"{path}.{i}")), None))
    placed = [i for i, layer in enumerate(owner) if layer is not None]
    if not placed:
        return None
    first, last = placed[0], placed[-1]
    inside = owner[first : last + 1]
    if None in inside or inside != sorted(inside) or sorted(set(inside)) != list(range(count)):
        return None
    layers = tuple(
        tuple(node for node, layer in zip(graph.nodes, owner, strict=True) if layer == i) for i in range(count)
    )
    return _Parts(before=graph.nodes[:first], layers=layers, after=graph.nodes[last + 1 :])


@dataclass(frozen=True, kw_only=True)
class LayerRule:
    """How the graph grows by one layer of the stack (module docstring): the counter step of each base name."""

    path: str
    head: int
    steps: dict[str, int]  # base name -> what one layer adds to its counter

    @classmethod
    def learn(cls, short: OpGraph, longer: OpGraph, stack: LayerStack) -> LayerRule | None:
        """From the exports at ``h + 2`` (``short``) and ``h + 3`` layers; None when the graphs do not grow by a
        layer of one fixed shape."""
        size = stack.head + 2
        a, b = _cut(short, stack.path, size), _cut(longer, stack.path, size + 1)
        if a is None or b is None or a.before != b.before or a.layers != b.layers[:size]:
            return None
        template, previous, added = a.layers[-1], a.layers[-2], b.layers[-1]
        targets = [node.target for node in template]
        if [node.target for node in previous] != targets or [node.target for node in added] != targets:
            return None
        steps: dict[str, int] = {}
        for old, new in zip(template, added, strict=True):
            (base, number), (new_base, new_number) = _split(old.name), _split(new.name)
            if base != new_base or steps.setdefault(base, new_number - number) != new_number - number:
                return None
        return cls(path=stack.path, head=stack.head, steps=steps)

    def expand(self, short: OpGraph, count: int) -> OpGraph:
        """The graph with ``count`` layers, written from the export at ``h + 2`` layers."""
        parts = _cut(short, self.path, self.head + 2)
        assert parts is not None, "the rule was learned on this graph"
        template, previous = parts.layers[-1], parts.layers[-2]
        last = self.head + 1  # the template's index
        position = {node.name: p for p, node in enumerate(template)}
        before_position = {node.name: p for p, node in enumerate(previous)}
        # the layer before the one being written, its node names by the template node at the same position
        before = {n.name: n.name for n in template}
        nodes = [*parts.before, *(node for layer in parts.layers for node in layer)]
        for index in range(last + 1, count):
            renamed = {n.name: self._name(n.name, index - last) for n in template}
            for node in template:
                inputs = tuple(
                    renamed[x]
                    if x in position
                    else before[template[before_position[x]].name]
                    if x in before_position
                    else self._value(x, index)
                    for x in node.inputs
                )
                nodes.append(
                    replace(
                        node,
                        name=renamed[node.name],
                        inputs=inputs,
                        params=tuple(self._value(p, index) for p in node.params),
                        module_path=self._value(node.module_path, index),
                    )
                )
            before = renamed
        final = before
        after_names = {n.name: self._name(n.name, count - last - 1) for n in parts.after}

        def read(name: str) -> str:
            return after_names.get(name) or final.get(name) or name

        nodes.extend(replace(n, name=after_names[n.name], inputs=tuple(map(read, n.inputs))) for n in parts.after)
        tree = short.output_tree
        if tree is not None:
            tree = OutputTree(
                spec=tree.spec,
                leaves=tuple(read(leaf) if leaf else leaf for leaf in tree.leaves),
                constants=tree.constants,
            )
        return OpGraph(
            nodes=tuple(nodes),
            inputs=short.inputs,
            params=self._values(short.params, count),
            buffers=self._values(short.buffers, count),
            outputs=tuple(map(read, short.outputs)),
            constants=self._values(short.constants, count),
            output_tree=tree,
        )

    def _name(self, name: str, shift: int) -> str:
        base, number = _split(name)
        return _join(base, number + shift * self.steps.get(base, 0))

    def _value(self, name: str, index: int) -> str:
        """A parameter, buffer, constant or module path of the template, renamed to layer ``index``."""
        prefix = f"{self.path}.{self.head + 1}"
        if _in_layer(name, prefix):
            return f"{self.path}.{index}{name[len(prefix) :]}"
        return name

    def _values(self, values: Sequence[Any], count: int) -> tuple[Any, ...]:
        """``values`` (named; the template's contiguous) with a copy of the template's for each added layer."""
        prefix = f"{self.path}.{self.head + 1}"
        mine = [i for i, value in enumerate(values) if _in_layer(value.name, prefix)]
        if not mine:
            return tuple(values)
        copies = [
            replace(values[i], name=self._value(values[i].name, index))
            for index in range(self.head + 2, count)
            for i in mine
        ]
        return (*values[: mine[-1] + 1], *copies, *values[mine[-1] + 1 :])


def capture_repeated(model: torch.nn.Module, export: Callable[[], OpGraph]) -> OpGraph | None:
    """The model's graph written from two short exports (``export`` captures the model as it stands), or None
    when it has no stack of identical layers the rule provably describes (module docstring)."""
    stack = find_layer_stack(model)
    if stack is None:
        return None
    size = stack.head + 2
    try:
        with truncated(model, stack, size):
            short = export()
        with truncated(model, stack, size + 1):
            longer = export()
    except Exception:  # a model that cannot run cut short (it counts its layers): export it whole
        return None
    rule = LayerRule.learn(short, longer, stack)
    if rule is None or not _same(rule.expand(short, size + 1), longer):
        return None
    return rule.expand(short, stack.count)


def _same(written: OpGraph, captured: OpGraph) -> bool:
    if written != captured:
        return False
    a, b = written.output_tree, captured.output_tree
    return (a is None) == (b is None) and (a is None or (a.leaves == b.leaves and a.constants == b.constants))
