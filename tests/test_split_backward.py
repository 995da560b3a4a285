"""Zero bubble's split backward loses the gradient of a parameter no gradient-needing stage input reaches: such
pipelines are never offered under zero bubble and the executor refuses a plan that has one
(:func:`planner.plan.schedules.split_backward_refusal`)."""

from __future__ import annotations

import itertools

from planner.plan import Stage
from planner.plan.schedules import split_backward_refusal, unreached_params
from tests.conftest import captured


def _stages(graph, cuts: list[int]) -> list[Stage]:
    names = [node.name for node in graph.nodes]
    bounds = [0, *cuts, len(names)]
    return [
        Stage(index=k, nodes=tuple(names[a:b]), devices=(k,), mesh_shape=(1,))
        for k, (a, b) in enumerate(itertools.pairwise(bounds))
    ]


def test_embeddings_looked_up_from_integer_inputs_in_a_later_stage_are_unreached() -> None:
    """The recommender's second stage looks two embeddings up from the integer ``categorical`` input and sends them
    on: no input that needs a gradient reaches them (the compatibility sweep's one mismatch, 2026-11-28: auto's
    zero-bubble plan at world 4 lost both gradients)."""
    graph = captured("zoo/nn_recommender", batch_size=4)
    names = [node.name for node in graph.nodes]
    stages = _stages(graph, [names.index("select"), names.index("embedding_2")])
    assert unreached_params(graph, stages[1].nodes) == ["embeddings.0.weight", "embeddings.1.weight"]
    refusal = split_backward_refusal(graph, stages)
    assert refusal is not None and "stage 1" in refusal and "embeddings.0.weight (2 parameter(s))" in refusal
    assert split_backward_refusal(graph, stages[:1]) is None  # the first stage runs its whole backward at once


def test_a_transformer_cut_anywhere_reaches_every_parameter() -> None:
    """GPT's later stages read what the stage before sent at every layer (the tied head included)."""
    graph = captured("gpt", batch_size=4, size="tiny")
    count = len(graph.nodes)
    for cut in range(1, count, max(1, count // 7)):
        assert split_backward_refusal(graph, _stages(graph, [cut])) is None, cut
