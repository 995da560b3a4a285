"""A plan in Megatron-LM's words (summary, JSON, ``print(plan)``), and ``plan show`` of a plan made from Python."""

from __future__ import annotations

import functools
import json
import math
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from cost_models.cluster import load_cluster
from planner.api import plan, summary
from planner.cli.main import main
from planner.plan import Plan, save_plan
from planner.plan.megatron_terms import megatron_terms_text
from planner.plan.report import plan_summary
from tests.conftest import EXAMPLES
from tests.support.synthetic_plans import synthetic_plan, synthetic_stage

SEQ = 16


def test_a_grid_plan_in_megatron_terms_counts_the_micro_batch_per_replica() -> None:
    stages = [synthetic_stage(s, range(32 * s, 32 * s + 32), (8, 4), sharded=(1,), synced=(0,)) for s in range(2)]
    # 16 rows a microbatch, 8 replicas
    grid = replace(synthetic_plan(stages, m=16, schedule="1f1b", mfu=0.25), batch_size=256)
    terms = grid.megatron
    assert (terms.tensor_parallel, terms.pipeline_parallel, terms.data_parallel) == (4, 2, 8)
    assert terms.micro_batch_size == 2  # 256 / (16 microbatches · 8 replicas), not the microbatch's 16 rows
    assert terms.global_batch_size == 256 and terms.num_microbatches == 16 and terms.per_stage == ()
    assert terms.samples_per_s_per_gpu == pytest.approx(256 / 1.0 / 64) and terms.tokens_per_s_per_gpu is None
    text = megatron_terms_text(terms)
    assert "global batch 256, micro-batch size 2, 16 microbatches, TP 4, PP 2, DP 8" in text
    assert "4 samples/s per GPU" in text and "VPP" not in text and "sequence length" not in text


def test_stages_of_different_degrees_are_listed_per_stage_as_mixed() -> None:
    stages = [
        synthetic_stage(0, range(0, 2), (2,), synced=(0,)),
        synthetic_stage(1, range(2, 6), (4,), sharded=(0,)),
    ]
    terms = replace(synthetic_plan(stages, m=4, schedule="gpipe", mfu=0.25), batch_size=16).megatron
    assert terms.tensor_parallel is None and terms.data_parallel is None and terms.micro_batch_size is None
    assert [(s.tensor_parallel, s.data_parallel, s.micro_batch_size) for s in terms.per_stage] == [(1, 2, 2), (4, 1, 4)]
    assert "TP×DP per stage (mixed) 1×2, 4×1, PP 2, micro-batch size per stage 2, 4" in megatron_terms_text(terms)


def test_an_operator_placement_has_no_degrees() -> None:
    cluster = load_cluster("local-cpu", num_nodes=1, devices_per_node=2)
    stages = [synthetic_stage(s, range(s, s + 1), (1,)) for s in range(2)]
    terms = synthetic_plan(stages, m=4, schedule="dataflow", cluster=cluster, method="hash", mfu=0.25).megatron
    assert (terms.tensor_parallel, terms.pipeline_parallel, terms.data_parallel) == (None, None, None)
    assert "operator placement (no TP/PP/DP degrees)" in megatron_terms_text(terms, per="device")


@functools.cache
def python_plan() -> Plan:
    """A GPT planned from Python (no model file) on 4 GPUs, its input batch × sequence token ids."""
    from examples.gpt import build_model, example_inputs

    with torch.device("meta"):
        model = build_model("tiny", seq=SEQ)
    inputs = example_inputs(8, size="tiny", seq=SEQ)
    return plan(model, inputs, load_cluster("dgx-a100", num_nodes=1, devices_per_node=4), batch_size=8)


def test_a_plan_from_python_has_the_summary_the_command_prints() -> None:
    planned = python_plan()
    assert planned.model.sequence_length == SEQ
    assert summary(planned) == plan_summary(planned)
    assert summary(planned, plan_path="p.json") == plan_summary(planned, plan_path="p.json")
    terms = planned.megatron
    assert terms.tokens_per_s_per_gpu == pytest.approx(8 * SEQ / planned.estimate.step_time_s / planned.num_devices)
    assert terms.mfu == planned.estimate.mfu
    line = summary(planned).splitlines()[1]
    assert line.startswith("Megatron-LM terms: global batch 8, ") and f"sequence length {SEQ}; " in line
    assert "tokens/s per GPU" in line and f"MFU {planned.estimate.mfu:.0%}" in line


def test_the_json_carries_the_terms_read_only_and_old_files_load() -> None:
    planned = python_plan()
    data = json.loads(planned.dumps())
    assert data["megatron"] == json.loads(json.dumps(planned.megatron.to_json()))
    assert data["megatron"]["sequence_length"] == SEQ and list(data)[-1] == "megatron"
    assert Plan.from_json(data) == planned
    edited = {**data, "megatron": {**data["megatron"], "global_batch_size": 12345}}
    assert Plan.from_json(edited).megatron == planned.megatron  # a stored copy is never read: it cannot disagree
    old = {key: value for key, value in data.items() if key != "megatron"}
    old["model"] = {key: value for key, value in data["model"].items() if key != "sequence_length"}
    loaded = Plan.from_json(old)  # a plan written before the block and the sequence length
    assert loaded.model.sequence_length is None and loaded.megatron.tokens_per_s_per_gpu is None
    assert math.isclose(loaded.megatron.samples_per_s_per_gpu, planned.megatron.samples_per_s_per_gpu)


def test_plan_show_shows_a_plan_made_from_python_and_says_what_it_cannot(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    path = tmp_path / "python.json"
    save_plan(python_plan(), path)
    assert main(["show", str(path)]) == 0
    out = capsys.readouterr().out
    first, summary_text = out.split("\n", 1)
    assert first.startswith("plan show: the plan names no model file (it was planned from Python)")
    assert "no simulated step" in first and summary_text.startswith(summary(python_plan()).splitlines()[0])
    assert "Megatron-LM terms: " in summary_text and "simulated:" not in summary_text
    assert main(["show", str(path), "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["simulated_step_time_s"] is None and shown["megatron"]["sequence_length"] == SEQ
    figure = tmp_path / "f.png"
    assert main(["show", str(path), "--figure", str(figure)]) == 2
    error = capsys.readouterr().err.strip()
    assert len(error.splitlines()) == 1 and "no model file" in error and not figure.exists()


def test_the_command_summary_has_the_terms_of_a_model_file_plan(capsys: pytest.CaptureFixture, tmp_path: Path) -> None:
    out = tmp_path / "gpt.json"
    args = ["--cluster", "dgx-a100", "--devices-per-node", "4", "--batch-size", "8", "--model-arg", "size=tiny"]
    assert main([str(EXAMPLES / "gpt.py"), *args, "--method", "megatron", "--degrees", "2,2,1", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    saved = Plan.from_json(json.loads(out.read_text()))
    assert summary(saved, plan_path=str(out)) in printed
    terms = saved.megatron
    assert (terms.tensor_parallel, terms.pipeline_parallel, terms.data_parallel) == (2, 2, 1)
    assert terms.micro_batch_size == 8 // saved.num_microbatches and terms.sequence_length is not None
    assert printed.splitlines()[2].startswith("Megatron-LM terms: global batch 8, micro-batch size ")
