"""``--space alpa``: auto restricted to Alpa's search space, to measure what the other choices add."""

from __future__ import annotations

import pytest

from cost_models.cluster import load_cluster
from planner.api import plan_model_file
from planner.errors import AutoplanError
from planner.options import PlanOptions, RematChoice, ZeroChoice
from planner.plan import Remat
from tests.conftest import EXAMPLES


def _space(space: str, **options: object) -> tuple[str, str]:
    built = PlanOptions(space=space, **options)
    return built.remat, built.zero


def test_the_alpa_space_maps_auto_options_into_it_and_refuses_the_rest() -> None:
    assert _space("full", allow_lossy=True) == ("auto", "auto")
    assert _space("alpa", schedule="1f1b") == ("off-or-full", "0")
    assert _space("alpa", remat="on", zero="0", schedule="gpipe") == (RematChoice.ON, ZeroChoice.OFF)
    with pytest.raises(AutoplanError, match="--schedule zero-bubble, --zero 1, --allow-lossy is outside --space alpa"):
        _space("alpa", zero="1", schedule="zero-bubble", allow_lossy=True)
    with pytest.raises(AutoplanError, match="--space must be one of full, alpa"):
        _space("mist")


def test_the_alpa_space_plan_uses_none_of_the_new_choices_and_the_full_space_beats_it() -> None:
    """GPT-350M on one DGX-A100 node (GPT-1.3B on two until 2026-11-28, twice the planning time): Alpa's space keeps
    its own choices; the full space is faster with a choice Alpa's space does not have (since issue 32, data
    parallelism under FSDP, each ZeRO level priced as it runs)."""
    cluster = load_cluster("dgx-a100", num_nodes=1)
    plans = {
        space: plan_model_file(EXAMPLES / "gpt.py", cluster, batch_size=64, model_args={"size": "350m"}, space=space)
        for space in ("full", "alpa")
    }
    alpa = plans["alpa"]
    assert alpa.schedule in ("none", "gpipe", "1f1b") and alpa.virtual_stages == 1
    assert all(stage.remat in (Remat.NONE, Remat.FULL) and stage.zero == 0 for stage in alpa.stages)
    assert not any(stage.uses_sequence_parallelism for stage in alpa.stages)
    assert not alpa.grad_sync.lossy
    full = plans["full"]
    assert full.estimate.step_time_s < alpa.estimate.step_time_s
    outside = (
        full.schedule in ("interleaved", "zero-bubble")
        or any(stage.zero for stage in full.stages)
        or any(stage.uses_sequence_parallelism or stage.remat == Remat.ATTENTION for stage in full.stages)
    )
    assert outside, full.stages


def test_without_sequence_parallelism_megatron_stages_all_reduce() -> None:
    cluster = load_cluster("dgx-a100", num_nodes=1)
    plans = {
        space: plan_model_file(
            EXAMPLES / "gpt.py",
            cluster,
            batch_size=16,
            model_args={"size": "350m"},
            method="megatron",
            degrees=(4, 1, 2),
            space=space,
        )
        for space in ("full", "alpa")
    }
    assert any(stage.uses_sequence_parallelism for stage in plans["full"].stages)
    assert not any(stage.uses_sequence_parallelism for stage in plans["alpa"].stages)


def test_the_command_line_refuses_an_option_outside_the_space_in_one_line(capsys, tmp_path) -> None:
    from planner.cli.main import main

    args = [
        str(EXAMPLES / "mlp.py"),
        "--cluster",
        "local-cpu",
        "--devices-per-node",
        "2",
        "--batch-size",
        "8",
        "--model-arg",
        "hidden=32",
        "--model-arg",
        "layers=2",
        "--out",
        str(tmp_path / "p.json"),
        "--space",
        "alpa",
        "--schedule",
        "interleaved",
    ]
    assert main(args) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if not line.startswith("plan: warning:")]
    assert err == ["plan: error: --schedule interleaved is outside --space alpa: drop it or use --space full"], err
    assert not (tmp_path / "p.json").exists()
