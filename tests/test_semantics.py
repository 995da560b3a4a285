"""The semantics users rely on, at world 2 and 4, each checked by a multi-process parity run.

* dropout: a model with dropout is checkable (``--check-parity`` turns it off on both sides), and so
  is one with stochastic depth (``torch.rand`` masks: fixed draws on both sides);
* batch normalization: the data-parallel and pipeline plans of a BatchNorm model state how many rows
  each call normalizes (``Plan.batch_stat_rows``) and match one device normalizing those chunks;
* tied weights: a pipeline whose stages share a tied embedding sums its gradients into one;
* operators without a sharding rule or a meta kernel (transformers' MoE ``grouped_mm_fallback``);
* layouts: an LSTM's non-contiguous outputs, stride-2 convolutions under tensor parallelism,
  several inputs of mixed dtypes (integer ids, float features).

Models come from ``examples/zoo``; one torchrun job per world runs every plan
(``tests/parity_worker.py``), two steps each, loss and every gradient compared by name.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from cost_models.cluster import load_cluster
from executors.semantics import without_dropout
from planner.api import plan_prepared, prepare_model_file
from planner.ir.capture import capture
from planner.ir.model_file import instantiate, load_model_file
from planner.plan import load_plan, save_plan
from tests.conftest import torchrun

ZOO = Path(__file__).resolve().parent.parent / "examples" / "zoo"
PIPELINE = {"degrees": (1, 2, 1), "schedule": "gpipe", "microbatches": 2}
CASES: dict[int, dict[str, tuple[str, str, dict]]] = {
    2: {
        "dropout-tp": ("nn_mha", "megatron", {"degrees": (2, 1, 1)}),
        "dropout-dp": ("nn_mha", "data-parallel", {}),
        "batchnorm-dp": ("nn_batchnorm_cnn", "data-parallel", {"microbatches": 2}),
        "batchnorm-pipeline": ("nn_batchnorm_cnn", "megatron", PIPELINE),
        "tied-pipeline": ("nn_transformer_lm", "megatron", PIPELINE),
        "tied-tp": ("nn_transformer_lm", "megatron", {"degrees": (2, 1, 1)}),
        "lstm-tp": ("nn_lstm", "megatron", {"degrees": (2, 1, 1)}),
        "strided-tp": ("nn_strided_cnn", "megatron", {"degrees": (2, 1, 1)}),
        "mixed-inputs-pipeline": ("nn_recommender", "megatron", PIPELINE),
        "custom-op-dp": ("hf_mixtral", "data-parallel", {}),
        "stochastic-depth-dp": ("hf_swin", "data-parallel", {}),
    },
    4: {
        "dropout-tp-dp": ("nn_mha", "megatron", {"degrees": (2, 1, 2)}),
        "batchnorm-dp": ("nn_batchnorm_cnn", "data-parallel", {}),
        "tied-pipeline-tp": ("nn_transformer_lm", "megatron", {"degrees": (2, 2, 1), "microbatches": 2}),
        "tied-pipeline-dp": ("nn_transformer_lm", "megatron", {"degrees": (1, 2, 2), "microbatches": 2}),
        "lstm-tp": ("nn_lstm", "megatron", {"degrees": (2, 1, 2)}),
        "strided-tp": ("nn_strided_cnn", "megatron", {"degrees": (2, 1, 2)}),
        "custom-op-tp": ("hf_mixtral", "megatron", {"degrees": (2, 1, 2)}),
    },
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict]:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    results = {}
    for world, cases in CASES.items():
        directory = tmp_path_factory.mktemp(f"semantics{world}")
        cluster = load_cluster("local-cpu", num_nodes=1, devices_per_node=world)
        plans = {}
        for key, (family, method, options) in cases.items():
            prepared = prepare_model_file(ZOO / f"{family}.py", cluster, batch_size=8, **options)
            plans[key] = directory / f"{key}.json"
            save_plan(plan_prepared(prepared, method), plans[key])
        done = torchrun(world, "parity_worker.py", directory / "parity.json", list(plans.values()))
        parity = json.loads((directory / "parity.json").read_text()) if done.returncode == 0 else None
        results[world] = {"plans": plans, "parity": parity, "log": done.stderr[-4000:]}
    return results


@pytest.mark.slow
@pytest.mark.parametrize("world,key", [(world, key) for world in CASES for key in CASES[world]])
def test_parity(runs: dict, world: int, key: str) -> None:
    run = runs[world]
    assert run["parity"] is not None, run["log"]
    steps = run["parity"][str(run["plans"][key])]
    assert len(steps) == 2 and all(step["ok"] for step in steps), [step["describe"] for step in steps]


@pytest.mark.slow
def test_plans_are_the_kind_named(runs: dict) -> None:
    """The cases test what their names say: shared tied weight across stages, pipelines, BN rows."""
    tied = load_plan(runs[2]["plans"]["tied-pipeline"])
    readers = [stage.index for stage in tied.stages for node in stage.nodes if "embed" in node or "linear" in node]
    assert len(tied.stages) == 2 and len(set(readers)) == 2
    assert tied.estimate.breakdown_s["tied_grad_sync_s"] > 0  # the summed gradient's all-reduce is charged
    dp = load_plan(runs[2]["plans"]["batchnorm-dp"])
    assert dp.batch_stat_rows == 8 // (2 * dp.num_microbatches) and any("batch normalization" in n for n in dp.notes)
    pipe = load_plan(runs[2]["plans"]["batchnorm-pipeline"])
    assert len(pipe.stages) == 2 and pipe.batch_stat_rows == 4
    assert load_plan(runs[4]["plans"]["batchnorm-dp"]).batch_stat_rows == 2


def test_without_dropout_zeroes_every_probability() -> None:
    model_file = load_model_file(ZOO / "nn_mha.py")
    model, inputs = instantiate(model_file, batch_size=4, model_args={})
    graph = capture(model, inputs)
    dropouts = [node for node in graph.nodes if "dropout" in node.target]
    assert dropouts and any(float(node.args[1]) > 0 for node in dropouts)
    quiet = without_dropout(graph)
    assert [n.name for n in quiet.nodes] == [n.name for n in graph.nodes]
    assert all(float(node.args[1]) == 0.0 for node in quiet.nodes if "dropout" in node.target)


def test_other_random_draws_are_fixed() -> None:
    model_file = load_model_file(ZOO / "hf_swin.py")
    model, inputs = instantiate(model_file, batch_size=2, model_args={})
    graph = capture(model, inputs)
    assert any(node.target == "aten.rand.default" for node in graph.nodes)
    fixed = without_dropout(graph)
    assert not any(node.target.startswith("aten.rand") for node in fixed.nodes)
    assert [n.name for n in fixed.nodes] == [n.name for n in graph.nodes]
