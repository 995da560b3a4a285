"""The ``parallelize`` section of the compiled ``train.py`` (no processes: the section runs against a stand-in
runtime whose ``parallelize`` is :func:`executors.training.layout.resolve_layout`).

* the section of a pipeline × tensor plan names each stage's module range, mesh (ranks, ``tp=2``) and DTensor
  placements grouped by pattern, and the schedule; a data-parallel plan's is one stage, ``dp=2``, all replicated;
* run as written, the section gives back the plan; an edit of the schedule or the microbatches is honoured (the plan
  returned runs it); an edit of a placement, a mesh or the module range is refused naming the line to change back;
* placements grouped by pattern resolve to every parameter's own placement.
"""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

import pytest
from torch.distributed.tensor import Partial, Replicate, Shard

from cost_models.cluster import load_cluster
from executors.training import layout
from executors.training.layout_text import parallelize_section, placement_entries
from planner.api import plan_model_file
from planner.plan import Plan

ROOT = Path(__file__).resolve().parents[1]
GPT_ARGS = {"size": "tiny", "vocab": 64, "seq": 16}


@pytest.fixture(scope="module")
def pipeline_tensor_plan() -> Plan:
    cluster = load_cluster("local-cpu", num_nodes=1, devices_per_node=4)
    return plan_model_file(
        ROOT / "examples" / "gpt.py",
        cluster,
        batch_size=8,
        model_args=GPT_ARGS,
        method="megatron",
        degrees=(2, 2, 1),
        microbatches=2,
        schedule="1f1b",
    )


@pytest.fixture(scope="module")
def data_parallel_plan() -> Plan:
    cluster = load_cluster("local-cpu", num_nodes=1, devices_per_node=2)
    return plan_model_file(ROOT / "examples" / "mlp.py", cluster, batch_size=16, method="megatron", degrees=(1, 1, 2))


def _run_section(text: str, plan: Plan, tmp_path: Path) -> Plan:
    """Run the section as train.py would, with a runtime whose parallelize returns the plan it resolves."""
    program = tmp_path / "train.py"
    program.write_text(text)
    stand_in = SimpleNamespace(
        stage=layout.stage,
        mesh=layout.mesh,
        schedule=layout.schedule,
        gradient_sync=layout.gradient_sync,
        parallelize=lambda session, *, stages, schedule, grad_sync, **_: layout.resolve_layout(
            session.plan, stages=stages, schedule=schedule, grad_sync=grad_sync
        ),
    )
    namespace = {"runtime": stand_in, "Shard": Shard, "Replicate": Replicate, "Partial": Partial}
    namespace |= {"loss_fn": None, "MODEL_FILE": None}
    exec(compile(text, str(program), "exec"), namespace)
    args = SimpleNamespace(optimizer="adam", seed=0, check_parity=False, compile=False)
    return namespace["parallelize"](None, SimpleNamespace(plan=plan), args)


def test_pipeline_tensor_section_names_stages_meshes_placements_and_schedule(pipeline_tensor_plan: Plan) -> None:
    text = parallelize_section(pipeline_tensor_plan)
    assert text.startswith("def parallelize(build_model, session, args):")
    assert text.count("runtime.stage(") == 2
    assert "# stage 0: wte … blocks.0.mlp.proj" in text and 'modules=("wte", "blocks.0.mlp.proj")' in text
    assert 'modules=("blocks.1.ln_1", "lm_head")' in text
    assert "mesh=runtime.mesh([0, 1], tp=2)" in text and "mesh=runtime.mesh([2, 3], tp=2)" in text
    assert '"blocks.*.attn.proj.weight": [Shard(1)]' in text and '"*": [Shard(0)]' in text  # grouped by pattern
    assert '"blocks.*.ln_1.*": [Replicate()]' in text  # a module whose parameters are placed alike
    assert 'runtime.schedule("1f1b", microbatches=2, virtual_stages=1)' in text
    assert 'runtime.gradient_sync("exact")' in text


def test_data_parallel_section_is_one_replicated_stage(data_parallel_plan: Plan) -> None:
    text = parallelize_section(data_parallel_plan)
    assert text.count("runtime.stage(") == 1
    assert "mesh=runtime.mesh([0, 1], dp=2)" in text
    assert 'placements={"*": [Replicate()]}' in text
    assert 'runtime.schedule("none", microbatches=' in text


def test_placements_by_pattern_resolve_to_every_parameter(pipeline_tensor_plan: Plan) -> None:
    for stage in pipeline_tensor_plan.stages:
        entries = placement_entries(stage)
        assert len(entries) < len(stage.param_placements)  # grouped
        for name, placement in stage.param_placements.items():
            assert layout.placement_of(name, entries)[1] == layout.plan_spec(placement)


def test_section_as_written_runs_the_plan(pipeline_tensor_plan: Plan, tmp_path: Path) -> None:
    assert _run_section(parallelize_section(pipeline_tensor_plan), pipeline_tensor_plan, tmp_path) is (
        pipeline_tensor_plan
    )


def test_schedule_and_microbatch_edits_are_honoured(pipeline_tensor_plan: Plan, tmp_path: Path) -> None:
    text = parallelize_section(pipeline_tensor_plan).replace(
        'runtime.schedule("1f1b", microbatches=2', 'runtime.schedule("gpipe", microbatches=4'
    )
    resolved = _run_section(text, pipeline_tensor_plan, tmp_path)
    assert (resolved.schedule, resolved.num_microbatches) == ("gpipe", 4)
    assert resolved.stages == pipeline_tensor_plan.stages


def _line_number(text: str, needle: str) -> int:
    return next(number for number, line in enumerate(text.splitlines(), 1) if needle in line)


@pytest.mark.parametrize(
    "old,new,message",
    [
        ('"blocks.*.ln_1.*": [Replicate()]', '"blocks.*.ln_1.*": [Shard(0)]', "the placement of"),
        ("mesh=runtime.mesh([2, 3], tp=2)", "mesh=runtime.mesh([3, 2], tp=2)", "stage 1's mesh ranks is [3, 2]"),
        ('modules=("blocks.1.ln_1", "lm_head")', 'modules=("blocks.1.ln_1", "ln_f")', "stage 1's module range"),
    ],
)
def test_structural_edits_are_refused_naming_the_line(
    pipeline_tensor_plan: Plan, tmp_path: Path, old: str, new: str, message: str
) -> None:
    text = parallelize_section(pipeline_tensor_plan).replace(old, new, 1)
    with pytest.raises(layout.LayoutEdit) as refused:
        _run_section(text, pipeline_tensor_plan, tmp_path)
    error = str(refused.value)
    assert message in error and "change it back" in error and "\n" not in error
    named = int(re.match(r"train\.py line (\d+): ", error).group(1))
    if old.startswith('"blocks'):
        assert named == _line_number(text, new)  # the placement's own line
    else:
        start = _line_number(text, new)
        assert named in range(start - 3, start + 1)  # the stage's call


@pytest.mark.parametrize(
    "old,new,message",
    [
        ('gradient_sync("exact")', 'gradient_sync("bf16")', "gradient sync 'bf16' is not the plan's 'exact'"),
        ("virtual_stages=1)", "virtual_stages=2)", "virtual_stages=2 but the plan has 1 per rank"),
        ('schedule("1f1b"', 'schedule("interleaved"', "interleaved needs at least 2 virtual stages"),
    ],
)
def test_sync_and_virtual_stage_edits_are_refused(
    pipeline_tensor_plan: Plan, tmp_path: Path, old: str, new: str, message: str
) -> None:
    text = parallelize_section(pipeline_tensor_plan).replace(old, new)
    with pytest.raises(layout.LayoutEdit, match=rf"^train\.py line {_line_number(text, new)}: .*{re.escape(message)}"):
        _run_section(text, pipeline_tensor_plan, tmp_path)


def test_a_schedule_the_plan_cannot_run_is_refused(pipeline_tensor_plan: Plan, tmp_path: Path) -> None:
    text = parallelize_section(pipeline_tensor_plan).replace("microbatches=2", "microbatches=3")
    with pytest.raises(layout.LayoutEdit, match=r"train\.py line \d+: the batch of 8 does not split into 3"):
        _run_section(text, pipeline_tensor_plan, tmp_path)
