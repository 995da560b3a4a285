"""The memory model: bytes per parameter by optimizer and sharding, saved activations."""

from __future__ import annotations

import pytest

from cost_models.memory import OPTIMIZERS, model_state_bytes, saved_activation_bytes
from planner.errors import AutoplanError
from tests.conftest import captured, setup_for


def test_mixed_precision_adam_is_16_bytes_per_param() -> None:
    assert OPTIMIZERS["adam-mixed"].total == 16
    assert model_state_bytes(1e9, optimizer="adam-mixed") == 16e9
    assert model_state_bytes(1e9, optimizer="adam-fp32") == 16e9
    assert model_state_bytes(1e9, optimizer="sgd") == 8e9


def test_zero_stages_shard_their_parts() -> None:
    d = 8
    # ZeRO-1: 2 + 2 + 12/8 ; ZeRO-2: 2 + (2 + 12)/8 ; ZeRO-3: 16/8
    assert model_state_bytes(1e9, optimizer="adam-mixed", state_shards=d) == pytest.approx(5.5e9)
    assert model_state_bytes(1e9, optimizer="adam-mixed", state_shards=d, grad_shards=d) == pytest.approx(3.75e9)
    assert model_state_bytes(
        1e9, optimizer="adam-mixed", state_shards=d, grad_shards=d, weight_shards=d
    ) == pytest.approx(2e9)
    with pytest.raises(AutoplanError, match="unknown optimizer"):
        model_state_bytes(1, optimizer="adagrad")


def test_mlp_saved_activations_hand_worked() -> None:
    # Each block: fc1 saves its input x (B·d), gelu saves fc1's output (B·h), fc2 saves gelu's
    # output (B·h); the residual add saves nothing. Blocks chain, so block i's x is block i-1's sum.
    batch, hidden, layers = 8, 64, 3
    graph = captured("mlp", batch, "export", hidden=hidden, layers=layers)
    expected = layers * (batch * hidden + 2 * batch * hidden) * 4
    assert saved_activation_bytes(graph) == expected
    assert saved_activation_bytes(graph, activation_itemsize=2) == expected // 2


def test_activations_grow_linearly_with_batch() -> None:
    small = saved_activation_bytes(captured("gpt", 2, "export", size="tiny"))
    large = saved_activation_bytes(captured("gpt", 4, "export", size="tiny"))
    assert large == 2 * small


def _dropout_graph(p: float):
    import torch

    from planner.ir.capture import capture

    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Dropout(p), torch.nn.Linear(8, 8))
    return capture(model, (torch.randn(4, 8),))


def test_dropout_keeps_a_one_byte_mask() -> None:
    # the two linears keep their inputs (4x8 fp32 each); dropout keeps its 4x8 bool mask, 1 byte an element
    assert saved_activation_bytes(_dropout_graph(0.1)) == 2 * 4 * 8 * 4 + 4 * 8
    assert saved_activation_bytes(_dropout_graph(0.1), activation_itemsize=2) == 2 * 4 * 8 * 2 + 4 * 8
    assert saved_activation_bytes(_dropout_graph(0.0)) == 2 * 4 * 8 * 4  # p = 0: the identity, no mask


def test_the_planner_charges_the_mask_where_the_dropout_runs() -> None:
    from planner.costing.node_cost import node_cost, strategy_context
    from planner.sharding.op_rules import enumerate_strategies
    from planner.sharding.sequence_parallel import computed_output
    from planner.sharding.specs import StageMesh

    graph = _dropout_graph(0.1)
    setup = setup_for()
    mesh = StageMesh(cluster=setup.cluster, devices=(0, 1), mesh_shape=(2,), activation_itemsize=2)
    context = strategy_context(graph, setup, mesh)
    dropout = next(node for node in graph.nodes if node.op_name == "dropout")
    strategies = enumerate_strategies(dropout, context)[0]
    for strategy in strategies:  # where it runs: a gathered output (R*, sequence parallelism) is computed on shards
        cost = node_cost(dropout, strategy, setup, mesh, saved=False)
        computed = computed_output(strategy, rank=len(dropout.output.shape))
        assert cost.activation_bytes == pytest.approx(4 * 8 / computed.num_shards(mesh.mesh_shape))
    assert any(strategy.output.placements == ("R*",) for strategy in strategies)
