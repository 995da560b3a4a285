"""The model-file convention: targets beside the inputs, neighbours importable, clear capture errors."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from planner.errors import AutoplanError
from planner.ir.capture import capture
from planner.ir.model_file import instantiate, instantiate_targets, load_model_file

CONVNET = """
import torch
import torch.nn.functional as F
from torch import nn
from helpers_beside import CLASSES

def build_model():
    return nn.Sequential(nn.Conv2d(3, 4, 3, stride=2), nn.BatchNorm2d(4), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                         nn.Flatten(), nn.Linear(4, CLASSES))

def example_inputs(batch_size):
    return {inputs}

def example_targets(batch_size):
    return torch.randint(0, CLASSES, (batch_size,))

def loss_fn(output, targets):
    return F.cross_entropy(output, targets[0])
"""


def _write(tmp_path: Path, inputs: str) -> Path:
    (tmp_path / "helpers_beside.py").write_text("CLASSES = 5\n")
    path = tmp_path / "convnet.py"
    path.write_text(CONVNET.format(inputs=inputs))
    return path


def test_targets_are_separate_from_the_inputs(tmp_path: Path) -> None:
    model_file = load_model_file(_write(tmp_path, "(torch.randn(batch_size, 3, 8, 8),)"))
    assert model_file.has_targets
    model, inputs = instantiate(model_file, batch_size=4, model_args={})
    graph = capture(model, inputs)
    assert len(graph.inputs) == 1
    targets = instantiate_targets(model_file, batch_size=4, model_args={}, on_meta=False)
    assert len(targets) == 1 and targets[0].shape == (4,) and targets[0].dtype == torch.int64
    assert not any(node.flops_fwd < 0 for node in graph.nodes)


def test_a_file_that_passes_labels_as_inputs_is_told_so(tmp_path: Path) -> None:
    """The user's mistake: labels among the forward inputs. The error counts, and points at targets."""
    path = _write(tmp_path, "(torch.randn(batch_size, 3, 8, 8), torch.randint(0, 5, (batch_size,)))")
    model, inputs = instantiate(load_model_file(path), batch_size=4, model_args={})
    with pytest.raises(AutoplanError, match=r"forward takes 1 input.*example_inputs gives 2.*example_targets"):
        capture(model, inputs)


def test_files_without_targets_keep_working() -> None:
    model_file = load_model_file(Path(__file__).resolve().parent.parent / "examples" / "mlp.py")
    assert not model_file.has_targets
    assert instantiate_targets(model_file, batch_size=4, model_args={}) == ()


def test_batch_norm_buffers_do_not_break_the_meta_run(tmp_path: Path) -> None:
    model_file = load_model_file(_write(tmp_path, "(torch.randn(batch_size, 3, 8, 8),)"))
    model, inputs = instantiate(model_file, batch_size=4, model_args={})
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "could not run ... on meta tensors" would fail here
        capture(model, inputs)


def test_a_tuple_and_its_getitems_share_a_layer() -> None:
    """Stage boundaries fall between layers: the LSTM's (output, (h, c)) tuple never crosses one."""
    from planner.ir.layers import graph_layers

    zoo = Path(__file__).resolve().parent.parent / "examples" / "zoo"
    model, inputs = instantiate(load_model_file(zoo / "nn_lstm.py"), batch_size=4, model_args={})
    graph = capture(model, inputs)
    layer_of = {name: index for index, layer in enumerate(graph_layers(graph, num_layers=4)) for name in layer}
    for node in graph.nodes:
        if node.target.endswith("getitem") and len(graph.node(node.inputs[0]).outputs) > 1:
            assert layer_of[node.name] == layer_of[node.inputs[0]], node.name


def test_placements_send_only_the_outputs_someone_reads() -> None:
    from executors.parallel.placement import used_outputs

    zoo = Path(__file__).resolve().parent.parent / "examples" / "zoo"
    model, inputs = instantiate(load_model_file(zoo / "nn_recommender.py"), batch_size=4, model_args={})
    graph = capture(model, inputs)
    bag = next(node for node in graph.nodes if "embedding_bag" in node.target)
    assert len(bag.outputs) == 4 and used_outputs(graph)[bag.name] == frozenset({0})
