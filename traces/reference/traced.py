"""A traced model's program for real: what models/traced describes (a HF config or a user's factory), built on
the CPU with random weights and run by the project's training loop (traces/tracker/loop.py `run_training_steps`),
so the traced describer is held against the program it describes.

`real_model` builds it as the trace did (frozen parameters, transformers' memoised tensors made anew, each
checkpointed layer wrapped as the simulation's region) behind the loop's call signature (`_RealRun`);
`real_batches` gives the batch that same build made (a factory's loss_fn may hold its targets).
"""

from __future__ import annotations

import torch

from ...models.config import ConfigError, TrainingSetup
from ...models.tape import checkpoint_segments, checkpointed
from ...models.traced import freeze
from ...models.traced.model import TracedModel
from ...models.traced.realpath import lru_caches
from ...models.traced.record import find_layers

# the batch of the latest real build of each model and shape, for `real_batches` right after (a factory's
# loss_fn may hold the batch's targets: the run must use those same tensors)
_REAL_BATCH: dict = {}


def real_model(model: TracedModel, setup: TrainingSetup, seed: int = 0):
    """The same program for real (random weights, CPU), as the project's training loop calls it:
    `out, loss = module(*batch_tensors)` (build.py `build_model`)."""
    torch.manual_seed(seed)
    net, batch, loss_fn = model.build(setup)
    if model.kind == "hf":  # weights were left uninitialised (no_init_weights): give them values
        with torch.no_grad():
            for p in net.parameters():
                p.normal_(0.0, 0.02)
    freeze(net, setup.optimizer.frozen)
    for cache in lru_caches(net):  # a real run starts as the trace did: transformers' memoised tensors made anew
        cache.cache_clear()
    layers = find_layers(net)
    net.peakledger_layers = layers  # FSDP2 units for a real distributed run (traces/distributed.py fsdp_units)
    _wrap_layers(net, layers, setup)
    _REAL_BATCH[_real_key(model, setup, seed)] = _flat(batch)
    return _RealRun(net, batch, loss_fn)


def _real_key(model: TracedModel, setup: TrainingSetup, seed: int) -> tuple:
    return (model.source, model.digest, setup.batch.micro_batch, setup.batch.seq_len, setup.precision.param, seed)


def _wrap_layers(net, layers: tuple[str, ...], setup: TrainingSetup) -> None:
    """Run each checkpointed layer as the simulation's region (models/traced/convert.py `_regions`): the layer's
    forward under `torch.utils.checkpoint.checkpoint(..., use_reentrant=False)` (op-policy: with torch's
    selective checkpoint contexts), or under `save_on_cpu` (offload)."""
    if setup.checkpointing.policy == "none":
        return
    for seg in checkpoint_segments(setup, len(layers)):
        if seg.wrap == "none":
            continue
        if len(seg.layers) > 1:
            raise ConfigError("checkpointing", f"{setup.checkpointing.policy} makes regions of several layers, which a "
                                               "traced model's own loop cannot run for real; simulate it, or "
                                               "validate full, every-k, layers, op-policy or offload")
        module = net.get_submodule(layers[seg.layers.start])
        module.forward = checkpointed(module.forward, seg.wrap)


def real_batches(model: TracedModel, setup: TrainingSetup, seed: int = 0) -> list[tuple]:
    same = _REAL_BATCH.pop(_real_key(model, setup, seed), None)
    if same is not None:  # the batch of the model `real_model` just built: a loss_fn may hold its targets
        return [same] * setup.batch.grad_accum
    torch.manual_seed(seed)
    _, batch, _ = model.build(setup)
    return [_flat(batch)] * setup.batch.grad_accum


def _flat(batch) -> tuple:
    """The batch's tensors, in order (a dict's other values, such as CLIP's `return_loss=True`, are constants
    `_RealRun` passes itself)."""
    if isinstance(batch, dict):
        return tuple(v for v in batch.values() if isinstance(v, torch.Tensor))
    if isinstance(batch, torch.Tensor):
        return (batch,)
    return tuple(batch)


def _RealRun(net, batch, loss_fn):
    """`net` itself (its parameter names unchanged), its `forward(*tensors)` returning (output, loss) with
    the batch rebuilt in the factory's structure, as the project's training loop calls a model."""
    call = net.forward
    keys = [k for k, v in batch.items() if isinstance(v, torch.Tensor)] if isinstance(batch, dict) else None
    constants = {k: v for k, v in batch.items() if not isinstance(v, torch.Tensor)} if keys is not None else {}
    single = isinstance(batch, torch.Tensor)

    def forward(*tensors):
        if keys is not None:
            out = call(**dict(zip(keys, tensors)), **constants)
        elif single:
            out = call(tensors[0])
        else:
            out = call(*tensors)
        return out, loss_fn(out)

    net.forward = forward
    return net
