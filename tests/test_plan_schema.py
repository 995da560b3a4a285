"""docs/plan-schema.json is the schema the plan's types generate, and plans made by every kind of method follow it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest

from cost_models.cluster import load_cluster
from planner.api import plan_model_file
from planner.plan import FORMAT_VERSION, Plan, PlanError, save_plan
from planner.plan.schema import plan_schema, schema_text
from tests.conftest import EXAMPLES, ROOT

PUBLISHED = ROOT / "docs" / "plan-schema.json"
# (model file, model args, batch size, method, options): a few fixed plans on a preset cluster of 4 GPUs
GOLDEN = {
    "mlp-auto": ("mlp.py", {}, 16, "auto", {}),
    "mlp-data-parallel": ("mlp.py", {}, 16, "data-parallel", {"zero": 3}),
    "mlp-hash": ("mlp.py", {}, 16, "hash", {}),
    "gpt-megatron": ("gpt.py", {"attention": "unfused"}, 8, "megatron", {"degrees": (2, 1, 2), "remat": "attention"}),
    "gpt-uniform-pipeline": ("gpt.py", {}, 8, "uniform-pipeline", {"microbatches": 4}),
}


@pytest.fixture(scope="module")
def golden_plans() -> dict[str, Plan]:
    cluster = load_cluster("dgx-a100", num_nodes=1, devices_per_node=4)
    return {
        name: plan_model_file(EXAMPLES / file, cluster, batch_size=batch, model_args=args, method=method, **options)
        for name, (file, args, batch, method, options) in GOLDEN.items()
    }


def test_the_published_schema_is_the_one_the_types_generate() -> None:
    assert PUBLISHED.read_text() == schema_text(), (
        "docs/plan-schema.json is stale: run `python -m planner.plan.schema > docs/plan-schema.json`"
    )
    jsonschema.Draft202012Validator.check_schema(plan_schema())


@pytest.mark.parametrize("name", list(GOLDEN))
def test_a_golden_plan_follows_the_published_schema_and_round_trips(name: str, golden_plans: dict[str, Plan]) -> None:
    plan = golden_plans[name]
    data = json.loads(plan.dumps())
    jsonschema.validate(data, json.loads(PUBLISHED.read_text()), cls=jsonschema.Draft202012Validator)
    assert Plan.from_json(data) == plan


def test_the_golden_plans_hold_every_typed_saving_and_explanation(golden_plans: dict[str, Plan]) -> None:
    """What was free-form before format 3 is typed, and the golden plans exercise it."""
    megatron = golden_plans["gpt-megatron"].to_json()["stages"][0]
    assert set(megatron["memory_saving"]) == {
        "choice",
        "next_best",
        "saved_s",
        "saved_bytes",
        "next_best_remat",
        "next_best_zero",
    }
    assert megatron["explanation"] and set(megatron["explanation"][0]) >= {"node", "compute_s", "memory_bytes"}
    assert golden_plans["mlp-data-parallel"].is_pure_data_parallel
    assert not golden_plans["gpt-megatron"].is_pure_data_parallel


def test_a_plan_without_a_required_field_or_with_an_unknown_one_is_refused_in_one_line(
    golden_plans: dict[str, Plan],
) -> None:
    data = golden_plans["mlp-hash"].to_json()
    del data["stages"][0]["devices"]
    with pytest.raises(PlanError, match=r"^plan JSON is malformed: stages\[0\]\.devices: missing"):
        Plan.from_json(data)
    data = {**golden_plans["mlp-hash"].to_json(), "zero": 1}
    with pytest.raises(PlanError, match=r"unknown field 'zero' of Plan"):
        Plan.from_json(data)
    with pytest.raises(PlanError, match=rf"format_version 2 is not one this autoplan reads \({FORMAT_VERSION}\)"):
        Plan.from_json({**data, "format_version": 2})


def test_a_plan_loads_without_torch(golden_plans: dict[str, Plan], tmp_path: Path) -> None:
    path = tmp_path / "plan.json"
    save_plan(golden_plans["gpt-megatron"], path)
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "from planner.plan import load_plan\n"
        "from planner.plan.choices import plan_choices\n"
        f"plan = load_plan({str(path)!r}); plan_choices(plan)\n"
        "print(len(plan.stages), plan.stages[0].memory_saving.next_best_zero)"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
