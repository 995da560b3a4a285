"""One number per quantity, on a CI slice (``benchmarks/consistency.py`` runs every quality case).

Every method's breakdown adds up to its step, auto's candidates are the methods' own plans and the figures its
summary prints, auto takes the least of them, and every method honours each forced option or refuses it in one
line.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping

import pytest

from benchmarks.consistency import check_case, check_options
from cost_models.cluster import load_cluster
from planner.api import plan_prepared, prepare_model_file
from planner.errors import AutoplanError
from tests.conftest import EXAMPLES

CASES = {
    "mlp@cpu2": ("mlp", {"hidden": 128, "layers": 4}, 16, "local-cpu", 1, 2),
    "gpt-tiny@p3x4": ("gpt", {"size": "tiny"}, 8, "p3.16xlarge", 1, 4),
    "moe@a100x4": ("moe", {"hidden": 128, "experts": 4, "layers": 2, "tokens": 32}, 16, "dgx-a100", 1, 4),
}


@functools.cache
def _prepared(case: str, options: tuple[tuple[str, object], ...] = ()):
    example, args, batch, cluster, nodes, per_node = CASES[case]
    return prepare_model_file(
        EXAMPLES / f"{example}.py",
        load_cluster(cluster, num_nodes=nodes, devices_per_node=per_node),
        batch_size=batch,
        model_args=args,
        rl_iterations=3,
        **dict(options),
    )


@pytest.mark.parametrize("case", list(CASES))
def test_every_method_prints_one_number_per_quantity(case: str) -> None:
    assert check_case(_prepared(case)) == []


def test_every_method_honours_each_option_or_refuses_it_in_one_line() -> None:
    def prepared_with(forced: Mapping[str, object]):
        return _prepared("gpt-tiny@p3x4", tuple(sorted(forced.items())))

    assert check_options(prepared_with) == []


def test_the_does_not_fit_figure_is_that_of_the_choices_asked_for() -> None:
    """A data-parallel plan that does not fit says what the smallest plan with the asked ZeRO level needs: less
    with ZeRO-3 than without, both over the budget."""
    needed = {}
    for zero in ("0", "3"):
        # the state split over the 4 devices fits (0.64 of 0.84 MiB), the data-parallel plans do not (without CPU
        # offload, which would hold the shards in host memory)
        prepared = _prepared("gpt-tiny@p3x4", (("memory_fraction", 0.00006), ("zero", zero), ("offload", "off")))
        with pytest.raises(AutoplanError, match=r"does not fit: the smallest data-parallel plan") as error:
            plan_prepared(prepared, "data-parallel")
        needed[zero] = float(str(error.value).split(" needs ")[1].split(" GiB")[0])
        assert (f"ZeRO-{zero}" in str(error.value)) == (zero == "3")
    assert needed["3"] < needed["0"]


@pytest.mark.parametrize("zero", ["2", "3"])
def test_zero_2_and_3_plan_only_what_fsdp_runs(zero: str) -> None:
    """A MoE's data-parallel layout splits its experts (no FSDP there): ``--zero 2|3`` plans a layout FSDP runs
    (every parameter replicated, one stage) or refuses in one line, never a plan that fails its own check."""
    from cost_models.cluster import preset

    cluster = preset("local-cpu").with_shape(num_nodes=1, devices_per_node=2)
    args = {"hidden": 128, "experts": 8, "top_k": 2, "layers": 2, "tokens": 64}
    prepared = prepare_model_file(EXAMPLES / "moe.py", cluster, batch_size=16, model_args=args, zero=zero)
    for method in ("data-parallel", "auto"):
        try:
            plan = plan_prepared(prepared, method)
        except AutoplanError:
            continue
        zeroed = [stage for stage in plan.stages if stage.zero >= 2]
        assert all(
            len(plan.stages) == 1 and set(spec) == {"R"} for stage in zeroed for spec in stage.param_placements.values()
        )
