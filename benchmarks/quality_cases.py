"""The cases of :mod:`benchmarks.quality` (also run by :mod:`benchmarks.estimates` and
:mod:`benchmarks.consistency`): an example model at a global batch on 8, 16 or 64 GPUs of p3.16xlarge,
dgx-a100 or dgx-h100, named ``model@clusterxGPUs`` (:data:`CASES`, read by :func:`parse_case`), and the
method groups the quality page compares auto with."""

from __future__ import annotations

CLUSTERS = {"p3": "p3.16xlarge", "a100": "dgx-a100", "h100": "dgx-h100"}
DEVICES_PER_NODE = 8
# example -> (model args, global batch) per model label; the batch is the same on every cluster and device count
MODELS = {
    "mlp": ("mlp", {"hidden": 4096, "layers": 8}, 1024),
    "resnet": ("resnet", {"width": 64, "blocks": 2, "stages": 4, "image_size": 64}, 256),
    "moe": ("moe", {"hidden": 1024, "experts": 8, "layers": 4, "tokens": 256}, 64),
    "gpt-350m": ("gpt", {"size": "350m"}, 128),
    "gpt-1.3b": ("gpt", {"size": "1.3b"}, 128),
    "gpt-6.7b": ("gpt", {"size": "6.7b"}, 128),
    "gpt-15b": ("gpt", {"size": "15b"}, 128),
    # Hugging Face models (examples/zoo/hf_llama.py, examples/hf_gpt2.py): Llama-3.2-1B's shape with Llama-2's
    # vocabulary, and GPT-2 XL
    "llama-1b": (
        "zoo/hf_llama",
        {"layers": 16, "hidden": 2048, "heads": 32, "kv_heads": 8, "intermediate": 8192, "seq": 2048, "vocab": 32000},
        64,
    ),
    "gpt2-xl": ("hf_gpt2", {"layers": 48, "hidden": 1600, "heads": 25, "seq": 1024, "vocab": 50257}, 128),
}
# "model@clusterxGPUs"
CASES = (
    "mlp@a100x8",
    "resnet@p3x8",
    "moe@h100x8",
    "gpt-350m@p3x8",
    "gpt-1.3b@a100x8",
    "gpt-1.3b@h100x8",
    "gpt-350m@p3x16",
    "gpt-1.3b@p3x16",
    "gpt-1.3b@a100x16",
    "gpt-6.7b@h100x16",
    "gpt-350m@p3x64",
    "gpt-1.3b@h100x64",
    "gpt-6.7b@p3x64",
    "gpt-6.7b@a100x64",
    "gpt-15b@h100x64",
    "llama-1b@a100x16",
    "gpt2-xl@p3x16",
)
QUICK = ("mlp@a100x8", "gpt-350m@p3x8")
HANDWRITTEN = ("data-parallel", "megatron", "uniform-pipeline")
PLACEMENT = ("hash", "critical-path", "multi-objective", "m-etf", "rl")
ALPA = "auto-alpa-space"  # auto searching Alpa's space only (--space alpa): GPipe/1F1B, recompute all or none, ...


def parse_case(case: str) -> tuple[str, dict, int, str, int]:
    """(example, model args, batch, cluster preset, number of nodes) of ``model@clusterxGPUs``."""
    model, _, where = case.partition("@")
    short, _, devices = where.partition("x")
    if model not in MODELS or short not in CLUSTERS or not devices.isdigit() or int(devices) % DEVICES_PER_NODE:
        raise SystemExit(
            f"quality.py: bad case {case!r}: use MODEL@CLUSTERxGPUS, MODEL in {', '.join(MODELS)}, "
            f"CLUSTER in {', '.join(CLUSTERS)}, GPUS a multiple of {DEVICES_PER_NODE}"
        )
    example, args, batch = MODELS[model]
    return example, args, batch, CLUSTERS[short], int(devices) // DEVICES_PER_NODE
