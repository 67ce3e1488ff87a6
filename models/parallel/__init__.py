"""Data parallelism: which bytes each rank holds, and the collectives that move them.

N ranks train one model on different data. A data-parallel *engine* decides, for each rank:

- the layout: how many elements of each parameter, gradient, fp32 master weight and optimizer state
  the rank stores (padding for uneven shards included), and which tensors its optimizer steps over;
- the transient buffers: all-gather buffers that rebuild a unit's full parameters for its compute,
  reduce / reduce-scatter buckets that carry gradients, and when each is allocated and freed;
- the collectives, as ops on the rank's communication stream that overlap compute in SimPy time.

Engines (`TrainingSetup.dp_engine`):

- "deepspeed" with `zero_stage` (DeepSpeed ZeRO semantics):
  0  full replicas; gradients all-reduced through flat buckets of `reduce_bucket_size` elements.
  1  bit16 parameters flattened into one buffer padded to a multiple of 2N elements; each rank keeps
     the fp32 master copy and optimizer states of its 1/N flat partition; full gradients until the
     step, then reduced and the rank's partition turned fp32 for the update; updated partitions are
     all-gathered in place.
  2  as 1, but gradients are reduced during backward: each gradient is copied into the `ipg` bucket
     (`reduce_bucket_size` elements, allocated once) and dropped; the rank keeps only its partition
     (`grads_in_partition`, allocated at the first reduce).
  3  every parameter split into N partitions of ceil(numel / N) (parameters of at most
     `stage3_param_persistence_threshold` elements stay whole); before each module runs its
     parameters are all-gathered into a buffer (prefetching up to `stage3_prefetch_bucket_size`
     elements ahead from the second step on, when the trace is known, never holding more than
     `stage3_max_live_parameters`), and released after; gradients go through the ipg bucket into a
     flat partition buffer allocated at start; fp32 partitions and states per sub-group.
- "fsdp2" (torch `fully_shard` per transformer block / per MLP Linear, then the root): each parameter
  is chunked on dim 0 and padded to ceil(dim0 / N) rows on every rank; optimizer states follow the
  rank's unpadded local rows. A unit's all-gather fills one flat output buffer, copied out into each
  parameter's unsharded storage; after the unit (forward with `reshard_after_forward`, and backward)
  the unsharded storage is freed; the unit's gradients are reduce-scattered through a flat input
  buffer into one flat sharded-gradient buffer. The root is not resharded after forward.
- "ddp": full replicas; the gradient buckets of torch DDP (`ddp_bucket_cap_mb`) all-reduced as
  backward ends.
- "zero-redundancy-optimizer": DDP plus torch's ZeroRedundancyOptimizer: whole parameters are
  assigned to ranks greedily, largest first, to the rank with the fewest elements so far; a rank
  keeps optimizer states for its own parameters only and broadcasts them after its step.

The layout functions are pure. `Engine` objects receive hooks from the describer (`training.py`) and
the autograd replay (`models/replay/`, passing its `ReplayState`) at the moments the real engine acts.

How the parameters reach the device (`TrainingSetup.build`, `Engine.load`): "direct" allocates each once, in its
training dtype and layout; "device-fp32" replays the program that builds the model on the GPU in fp32, casts it
with `model.to(dtype)` where the engine keeps 16-bit parameters, makes peft's adapters, and, under FSDP2, runs each
unit's `fully_shard` (engine.py `DeviceBuild`, fsdp.py `FSDP2.shard_built`): the cached segments it leaves are
where training's first allocations land.

Modules: layout.py (the pure layout functions and constants), engine.py (`Engine`, the hooks and the single-rank
behaviour), ddp.py (DDP, ZeroRedundancyOptimizer), gathering.py (what FSDP2 and ZeRO-3 share), fsdp.py (FSDP2),
deepspeed.py (ZeRO 0-3); `make_engine` builds the one the setup names, where models/dp_engines.py (the
registry: names, knobs, module) says it lives. Model parallelism composes on the device
mesh (mesh.py: a rank's coordinates, its builder, the rank classes): tensor/ rewrites the tape into a
tensor-parallel rank's shards and collectives and wraps the engine in `TensorParallelEngine`; context.py (with
ring.py) into a context-parallel rank's; stages.py cuts it into a pipeline rank's stages (the layout, the schedules'
actions) and pipeline.py wraps the engine in `PipelineEngine`, which replays them in the schedule's order; expert.py
holds an expert-parallel rank's experts and token dispatch (written into its Mixtral tape) and wraps the engine in
`ExpertParallelEngine`. checks.py says what each degree is checked against and what is not simulated yet. The
data-parallel engine sees its dp group only (`setup.mesh.dp` ranks, the builder's `dp_rank`; dp x cp when FSDP2 folds
context parallelism in, mesh.py `folds_cp`).
"""

from __future__ import annotations

from collections.abc import Callable

from ..dp_engines import DP_ENGINES
from .checks import check_model_parallel
from .ddp import DDP, ZeroRedundancy
from .deepspeed import DeepSpeedReplica, DeepSpeedZero3, DeepSpeedZero12, IpgBucket, deepspeed_engine
from .engine import DeviceBuild, Engine
from .fsdp import FSDP2
from .gathering import Gathering
from .layout import (
    DDP_FIRST_BUCKET_BYTES,
    DS_ALIGNMENT,
    DS_SUB_GROUP_SIZE,
    ROOT,
    UNIT_PATTERN,
    OptimTensor,
    ceil_div,
    dim0_ranges,
    dim0_shard,
    flat_partition,
    greedy_owners,
    greedy_partition,
    own_dtype,
    sub_groups,
    unit_of,
)
from .pipeline import PipelineEngine
from .stages import rank_actions, stage_layout

# each data-parallel engine of models/dp_engines.py (its name, knobs and summary, which the config reads without
# importing this package) by its class, or the function choosing one (DeepSpeed's stages): it takes the rank's
# GraphBuilder and returns its `Engine`
ENGINES: dict[str, Callable] = {"deepspeed": deepspeed_engine, "fsdp2": FSDP2, "ddp": DDP,
                                "zero-redundancy-optimizer": ZeroRedundancy}


def make_engine(builder) -> Engine:
    """The engine `builder.setup.data_parallel.engine` names (`ENGINES`)."""
    return ENGINES[DP_ENGINES[builder.setup.data_parallel.engine].name](builder)


__all__ = ["DDP", "ZeroRedundancy", "DeepSpeedReplica", "DeepSpeedZero3", "DeepSpeedZero12", "IpgBucket", "Engine",
           "DeviceBuild", "FSDP2", "Gathering", "DDP_FIRST_BUCKET_BYTES", "DS_ALIGNMENT", "DS_SUB_GROUP_SIZE", "ROOT",
           "UNIT_PATTERN", "OptimTensor", "ceil_div", "dim0_ranges", "dim0_shard", "flat_partition", "greedy_owners",
           "greedy_partition", "own_dtype", "sub_groups", "unit_of", "make_engine", "ENGINES", "PipelineEngine",
           "check_model_parallel", "rank_actions", "stage_layout"]
