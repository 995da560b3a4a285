"""Capture once per repeated block (:mod:`planner.ir.repeated_layers`): the graph written from two short exports is
the whole export's, node for node, and a stack that is not provably one layer repeated is exported whole."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from torch import nn

import planner.ir.capture as capture_module
from planner.ir.capture import capture
from planner.ir.repeated_layers import MIN_LAYERS, capture_repeated, find_layer_stack
from planner.preparation import model_from_file

ROOT = Path(__file__).resolve().parent.parent
os.environ.setdefault("HF_HUB_OFFLINE", "1")

# (zoo family, the stack, its head of distinct layers): decoder-only, encoder-only, MoE, a dense head before MoE
# layers (DeepSeek-V3), a distinct first layer (T5's relative attention bias), torch.nn's own encoder layers
WRITTEN = [
    ("hf_llama", "model.model.layers", 0),
    ("hf_gpt2", "model.transformer.h", 0),
    ("hf_bert", "model.bert.encoder.layer", 0),
    ("hf_qwen3_moe", "model.model.layers", 0),
    ("hf_deepseek_v3", "model.model.layers", 1),
    ("hf_t5", "model.encoder.block", 1),
    ("nn_transformer_lm", "encoder.layers", 0),
]


def _exports(model: nn.Module, inputs: tuple) -> tuple[list[int], object]:
    """Spy: the layers the stack held at each export, and an export of the model as it stands."""
    held: list[int] = []
    stack = find_layer_stack(model)

    def export():
        held.append(len(model.get_submodule(stack.path)) if stack else -1)
        return capture(model, inputs)

    return held, export


@pytest.mark.parametrize(("family", "path", "head"), WRITTEN)
def test_the_written_graph_is_the_whole_export(family: str, path: str, head: int) -> None:
    model, inputs, _ = model_from_file(
        ROOT / "examples" / "zoo" / f"{family}.py", batch_size=2, model_args={"layers": 9}
    )
    stack = find_layer_stack(model)
    assert (stack.path, stack.count, stack.head) == (path, 9, head)
    held, export = _exports(model, inputs)
    written = capture_repeated(model, export)
    assert held == [head + 2, head + 3]  # two short exports, nothing else
    whole = capture(model, inputs)
    assert written is not None and written == whole
    assert written.fingerprint() == whole.fingerprint()  # what the ranks check before any step
    assert written.output_tree.leaves == whole.output_tree.leaves


def test_the_planner_captures_reuse_the_layers(monkeypatch: pytest.MonkeyPatch) -> None:
    """``capture(..., reuse_layers=True)`` exports the model twice, cut short, and gives the whole graph."""
    model, inputs, _ = model_from_file(
        ROOT / "examples" / "zoo" / "hf_llama.py", batch_size=2, model_args={"layers": 12}
    )
    layers = model.get_submodule("model.model.layers")
    held: list[int] = []
    real = capture_module._capture_export

    def spy(*args, **kwargs):
        held.append(len(layers))
        return real(*args, **kwargs)

    monkeypatch.setattr(capture_module, "_capture_export", spy)
    written = capture(model, inputs, reuse_layers=True)
    assert held == [2, 3]
    whole = capture(model, inputs)
    assert held == [2, 3, 12] and written == whole


class Block(nn.Module):
    def __init__(self, width: int, *, doubled: bool = False) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)
        self.doubled = doubled

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.linear(x))
        return x + (2 * y if self.doubled else y)


class Stack(nn.Module):
    def __init__(self, blocks: list[nn.Module], width: int = 8) -> None:
        super().__init__()
        self.embed = nn.Linear(4, width)
        self.blocks = nn.ModuleList(blocks)
        self.head = nn.Linear(width, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x).sum(dim=-1)


def _check(model: nn.Module, *, reused: bool) -> None:
    inputs = (torch.randn(3, 4),)
    written = capture_repeated(model, lambda: capture(model, inputs))
    assert (written is not None) == reused
    assert capture(model, inputs, reuse_layers=True) == capture(model, inputs)


def test_identical_blocks_are_written() -> None:
    _check(Stack([Block(8) for _ in range(MIN_LAYERS + 2)]), reused=True)


def test_a_block_configured_otherwise_stops_the_reuse() -> None:
    """The last three blocks double their output (an attribute): the identical run is too short to reuse."""
    blocks = [Block(8, doubled=i >= MIN_LAYERS - 1) for i in range(MIN_LAYERS + 2)]
    assert find_layer_stack(Stack(blocks)) is None
    _check(Stack(blocks), reused=False)


def test_a_distinct_first_block_is_the_head() -> None:
    blocks = [Block(8, doubled=i == 0) for i in range(MIN_LAYERS + 2)]
    assert find_layer_stack(Stack(blocks)).head == 1
    _check(Stack(blocks), reused=True)


def test_shared_blocks_and_short_stacks_are_exported_whole() -> None:
    shared = Block(8)
    assert find_layer_stack(Stack([shared] * (MIN_LAYERS + 2))) is None  # one module, its weights shared
    assert find_layer_stack(Stack([Block(8) for _ in range(MIN_LAYERS - 1)])) is None
    _check(Stack([shared] * (MIN_LAYERS + 2)), reused=False)


def test_per_layer_config_lists_stop_the_reuse() -> None:
    """ModernBERT alternates global and local attention by its config's per-layer list: exported whole."""
    model, inputs, _ = model_from_file(
        ROOT / "examples" / "zoo" / "hf_modernbert.py", batch_size=2, model_args={"layers": 9}
    )
    assert find_layer_stack(model) is None
    assert capture(model, inputs, reuse_layers=True) == capture(model, inputs)


class Gated(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return self.linear(x * gate)


class ReadsFirst(nn.Module):
    """Each block reads the previous block's output and the first block's (T5 hands layer 0's position bias on)."""

    def __init__(self, count: int, width: int = 8) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Gated(width) for _ in range(count))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        first = x
        for index, block in enumerate(self.blocks):
            x = block(x, first)
            first = x if index == 0 else first
        return x.sum(dim=-1)


def test_a_rule_the_longer_export_contradicts_is_not_used() -> None:
    """The short export's template reads the layer before it, which is also the first: the rule written at three
    layers reads layer 1 where the export reads layer 0, so the check against the longer export refuses it."""
    model = ReadsFirst(MIN_LAYERS + 2)
    inputs = (torch.randn(3, 8),)
    assert find_layer_stack(model) is not None
    assert capture_repeated(model, lambda: capture(model, inputs)) is None
    assert capture(model, inputs, reuse_layers=True) == capture(model, inputs)
