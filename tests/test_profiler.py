"""Tests for cost_models.profiling.profiler: real timings of small example models on the CPU."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from cost_models.cluster import preset
from cost_models.compute import NodeTime, ProfiledCompute, RooflineCompute
from cost_models.profiling.profiler import (
    NodeMeasurer,
    ProfileCache,
    default_cache_path,
    node_memory_bytes,
    profile_graph,
)
from planner.errors import AutoplanError
from planner.ir.graph import GraphValue, NodeKind, OpGraph, OpNode, TensorArg, TensorMeta, ValueKind
from tests.conftest import captured

FAST = {"warmup": 1, "repeats": 3}


@pytest.fixture(scope="module")
def mlp_graph() -> OpGraph:
    return captured("mlp", 8, hidden=64, layers=2)


@pytest.fixture(scope="module")
def gpt_graph() -> OpGraph:
    return captured("gpt", 8, size="tiny")


def _positive_finite(value: float) -> bool:
    return math.isfinite(value) and value > 0


def test_mlp_every_node_timed_and_identical_layers_deduplicated(mlp_graph: OpGraph) -> None:
    result = profile_graph(mlp_graph, **FAST)
    assert dict(result.skipped) == {}
    assert result.cached_hits == 0
    for node in mlp_graph:
        node_time = result.times[node.signature()]
        if node.kind == NodeKind.VIEW:
            assert node_time.fwd_s == 0 and node_time.bwd_s == 0
            continue
        assert _positive_finite(node_time.fwd_s), node.name
        if node.op_name == "linear":
            assert _positive_finite(node_time.bwd_s), node.name
    distinct = {node.signature() for node in mlp_graph}
    assert len(result.times) == len(distinct) < len(mlp_graph)
    assert result.measured == len(distinct)


def test_gpt_tiny_profiles_without_failures(gpt_graph: OpGraph) -> None:
    result = profile_graph(gpt_graph, **FAST)
    assert dict(result.skipped) == {}
    by_op = {node.op_name: result.times[node.signature()] for node in gpt_graph}
    for op_name in ("embedding", "scaled_dot_product_attention", "layer_norm", "linear", "gelu"):
        assert _positive_finite(by_op[op_name].fwd_s), op_name
        assert _positive_finite(by_op[op_name].bwd_s), op_name
    views = [node for node in gpt_graph if node.kind == NodeKind.VIEW]
    assert views
    assert all(result.times[node.signature()].total_s == 0 for node in views)


def test_progress_reports_each_distinct_signature(mlp_graph: OpGraph) -> None:
    calls: list[tuple[int, int]] = []
    profile_graph(mlp_graph, progress=lambda done, total: calls.append((done, total)), **FAST)
    total = len({node.signature() for node in mlp_graph})
    assert calls == [(done, total) for done in range(1, total + 1)]


def test_second_run_is_served_from_the_cache(mlp_graph: OpGraph, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("AUTOPLAN_CACHE_DIR", str(tmp_path))
    cache = ProfileCache(device="cpu")
    assert cache.path == tmp_path / "profile-cpu.json" == default_cache_path("cpu")
    first = profile_graph(mlp_graph, cache=cache, **FAST)
    assert cache.path.is_file()
    assert first.cached_hits == 0 and first.measured > 0

    second = profile_graph(mlp_graph, cache=ProfileCache(device="cpu"), **FAST)
    assert second.cached_hits == first.measured
    assert second.measured == 0
    assert dict(second.times) == dict(first.times)


def test_cache_key_includes_thread_count(mlp_graph: OpGraph, tmp_path: Path) -> None:
    cache = ProfileCache(tmp_path / "cache.json")
    profile_graph(mlp_graph, cache=cache, **FAST)
    torch.set_num_threads(2)
    again = profile_graph(mlp_graph, cache=cache, **FAST)
    assert again.cached_hits == 0


@pytest.mark.parametrize("content", ["{not json", '{"version": 1, "entries": {"cpu": {"sig": {"fwd_s": "x"}}}}', "[]"])
def test_corrupt_cache_file_is_ignored_with_a_warning(mlp_graph: OpGraph, tmp_path: Path, content: str) -> None:
    path = tmp_path / "profile-cpu.json"
    path.write_text(content)
    with pytest.warns(UserWarning, match="ignoring unreadable profile cache"):
        cache = ProfileCache(path)
    result = profile_graph(mlp_graph, cache=cache, **FAST)
    assert result.cached_hits == 0 and not result.skipped
    saved = json.loads(path.read_text())
    assert saved["version"] == 1
    assert sum(len(table) for table in saved["entries"].values()) == result.measured


def test_nodes_larger_than_max_bytes_are_skipped(gpt_graph: OpGraph) -> None:
    timed_nodes = [node for node in gpt_graph if node.kind != NodeKind.VIEW]
    largest = max(node_memory_bytes(node) for node in timed_nodes)
    result = profile_graph(gpt_graph, max_bytes=largest - 1, **FAST)
    too_big = {node.name for node in timed_nodes if node_memory_bytes(node) == largest}
    assert too_big and set(result.skipped) == too_big
    assert all("GiB" in reason for reason in result.skipped.values())
    for node in gpt_graph:
        assert (node.signature() in result.times) == (node.name not in too_big)


def test_failing_node_is_skipped_with_its_reason() -> None:
    left = TensorMeta(shape=(2, 3), dtype="float32")
    right = TensorMeta(shape=(4, 5), dtype="float32")
    broken = OpNode(
        name="mm",
        target="aten.mm.default",
        kind=NodeKind.MATMUL,
        inputs=("a", "b"),
        input_metas=(left, right),
        outputs=(TensorMeta(shape=(2, 5), dtype="float32"),),
        args=(TensorArg(0), TensorArg(1)),
    )
    graph = OpGraph(
        nodes=(broken,),
        inputs=(
            GraphValue(name="a", kind=ValueKind.INPUT, meta=left),
            GraphValue(name="b", kind=ValueKind.INPUT, meta=right),
        ),
        params=(),
    )
    result = profile_graph(graph, **FAST)
    assert dict(result.times) == {}
    assert result.skipped["mm"].startswith("failed to run: RuntimeError")


def test_profiled_compute_covers_the_graph_and_falls_back(gpt_graph: OpGraph) -> None:
    device_spec = preset("local-cpu").device
    compute = ProfiledCompute(
        table=profile_graph(gpt_graph, **FAST).times, fallback=RooflineCompute(device=device_spec)
    )
    nodes = list(gpt_graph)
    assert compute.coverage(nodes) == 1.0
    roofline = RooflineCompute(device=device_spec)
    assert compute.fallback.node_time(nodes[0]) == roofline.node_time(nodes[0])


def test_nodes_of_other_batch_sizes_are_measured_once_and_cached(tmp_path: Path) -> None:
    """The graph at a microbatch size has other signatures: measured when first priced, then kept."""
    device_spec = preset("local-cpu").device
    full, half = captured("mlp", 8, hidden=64, layers=2), captured("mlp", 4, hidden=64, layers=2)
    calls: list[str] = []
    measurer = NodeMeasurer(cache=ProfileCache(tmp_path / "cache.json"), **FAST)

    def measure(node: OpNode):
        calls.append(node.signature())
        return measurer(node)

    table = profile_graph(full, **FAST).times
    compute = ProfiledCompute(table=table, fallback=RooflineCompute(device=device_spec), measure=measure)
    nodes = [node for node in half if node.kind != NodeKind.VIEW]
    assert compute.coverage(nodes) == 1.0
    assert len(calls) == len({node.signature() for node in nodes}) > 0
    assert all(_positive_finite(compute.node_time(node).fwd_s) for node in nodes)
    assert len(calls) == len(set(calls))  # asked again: served from memory
    assert len(json.loads((tmp_path / "cache.json").read_text())["entries"]) == 1


def test_measured_times_take_the_shared_slowdown_and_keep_a_fixed_part() -> None:
    node = next(iter(captured("mlp", 8, hidden=64, layers=2)))
    table = {node.signature(): NodeTime(fwd_s=4e-5, bwd_s=8e-5)}
    roofline = RooflineCompute(device=preset("local-cpu").device)
    compute = ProfiledCompute(table=table, fallback=roofline, slowdown=2.0, overhead_s=1e-5)
    time = compute.node_time(node)
    assert (time.fwd_s, time.bwd_s, time.overhead_s) == pytest.approx((8e-5, 16e-5, 1e-5))
    half = time.scaled(0.5)
    assert (half.fwd_s, half.bwd_s) == pytest.approx((1e-5 + 3.5e-5, 1e-5 + 7.5e-5))


def test_bad_options_are_user_errors(mlp_graph: OpGraph) -> None:
    with pytest.raises(AutoplanError):
        profile_graph(mlp_graph, repeats=0)
    with pytest.raises(AutoplanError):
        profile_graph(mlp_graph, warmup=-1)
    with pytest.raises(AutoplanError):
        profile_graph(mlp_graph, device="not-a-device")
    if not torch.cuda.is_available():
        with pytest.raises(AutoplanError, match="no CUDA"):
            profile_graph(mlp_graph, device="cuda")
