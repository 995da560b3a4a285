"""The discrete-event simulator against schedules worked out by hand and the analytic pipeline formulas."""

from __future__ import annotations

import pytest

from cost_models.simulator import TaskGraph, simulate
from planner.costing.lowered_tasks import pipeline_order
from planner.costing.lowering import simulate_lowered
from tests.conftest import pipeline


def spans_of(result) -> dict[tuple[str, str], tuple[float, float]]:
    return {(span.resource, span.task): (span.start_s, span.end_s) for span in result.spans}


def test_gpipe_two_stages_by_hand() -> None:
    result = simulate_lowered(pipeline([1, 1], [2, 2], m=2, schedule="gpipe"), record=True)
    spans = spans_of(result)
    assert spans["stage 0", "F0 c0"] == (0, 1) and spans["stage 0", "F1 c0"] == (1, 2)
    assert spans["stage 1", "F0 c1"] == (1, 2) and spans["stage 1", "F1 c1"] == (2, 3)
    assert spans["stage 1", "B0 c1"] == (3, 5) and spans["stage 1", "B1 c1"] == (5, 7)
    assert spans["stage 0", "B0 c0"] == (5, 7) and spans["stage 0", "B1 c0"] == (7, 9)
    assert result.step_time_s == 9
    assert result.busy_s == (6, 6) and result.idle_s == (3, 3)
    assert result.bubble_fraction == pytest.approx(1 / 3)  # (p − 1) / (m + p − 1)


def test_1f1b_two_stages_by_hand_holds_fewer_activations() -> None:
    result = simulate_lowered(pipeline([1, 1], [2, 2], m=2, schedule="1f1b", act=10), record=True)
    spans = spans_of(result)
    # Stage 1 alternates at once; stage 0 warms up with one forward, then F1, B0, B1.
    assert spans["stage 1", "F0 c1"] == (1, 2) and spans["stage 1", "B0 c1"] == (2, 4)
    assert spans["stage 1", "F1 c1"] == (4, 5) and spans["stage 1", "B1 c1"] == (5, 7)
    assert spans["stage 0", "F1 c0"] == (1, 2) and spans["stage 0", "B0 c0"] == (4, 6)
    assert spans["stage 0", "B1 c0"] == (7, 9)
    assert result.step_time_s == 9
    assert result.peak_memory_bytes == (20, 10)  # in flight: p − s microbatches
    gpipe = simulate_lowered(pipeline([1, 1], [2, 2], m=2, schedule="gpipe", act=10))
    assert gpipe.peak_memory_bytes == (20, 20)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("p", [2, 3, 4])
@pytest.mark.parametrize("m", [1, 2, 4, 8])
def test_equal_stages_follow_the_analytic_formula(schedule: str, p: int, m: int) -> None:
    f, b = 1.0, 2.0
    result = simulate_lowered(pipeline([f] * p, [b] * p, m=m, schedule=schedule, act=1.0))
    assert result.step_time_s == pytest.approx((m + p - 1) * (f + b))
    assert result.bubble_fraction == pytest.approx((p - 1) / (m + p - 1))
    flights = [min(p - s, m) if schedule == "1f1b" else m for s in range(p)]
    assert list(result.peak_memory_bytes) == flights


def test_gpipe_unequal_stages_is_two_flow_shops() -> None:
    """All forwards, then all backwards: Σf + (m − 1)·max f, then Σb + (m − 1)·max b."""
    fwd, bwd, m = [1, 2, 1], [2, 4, 2], 3
    result = simulate_lowered(pipeline(fwd, bwd, m=m, schedule="gpipe"))
    assert result.step_time_s == pytest.approx(sum(fwd) + (m - 1) * max(fwd) + sum(bwd) + (m - 1) * max(bwd))


def test_transfers_and_step_lengthen_the_critical_path() -> None:
    result = simulate_lowered(pipeline([1, 1], [2, 2], m=1, schedule="1f1b", transfer_s=0.5, step_s=0.25))
    # F0 [0,1], send [1,1.5], F1 [1.5,2.5], B1 [2.5,4.5], send [4.5,5], B0 [5,7], step [7,7.25].
    assert result.step_time_s == pytest.approx(7.25)
    assert result.busy_s == pytest.approx((3.25, 3.25))


def test_1f1b_order_warms_up_then_alternates() -> None:
    order = pipeline_order("1f1b", num_stages=4, stage=1, num_microbatches=4)
    assert order == [("F", 0), ("F", 1), ("F", 2), ("B", 0), ("F", 3), ("B", 1), ("B", 2), ("B", 3)]
    assert pipeline_order("1f1b", num_stages=4, stage=3, num_microbatches=2) == [("F", 0), ("B", 0), ("F", 1), ("B", 1)]
    assert pipeline_order("gpipe", num_stages=2, stage=0, num_microbatches=2) == [
        ("F", 0),
        ("F", 1),
        ("B", 0),
        ("B", 1),
    ]


def test_ready_order_runs_by_priority_then_arrival() -> None:
    graph = TaskGraph(num_devices=1)
    device = graph.add_resource("d", devices=(0,))
    first = graph.add_task("first", resource=device, duration_s=1)
    late = graph.add_task("late", resource=device, duration_s=1, deps=(first,), priority=1)
    urgent = graph.add_task("urgent", resource=device, duration_s=1, deps=(first,), priority=0)
    result = simulate(graph, record=True)
    starts = {span.task: span.start_s for span in result.spans}
    assert starts["urgent"] == 1 and starts["late"] == 2 and result.step_time_s == 3
    assert late < urgent  # created first, yet runs second: priority beats creation order


def test_fixed_order_waits_for_its_next_task_even_if_another_is_ready() -> None:
    graph = TaskGraph(num_devices=2)
    a, b = graph.add_resource("a", devices=(0,), order="fixed"), graph.add_resource("b", devices=(1,))
    slow = graph.add_task("slow", resource=b, duration_s=5)
    waits = graph.add_task("waits", resource=a, duration_s=1, deps=(slow,))
    free = graph.add_task("free", resource=a, duration_s=1)
    graph.set_order(a, [waits, free])
    result = simulate(graph, record=True)
    starts = {span.task: span.start_s for span in result.spans}
    assert starts["waits"] == 5 and starts["free"] == 6 and result.step_time_s == 7


def test_memory_peaks_while_allocations_overlap() -> None:
    graph = TaskGraph(num_devices=1)
    device = graph.add_resource("d", devices=(0,), base_memory_bytes=100)
    one = graph.add_task("alloc 1", resource=device, duration_s=1, alloc_bytes=10)
    two = graph.add_task("alloc 2", resource=device, duration_s=1, alloc_bytes=20, deps=(one,))
    graph.add_task("free both", resource=device, duration_s=1, free_bytes=30, deps=(two,))
    graph.add_task("alloc 3", resource=device, duration_s=1, alloc_bytes=5, deps=(2,))
    assert simulate(graph).peak_memory_bytes == (130,)


def test_an_order_that_cannot_run_is_an_internal_error() -> None:
    graph = TaskGraph(num_devices=1)
    device = graph.add_resource("d", devices=(0,), order="fixed")
    first = graph.add_task("first", resource=device, duration_s=1)
    second = graph.add_task("second", resource=device, duration_s=1, deps=(first,))
    graph.set_order(device, [second, first])
    with pytest.raises(AssertionError, match="stalled"):
        simulate(graph)


def test_links_overlap_with_compute_and_devices_without_work_are_not_bubbles() -> None:
    graph = TaskGraph(num_devices=3)
    d0, d1 = graph.add_resource("d0", devices=(0,)), graph.add_resource("d1", devices=(1,))
    link = graph.add_resource("link 0>1")
    produce = graph.add_task("produce", resource=d0, duration_s=1)
    graph.add_task("send", resource=link, duration_s=2, deps=(produce,))
    graph.add_task("more", resource=d0, duration_s=2, deps=(produce,))
    graph.add_task("consume", resource=d1, duration_s=1, deps=(1,))
    result = simulate(graph)
    assert result.step_time_s == 4 and result.busy_s == (3, 1, 0)
    assert result.bubble_fraction == pytest.approx(1 - 4 / 8)


def test_a_background_task_runs_on_the_timeline_but_not_in_the_step() -> None:
    graph = TaskGraph(num_devices=1)
    device = graph.add_resource("device", devices=(0,))
    link = graph.add_resource("hidden link")
    compute = graph.add_task("compute", resource=device, duration_s=1.0)
    graph.add_task("exposed", resource=device, duration_s=0.5, deps=(compute,), end_of_step=True)
    graph.add_task("hidden", resource=link, duration_s=3.0, deps=(compute,), background=True)
    result = simulate(graph, record=True)
    assert result.step_time_s == 1.5 and result.background_s == 3.0 and result.idle_s == (0.0,)
    assert {span.task: span.end_s for span in result.spans}["hidden"] == 4.0  # drawn past the step's end
