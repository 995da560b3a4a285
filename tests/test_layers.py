"""Layers: repeated blocks from module paths, Alpa's clustering DP, layer subgraphs and their options."""

from __future__ import annotations

import itertools

import pytest
import torch

from planner.inter.layer_costs import SLOTS, SOURCES, layer_table
from planner.intra.stage_problem import IntraOpOptions
from planner.ir.capture import capture
from planner.ir.graph import subgraph
from planner.ir.layers import (
    boundary_bytes,
    cluster_layers,
    collapse_identical_layers,
    graph_layers,
    keep_tuples_whole,
)
from tests.conftest import captured, mesh_for, setup_for


def test_gpt_layers_follow_the_blocks() -> None:
    graph = captured("gpt", 4, "export", size="tiny", layers=3)
    layers = graph_layers(graph)
    assert [len(layer) for layer in layers] == [3, 20, 20, 20, 2]
    assert all(graph.node(name).module_path.startswith("blocks.1") for name in layers[2])
    collapsed = collapse_identical_layers(graph)
    assert collapsed.runs == ((3, 20),)
    assert len(collapsed.unique_nodes) == len(graph) - 40


def test_boundary_bytes_hand_worked() -> None:
    graph = captured("mlp", 8, "export", hidden=64, layers=2)  # fc1, gelu, fc2, add per block
    cut = boundary_bytes(graph)
    activation = 8 * 64 * 4
    assert cut[0] == activation  # fc1's output (to gelu); graph inputs are not node outputs and never count
    assert cut[3] == activation  # after block 0: only its sum crosses
    assert cut[-1] == 0


def brute_force_clusters(graph, num_layers: int, cap: float) -> float:
    flops = [n.flops_fwd + n.flops_bwd for n in graph.nodes]
    cut = boundary_bytes(graph)
    best = float("inf")
    for bounds in itertools.combinations(range(1, len(flops)), num_layers - 1):
        edges = (0, *bounds, len(flops))
        if all(sum(flops[a:b]) <= cap for a, b in itertools.pairwise(edges)):
            best = min(best, max((cut[b - 1] for b in bounds), default=0.0))
    return best


@pytest.mark.parametrize("num_layers", [2, 3, 4])
def test_clustering_matches_brute_force(num_layers: int) -> None:
    graph = captured("resnet", 4, "export", width=8, blocks=1)
    total = graph.flops_fwd + graph.flops_bwd
    layers = cluster_layers(graph, num_layers=num_layers, tolerance=0.5)
    assert [name for layer in layers for name in layer] == [n.name for n in graph.nodes]
    assert len(layers) == num_layers
    cap = 1.5 * total / num_layers
    position = {n.name: i for i, n in enumerate(graph.nodes)}
    cut = boundary_bytes(graph)
    achieved = max((cut[position[layer[-1]]] for layer in layers[:-1]), default=0.0)
    assert achieved == brute_force_clusters(graph, num_layers, cap)


def test_subgraph_turns_outside_values_into_inputs() -> None:
    graph = captured("gpt", 4, "export", size="tiny")
    block = graph_layers(graph)[2]
    part = subgraph(graph, block)
    assert len(part) == len(block)
    assert all(p.startswith("blocks.1.") for p in part.param_names)
    (source,) = part.inputs
    assert graph.has_node(source.name) and source.meta.shape == (4, 32, 64)
    assert part.outputs == (block[-1],)


def test_layer_table_trades_time_for_memory() -> None:
    graph = captured("gpt", 16, "export", size="tiny", hidden=512, heads=8)
    block = subgraph(graph, graph_layers(graph)[1])
    setup = setup_for()
    table = layer_table(block, setup, mesh_for(setup, (8,)), options=IntraOpOptions())
    assert len(table.options) == len(SLOTS)
    sweep = [table.options[SLOTS.index((f"λ={kappa:g}", "none", 0))] for kappa in (0.0, 0.25, 1.0, 4.0)]
    memory = [o.state_bytes + o.activation_bytes for o in sweep]
    assert all(b <= a * (1 + 1e-9) for a, b in itertools.pairwise(memory))  # more weight on memory, less memory
    assert all(b.time_s >= a.time_s * (1 - 1e-9) for a, b in itertools.pairwise(sweep))
    assert memory[-1] < memory[0]
    for source in SOURCES:
        plain, remat = (table.options[SLOTS.index((source, kind, 0))] for kind in ("none", "full"))
        assert remat.time_s > plain.time_s and remat.activation_bytes < plain.activation_bytes
    replicas, zero = (table.options[SLOTS.index(("data-parallel", "none", level))] for level in (0, 1))
    assert zero.state_bytes == pytest.approx(replicas.state_bytes * (2 + 2 + 12 / 8) / 16)  # ZeRO-1: Adam state / 8
    unsharded = [o for (_, kind, level), o in zip(SLOTS, table.options, strict=True) if (kind, level) == ("none", 0)]
    assert sweep[0].time_s <= min(o.time_s for o in unsharded)  # λ = 0 is the exact fastest


class _TokensAcross(torch.nn.Module):
    """The token ids (int64) live across the cut after fc1: the embedding reads them at the end."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(16, 16)
        self.embed = torch.nn.Embedding(10, 16)

    def forward(self, x: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        ids = tokens + 1
        return self.fc1(x).relu() + self.embed(ids)


def test_boundary_bytes_count_each_value_at_its_dtype() -> None:
    graph = capture(_TokensAcross(), (torch.randn(4, 16), torch.zeros(4, dtype=torch.long)))
    position = {node.name: k for k, node in enumerate(graph.nodes)}
    after_fc1 = position[next(n.name for n in graph.nodes if n.kind.name == "MATMUL")]
    ids = 4 * 8  # four int64 token ids
    fc1 = 4 * 16
    assert boundary_bytes(graph)[after_fc1] == ids + fc1 * 4
    # mixed precision halves floats only; integer ids keep 8 bytes each and send back no gradient
    assert boundary_bytes(graph, activation_itemsize=2)[after_fc1] == ids + fc1 * 2
    assert boundary_bytes(graph, activation_itemsize=2, gradients=True)[after_fc1] == fc1 * 2


def test_an_lstm_tuple_stays_whole_when_each_getitem_is_a_layer() -> None:
    """An LSTM's output tuple is unpacked by three ``getitem`` nodes; clustered one node per layer, every one of
    them moves into the LSTM's layer (not into the layer its neighbour left empty), so no cut carries the tuple."""

    class LSTMLanguageModel(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = torch.nn.Embedding(32, 8)
            self.lstm = torch.nn.LSTM(8, 8, num_layers=2, batch_first=True)
            self.head = torch.nn.Linear(8, 32)

        def forward(self, tokens: torch.Tensor) -> torch.Tensor:
            out, _ = self.lstm(self.embed(tokens))
            return self.head(out)

    graph = capture(LSTMLanguageModel(), (torch.randint(0, 32, (4, 6)),), tracer="export")
    layers = keep_tuples_whole(graph, [[node.name] for node in graph.nodes])
    (lstm_layer,) = [layer for layer in layers if "lstm" in layer]
    assert lstm_layer == ["lstm", "getitem", "getitem_1", "getitem_2"]
    assert [name for layer in layers for name in layer] == [node.name for node in graph.nodes]
