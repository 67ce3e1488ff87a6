"""An exact allocation tracker for real torch runs, writing our event schema (`EventLog`).

How it measures
---------------
- A `TorchDispatchMode` sees every aten op below autograd (forward, backward and optimizer kernels).
  Each output tensor's untyped storage that is not already known, and is not the storage of one of
  the op's inputs, is a new allocation of `storage.nbytes()` bytes. Views and in-place results share
  a known storage and allocate nothing. Zero-byte storages are ignored.
- `weakref.finalize` on that storage fires when its last reference (Python or C++) goes; that is the
  free. Storage Python objects are preserved by torch while the C++ storage lives, so the finalizer
  does not fire early.
- A tensor an op reads whose storage was never seen (created outside dispatch, e.g. the tensor
  `torch.tensor(0.0)` builds before its `lift_fresh`) is recorded as allocated when first seen.
  Python scalars wrapped by the arg parser never reach dispatch: that is the tiny gap to the profiler.
- Everything alive before the run is recorded at the start, in Phase.LOAD: parameters (PARAMETER),
  module buffers (BUFFER), existing `.grad`s (GRADIENT) and optimizer state (OPTIMIZER_STATE).

Labels
------
Each allocation is one internal, mutable record; Blocks and Events are built at the end, so labels
known only later are fixed up before the log is returned:
PARAMETER > BUFFER > INPUT (tensors passed to `mark_input`) > GRADIENT (a storage that was some
parameter's `.grad`, checked after every backward, optimizer step and zero_grad; a temporary the
AccumulateGrad node stole becomes the gradient) > OPTIMIZER_STATE (a storage found in
`optimizer.state`, with its `OptimizerState`) > ACTIVATION (saved for backward, learnt through
`torch.autograd.graph.saved_tensors_hooks`, or explicitly `mark`ed: `run_training_steps` marks the
logits/outputs the caller holds until backward ends, as the simulator counts them) > TEMPORARY.
The phase, step and micro-batch come from `with tracker.phase(...)`; names are the module path
(forward pre/post hooks) plus the aten op in forward, the running autograd node in backward, and
`param.grad` / `param.exp_avg` ... for gradients and optimizer state. Every block is device memory
(Pool.DEVICE) except the host buffers an optimizer-state offload names (`optimizer.host_buffers`,
traces/reference/build.py `StateOffload`): Pool.HOST, so a CPU run shows the device memory a GPU would hold.

Distributed runs (traces/distributed.py: one tracker per rank, `rank=r` on every Block)
---------------------------------------------------------------------------------------
- DTensors (FSDP2's sharded parameters, their grads and optimizer states) are followed to their local
  shard's storage, and the Block carries the DTensor's shard factor.
- `torch.UntypedStorage.resize_` is patched while tracking (dispatch never sees it): a resize to 0
  frees the storage's allocation, a resize back allocates anew with the same labels. Any aten op that
  reallocates an input's storage (resize_, out= arguments) is recorded the same way.
- FSDP2 units get ALL_GATHER_BUFFER / REDUCE_SCATTER_BUCKET blocks, `<param>.unsharded` parameters and
  `<param>.unsharded.grad` gradients (fsdp_labels.py `FSDPLabels`); DDP's gradient buckets become
  REDUCE_SCATTER_BUCKET `ddp.bucket.<k>` (`ddp_buckets=True`). Between OPTIMIZER_STATE and ACTIVATION
  in the order above come ALL_GATHER_BUFFER, then REDUCE_SCATTER_BUCKET.

Exactness (measured on this machine, torch 2.13 CPU, `torch.set_num_threads(1)`, seed 0), the 3 x
Linear(512) MLP ("tiny-mlp"), batch 64, AdamW, 2 steps, `run_training_steps` vs `profiler.profiler_peak` (the
same loop under torch.profiler, memory-timeline peak event by event, host batch excluded):

    foreach   tracker 15,759,384 B   profiler 15,759,396 B   gap 12 B
    for-loop  tracker 14,706,712 B   profiler 14,706,724 B   gap 12 B
    fused     tracker 13,262,876 B   profiler 13,262,876 B   gap 0

The 12 B are tiny scalar allocations dispatch never sees, the same gap as in the shared notes. The
notes' absolute figures (15,099,932 B for-loop, 16,152,604 B foreach) are both 393,220 B = 3 x
131,072 + 4 higher, which is what one (64, 512) fp32 inputs + targets + output and the 4-byte loss
still alive at the optimizer step would add (the notes do not give their loop, so this is an
inference); this loop drops them when backward ends, as the simulator's loop does.
Running the tracker with or without the saved-tensor hooks gives the same peak (the pack hook returns
a detached alias of the same storage, so it creates no reference cycle through the saving node).

The package's modules
---------------------
    allocation.py  `AllocationTracker`: the dispatch mode, the storage-resize watch, one record per allocation
                   and its labels, the `EventLog` built at the end
    loop.py        the training loop run under it: `run_training_steps`, `training_loop`, `batch_for`
    totals.py      what a log adds up to: `live_bytes`, `peak`
"""

from .allocation import DTYPE_NAMES, SOURCE, AllocationTracker, shard_factor
from .loop import batch_for, run_training_steps, training_loop
from .totals import live_bytes, peak

__all__ = ["AllocationTracker", "run_training_steps", "training_loop", "shard_factor",
           "live_bytes", "peak", "SOURCE", "DTYPE_NAMES", "batch_for"]
