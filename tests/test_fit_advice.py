"""Does-not-fit advice from the estimate: each change named fits by the same figures, and none that cannot help."""

from __future__ import annotations

import re

import pytest

from cost_models.memory import model_state_bytes
from cost_models.units import GIB
from planner.api import plan_model_file
from planner.baselines.method_options import MemoryParts, advice_text, does_not_fit_message, fit_advice
from planner.errors import AutoplanError
from planner.options import PlanOptions
from tests.conftest import EXAMPLES, setup_for

GPT = EXAMPLES / "gpt.py"
SIZE = {"size": "350m"}
PARAMS = 1e9  # adam-mixed: 16 bytes a parameter, 2 + 2 + 12


def parts(state_gib: float, activation_gib: float, *, zero: int = 0, d: int = 8, m: int = 2) -> MemoryParts:
    return MemoryParts(
        state_bytes=state_gib * GIB, activation_bytes=activation_gib * GIB, zero=zero, data_degree=d, num_microbatches=m
    )


def test_the_zero_level_advised_is_the_first_whose_repriced_state_fits() -> None:
    setup = setup_for(8.0)  # 8 GiB on each of 8 devices
    state = model_state_bytes(PARAMS, optimizer="adam-mixed") / GIB  # 14.9 GiB replicated
    unfit = parts(state, 1.0)
    # ZeRO-1: 5.5 bytes a parameter (5.1 GiB) + 1 GiB fits 8 GiB; data-parallel may go up to 3, Megatron to 1
    advice = fit_advice("data-parallel", PlanOptions(zero="0"), setup, parts=unfit, batch_size=64)
    zero1 = model_state_bytes(PARAMS, optimizer="adam-mixed", state_shards=8) / GIB + 1.0
    assert advice[0] == f"--zero 1 (about {zero1:.1f} GiB)"
    tight = setup_for(4.0)  # ZeRO-1 (5.1 GiB + 1) and ZeRO-2 (3.5 GiB + 1) are over; ZeRO-3 (1.9 + 1) is not
    assert fit_advice("data-parallel", PlanOptions(zero="0"), tight, parts=unfit, batch_size=64)[0].startswith(
        "--zero 3 (about 2.9 GiB)"
    )
    megatron = fit_advice("megatron", PlanOptions(zero="0"), tight, parts=unfit, batch_size=64)
    assert not any(entry.startswith("--zero") for entry in megatron)


def test_no_zero_advice_when_the_planner_chose_the_level_or_there_is_one_replica() -> None:
    setup, unfit = setup_for(8.0), parts(14.9, 1.0)
    assert fit_advice("data-parallel", PlanOptions(), setup, parts=unfit, batch_size=64) == []
    assert fit_advice("data-parallel", PlanOptions(zero="0"), setup, parts=parts(14.9, 1.0, d=1), batch_size=64) == []


def test_the_batch_advised_is_the_largest_the_linear_activation_term_allows() -> None:
    setup = setup_for(12.0)  # state 4 GiB + activations 20 GiB at batch 64, 2 microbatches over 4 replicas
    advice = fit_advice("megatron", PlanOptions(), setup, parts=parts(4.0, 20.0, d=4), batch_size=64)
    # 64 · (12 − 4) / 20 = 25.6 rows: the largest multiple of 2 · 4 is 24, and 4 + 20 · 24 / 64 = 11.5 GiB fits
    assert advice[0] == "--batch-size 24 or less"
    assert 4.0 + 20.0 * 24 / 64 <= 12.0 < 4.0 + 20.0 * 32 / 64
    # more replicas split the rows: 8 · 20 / (12 − 4) = 20 devices
    assert advice[1] == "about 20 devices" and len(advice) == 2


def test_nothing_is_advised_that_cannot_help() -> None:
    setup = setup_for(8.0)
    # the state alone is over the budget: no batch, no device count of this layout helps
    assert fit_advice("megatron", PlanOptions(), setup, parts=parts(9.0, 3.0), batch_size=64) == []
    # recomputation only when it was turned off and the state leaves room
    assert fit_advice("megatron", PlanOptions(remat="off"), setup, parts=parts(9.0, 3.0), batch_size=64) == []
    advice = fit_advice("megatron", PlanOptions(remat="off"), setup, parts=parts(4.0, 30.0, m=8), batch_size=64)
    assert advice[-1] == "recomputation (--remat full) to cut the activations"
    assert advice_text([], otherwise="X") == "X"
    assert advice_text(["a", "b", "c"], otherwise="X") == "by its estimate it fits with a, b or c"


@pytest.mark.parametrize("method", ["megatron", "uniform-pipeline", "data-parallel"])
def test_the_hand_written_message_names_need_budget_and_advice_in_words_without_a_double_negative(method) -> None:
    setup = setup_for(12.0)
    text = does_not_fit_message(
        method, PlanOptions(), setup, 24 * GIB, parts=parts(4.0, 20.0, d=4), batch_size=64, num_params=10**8
    )
    assert text.startswith(f"does not fit: the smallest {method} plan needs 24.0 GiB per device (state 4.0 GiB + ")
    assert "the budget is 12.0 GiB" in text and text.endswith("--batch-size 24 or less or about 20 devices")
    none = does_not_fit_message(method, PlanOptions(), setup, None)
    assert none == f"cannot make a {method} plan for this model and cluster" and "no " not in none
    state = does_not_fit_message(method, PlanOptions(), setup, 24 * GIB, num_params=10**10)  # 149 GiB of state
    assert "even split over all 8 devices" in state and state.endswith("use at least 13 devices at this budget")


def _refusal(**keywords) -> str:
    with pytest.raises(AutoplanError) as error:
        plan_model_file(GPT, "p3.16xlarge", model_args=SIZE, **keywords)
    return str(error.value)


def test_the_zero_level_a_data_parallel_refusal_advises_fits() -> None:
    """GPT-350M on 8 V100s at 40% of their memory: no ZeRO does not fit, the level advised does."""
    text = _refusal(batch_size=8, method="data-parallel", zero="0", memory_fraction=0.4)
    level = re.search(r"it fits with --zero (\d) \(about ([\d.]+) GiB\)", text)
    assert level is not None, text
    made = plan_model_file(
        GPT,
        "p3.16xlarge",
        model_args={"size": "350m"},
        batch_size=8,
        method="data-parallel",
        zero=level[1],
        memory_fraction=0.4,
    )
    assert made.zero == int(level[1]) and made.estimate.memory_per_device_bytes <= made.memory_budget_bytes


def test_the_batch_a_megatron_refusal_advises_is_within_the_budget_by_the_estimate() -> None:
    """GPT-350M at batch 32768 on 8 V100s (2048 fits since each device runs the loss on its own rows of the
    logits): at the batch advised, the smallest megatron plan needs no more than the
    budget by the same estimate (megatron prices only its fastest plans exactly, so it may still refuse)."""
    text = _refusal(batch_size=32768, method="megatron")
    batch = re.search(r"--batch-size (\d+) or less", text)
    assert batch is not None and "state" in text and "activations" in text, text
    try:
        plan_model_file(GPT, "p3.16xlarge", model_args=SIZE, batch_size=int(batch[1]), method="megatron")
    except AutoplanError as error:
        needed = re.search(r"needs ([\d.]+) GiB per device", str(error))
        assert needed is not None and float(needed[1]) <= 13.7, str(error)


def test_outputs_held_whole_are_named_and_no_device_count_is_advised_that_they_would_still_overflow() -> None:
    """The model's outputs and the loss on them, held whole by each device of the last stage, are the whole
    microbatch's however many replicas there are: more devices shrink only the rest of the activations."""
    setup = setup_for(12.0)
    mostly = MemoryParts(
        state_bytes=1 * GIB, activation_bytes=20 * GIB, zero=0, data_degree=4, num_microbatches=2, output_bytes=15 * GIB
    )
    text = does_not_fit_message("megatron", PlanOptions(), setup, 21 * GIB, parts=mostly, batch_size=64)
    assert "activations 20.0 GiB, 15.0 GiB of them the model's outputs and the loss on them, whole on each" in text
    assert "devices" not in text.split("the budget is")[1]  # 15 GiB of outputs alone are over the 12 GiB budget
    some = MemoryParts(
        state_bytes=1 * GIB, activation_bytes=20 * GIB, zero=0, data_degree=4, num_microbatches=2, output_bytes=5 * GIB
    )
    # 6 GiB of room beside state and outputs for 15 GiB of scaling activations: 8 devices × 15 / 6 = 20
    assert "about 20 devices" in fit_advice("megatron", PlanOptions(), setup, parts=some, batch_size=64)
    assert "of them" not in does_not_fit_message("megatron", PlanOptions(), setup, 21 * GIB, parts=some, batch_size=64)


def test_a_refusal_whose_logits_fill_the_device_says_so_and_the_batch_it_advises_fits() -> None:
    """A small GPT with a 250,000-token vocabulary at batch 64 in one microbatch: the logits, whole on every device
    of the stage, and the cross entropy on them are nearly all of the 213 GiB the plan needs."""
    keywords = {
        "model_args": {"size": "tiny", "vocab": "250000", "seq": "1024"},
        "method": "megatron",
        "degrees": (8, 1, 1),
        "microbatches": 1,
    }
    with pytest.raises(AutoplanError) as error:
        plan_model_file(GPT, "p3.16xlarge", batch_size=64, **keywords)
    text = str(error.value)
    assert "of them the model's outputs and the loss on them" in text and "devices" not in text.split("budget is")[1]
    batch = re.search(r"--batch-size (\d+) or less", text)
    assert batch is not None, text
    made = plan_model_file(GPT, "p3.16xlarge", batch_size=int(batch[1]), **keywords)
    assert made.estimate.memory_per_device_bytes <= made.memory_budget_bytes
