"""Multi-process parity: every executor against one process, by loss and every gradient.

For each world size (2 and 4) the plans below are made here, then one torchrun job
(``tests/parity_worker.py``) runs them all with gloo — the ranks pay their imports once — and
checks, for two optimizer steps (three until 2026-11-28, for CI time), the loss and every parameter
gradient against the user's own module in one process (fp32, rtol 1e-4, atol 1e-5). A second job counts the
collectives of tensor-parallel plans per phase (``tests/collectives_worker.py``) against those the cost model
charges (:func:`tests.support.charged_collectives.charged_collectives`).
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import replace
from pathlib import Path

import pytest

from cost_models.cluster import load_cluster
from executors.parallel.pipeline import boundary_shards, stage_segments
from planner.api import plan_prepared, prepare_model_file
from planner.inter.search import layering
from planner.ir.graph import OpGraph
from planner.ir.recompute import remat_runs
from planner.plan import Plan, load_plan, save_plan
from tests.conftest import captured, edit_strategy, torchrun

pytestmark = pytest.mark.slow  # every test here launches processes

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
MODELS = {
    "mlp": ("mlp.py", {}, 16),
    "gpt": ("gpt.py", {}, 8),
    "resnet": ("resnet.py", {"width": 8, "blocks": 1, "stages": 2, "image_size": 8}, 8),
    "moe": ("moe.py", {"hidden": 32, "layers": 2, "experts": 4, "ffn": 32, "tokens": 8}, 8),
}
# zoo models planned in one case each (not in every case of MODELS)
ZOO_MODELS = {
    "transformer_lm": ("zoo/nn_transformer_lm.py", {"seq": 64}, 8),
    "swin": ("zoo/hf_swin.py", {}, 8),
    "llama": ("zoo/hf_llama.py", {"layers": 4}, 8),
    "bert": ("zoo/hf_bert.py", {}, 8),
    "gpt_unfused": ("gpt.py", {"attention": "unfused"}, 8),
    "gpt_unfused_dropout": ("gpt.py", {"attention": "unfused", "dropout": 0.1}, 8),
    "gpt2_eager": ("zoo/hf_gpt2.py", {"attention": "eager"}, 8),
    "unet": ("zoo/nn_unet.py", {"width": 8, "depth": 2, "image_size": 16}, 8),
}
# (model, method, planner options) per world size; the key names the plan kind
TP = {"degrees": (2, 1, 1)}
GPIPE = {"degrees": (1, 2, 1), "schedule": "gpipe", "microbatches": 2}
ONE_F_ONE_B = {"degrees": (1, 2, 1), "schedule": "1f1b", "microbatches": 4}
CASES: dict[int, dict[str, tuple[str, str, dict]]] = {
    2: {
        **{f"{m}-data-parallel": (m, "data-parallel", {}) for m in MODELS},
        **{f"{m}-tp": (m, "megatron", TP) for m in MODELS},
        **{f"{m}-auto": (m, "auto", {}) for m in MODELS},
        # op placements (hash, critical path) run at world 4 only since 2026-11-28: the same executor and models
        **{f"{m}-gpipe": (m, "megatron", GPIPE) for m in ("mlp", "gpt", "resnet")},
        **{f"{m}-1f1b": (m, "megatron", ONE_F_ONE_B) for m in ("mlp", "gpt", "moe")},
        "mlp-fsdp": ("mlp", "data-parallel", {"zero": 2}),
        # several stages per rank (torch's ScheduleInterleaved1F1B), and backward split into I and W
        "gpt-interleaved": ("gpt", "auto", {"schedule": "interleaved"}),
        "llama-zero-bubble": ("llama", "auto", {"schedule": "zero-bubble"}),
        # a stage input's gradient that is not contiguous (a transposed convolution's, a cat's) is sent back
        "unet-zero-bubble": ("unet", "uniform-pipeline", {"schedule": "zero-bubble", "microbatches": 4}),
        # Megatron's layout of attention as separate operators (Q·Kᵀ, mask, softmax, dropout, ·V): split by heads
        "gpt-unfused-tp": ("gpt_unfused_dropout", "megatron", TP),
    },
    4: {
        **{f"{m}-tp2d": (m, "megatron", {"degrees": (2, 1, 2)}) for m in MODELS},
        **{f"{m}-auto": (m, "auto", {}) for m in MODELS},
        **{f"{m}-hash": (m, "hash", {}) for m in MODELS},
        **{f"{m}-critical-path": (m, "critical-path", {}) for m in MODELS},
        "gpt-pp-tp-1f1b": ("gpt", "megatron", {"degrees": (2, 2, 1), "schedule": "1f1b", "microbatches": 2}),
        "mlp-pp-tp-gpipe": ("mlp", "megatron", {"degrees": (2, 2, 1), "schedule": "gpipe", "microbatches": 2}),
        "moe-data-parallel": ("moe", "data-parallel", {}),
        "gpt-zero-bubble": ("gpt", "auto", {"schedule": "zero-bubble"}),  # tensor-parallel stages, v = 2
        "llama-interleaved": ("llama", "auto", {"schedule": "interleaved"}),
        # linears whose input splits the sequence over both mesh axes: run on each rank's rows (executor)
        "transformer_lm-rows-2d": ("transformer_lm", "uniform-pipeline", {}),
        # sequence parallel on a post-LN model: a gathered norm output is also read as sequence shards (locally)
        "bert-sp-tp2d": ("bert", "megatron", {"degrees": (2, 1, 2)}),
        # attention on batch shards with a whole relative-position bias: the bias's gradient is a partial sum
        "swin-attention-bias": ("swin", "megatron", {}),
    },
}
# pipelines whose stages differ in device count: (model, devices of stage 0, devices of stage 1)
UNEVEN = {4: {"gpt-uneven-1-2": ("gpt", (0,), (1, 2)), "mlp-uneven-2-1": ("mlp", (0, 1), (2,))}}
# memory-saving choices: (model, method, planner options, then the recomputation and microbatch count set on the
# plan where the method does not choose them). FSDP's ZeRO-1/2/3 on data-parallel plans, ZeRO-1 on sharded and
# pipeline stages; full and selective (attention) recomputation; GPT and Hugging Face GPT-2 (tied embeddings)
MEMORY = {
    2: {
        "gpt-fsdp1-full-m2": ("gpt_unfused", "data-parallel", {"zero": 1}, {"remat": "full", "microbatches": 2}),
        "gpt2-fsdp3-attention-m2": (
            "gpt2_eager",
            "data-parallel",
            {"zero": 3},
            {"remat": "attention", "microbatches": 2},
        ),
    },
    4: {
        "gpt-tp2d-zero1-attention": (
            "gpt_unfused",
            "megatron",
            {"degrees": (2, 1, 2), "zero": 1, "remat": "attention"},
            {},
        ),
        "gpt2-pp-zero1-full": (
            "gpt2_eager",
            "megatron",
            {"degrees": (1, 2, 2), "zero": 1, "remat": "full", "schedule": "gpipe", "microbatches": 2},
            {},
        ),
    },
}
# a plan with one node's stored strategy changed: (plan it edits, node, the output spec of its new strategy)
# sequence-parallel GPT plans edited: the first norm keeps its shards (its R* readers gather on the edge), or q
# reads the gathered norm plainly (R, its own all-reduce; the norm still reduce-scatters what comes back)
EDITED = {
    2: {
        "mlp-tp-gelu-replicated": ("mlp-tp", "gelu", ("R",)),
        "gpt-tp-norm-sharded": ("gpt-tp", "layer_norm", ("S(1)",)),
        "gpt-tp-q-plain": ("gpt-tp", "linear", ("S(2)",)),
    }
}
COLLECTIVE_CASES = {
    2: ["mlp-tp", "gpt-tp", "mlp-tp-gelu-replicated", "gpt-tp-norm-sharded", "gpt-unfused-tp"],
    4: ["mlp-tp2d", "gpt-tp2d"],
}


def make_plans(world: int, directory: Path) -> dict[str, Path]:
    cluster = load_cluster("local-cpu", num_nodes=1, devices_per_node=world)
    paths = {}
    for key, (model, method, options) in CASES[world].items():
        file, args, batch = {**MODELS, **ZOO_MODELS}[model]
        prepared = prepare_model_file(EXAMPLES / file, cluster, batch_size=batch, model_args=args, **options)
        paths[key] = directory / f"{key}.json"
        save_plan(plan_prepared(prepared, method), paths[key])
    for key, (model, first, second) in UNEVEN.get(world, {}).items():
        paths[key] = directory / f"{key}.json"
        save_plan(uneven_plan(model, world=world, devices=(first, second)), paths[key])
    for key, (model, method, options, edits) in MEMORY.get(world, {}).items():
        file, args, batch = ZOO_MODELS[model]
        prepared = prepare_model_file(EXAMPLES / file, cluster, batch_size=batch, model_args=args, **options)
        paths[key] = directory / f"{key}.json"
        graph = captured(Path(file).with_suffix("").as_posix(), batch, **args)
        save_plan(with_memory_choices(plan_prepared(prepared, method), graph, **edits), paths[key])
    for key, (base, node, output_spec) in EDITED.get(world, {}).items():
        file, args, batch = MODELS[base.split("-")[0]]
        graph = captured(Path(file).stem, batch, **args)
        paths[key] = directory / f"{key}.json"
        save_plan(edit_strategy(load_plan(paths[base]), graph, stage=0, node=node, output_spec=output_spec), paths[key])
    return paths


def with_memory_choices(plan: Plan, graph: OpGraph, *, remat: str = "", microbatches: int = 0) -> Plan:
    """``plan`` (one stage) recomputing ``remat``'s runs of its layers, over ``microbatches``."""
    if not remat:
        return plan
    (stage,) = plan.stages
    runs = remat_runs(remat, graph, stage.nodes, layers=layering(graph).layers)
    stage = replace(stage, remat=remat, remat_regions=tuple((run[0], run[-1]) for run in runs))
    return replace(plan, stages=(stage,), num_microbatches=microbatches or plan.num_microbatches)


def uneven_plan(model: str, *, world: int, devices: tuple[tuple[int, ...], tuple[int, ...]]) -> Plan:
    """A two-stage GPipe plan with stages of different sizes: the split of the (1, 2, 1) Megatron plan,
    a two-device stage taking the (2, 1, 1) Megatron plan's specs for its nodes."""
    file, args, batch = MODELS[model]
    two = load_cluster("local-cpu", num_nodes=1, devices_per_node=2)
    split = plan_prepared(
        prepare_model_file(
            EXAMPLES / file, two, batch_size=batch, model_args=args, degrees=(1, 2, 1), schedule="gpipe", microbatches=2
        ),
        "megatron",
    )
    tensor_parallel = plan_prepared(
        prepare_model_file(EXAMPLES / file, two, batch_size=batch // 2, model_args=args, degrees=(2, 1, 1)), "megatron"
    ).stages[0]
    stages = []
    for stage, on in zip(split.stages, devices, strict=True):
        specs = tensor_parallel if len(on) == 2 else stage  # a one-device stage keeps its own strategies
        strategies = {n: specs.strategies[n] for n in stage.nodes}
        params = {p: specs.param_placements[p] if len(on) == 2 else ("R",) for p in stage.param_placements}
        stages.append(
            replace(
                stage, devices=on, mesh_shape=(len(on),), strategies=strategies, param_placements=params, explanation=()
            )
        )
    cluster = load_cluster("local-cpu", num_nodes=1, devices_per_node=world)
    return replace(split, cluster=cluster, stages=tuple(stages))


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict]:
    results = {}
    for world in CASES:
        directory = tmp_path_factory.mktemp(f"world{world}")
        plans = make_plans(world, directory)
        done = torchrun(world, "parity_worker.py", directory / "parity.json", list(plans.values()))
        parity = json.loads((directory / "parity.json").read_text()) if done.returncode == 0 else None
        collective_plans = [plans[key] for key in COLLECTIVE_CASES[world]]
        counted = torchrun(world, "collectives_worker.py", directory / "collectives.json", collective_plans)
        collectives = json.loads((directory / "collectives.json").read_text()) if counted.returncode == 0 else None
        results[world] = {
            "plans": plans,
            "parity": parity,
            "collectives": collectives,
            "log": done.stderr[-4000:],
            "collectives_log": counted.stderr[-4000:],
        }
    return results


@pytest.mark.parametrize(
    "world,key",
    [
        (world, key)
        for world in CASES
        for key in [*CASES[world], *UNEVEN.get(world, {}), *EDITED.get(world, {}), *MEMORY.get(world, {})]
    ],
)
def test_parity_with_one_process(runs: dict, world: int, key: str) -> None:
    run = runs[world]
    assert run["parity"] is not None, f"the world-{world} job failed:\n{run['log']}"
    steps = run["parity"][str(run["plans"][key])]
    assert len(steps) == 2
    for step in steps:
        assert step["ok"], step["describe"]


def _on_gloo(counts: dict[str, int]) -> dict[str, int]:
    """gloo has no all-to-all: DTensor falls back to an all-gather and a local chunk."""
    result = dict(counts)
    if "all_to_all" in result:
        result["all_gather"] = result.get("all_gather", 0) + result.pop("all_to_all")
    return result


@pytest.mark.parametrize("world,key", [(world, key) for world in COLLECTIVE_CASES for key in COLLECTIVE_CASES[world]])
def test_collectives_are_the_charged_ones(runs: dict, world: int, key: str) -> None:
    """Forward and gradient sync (one all-reduce per bucket and axis): exactly the cost model's collectives.
    Backward: the same all-reduces; GPT's head split (an all-to-all, all-gathered on gloo) adds one all-gather."""
    run = runs[world]
    assert run["collectives"] is not None, f"the world-{world} collectives job failed:\n{run['collectives_log']}"
    phases = run["collectives"][str(run["plans"][key])]
    for phase in ("forward", "backward"):  # the simulator charges exactly what the plan file lists
        assert phases[phase]["charged"] == phases[phase]["plan"], phase
    assert phases["sync"]["charged_params"] == phases["sync"]["plan"]  # ... its parameters' sync, in buckets
    for phase in ("forward", "sync"):
        assert phases[phase]["observed"] == _on_gloo(phases[phase]["charged"]), phase
    backward = phases["backward"]
    if key.startswith("mlp"):  # (an exchange between splits, all-to-all, is an all-gather on gloo)
        assert backward["observed"] == _on_gloo(backward["charged"])
    assert backward["observed"].get("all_reduce", 0) == backward["charged"].get("all_reduce", 0)
    assert phases["forward"]["observed"], "a tensor-parallel plan communicates in forward"


def test_the_executor_runs_an_edited_strategy_as_stored(runs: dict) -> None:
    """gelu stored replicated instead of column-split: DTensor issues the all-gather into it (forward) and the
    all-gather of linear_1's input gradient (backward) that its record implies — one more of each than the
    plan it was edited from — and the run still matches one device (test_parity_with_one_process)."""
    run = runs[2]
    assert run["collectives"] is not None, f"the world-2 collectives job failed:\n{run['collectives_log']}"
    base, edited = (run["collectives"][str(run["plans"][key])] for key in ("mlp-tp", "mlp-tp-gelu-replicated"))
    for phase in ("forward", "backward"):
        more = Counter(edited[phase]["observed"]) - Counter(base[phase]["observed"])
        assert _on_gloo(dict(more)) == {"all_gather": 1}, phase
    assert edited["sync"]["observed"] == base["sync"]["observed"]


def test_the_rows_case_splits_a_linear_input_dim_over_both_axes(runs: dict) -> None:
    """The plan the rows case runs still has what it is there for: a linear reading a leading dim split twice."""
    plan = load_plan(runs[4]["plans"]["transformer_lm-rows-2d"])
    twice = [
        name
        for stage in plan.stages
        for name, record in stage.strategies.items()
        if name.startswith("linear")
        and record.input_specs[0] is not None
        and len(record.input_specs[0]) == 2
        and len(set(record.input_specs[0])) == 1
        and record.input_specs[0][0] not in ("R", "S(0)")
    ]
    assert twice, "the planner no longer picks a doubly split linear input here: choose another case"


def test_the_schedule_cases_run_the_schedule_they_name(runs: dict) -> None:
    """The interleaved and zero-bubble parity cases are what they say (a canary for plans that drift)."""
    for world, key, schedule, several in (
        (2, "gpt-interleaved", "interleaved", True),
        (2, "llama-zero-bubble", "zero-bubble", False),
        (4, "gpt-zero-bubble", "zero-bubble", False),
        (4, "llama-interleaved", "interleaved", True),
    ):
        plan = load_plan(runs[world]["plans"][key])
        assert plan.schedule == schedule, key
        assert plan.num_pipeline_ranks >= 2 and (plan.virtual_stages >= 2 or not several), key


def test_the_sequence_parallel_cases_are_sequence_parallel(runs: dict) -> None:
    """Megatron plans of transformers with t > 1 are sequence parallel (a canary for plans that drift): the norms
    gather their outputs (R*) for the column-parallel linears; BERT's post-LN norms are also read as shards."""
    for world, key in ((2, "gpt-tp"), (4, "gpt-tp2d"), (4, "bert-sp-tp2d")):
        plan = load_plan(runs[world]["plans"][key])
        assert all(stage.uses_sequence_parallelism for stage in plan.stages), key
    bert = load_plan(runs[4]["plans"]["bert-sp-tp2d"]).stages[0]
    gathered = {name for name, record in bert.strategies.items() if "R*" in record.output_spec}
    readers = {
        name
        for name, record in bert.strategies.items()
        if "R*" not in record.output_spec and any(spec is not None and "S(1)" in spec for spec in record.input_specs)
    }
    assert gathered and readers


def test_the_executor_gathers_on_the_edge_when_a_norm_keeps_its_shards(runs: dict) -> None:
    """gpt-tp-norm-sharded: ln_1 stored on sequence shards (S(1)) instead of gathered (R*): its q, k and v readers
    (R*) each all-gather it forward and all-reduce its gradient on the edge; ln_1's own gather and reduce-scatter
    go — and the run still matches one device (test_parity_with_one_process)."""
    run = runs[2]
    assert run["collectives"] is not None, f"the world-2 collectives job failed:\n{run['collectives_log']}"
    base, edited = (run["collectives"][str(run["plans"][key])] for key in ("gpt-tp", "gpt-tp-norm-sharded"))
    more = {
        phase: Counter(edited[phase]["charged"]) - Counter(base[phase]["charged"]) for phase in ("forward", "backward")
    }
    assert more == {"forward": Counter(all_gather=2), "backward": Counter(all_reduce=3)}


def test_the_data_parallel_pipeline_case_sends_values_as_shards(runs: dict) -> None:
    """gpt2-pp-zero1-full's stages are two replicas each: its boundary values cross as each rank's rows (S(0))
    (planner.plan.stage.boundary_spec), so its parity covers that path."""
    plan = load_plan(runs[4]["plans"]["gpt2-pp-zero1-full"])
    file, args, batch = ZOO_MODELS["gpt2_eager"]
    graph = captured(Path(file).with_suffix("").as_posix(), batch // plan.num_microbatches, **args)
    rows = boundary_shards(graph, plan, stage_segments(graph, plan, loss_inputs=()))
    assert rows[0].outputs and set(rows[0].outputs.values()) == {("S(0)",)}


@pytest.mark.parametrize("world,key", [(world, key) for world in MEMORY for key in MEMORY[world]])
def test_the_memory_cases_run_what_they_are_named_for(runs: dict, world: int, key: str) -> None:
    """Each memory case's plan holds its ZeRO level and recomputation (the parity test above runs it)."""
    plan = load_plan(runs[world]["plans"][key])
    level = int(key.split("zero")[1][0]) if "zero" in key else int(key.split("fsdp")[1][0])
    assert {stage.zero for stage in plan.stages} == {level}
    kind = "attention" if "attention" in key else "full"
    assert all(stage.remat == kind and stage.remat_regions for stage in plan.stages)


def test_the_unfused_attention_case_splits_heads(runs: dict) -> None:
    """gpt-unfused-tp: Megatron's layout of attention as separate operators keeps the heads split from Q·Kᵀ to ·V
    (a canary for plans that drift; the parity test above runs it, dropout off while checking)."""
    (stage,) = load_plan(runs[2]["plans"]["gpt-unfused-tp"]).stages
    softmax = [record for name, record in stage.strategies.items() if name.startswith("softmax")]
    assert softmax and all(record.output_spec == ("S(1)",) and record.compute_shards == 2 for record in softmax)
