"""Capture of every example, both tracers, big models on meta, and FLOPs against closed forms."""

from __future__ import annotations

import math

import pytest
import torch

from planner.errors import AutoplanError
from planner.ir.capture import capture
from planner.ir.graph import NodeKind, TensorMeta, ValueKind
from planner.ir.model_file import instantiate, load_model_file
from tests.conftest import EXAMPLES, captured

SMALL = {
    "mlp": {"hidden": 64, "layers": 2},
    "gpt": {"size": "tiny"},
    "resnet": {"width": 8, "blocks": 1},
    "moe": {"hidden": 32, "experts": 4, "tokens": 8},
}


def gpt_step_flops(*, batch: int, seq: int, layers: int, hidden: int, vocab: int) -> float:
    """REFERENCES.md: 72·B·s·L·h²·(1 + s/(6h) + V/(12·L·h)), forward + backward, no recomputation."""
    return 72 * batch * seq * layers * hidden**2 * (1 + seq / (6 * hidden) + vocab / (12 * layers * hidden))


@pytest.mark.parametrize("tracer", ["export", "fx"])
@pytest.mark.parametrize("name", sorted(SMALL))
def test_every_example_captures(name: str, tracer: str) -> None:
    graph = captured(name, 4, tracer, **SMALL[name])
    model_file = load_model_file(EXAMPLES / f"{name}.py")
    with torch.device("meta"):
        model = model_file.build_model(**SMALL[name])
    expected = dict(model.named_parameters())
    assert set(graph.param_names) == set(expected)
    for param in graph.params:
        assert param.meta.shape == tuple(expected[param.name].shape)
    assert graph.flops_fwd > 0 and graph.flops_bwd >= graph.flops_fwd
    assert all(node.outputs for node in graph.nodes)
    assert {n.name for n in graph.nodes} >= set(graph.outputs) - {v.name for v in graph.inputs}
    assert not [node.name for node in graph.nodes if node.kind == NodeKind.OTHER]


def test_tracers_agree_on_gpt() -> None:
    exported = captured("gpt", 4, "export", size="tiny")
    traced = captured("gpt", 4, "fx", size="tiny")
    assert exported.flops_fwd == traced.flops_fwd
    assert exported.flops_bwd == traced.flops_bwd
    assert [n.kind for n in exported.nodes] == [n.kind for n in traced.nodes]


def test_node_fields_of_a_linear() -> None:
    graph = captured("gpt", 4, "export", size="tiny")
    fc = next(n for n in graph.nodes if n.module_path == "blocks.0.mlp.fc")
    assert fc.kind == NodeKind.MATMUL
    assert fc.params == ("blocks.0.mlp.fc.weight", "blocks.0.mlp.fc.bias")
    assert fc.input_metas[0] == TensorMeta(shape=(4, 32, 64), dtype="float32")
    assert fc.output == TensorMeta(shape=(4, 32, 256), dtype="float32")
    assert fc.flops_fwd == 2 * 4 * 32 * 64 * 256
    assert fc.flops_bwd == 2 * fc.flops_fwd
    assert fc.bytes_moved == sum(m.nbytes for m in (*fc.input_metas, *fc.outputs))
    assert graph.value_kind("tokens") == ValueKind.INPUT


@pytest.mark.parametrize(("size", "layers", "hidden"), [("tiny", 2, 64), ("125m", 12, 768), ("1.3b", 24, 2048)])
def test_gpt_flops_match_closed_form(size: str, layers: int, hidden: int) -> None:
    seq, vocab = (32, 512) if size == "tiny" else (1024, 51200)
    graph = captured("gpt", 2, "export", size=size)
    expected = gpt_step_flops(batch=2, seq=seq, layers=layers, hidden=hidden, vocab=vocab)
    assert graph.flops_fwd + graph.flops_bwd == pytest.approx(expected, rel=0.05)


def test_gpt_per_node_flops_match_closed_form() -> None:
    b, s, h, v = 2, 1024, 768, 51200
    graph = captured("gpt", b, "export", size="125m")
    by_module = {n.module_path: n for n in graph.nodes if n.kind == NodeKind.MATMUL}
    assert by_module["blocks.3.attn.q"].flops_fwd == 2 * b * s * h * h
    assert by_module["blocks.3.mlp.fc"].flops_fwd == 2 * b * s * h * 4 * h
    assert by_module["lm_head"].flops_fwd == 2 * b * s * h * v
    attention = [n for n in graph.nodes if n.kind == NodeKind.ATTENTION]
    assert len(attention) == 12
    assert attention[0].flops_fwd == pytest.approx(4 * b * s * s * h, rel=0.05)


def test_gpt_39b_captures_on_meta_without_weights() -> None:
    graph = captured("gpt", 8, "export", size="39b")
    assert graph.num_params == pytest.approx(39.5e9, rel=0.01)
    expected = gpt_step_flops(batch=8, seq=1024, layers=48, hidden=8192, vocab=51200)
    assert graph.flops_fwd + graph.flops_bwd == pytest.approx(expected, rel=0.05)
    assert len(graph.nodes) > 48 * 15


def test_identical_layers_share_signatures() -> None:
    graph = captured("gpt", 4, "export", size="tiny")
    first = [n.signature() for n in graph.nodes if n.module_path.startswith("blocks.0.")]
    second = [n.signature() for n in graph.nodes if n.module_path.startswith("blocks.1.")]
    assert first and first == second


def test_graph_views() -> None:
    graph = captured("mlp", 4, "export", hidden=64, layers=2)
    nx_graph = graph.to_networkx()
    assert nx_graph.number_of_nodes() == len(graph)
    assert all(nx_graph.edges[e]["bytes"] > 0 for e in nx_graph.edges)
    assert graph.fingerprint() != captured("mlp", 8, "export", hidden=64, layers=2).fingerprint()
    with pytest.raises(AttributeError):
        graph.nodes[0].name = "x"  # type: ignore[misc]


def test_uncapturable_model_is_a_clear_error() -> None:
    class DataDependent(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * 2 if x.sum() > 0 else x

    for tracer in ("export", "fx"):  # no tracer captures a branch on data: say what to change, not the other one
        with pytest.raises(AutoplanError, match=r"could not .*branch on a Python flag.*torch\.cond") as raised:
            capture(DataDependent(), (torch.randn(2, 2),), tracer=tracer)
        assert "--tracer" not in str(raised.value)
    with pytest.raises(AutoplanError, match="unknown tracer"):
        capture(DataDependent(), (torch.randn(2, 2),), tracer="jit")


def test_real_weights_capture_like_meta() -> None:
    model_file = load_model_file(EXAMPLES / "mlp.py")
    model, inputs = instantiate(model_file, batch_size=4, model_args={"hidden": 64, "layers": 2}, on_meta=False)
    graph = capture(model, inputs)
    assert graph.fingerprint() == captured("mlp", 4, "export", hidden=64, layers=2).fingerprint()
    assert math.prod(graph.inputs[0].meta.shape) == 4 * 64
