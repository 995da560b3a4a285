"""Runtime profiles: how a training system runs a plan, where the plan itself leaves it open.

A plan fixes the stages, meshes, every operator's sharding, the microbatches, the schedule and the
recomputation. How the system that runs it syncs gradients, steps the optimizer and keeps the last stage's
outputs and loss is the *runtime*: the default
profile, ``autoplan``, is our executors (what ``plan run`` executes); the others describe a published system, so
that its published runs are estimated as they ran (``benchmarks/published.py``) and the rows test the compute
and network model rather than the differences between its runtime and ours. ``--runtime NAME`` picks one
(:func:`runtime_profile`); a plan stores its profile's name (``Plan.runtime``) and says in its notes when the
estimate describes another system than ours (:meth:`RuntimeProfile.note`); ``plan run`` and ``plan compile``
refuse such a plan (:meth:`RuntimeProfile.refusal`). What a profile sets:

* ``grad_sync_after_backward``: every stage all-reduces its gradients after its last backward, not bucket by
  bucket while the backward runs (:func:`planner.costing.compression.stage_sync` puts every bucket's ready time
  at the backward's end; the estimate, the pricing and the simulator read those segments);
* ``one_grad_buffer``: a stage's gradients live in one contiguous buffer, all-reduced as one message per process
  group instead of DDP's 25 MiB buckets (one latency instead of one per bucket);
* ``local_outputs``: each rank keeps its own share of the last stage's outputs and runs the loss on that share
  (Megatron-LM: its replica's rows of the logits, split over the vocabulary by tensor parallelism, and
  ``vocab_parallel_cross_entropy`` on them, ``megatron/mpu/cross_entropy.py``); our executors gather the last
  stage's outputs over the vocabulary and run the loss on each rank's rows of them where the outputs are
  batch-major (:func:`planner.plan.stage.loss_row_axes`), else whole on each of its ranks (``StageSharding.leave``).
  The memory reads it: :func:`planner.costing.plan_memory.sharded_stage_memory` (the gathered copies and the
  loss's tensors) and :func:`planner.inter.layer_costs.loss_and_output_bytes` (the layer tables' figure);
* ``kept_receive_buffers``: a pipeline stage keeps one receive buffer per microbatch for the run, activations
  forward and output gradients back (``torch.distributed.pipelining``'s stock ``PipelineStage``: no profile
  here runs it). Megatron-LM allocates each received tensor when it arrives (``megatron/p2p_communication.py``
  ``_communicate``: ``torch.empty`` per call) and our executors' stages allocate a microbatch's buffers when its
  receive is posted and drop them once it has read them (:mod:`executors.parallel.receive_buffers`, since
  2026-11-28), so what a stage receives is the in-flight microbatches' stage inputs, already on the activations'
  timeline, and a gradient freed by the backward that reads it
  (:func:`planner.costing.plan_memory.sharded_stage_memory`);
* ``optimizer``: per optimizer name, the bytes its step moves per parameter, from its code, at the device's
  streaming bandwidth (:func:`planner.costing.estimate.optimizer_step_s`, on GPU devices). Not priced: the host
  calls it issues per parameter tensor (8 for our AdamW below, 1 for Megatron's), which bound the step of a model
  of many small tensors. The search scores candidates with the step amortised over the microbatches
  (:func:`planner.baselines.handwritten.approximate_step_s`) before pricing the best exactly; a host-bound step
  that large misranks them (auto came out slower than an exactly priced Megatron point of its own grid,
  ``tests/test_inter_op.py``), so the term waits for a search that keeps the step apart.

Profiles and their sources:

* ``autoplan``: our executors. DDP (``executors/parallel/data_parallel.py``: torch DDP, 25 MiB buckets after a 1 MiB
  first one, overlapped with the last backward) and the sharded stages' buckets (``executors/parallel/grad_sync.py``).
  The optimizer is ``torch.optim.AdamW(foreach=False)`` on fp32 parameters (``executors/precision.py``): per
  parameter tensor, torch 2.13's ``_single_tensor_adam`` runs ``exp_avg.lerp_`` (reads 8 B, writes 4),
  ``exp_avg_sq.mul_`` (4, 4), ``.addcmul_`` (8, 4), ``exp_avg_sq.sqrt()`` (4, 4), ``/ bias_correction2_sqrt``
  (4, 4), ``.add_(eps)`` (4, 4) and ``param.addcdiv_`` (12, 4): 72 B per parameter in 7 kernels (8 host calls
  with ``step += 1``); SGD runs torch's default multi-tensor (foreach) path: ``param.add_(grad)``
  12 B, with momentum ``buf.mul_().add_(grad)`` and ``param.add_(buf)`` 32 B, a handful of launches per step.
  Every step the program also takes the gradient norm (``executors/training/parallel_model.py``
  ``_squared_norm``: the gradient read, its square written and read, :data:`GRAD_NORM_BYTES` = 12 B per
  parameter), added to each optimizer's bytes. Under ``adam-mixed`` the parameters stay fp32 and bf16 autocast
  casts each matmul's and convolution's weight and bias to bf16 once per step (reads 4 B, writes 2: the whole
  step is one autocast region, whose cache serves every microbatch) and casts their bf16 gradients back in every
  microbatch's backward (reads 2, writes 4) (``autocast_casts``: :func:`planner.costing.node_cost.autocast_cast_s`;
  the step's cast is shown with the optimizer's part of the step). Not priced: the in-place accumulation of a
  second microbatch's gradient, and the bf16 copies' memory (2 B per such parameter, kept for the backward).
* ``megatron-lm-2019``: Megatron-LM as Shoeybi et al. (2019) ran it, commit ``ebbe40cd`` (2019-10-09) of
  github.com/NVIDIA/Megatron-LM: ``--DDP-impl local`` (the default, ``arguments.py``); ``pretrain_gpt2.py``
  ``backward_step`` calls ``model.allreduce_params(reduce_after=False)`` after ``loss.backward()``, and
  ``megatron/model/distributed.py`` flattens every gradient of a type into one tensor
  (``_flatten_dense_tensors``) and all-reduces it once. Its fp16 optimizer is priced as 2021's (below).
* ``megatron-lm-2021``: Megatron-LM v2.5 (tag ``v2.5``, commit ``e269e200``, 2021-08-10), the code of
  Narayanan et al. (SC'21): ``megatron/training.py`` ``train_step`` runs ``forward_backward_func`` (the whole
  pipeline schedule), then ``model_module.allreduce_gradients()`` under ``--DDP-impl local`` (the default,
  ``megatron/arguments.py``), which all-reduces one contiguous buffer per dtype (``megatron/model/
  distributed.py``), then the optimizer. ``Float16OptimizerWithFloat16Params.step``
  (``megatron/optimizer/optimizer.py``): fp16 gradients copied to fp32 main gradients, one ``.float()`` call per
  tensor (reads 2 B, writes 4), ``_amp_foreach_non_finite_check_and_unscale_`` (4, 4), the global norm by
  ``multi_tensor_l2norm`` (4) and the clip by ``multi_tensor_scale`` (4, 4) (``clip_grads.py``), apex
  ``FusedAdam`` (reads parameter, gradient and both moments, 16 B, writes 12) and the fp32 parameters copied back
  to fp16 by ``multi_tensor_copy`` (4, 2): 60 B per parameter (one host call per tensor, the rest multi-tensor).
* ``megatron-lm-2021-torch-ddp``: the same with ``--DDP-impl torch``: torch DDP's buckets, overlapped with the
  backward. SC'21's own scripts (``examples/sc21/run_table_1.sh`` at ``v2.5``) use it for Table 1's rows without
  pipeline parallelism (1.7B–18.4B) and ``local`` for the pipelined ones.

What a profile does not change: the operators' kernels (the model file says what runs: ``examples/gpt.py``'s
``attention=unfused`` is Megatron-LM's layer of the time), the device constants, and which collectives the
plan's shardings issue.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from cost_models.device import DeviceSpec
from planner.errors import AutoplanError
from planner.ir.graph import NodeKind

OUR_RUNTIME = "autoplan"
AUTOCAST_CAST_BYTES = 6  # per element and cast: fp32 read and bf16 written (forward), the reverse (backward)
CAST_KINDS = (NodeKind.MATMUL, NodeKind.CONV)  # the operators autocast runs in bf16, casting their parameters


@dataclass(frozen=True, kw_only=True)
class OptimizerCost:
    """What one optimizer step moves: bytes per parameter (read and written, all its kernels)."""

    bytes_per_param: float


@dataclass(frozen=True, kw_only=True)
class RuntimeProfile:
    """How a training system syncs gradients, steps the optimizer and keeps the outputs (module docstring)."""

    name: str
    summary: str  # one line: what system, which version
    grad_sync_after_backward: bool = False
    one_grad_buffer: bool = False
    autocast_casts: bool = False  # fp32 parameters cast to bf16 by autocast every microbatch (module docstring)
    local_outputs: bool = False  # each rank keeps its share of the outputs and the loss's tensors (module docstring)
    kept_receive_buffers: bool = False  # a pipeline stage keeps a receive buffer per microbatch (module docstring)
    optimizer: dict[str, OptimizerCost] = field(default_factory=dict)

    @property
    def is_ours(self) -> bool:
        return self.name == OUR_RUNTIME

    def optimizer_cost(self, optimizer: str) -> OptimizerCost | None:
        """The optimizer's step as this runtime runs it; None for one it does not describe."""
        return self.optimizer.get(optimizer)

    def note(self) -> str | None:
        """For a plan's notes: what its estimate describes (None for our own runtime)."""
        if self.is_ours:
            return None
        return (
            f"runtime {self.name}: the estimate describes {self.summary}, not what `plan run` executes "
            "(our executors); plan without --runtime for a plan to run"
        )

    def refusal(self, *, what: str) -> str | None:
        """Why ``what`` (``plan run``, ``plan compile``) cannot take a plan made under this profile."""
        if self.is_ours:
            return None
        return (
            f"{what}: this plan was made under --runtime {self.name}, an estimate of {self.summary}; our "
            "executors run differently (gradient sync, optimizer), so its estimate would not describe the run: "
            "re-plan without --runtime to run it"
        )


GRAD_NORM_BYTES = 12.0  # our program's gradient norm every step, per parameter (module docstring)
_TORCH_ADAMW = OptimizerCost(bytes_per_param=72.0 + GRAD_NORM_BYTES)
_AUTOPLAN_OPTIMIZERS = {
    "adam-mixed": _TORCH_ADAMW,  # fp32 parameters under bf16 autocast: the same AdamW step as adam-fp32
    "adam-fp32": _TORCH_ADAMW,
    "sgd": OptimizerCost(bytes_per_param=12.0 + GRAD_NORM_BYTES),
    "sgd-momentum": OptimizerCost(bytes_per_param=32.0 + GRAD_NORM_BYTES),
}
_MEGATRON_OPTIMIZERS = {"adam-mixed": OptimizerCost(bytes_per_param=60.0)}

PROFILES: dict[str, RuntimeProfile] = {
    profile.name: profile
    for profile in (
        RuntimeProfile(
            name=OUR_RUNTIME,
            summary="our executors (what plan run executes)",
            autocast_casts=True,
            optimizer=_AUTOPLAN_OPTIMIZERS,
        ),
        RuntimeProfile(
            name="megatron-lm-2019",
            summary="Megatron-LM 2019 (local DDP: one all-reduce after the backward)",
            grad_sync_after_backward=True,
            one_grad_buffer=True,
            local_outputs=True,
            kept_receive_buffers=False,
            optimizer=_MEGATRON_OPTIMIZERS,
        ),
        RuntimeProfile(
            name="megatron-lm-2021",
            summary="Megatron-LM v2.5, 2021 (local DDP: one all-reduce per stage after the pipeline's backward)",
            grad_sync_after_backward=True,
            one_grad_buffer=True,
            local_outputs=True,
            kept_receive_buffers=False,
            optimizer=_MEGATRON_OPTIMIZERS,
        ),
        RuntimeProfile(
            name="megatron-lm-2021-torch-ddp",
            summary="Megatron-LM v2.5, 2021, with --DDP-impl torch (DDP's buckets overlapped with the backward)",
            local_outputs=True,
            kept_receive_buffers=False,
            optimizer=_MEGATRON_OPTIMIZERS,
        ),
    )
}
AUTOPLAN = PROFILES[OUR_RUNTIME]


def runtime_profile(name: str) -> RuntimeProfile:
    """The profile called ``name``; an AutoplanError naming the choices for any other."""
    if name not in PROFILES:
        raise AutoplanError(f"--runtime must be one of {', '.join(PROFILES)}, got {name!r}")
    return PROFILES[name]


def casts_parameters(kind: NodeKind, *, runtime: RuntimeProfile, optimizer: str, device: DeviceSpec) -> bool:
    """Whether an operator of ``kind`` has its fp32 parameters cast by autocast in ``runtime`` (module docstring):
    matmuls and convolutions, under ``adam-mixed``, on a device with a kernel model (the GPU presets)."""
    return kind in CAST_KINDS and runtime.autocast_casts and optimizer == "adam-mixed" and device.kernels is not None


def autocast_cast_seconds(*, numel: float, num_params: int, device: DeviceSpec) -> float:
    """One cast of ``numel`` parameter elements in ``num_params`` tensors: :data:`AUTOCAST_CAST_BYTES` each at the
    streaming bandwidth, one kernel's overhead per tensor."""
    bandwidth = device.memory_bandwidth * device.memory_efficiency
    return numel * AUTOCAST_CAST_BYTES / bandwidth + num_params * device.kernel_overhead_s
