"""The best model-FLOPs utilisation published for a GPU type and model size: a sanity bound on an estimate.

An estimate whose MFU (model FLOPs per step over the step and the devices' peak, :func:`planner.costing.estimate.mfu`)
is above the best any published training run reached on that GPU for models of that size is probably optimistic:
:func:`mfu_bound_note` says so in the plan's notes, with the bound, its source and why the cost model can land
above it. The bound is a note, not a cap: the estimate is left as it is.

:data:`PUBLISHED_MFU`, each row the highest MFU in its source for that GPU and size range (MFU as the source
defines it: model FLOPs with attention, without recomputation, over the bf16/fp16 dense peak; where a source
gives only hardware FLOPs, recomputation included, that figure, which makes the bound looser):

* A100 80 GB: MosaicML llm-foundry, ``scripts/train/benchmarking/README.md`` ("MPT Training Benchmarks", A100
  80GB with 1600 Gbps RoCE, FSDP FULL_SHARD, bf16), the best MFU of each model: 125M 54.13% (seq 65536), 350M
  53.8%, 760M 56.85%, 1B 60.68%, 3B 63.71%, 7B 64.23%, 13B 59.57%, 30B 56.4%, 70B 53.33%; Megatron-LM SC'21
  (Narayanan et al. 2021, Table 1; ``../shared/published-measurements.md``): 44–52% of peak counting the
  recomputation's FLOPs, 1.7B–1T, below MPT's in every range.
* H100 80 GB: the same llm-foundry page (H100 80GB, bf16): 760M 40.42%, 1B 43.21%, 3B 46.32%, 7B 46.44%, 13B
  44.27%, 30B 43.92%, 70B 42.57%; Megatron-LM's README (github.com/NVIDIA/Megatron-LM, 2025): "up to 47% Model FLOP
  Utilization (MFU) on H100 clusters", 41% for its smallest model (2B) to 47–48% for the largest (up to 462B).
* V100: Megatron-LM 2019 (Shoeybi et al.; ``../shared/published-measurements.md``): 39 TFLOP/s of 125 on one
  V100, 1.2B (31%, its FLOP count unstated), 29.5 TFLOP/s per GPU for 8.3B on 512 (24%).

Sizes are parameters of the model (``ModelRef.num_params``); a range's upper end is exclusive.
"""

from __future__ import annotations

from dataclasses import dataclass

_B = 1e9


@dataclass(frozen=True, kw_only=True)
class MfuBound:
    gpu: str  # a prefix of DeviceSpec.name: A100, H100, V100
    min_params: float
    max_params: float
    mfu: float
    source: str


PUBLISHED_MFU: tuple[MfuBound, ...] = (
    MfuBound(gpu="A100", min_params=0, max_params=0.5 * _B, mfu=0.5413, source="MPT-125M, llm-foundry benchmarks"),
    MfuBound(gpu="A100", min_params=0.5 * _B, max_params=2 * _B, mfu=0.6068, source="MPT-1B, llm-foundry benchmarks"),
    MfuBound(gpu="A100", min_params=2 * _B, max_params=10 * _B, mfu=0.6423, source="MPT-7B, llm-foundry benchmarks"),
    MfuBound(gpu="A100", min_params=10 * _B, max_params=50 * _B, mfu=0.5957, source="MPT-13B, llm-foundry benchmarks"),
    MfuBound(
        gpu="A100", min_params=50 * _B, max_params=float("inf"), mfu=0.5333, source="MPT-70B, llm-foundry benchmarks"
    ),
    MfuBound(gpu="H100", min_params=0, max_params=2 * _B, mfu=0.4321, source="MPT-1B, llm-foundry benchmarks"),
    MfuBound(gpu="H100", min_params=2 * _B, max_params=10 * _B, mfu=0.4644, source="MPT-7B, llm-foundry benchmarks"),
    MfuBound(
        gpu="H100",
        min_params=10 * _B,
        max_params=float("inf"),
        mfu=0.48,
        source="Megatron-LM's README, 2B-462B on H100 clusters",
    ),
    MfuBound(gpu="V100", min_params=0, max_params=float("inf"), mfu=0.31, source="Megatron-LM 2019, 1.2B on one V100"),
)


def published_bound(device_name: str, num_params: float) -> MfuBound | None:
    """The row of :data:`PUBLISHED_MFU` for this GPU and model size, None for a device it does not cover."""
    for bound in PUBLISHED_MFU:
        if device_name.startswith(bound.gpu) and bound.min_params <= num_params < bound.max_params:
            return bound
    return None


def mfu_bound_note(*, device_name: str, num_params: float, mfu: float, gemm_efficiency: float | None) -> str | None:
    """A note for an estimate above the best published MFU of its GPU and model size (None when it is not)."""
    bound = published_bound(device_name, num_params)
    if bound is None or mfu <= bound.mfu:
        return None
    ceiling = (
        f"every GEMM at up to {gemm_efficiency:.0%} of peak (the best measured matmul rate)"
        if gemm_efficiency
        else "the device's compute efficiency"
    )
    return (
        f"estimated MFU {mfu:.0%} is above the best published for {bound.gpu} and {num_params / _B:.2g}B parameters "
        f"({bound.mfu:.1%}, {bound.source}; cost_models.mfu_bounds): the estimate is likely optimistic. The cost "
        f"model prices {ceiling} and the other operators at their roofline, and leaves out what slows real runs "
        "beyond them: kernels the shape model does not cover (embedding and loss backward, fused-kernel "
        "epilogues), stragglers and clock throttling, data loading"
    )
