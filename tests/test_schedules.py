"""Pipeline schedules: our action orders are torch's, and the plan, simulator and pricing read them alike."""

from __future__ import annotations

import pytest
import torch.distributed.pipelining.schedules as torch_schedules
from torch.distributed.pipelining.stage import _PipelineStageBase

from planner.errors import AutoplanError
from planner.inter.schedule_variants import balanced_cuts
from planner.plan.schedules import check_schedule, rank_actions


class _OrderOnlyStage(_PipelineStageBase):
    """Just what torch's schedule classes read to compute ``pipeline_order`` (no process group)."""

    def __init__(self, *, stage_index: int, num_stages: int, group_size: int) -> None:  # no super(): no group
        self.stage_index, self.num_stages, self.group_size, self.group_rank = stage_index, num_stages, group_size, 0
        self.submod, self.stage_index_to_group_rank, self.has_backward = None, {}, True

    def _create_grad_recv_info(self, *args, **kwargs):  # pragma: no cover - never called
        raise AssertionError

    def _prepare_backward_infra(self, *args, **kwargs):  # pragma: no cover
        raise AssertionError

    def _prepare_forward_infra(self, *args, **kwargs):  # pragma: no cover
        raise AssertionError


TORCH_CLASSES = {"interleaved": "ScheduleInterleaved1F1B", "zero-bubble": "ScheduleInterleavedZeroBubble"}
KINDS = {"FORWARD": "F", "FULL_BACKWARD": "B", "BACKWARD_INPUT": "I", "BACKWARD_WEIGHT": "W"}


def torch_order(schedule: str, *, num_ranks: int, virtual_stages: int, num_microbatches: int) -> dict[int, list]:
    cls = getattr(torch_schedules, TORCH_CLASSES[schedule])
    stages = [
        _OrderOnlyStage(stage_index=k * num_ranks, num_stages=num_ranks * virtual_stages, group_size=num_ranks)
        for k in range(virtual_stages)
    ]
    order = cls(stages, n_microbatches=num_microbatches).pipeline_order
    return {
        rank: [(a.stage_index, KINDS[a.computation_type.name], a.microbatch_index) for a in actions if a is not None]
        for rank, actions in order.items()
    }


CASES = [(p, v, m) for p in (2, 3, 4) for v in (1, 2, 3) for m in (1, 2, 3, 4, 6, 8, 12) if m % max(1, m // p) == 0]


@pytest.mark.parametrize("schedule", ["interleaved", "zero-bubble"])
@pytest.mark.parametrize(("num_ranks", "virtual_stages", "num_microbatches"), CASES)
def test_our_orders_are_torchs(schedule: str, num_ranks: int, virtual_stages: int, num_microbatches: int) -> None:
    if schedule == "interleaved" and virtual_stages == 1:
        pytest.skip("interleaved needs v >= 2 (one stage per rank is 1F1B)")
    expected = torch_order(
        schedule, num_ranks=num_ranks, virtual_stages=virtual_stages, num_microbatches=num_microbatches
    )
    for rank in range(num_ranks):
        ours = rank_actions(
            schedule, num_ranks=num_ranks, virtual_stages=virtual_stages, num_microbatches=num_microbatches, rank=rank
        )
        assert ours == expected[rank], (rank, ours, expected[rank])


def test_every_stage_runs_each_microbatch_once_per_kind() -> None:
    p, v, m = 4, 2, 8
    for schedule, kinds in (("interleaved", "FB"), ("zero-bubble", "FIW")):
        seen = [
            a
            for r in range(p)
            for a in rank_actions(schedule, num_ranks=p, virtual_stages=v, num_microbatches=m, rank=r)
        ]
        assert sorted(seen) == sorted((s, k, i) for s in range(p * v) for k in kinds for i in range(m))


def test_torchs_refusals_are_ours() -> None:
    with pytest.raises(AutoplanError, match="equal rounds"):
        check_schedule("interleaved", num_ranks=4, virtual_stages=2, num_microbatches=9)
    with pytest.raises(AutoplanError, match="at least 2 virtual stages"):
        check_schedule("interleaved", num_ranks=4, virtual_stages=1, num_microbatches=8)
    with pytest.raises(AutoplanError, match="one stage per rank"):
        check_schedule("1f1b", num_ranks=2, virtual_stages=2, num_microbatches=8)
    check_schedule("zero-bubble", num_ranks=4, virtual_stages=1, num_microbatches=8)


@pytest.mark.parametrize("seed", range(20))
def test_balanced_cuts_minimise_the_largest_part(seed: int) -> None:
    import itertools
    import random

    rng = random.Random(seed)
    times = [rng.choice([0.5, 1.0, 1.0, 2.0, 3.0]) for _ in range(rng.randint(2, 8))]
    parts = rng.randint(1, len(times))
    cuts = balanced_cuts(times, parts)
    assert [a for a, _ in cuts] == [0, *[b + 1 for _, b in cuts[:-1]]] and cuts[-1][1] == len(times) - 1
    best = min(
        max(sum(times[a:b]) for a, b in zip((0, *bounds), (*bounds, len(times)), strict=True))
        for bounds in itertools.combinations(range(1, len(times)), parts - 1)
    )
    assert max(sum(times[a : b + 1]) for a, b in cuts) == pytest.approx(best)


def _gpt(size: str, *, num_nodes: int, **options):
    from cost_models.cluster import load_cluster
    from planner.api import prepare_model_file
    from tests.conftest import ROOT

    cluster = load_cluster("p3.16xlarge", num_nodes=num_nodes, devices_per_node=8)
    return prepare_model_file(
        ROOT / "examples" / "gpt.py", cluster, batch_size=16, model_args={"size": size}, microbatches=4, **options
    )


def test_a_pipeline_with_few_microbatches_picks_interleaving_or_zero_bubble() -> None:
    """GPT-6.7B on two p3.16xlarge (16 × V100 16 GB, 25 Gbit/s between the nodes) with only 4 microbatches:
    it must be pipelined across the nodes, and under 1F1B a third of the step would be bubble."""
    from planner.api import plan_prepared
    from planner.costing.lowering import simulate_plan
    from planner.costing.setup import plan_setup

    prepared = _gpt("6.7b", num_nodes=2)
    plan = plan_prepared(prepared, "auto")
    assert plan.schedule in ("interleaved", "zero-bubble") and plan.num_pipeline_ranks >= 2
    note = next(note for note in plan.notes if note.startswith(f"schedule {plan.schedule}"))
    saved_ms = float(note.rsplit("saves ", 1)[1].split(" ms")[0])
    assert saved_ms > 0.05 * plan.estimate.step_time_s * 1e3, note  # against its own 1F1B/GPipe candidate
    replay = simulate_plan(plan, prepared.graphs.at(plan.batch_size // plan.num_microbatches), plan_setup(plan))
    assert replay.step_time_s == pytest.approx(plan.estimate.step_time_s, rel=1e-6)  # priced by this replay


def test_megatrons_deep_pipeline_gets_its_interleaved_schedule_and_no_other() -> None:
    """The fair Megatron baseline: with a deep pipeline (p = 8) and 4 microbatches, Megatron-LM's interleaved
    1F1B beats its GPipe/1F1B; zero bubble is not one of Megatron's schedules, so it is refused by name."""
    from planner.api import plan_prepared

    plan = plan_prepared(_gpt("2.6b", num_nodes=1, degrees=(1, 8, 1)), "megatron")
    assert plan.schedule == "interleaved" and plan.virtual_stages >= 2 and plan.num_pipeline_ranks == 8
    with pytest.raises(AutoplanError, match="not one of this method's schedules"):
        plan_prepared(_gpt("2.6b", num_nodes=1, degrees=(1, 8, 1), schedule="zero-bubble"), "megatron")


def test_the_simulator_replays_zero_bubble_and_interleaving_on_shared_ranks() -> None:
    """The same four stages under 1F1B and zero bubble (W fills the bubble: never slower), then as two ranks of
    two virtual stages each (each rank one resource whose memory holds both stages' state)."""
    from dataclasses import replace

    from cost_models.cluster import load_cluster
    from planner.api import plan_prepared, prepare_model_file
    from planner.costing.lowering import lower_plan, simulate_lowered
    from planner.costing.setup import plan_setup
    from tests.conftest import ROOT

    cluster = load_cluster("local-cpu", num_nodes=1, devices_per_node=4)
    prepared = prepare_model_file(
        ROOT / "examples" / "gpt.py", cluster, batch_size=8, degrees=(1, 4, 1), schedule="1f1b", microbatches=4
    )
    plan = plan_prepared(prepared, "megatron")
    assert plan.schedule == "1f1b" and len(plan.stages) == 4
    graph, setup = prepared.graphs.at(2), plan_setup(plan)
    one_f_one_b = simulate_lowered(lower_plan(plan, graph, setup))
    zero_bubble = simulate_lowered(lower_plan(replace(plan, schedule="zero-bubble"), graph, setup), record=True)
    assert zero_bubble.step_time_s <= one_f_one_b.step_time_s * (1 + 1e-9)
    assert {span.task[0] for span in zero_bubble.spans if span.resource.startswith("stage")} >= {"F", "I", "W"}
    two_ranks = replace(
        plan,
        schedule="interleaved",
        stages=tuple(replace(stage, devices=plan.stages[stage.index % 2].devices) for stage in plan.stages),
    )
    lowered = lower_plan(two_ranks, graph, setup)
    assert lowered.stage_groups == (0, 1, 0, 1)
    result = simulate_lowered(lowered)
    assert result.peak_memory_bytes[0] >= lowered.state_bytes[0] + lowered.state_bytes[2]
    assert result.busy_s[2] == 0.0 and result.busy_s[0] > 0.0  # devices 2 and 3 hold no stage now
