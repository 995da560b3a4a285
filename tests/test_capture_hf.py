"""Hugging Face transformers GPT-2 and BERT (examples/hf_*.py), captured on meta and on real weights.

Skipped when transformers is not installed (``pip install -e ".[hf]"``), except the test of the
error a model file gives without it.
"""

from __future__ import annotations

import functools
import os
import sys
from collections import Counter

import pytest
import torch

from planner.errors import AutoplanError
from planner.ir.capture import capture
from planner.ir.graph import NodeKind, OpGraph
from planner.ir.model_file import instantiate, load_model_file
from tests.conftest import EXAMPLES

os.environ.setdefault("HF_HUB_OFFLINE", "1")

BATCH, SEQ, LAYERS, HIDDEN, VOCAB = 2, 32, 2, 64, 512  # the model files' defaults
MODELS = ("hf_gpt2", "hf_bert")
# (matmuls with parameters, layer norms, embeddings, extra hidden x hidden matmuls outside the blocks)
EXPECTED = {"hf_gpt2": (4 * LAYERS + 1, 2 * LAYERS + 1, 2, 0), "hf_bert": (6 * LAYERS + 2, 2 * LAYERS + 2, 3, 1)}
OP_KINDS = {
    "addmm": NodeKind.MATMUL,  # GPT-2's Conv1D
    "linear": NodeKind.MATMUL,
    "layer_norm": NodeKind.NORM,
    "scaled_dot_product_attention": NodeKind.ATTENTION,
    "embedding": NodeKind.EMBEDDING,
}
INPUTS = {"hf_gpt2": ["input_ids"], "hf_bert": ["input_ids", "attention_mask"]}
TIED = {"hf_gpt2": "model.transformer.wte.weight", "hf_bert": "model.bert.embeddings.word_embeddings.weight"}


@pytest.fixture
def transformers():
    return pytest.importorskip("transformers")


@functools.cache
def _built(name: str, on_meta: bool) -> tuple[torch.nn.Module, OpGraph]:
    model_file = load_model_file(EXAMPLES / f"{name}.py")
    model, inputs = instantiate(model_file, batch_size=BATCH, model_args={}, on_meta=on_meta)
    return model, capture(model, inputs)


def _kinds(graph: OpGraph) -> Counter[NodeKind]:
    return Counter(node.kind for node in graph)


@pytest.mark.parametrize("on_meta", [True, False], ids=["meta", "real"])
@pytest.mark.parametrize("name", MODELS)
def test_hf_model_captures(transformers, name: str, on_meta: bool) -> None:
    model, graph = _built(name, on_meta)
    assert all(p.is_meta == on_meta for p in model.parameters())
    expected = dict(model.named_parameters())
    assert len(graph.param_names) == len(set(graph.param_names))
    assert set(graph.param_names) == set(expected)
    assert graph.num_params == sum(p.numel() for p in model.parameters())
    for param in graph.params:
        assert param.meta.shape == tuple(expected[param.name].shape)
    assert [value.name for value in graph.inputs] == INPUTS[name]
    (output,) = graph.outputs
    assert graph.node(output).output.shape == (BATCH, SEQ, VOCAB)

    kinds = _kinds(graph)
    matmuls, norms, embeddings, _ = EXPECTED[name]
    assert NodeKind.OTHER not in kinds, [node.target for node in graph if node.kind == NodeKind.OTHER]
    assert kinds[NodeKind.ATTENTION] == LAYERS
    assert kinds[NodeKind.NORM] == norms
    assert kinds[NodeKind.EMBEDDING] == embeddings
    assert sum(1 for node in graph if node.kind == NodeKind.MATMUL and node.params) == matmuls
    for node in graph:
        if node.kind in (NodeKind.MATMUL, NodeKind.ATTENTION, NodeKind.NORM):
            assert node.module_path.startswith("model."), node
        assert node.kind == OP_KINDS.get(node.op_name, node.kind), node


@pytest.mark.parametrize("on_meta", [True, False], ids=["meta", "real"])
@pytest.mark.parametrize("name", MODELS)
def test_hf_flops_match_closed_form(transformers, name: str, on_meta: bool) -> None:
    _, graph = _built(name, on_meta)
    tokens = BATCH * SEQ
    *_, extra = EXPECTED[name]
    linear = 2 * tokens * ((12 * LAYERS + extra) * HIDDEN**2 + VOCAB * HIDDEN)
    attention = 4 * BATCH * SEQ**2 * HIDDEN * LAYERS  # QK^T and PV
    assert graph.flops_fwd == linear + attention
    assert graph.flops_bwd == 2 * graph.flops_fwd


@pytest.mark.parametrize("name", MODELS)
def test_hf_tied_embedding_is_one_parameter(transformers, name: str) -> None:
    _, graph = _built(name, True)
    readers = [node for node in graph if TIED[name] in node.params]
    assert {node.kind for node in readers} == {NodeKind.EMBEDDING, NodeKind.MATMUL}
    assert not any(".decoder." in n or "lm_head" in n for n in graph.param_names)


@pytest.mark.parametrize("name", MODELS)
def test_hf_meta_and_real_agree(transformers, name: str) -> None:
    (_, on_meta), (_, real) = _built(name, True), _built(name, False)
    assert on_meta.param_names == real.param_names
    assert on_meta.flops_fwd == real.flops_fwd
    important = (NodeKind.MATMUL, NodeKind.ATTENTION, NodeKind.NORM, NodeKind.EMBEDDING)
    assert [_kinds(on_meta)[k] for k in important] == [_kinds(real)[k] for k in important]


@pytest.mark.parametrize("name", MODELS)
def test_hf_model_file_without_transformers(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers -> ImportError
    model_file = load_model_file(EXAMPLES / f"{name}.py")
    with pytest.raises(AutoplanError, match=r"autoplan\[hf\]"):
        instantiate(model_file, batch_size=BATCH, model_args={})
