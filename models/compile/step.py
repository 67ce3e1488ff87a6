"""The step torch.compile compiles, the same on both sides: the traced loop's forward and loss as one function,
`fn(*tensors) -> (out, loss_fn(out))`, called as `out, loss = fn(*batch)`, then `loss.backward()` outside it
(traces/reference/traced.py `_RealRun` is this function for the real run, whose `forward` is what
traces/compiled_run.py compiles). With activation checkpointing (full, every-k, layers, op-policy) each checkpointed
block runs under `torch.utils.checkpoint.checkpoint(..., use_reentrant=False)` (op-policy's with torch's selective
checkpoint contexts), which dynamo traces as one higher-order op and AOTAutograd's partitioner recomputes in the
backward graph, following op-policy's must-save / prefer-recompute tags (where dynamo cannot keep the checkpoint,
capture.py refuses the model)."""

from __future__ import annotations

from ..config import ConfigError, TrainingSetup
from ..tape import checkpoint_segments, checkpointed

# The threads inductor writes its CPU program for, and the real run runs with: the program depends on the count
# (`torch/_inductor/utils.py parallel_num_threads`: how reductions and loops are split, so which buffers the wrapper
# allocates; tiny CNN, micro-batch 8: 458,088 B more at the backward's peak for 2 threads than for 1)
CPU_THREADS = 1


def loop_forward(net, batch):
    """`fn(*tensors)` running `net` on the batch's tensors in the factory's structure (a dict's other values, such as
    CLIP's `return_loss=True`, passed as constants), and the tensors."""
    import torch

    if isinstance(batch, dict):
        keys = [k for k, v in batch.items() if isinstance(v, torch.Tensor)]
        constants = {k: v for k, v in batch.items() if not isinstance(v, torch.Tensor)}
        return (lambda *t: net(**dict(zip(keys, t)), **constants)), tuple(batch[k] for k in keys)
    if isinstance(batch, torch.Tensor):
        return (lambda t: net(t)), (batch,)
    return (lambda *t: net(*t)), tuple(batch)


def step_function(net, batch, loss_fn):
    """(fn, tensors): fn(*tensors) -> (out, loss_fn(out)), the region torch.compile compiles."""
    forward, tensors = loop_forward(net, batch)

    def step(*t):
        out = forward(*t)
        return out, loss_fn(out)

    return step, tensors


def wrap_checkpointed(net, layers: tuple[str, ...], setup: TrainingSetup) -> None:
    """Each checkpointed layer's forward under non-reentrant `checkpoint`, op-policy's under torch's selective
    checkpoint contexts (models/tape.py `checkpointed`, which traces/reference/traced.py `_wrap_layers` gives the
    real model too)."""
    if setup.checkpointing.policy == "none":
        return
    for seg in checkpoint_segments(setup, len(layers)):
        if seg.wrap == "none":
            continue
        if seg.wrap not in ("checkpoint", "op-policy") or len(seg.layers) != 1:  # (checks.py keeps them out)
            raise ConfigError(
                "checkpointing",
                f"{setup.checkpointing.policy} with compile is not modelled yet; allowed "
                "with it: none, full, every-k, layers, op-policy",
            )
        module = net.get_submodule(layers[seg.layers.start])
        module.forward = checkpointed(module.forward, seg.wrap)
