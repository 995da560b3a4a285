"""Which graphs a per-operator placement runs exactly: none that writes in place into a value read elsewhere.

A placement runs each operator on its own device and sends its outputs to the devices of its readers
(:mod:`executors.parallel.placement`); an in-place operator runs on a copy of the value it updates. That is the
model's own computation only when nothing else sees the update through aliasing: the value it updates is not a
view of another tensor (``x[..., :d].copy_(a)`` writes into ``x``, which later operators read), and no operator
after it reads the updated value by its old name. :func:`aliasing_refusal` finds the first operator that breaks
this and says why the plan is refused at planning time (a rotary embedding assembled with ``copy_`` into slices,
as Hugging Face's DeepSeek-V3 does, ran with uninitialized values).
"""

from __future__ import annotations

from planner.ir.graph import NodeKind, OpGraph
from planner.ir.node_call import is_inplace


def aliasing_refusal(graph: OpGraph, *, method: str) -> str | None:
    """Why ``method``'s placement of ``graph`` cannot run exactly (module docstring), or None when it can."""
    order = {node.name: index for index, node in enumerate(graph.nodes)}
    readers = graph.consumers()
    for node in graph.nodes:
        if not is_inplace(node.target) or not node.inputs:
            continue
        updated = node.inputs[0]
        is_view = graph.has_node(updated) and graph.node(updated).kind == NodeKind.VIEW
        later = [name for name in readers.get(updated, ()) if name in order and order[name] > order[node.name]]
        if is_view or later:
            how = f"a view ({updated}) of another tensor" if is_view else f"{updated}, which {later[0]} reads after it"
            return (
                f"the {method} placement runs each operator on its own device, and this model updates {how} in "
                f"place ({node.name}: {node.target}): the update would not reach the tensor's other readers; plan "
                "it with auto, megatron, data-parallel or uniform-pipeline"
            )
    return None
