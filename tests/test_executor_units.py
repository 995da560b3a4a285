"""Executor pieces that need no process group: segments, batch splits, parity verdicts, checks."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard

from cost_models.cluster import load_cluster
from executors.graph_module import GraphModule, make_segment, model_tensors
from executors.parallel.dtensor_edges import to_placements
from executors.parallel.pipeline import check_pipeline, stage_segments
from executors.parity import compare
from executors.session import split_batch
from executors.training.launch import crowded_cores_warning
from executors.training.program import describe_program, program_to_run, write_program
from planner.api import plan_model_file
from planner.costing.setup import plan_setup
from planner.errors import AutoplanError
from planner.ir.capture import capture
from planner.ir.model_file import instantiate, load_model_file
from tests.support.charged_collectives import charged_collectives

ROOT = Path(__file__).resolve().parent.parent
MLP = ROOT / "examples" / "mlp.py"


def _mlp(batch: int = 4):
    model_file = load_model_file(MLP)
    torch.manual_seed(0)
    model, inputs = instantiate(model_file, batch_size=batch, model_args={}, on_meta=False)
    return model, inputs, capture(model, inputs)


def test_graph_module_of_the_whole_graph_is_the_model() -> None:
    model, inputs, graph = _mlp()
    segment = make_segment(graph, [n.name for n in graph.nodes], needed_after=graph.outputs)
    params, buffers = model_tensors(model)
    module = GraphModule(graph, segment, params=params, buffers=buffers)
    (output,) = module(*inputs)
    torch.testing.assert_close(output, model(*inputs))
    assert [name for name, _ in module.named_graph_parameters()] == list(params)


def test_segments_hand_on_what_later_stages_read() -> None:
    _, _, graph = _mlp()
    names = [n.name for n in graph.nodes]
    before = set(names[:5]) | {"x"}
    later = [value for name in names[5:] for value in graph.node(name).inputs if value in before]
    first = make_segment(graph, names[:5], needed_after=later)
    assert first.inputs == ("x",)
    assert set(first.outputs) == {value for value in later if value in set(names[:5])}
    assert all(p.startswith("blocks.0.") or p.startswith("blocks.1.") for p in first.params)


def test_split_batch_cuts_dim_0_only_where_it_is_the_batch() -> None:
    x, scale = torch.arange(8.0).reshape(4, 2), torch.ones(3)
    pieces = split_batch((x, scale), num_chunks=2, batch_size=4)
    assert [p[0].shape[0] for p in pieces] == [2, 2]
    assert all(p[1] is scale for p in pieces)


def test_parity_verdict_names_the_worst_gradient() -> None:
    reference = {"a": torch.ones(3), "b": torch.ones(2)}
    good = compare(1.0, 1.0, {"a": torch.ones(3), "b": torch.ones(2) + 1e-7}, reference)
    bad = compare(1.0, 1.0, {"a": torch.ones(3), "b": torch.ones(2) + 1e-2}, reference)
    missing = compare(1.0, 1.0, {"a": torch.ones(3)}, reference)
    assert good.ok and not bad.ok and not missing.ok
    assert bad.worst == "b" and abs(bad.max_grad_diff - 1e-2) < 1e-6
    assert "MISMATCH" in bad.describe() and "missing" in missing.describe()
    assert "likely cause" not in bad.describe()  # equal losses: nothing points at the loss


def test_a_summed_loss_is_named_as_the_likely_cause() -> None:
    reference = {"w": torch.full((2,), 4.0)}
    summed = compare(1.5, 6.0, {"w": torch.ones(2)}, reference)  # one device sums 4 microbatches' rows
    assert not summed.ok and 'reduction="sum"' in summed.describe() and "4x" in summed.describe()
    other = compare(1.37, 1.0, {"w": torch.ones(2)}, {"w": torch.ones(2)})
    assert not other.ok and "likely cause" not in other.describe()


def test_placements_in_dtensor_words() -> None:
    assert to_placements(("S(1)", "R")) == (Shard(1), Replicate())


def test_pipeline_groups_need_equal_stage_sizes() -> None:
    cluster = load_cluster("local-cpu", num_nodes=1, devices_per_node=2)
    plan = plan_model_file(MLP, cluster, batch_size=16, method="megatron", degrees=(1, 2, 1), microbatches=2)
    assert check_pipeline(plan) == 1
    _, _, graph = _mlp(8)
    segments = stage_segments(graph, plan, loss_inputs=("x",))
    assert segments[0].inputs == ("x",) and "x" in segments[-1].inputs
    assert set(segments[0].outputs) == set(segments[1].inputs) - {"x"} | ({"x"} & set(segments[0].outputs))
    uneven = replace(plan, stages=(replace(plan.stages[0], devices=(0,)), replace(plan.stages[1], devices=(1, 2))))
    assert check_pipeline(uneven) is None
    with pytest.raises(AutoplanError, match="gpipe, 1f1b, interleaved, zero-bubble"):
        check_pipeline(replace(plan, schedule="none"))


def test_charged_collectives_of_megatron_mlp() -> None:
    """Row-parallel fc2 all-reduces forward, column-parallel fc1's input gradient backward (not the
    first block's: the data needs no gradient); nothing replicated, nothing to sync."""
    cluster = load_cluster("local-cpu", num_nodes=1, devices_per_node=2)
    plan = plan_model_file(MLP, cluster, batch_size=16, method="megatron", degrees=(2, 1, 1))
    graph = _mlp(16)[2]
    charged = charged_collectives(plan.stages[0], graph, plan_setup(plan), num_microbatches=1)
    assert charged["forward"] == {"all_reduce": 4}
    assert charged["backward"] == {"all_reduce": 3}
    assert sum(charged["sync"].values()) == 0


def test_compiled_program_names_its_launch(tmp_path: Path) -> None:
    cluster = load_cluster("local-cpu", num_nodes=1, devices_per_node=2)
    plan = plan_model_file(MLP, cluster, batch_size=16, method="data-parallel")
    program = write_program(plan, tmp_path / "out")
    text = program.read_text()
    assert "torchrun --standalone --nproc-per-node 2" in text and "data 2" in text
    for part in (
        "def build_model",
        "def loss_fn",
        "def make_dataloader",
        "def make_optimizer",
        "def make_lr_schedule",
        "clip_grad_norm_",
        "save_checkpoint",
        "load_checkpoint",
        "log.log",
    ):
        assert part in text, part  # the program keeps these in plain sight
    assert (tmp_path / "out" / "plan.json").is_file()
    compile(text, str(program), "exec")


def test_plan_run_runs_the_compiled_program_and_says_if_it_was_edited(tmp_path: Path) -> None:
    """``plan run DIR`` and ``plan run DIR/plan.json`` run DIR/train.py (edits included); a bare plan file runs
    the stock program; the line printed first says which, and whether the program was edited."""
    cluster = load_cluster("local-cpu", num_nodes=1, devices_per_node=2)
    plan = plan_model_file(MLP, cluster, batch_size=16, method="data-parallel")
    here, moved = tmp_path / "here", tmp_path / "moved"
    program = write_program(plan, here)
    for target in (here, here / "plan.json"):
        chosen = program_to_run(target)
        assert (chosen.plan_path, chosen.program) == (here / "plan.json", program)
    assert "(as compiled)" in describe_program(plan, program)
    here.rename(moved)  # the text does not name its directory: a moved program is still "as compiled"
    assert "(as compiled)" in describe_program(plan, moved / "train.py")
    edited = (moved / "train.py").read_text().replace("def make_dataloader", "def make_dataloader  # mine\ndef _x")
    (moved / "train.py").write_text(edited)
    assert "edited since `plan compile`" in describe_program(plan, moved / "train.py")
    (tmp_path / "plan.json").write_text((moved / "plan.json").read_text())
    bare = program_to_run(tmp_path / "plan.json")  # no train.py beside it: the stock program
    assert bare.program is None and "stock train.py" in describe_program(plan, None)
    (moved / "train.py").unlink()
    with pytest.raises(AutoplanError, match=r"has no train\.py"):
        program_to_run(moved)


def test_a_failed_timing_job_names_the_workers_exception() -> None:
    from executors.measure.step_timing import root_cause

    stderr = '[rank0]:   File "x.py", line 3\n[rank0]: ValueError: too few microbatches\nChildFailedError: \n'
    assert root_cause(stderr) == "[rank0]: ValueError: too few microbatches"
    assert root_cause("RuntimeError: gloo\nChildFailedError: boom") == "ChildFailedError: boom"
    assert root_cause("") == "no output"


def test_cpu_ranks_beyond_the_cores_get_one_warning() -> None:
    assert crowded_cores_warning(4, cores=2, backend="gloo") == (
        "4 CPU processes share 2 core(s) here: they take turns, so the step times will not mean much (losses and "
        "the parity check still do)"
    )
    assert crowded_cores_warning(2, cores=2, backend="gloo") is None
    assert crowded_cores_warning(8, cores=2, backend="nccl") is None  # one GPU per rank: the cores do not bound it


def test_a_moved_model_file_stops_the_program_in_one_line(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """The compiled program loads its plan and model file at import: a file that moved is one line, exit 2."""
    from executors.training import runtime

    cluster = load_cluster("local-cpu", num_nodes=1, devices_per_node=2)
    plan = plan_model_file(MLP, cluster, batch_size=16, method="data-parallel")
    moved = replace(plan, model=replace(plan.model, file=str(tmp_path / "gone.py")))
    with pytest.raises(SystemExit) as stopped:
        runtime.load_model_file(moved)
    assert stopped.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("train.py: error: ") and "gone.py" in err and len(err.splitlines()) == 1
    with pytest.raises(SystemExit):
        runtime.load_plan(tmp_path / "missing.json")


def test_plan_run_passes_what_follows_a_double_dash_to_the_program() -> None:
    from planner.cli.run import split_passthrough

    assert split_passthrough(["DIR", "--steps", "2"]) == (["DIR", "--steps", "2"], [])
    assert split_passthrough(["DIR", "--", "--export-hf", "hf", "--"]) == (["DIR"], ["--export-hf", "hf", "--"])
