"""Memory-saving choices per stage: ZeRO levels and selective or full recomputation, priced, chosen and run."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from cost_models.cluster import load_cluster
from cost_models.memory import kept_under_recompute, saved_activation_bytes, zero_shards
from executors.graph_module import GraphModule, call_node_plain, make_segment, model_tensors
from planner.api import plan_prepared, prepare_model_file
from planner.costing.zero import FsdpGroup, fsdp_timeline
from planner.ir.layers import graph_layers
from planner.ir.model_file import instantiate, load_model_file
from planner.ir.recompute import attention_cores, remat_runs
from planner.plan import Plan, PlanError, Remat, Stage, validate_plan
from planner.plan.report import plan_summary
from planner.preparation import Prepared
from tests.conftest import EXAMPLES, captured

UNFUSED = {"attention": "unfused", "dropout": 0.1}


def test_remat_given_as_a_bool_is_the_whole_stage_or_nothing_and_is_stored_by_name() -> None:
    """``remat=True`` recomputes the whole stage, ``False`` nothing; the plan stores the name (``full``, ``none``)."""
    stage = Stage(
        index=0, nodes=("a", "b"), devices=(0, 1), mesh_shape=(2,), param_placements={"w": ("R",)}, remat=True
    )
    assert stage.remat == Remat.FULL and stage.recomputed_runs() == (("a", "b"),) and stage.zero == 0
    assert not Stage(index=0, nodes=("a",), devices=(0,), mesh_shape=(1,), remat=False).remat
    again = Stage.from_json(stage.to_json())
    assert again == stage and stage.to_json()["remat"] == "full"
    with pytest.raises(ValueError, match=r"remat: True is not one of 'none', 'attention', 'full'"):
        Stage.from_json({**stage.to_json(), "remat": True})


def test_attention_cores_are_the_s_squared_runs_of_an_unfused_attention() -> None:
    graph = captured("gpt", 4, **UNFUSED)
    cores = attention_cores(graph, [node.name for node in graph.nodes])
    assert len(cores) == 2  # one per layer
    for core in cores:
        kinds = [graph.node(name).kind for name in core]
        assert kinds[0] == kinds[-1] == "matmul" and "softmax" in kinds
        assert any(graph.node(name).op_name == "dropout" for name in core)
    assert attention_cores(captured("gpt", 4), [node.name for node in captured("gpt", 4).nodes]) == ()  # fused SDPA


def test_recomputation_keeps_what_enters_the_runs() -> None:
    """Selective keeps less than nothing recomputed and more than full; full per layer keeps each layer's input."""
    graph = captured("gpt", 4, **UNFUSED)
    names = [node.name for node in graph.nodes]
    plain = saved_activation_bytes(graph)

    def kept(kind: str) -> int:
        state = kept_under_recompute(graph, remat_runs(kind, graph, names, layers=graph_layers(graph)))
        values = sum(
            graph.node(v).output.nbytes if graph.has_node(v) else graph.value(v).meta.nbytes for v in state.values
        )
        return values + sum(graph.node(n).output.numel for n in state.masked)  # a mask: one byte an element

    attention, full = kept("attention"), kept("full")
    assert full < attention < plain
    # per layer: the scores, the probabilities and the dropped-out ones ([b, heads, s, s] each), the dropout mask
    # (a byte an element) and the causal mask masked_fill reads
    scores, causal = graph.node("softmax").output, graph.node("triu").output
    assert plain - attention == 2 * (3 * scores.nbytes + scores.numel + causal.nbytes)
    whole = kept_under_recompute(graph, (tuple(names),))
    assert whole.values == {value.name for value in graph.inputs} and not whole.masked


def test_the_executor_recomputes_the_runs_and_keeps_only_their_inputs() -> None:
    """Every node of a checkpointed run runs twice per step (forward, then again in backward); the tensors saved
    for backward shrink; the gradients are the same."""
    model_file = load_model_file(EXAMPLES / "gpt.py")
    model, _ = instantiate(model_file, batch_size=4, model_args={"attention": "unfused"})
    model = model.to_empty(device="cpu")
    torch.manual_seed(0)
    for param in model.parameters():
        torch.nn.init.normal_(param, std=0.02)
    graph = captured("gpt", 4, attention="unfused")
    tokens = torch.randint(0, 512, (4, 32))
    runs = attention_cores(graph, [node.name for node in graph.nodes])

    def step(checkpointed) -> tuple[dict[str, int], int, dict[str, torch.Tensor]]:
        calls: dict[str, int] = {}

        def call(node, tensors):
            calls[node.name] = calls.get(node.name, 0) + 1
            return call_node_plain(node, tensors)

        params, buffers = model_tensors(model)
        segment = make_segment(graph, [node.name for node in graph.nodes], needed_after=graph.outputs)
        module = GraphModule(graph, segment, params=params, buffers=buffers, call_node=call, checkpointed=checkpointed)
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(
            lambda t: saved.append(t.numel() * t.element_size()) or t, lambda t: t
        ):
            (logits,) = module(tokens)
        model.zero_grad(set_to_none=True)
        logits.float().square().mean().backward()
        return calls, sum(saved), {name: p.grad.clone() for name, p in model.named_parameters()}

    plain_calls, plain_saved, plain_grads = step(())
    calls, saved, grads = step(runs)
    inside = {name for run in runs for name in run}
    assert all(calls[name] == 2 for name in inside) and all(calls[n] == 1 for n in calls if n not in inside)
    assert set(plain_calls.values()) == {1}
    assert saved < plain_saved
    for name, grad in plain_grads.items():
        torch.testing.assert_close(grads[name], grad)


def test_zero_levels_shard_their_parts() -> None:
    assert zero_shards(0, 8) == (1, 1, 1) and zero_shards(1, 8) == (1, 1, 8)
    assert zero_shards(2, 8) == (1, 8, 8) and zero_shards(3, 8) == (8, 8, 8)


def test_fsdp_prefetch_hides_gathers_behind_compute() -> None:
    """Level 3: the first group's gather is exposed, the next ones overlap the previous group's forward (and in
    backward the previous group's backward); the last reduce-scatter is what the step waits for."""
    groups = [FsdpGroup(forward_s=1.0, backward_s=2.0, gather_s=0.5, scatter_s=0.25) for _ in range(3)]
    timeline = fsdp_timeline(groups, level=3, num_microbatches=1)
    assert timeline.forward_wait_s == (0.5,)  # only the first gather
    assert timeline.backward_wait_s == (pytest.approx(0.5),)  # the last group's gather for backward, then hidden
    assert timeline.tail_s == pytest.approx(0.25)
    assert timeline.comm_s == pytest.approx(3 * (0.5 + 0.5 + 0.25))
    slow = [dataclasses.replace(g, gather_s=3.0) for g in groups]  # gathers longer than compute: exposed
    assert sum(fsdp_timeline(slow, level=3, num_microbatches=1).forward_wait_s) == pytest.approx(3 + 2 + 2)
    once = fsdp_timeline(groups, level=1, num_microbatches=4)  # gathered once, reduce-scattered in the last backward
    assert once.forward_wait_s[0] == 0.5 and once.forward_wait_s[1:] == (0.0, 0.0, 0.0)
    assert once.backward_wait_s == (0.0,) * 4 and once.comm_s == pytest.approx(3 * 0.75)


def _data_parallel_plan(zero: int = 0) -> Plan:
    cluster = load_cluster("local-cpu", num_nodes=1, devices_per_node=2)
    prepared = prepare_model_file(EXAMPLES / "gpt.py", cluster, batch_size=8, model_args=UNFUSED, zero=zero)
    return plan_prepared(prepared, "data-parallel")


def test_fsdp_levels_trade_memory_for_communication() -> None:
    plans = {level: _data_parallel_plan(level) for level in (0, 1, 3)}
    memory = {level: plan.estimate.memory_per_device_bytes for level, plan in plans.items()}
    assert memory[3] < memory[1] < memory[0]
    assert [plans[level].stages[0].zero for level in (0, 1, 3)] == [0, 1, 3]
    graph = captured("gpt", 8, **UNFUSED)
    for plan in plans.values():
        validate_plan(plan, graph)


def test_plans_the_executors_cannot_run_are_refused() -> None:
    plan = _data_parallel_plan(1)
    graph = captured("gpt", 8, **UNFUSED)
    stage = plan.stages[0]
    cluster = load_cluster("local-cpu", num_nodes=1, devices_per_node=2)
    pipeline = plan_prepared(
        prepare_model_file(
            EXAMPLES / "gpt.py",
            cluster,
            batch_size=8,
            model_args=UNFUSED,
            degrees=(1, 2, 1),
            microbatches=2,
            schedule="gpipe",
        ),
        "megatron",
    )
    split = dataclasses.replace(pipeline, stages=(pipeline.stages[0], dataclasses.replace(pipeline.stages[1], zero=2)))
    with pytest.raises(PlanError, match="runs under FSDP"):
        validate_plan(split, graph)
    backwards = dataclasses.replace(stage, remat="full", remat_regions=((stage.nodes[5], stage.nodes[2]),))
    with pytest.raises(PlanError, match="not a run"):
        validate_plan(dataclasses.replace(plan, stages=(backwards,)), graph)
    norm = captured("zoo/nn_batchnorm_cnn", 8)
    cluster = load_cluster("local-cpu", num_nodes=1, devices_per_node=2)
    cnn = plan_prepared(
        prepare_model_file(EXAMPLES / "zoo/nn_batchnorm_cnn.py", cluster, batch_size=8), "data-parallel"
    )
    whole = dataclasses.replace(cnn.stages[0], remat="full")  # one run, the batch normalizations in it
    with pytest.raises(PlanError, match="batch statistics"):
        validate_plan(dataclasses.replace(cnn, stages=(whole,)), norm)


def test_golden_a_model_that_barely_fits_trades_full_recomputation_for_selective_or_zero() -> None:
    """A 4-layer GPT (hidden 768, seq 1024, unfused attention) at batch 16 on 4 V100s with 8% of their memory
    (1.1 GiB; the loss alone holds ~0.6 GiB per 1024-token sample: float32 log-softmax of 51,200 logits per token
    and two gradients as large): Alpa's space (each stage recomputed whole or not at all, no ZeRO) recomputes a
    stage in full; auto recomputes the attention cores or uses ZeRO where a stage has data-parallel axes instead,
    and is faster than Alpa's plan, than recomputing everything and than recomputing nothing."""
    cluster = load_cluster("p3.16xlarge", num_nodes=1, devices_per_node=4)
    args = {"size": "125m", "layers": 4, "attention": "unfused"}
    prepared = prepare_model_file(EXAMPLES / "gpt.py", cluster, batch_size=16, model_args=args, memory_fraction=0.08)

    def best(**options: str) -> Plan:
        return plan_prepared(
            dataclasses.replace(prepared, options=dataclasses.replace(prepared.options, **options)), "auto"
        )

    alpa, chosen = best(remat="off-or-full", zero="0"), best()
    full, none = best(remat="on", zero="0"), best(remat="off", zero="0")
    assert any(stage.remat == Remat.FULL for stage in alpa.stages)
    assert all(stage.remat == Remat.FULL for stage in full.stages)
    assert not any(stage.remat == Remat.FULL for stage in chosen.stages)
    assert any(stage.remat == Remat.ATTENTION or stage.zero for stage in chosen.stages)
    for other in (alpa, full, none):
        assert chosen.estimate.step_time_s < 0.97 * other.estimate.step_time_s
    assert chosen.estimate.memory_per_device_bytes <= prepared.setup.memory_budget_bytes
    # what the choice saves against the next-best pair, said per stage
    saving = next(s.memory_saving for s in chosen.stages if s.remat == Remat.ATTENTION or s.zero)
    assert saving.choice != "no recomputation, no ZeRO" and saving.next_best
    assert math.isfinite(saving.saved_s)
    assert f"memory: {saving.choice}" in plan_summary(chosen)


def _edge_of_the_budget() -> Prepared:
    """GPT-125M (4 layers) on 4 V100s at 7.12% of their memory: the window where only a pipeline with recomputation
    fits (7.11% fits nothing; scanned on 2026-11-28)."""
    cluster = load_cluster("p3.16xlarge", num_nodes=1, devices_per_node=4)
    args = {"size": "125m", "layers": 4, "attention": "unfused"}
    return prepare_model_file(EXAMPLES / "gpt.py", cluster, batch_size=16, model_args=args, memory_fraction=0.0712)


def test_the_stage_dp_charges_what_the_tape_holds_so_its_plan_fits_at_the_edge() -> None:
    """Each layer's table charges what the exact pricing's tape holds beyond the intra-op problem's figures (the
    resharded copies its operators save, one microbatch's peak, the gradient buckets:
    :func:`planner.costing.plan_memory.layer_memory`), so at the edge of the budget the DP's own plan fits once priced
    exactly — no retry under a tighter budget — and it is faster than every stage under full recomputation."""
    prepared = _edge_of_the_budget()
    forced = dataclasses.replace(prepared.options, remat="on", zero="0")
    full = plan_prepared(dataclasses.replace(prepared, options=forced), "auto")
    chosen = plan_prepared(prepared, "auto")
    assert chosen.estimate.memory_per_device_bytes <= prepared.setup.memory_budget_bytes
    assert chosen.estimate.step_time_s < full.estimate.step_time_s
    assert not any("the stage DP's plans did not fit" in note for note in chosen.notes)


def test_auto_finds_a_plan_that_fits_where_the_dps_own_plans_do_not(monkeypatch: pytest.MonkeyPatch) -> None:
    """When the stage DP's plans are all over once priced exactly (its memory per stage is an estimate), auto runs
    the DP again under a tighter budget, then with full recomputation, and says so. Forced here by dropping what
    the layer tables charge beyond the intra-op problem (the DP's figures before 2026-11-28, which missed at 7.12%):
    auto still finds the plan that fits instead of "does not fit"."""
    from planner.costing.plan_memory import LayerMemory
    from planner.inter import layer_costs

    def nothing(*args: object, **kwargs: object) -> LayerMemory:
        return LayerMemory(copies_bytes=0.0, peak_extra_bytes=0.0, sync_bytes=0.0)

    monkeypatch.setattr(layer_costs, "layer_memory", nothing)
    prepared = _edge_of_the_budget()
    chosen = plan_prepared(prepared, "auto")
    assert chosen.estimate.memory_per_device_bytes <= prepared.setup.memory_budget_bytes
    assert any("under the whole budget the stage DP's plans did not fit" in note for note in chosen.notes)


@pytest.mark.parametrize(
    ("method", "options"),
    [
        ("megatron", {"degrees": (2, 1, 2), "remat": "attention", "zero": 1, "microbatches": 2}),
        ("data-parallel", {"zero": 3}),
    ],
)
def test_memory_choices_have_one_price_in_the_estimate_and_the_simulator(method: str, options: dict) -> None:
    """A one-stage plan has no boundary to overlap: its estimate and simulated step agree exactly, selective
    recomputation and ZeRO-1 on a sharded stage included, and FSDP's gathers and reduce-scatters at ZeRO-3."""
    from planner.costing.lowering import simulate_plan
    from planner.costing.setup import plan_setup

    cluster = load_cluster("dgx-a100", num_nodes=1, devices_per_node=4)
    args = {"size": "tiny", "attention": "unfused"}
    plan = plan_prepared(
        prepare_model_file(EXAMPLES / "gpt.py", cluster, batch_size=8, model_args=args, **options), method
    )
    stage = plan.stages[0]
    assert len(plan.stages) == 1 and stage.zero == options["zero"]
    assert stage.remat == options.get("remat", "none")
    graph = captured("gpt", 8 // plan.num_microbatches, **args)
    simulated = simulate_plan(plan, graph, plan_setup(plan))
    assert simulated.step_time_s == pytest.approx(plan.estimate.step_time_s, rel=1e-9)
