"""Measure every rank of a real tensor-parallel CPU run: torch's DTensor TP (`parallelize_module`) on gloo.

`measure_tensor_parallel` spawns `tp` processes joined as every real run joins its ranks (traces/harness.py
`measure_ranks`: rendezvous on a TCPStore rank 0 binds to 127.0.0.1 at a free port, gloo on `lo`), builds a
one-dimensional DeviceMesh over "cpu", builds the same reference model on every rank
(`traces.reference.build_model`, same seed), applies `tp_plan` with `parallelize_module`, and runs `setup.batch.steps`
training steps (forward and loss under `loss_parallel()`, backward, the optimizer's step, zero_grad) on the same
micro-batches on every rank (tensor parallelism splits the model, not the data) under the rank's own tracker. One
`EventLog` per rank, rank order.

The plan (`tp_plan`) is torchtitan's `apply_tp` (torchtitan/models/llama3/infra/parallelize.py) written for
the reference models' module names, with sequence parallelism switched by `sequence_parallel`:

  embedding         RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1) if SP else Replicate())
                    (vocab-parallel: the weight is Shard(0), rows of the vocabulary)
  norms             SequenceParallel() with SP; without it plain replicated modules (nothing applied)
  attention / mlp   PrepareModuleInput(input_layouts=(Shard(1) if SP else Replicate(),), desired=(Replicate(),))
                    (use_local_output=False: the q/k/v (gate/up) input gradients are summed as one Partial
                    DTensor and reduced once, a reduce-scatter with SP, an all-reduce without)
  q/k/v, c_attn,
  gate/up, c_fc     ColwiseParallel() (weights and biases Shard(0): heads / tp, ffn / tp per rank)
  o_proj, c_proj,
  down_proj         RowwiseParallel(output_layouts=Shard(1) if SP else Replicate()) (weight Shard(1), bias
                    replicated)
  lm_head           ColwiseParallel(input_layouts=Shard(1) if SP else Replicate(), output_layouts=Shard(-1),
                    use_local_output=False), the loss under `loss_parallel()` (the logits stay vocab-sharded)
  GPT-2 positions   with SP: PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Shard(0)) on
                    wpe (each rank adds its own rows of the (T, D) table to its sequence shard)

The attention modules run on their local heads (n_head / tp, n_kv_head / tp), as the PyTorch TP tutorial
adjusts them (`attn_layer.n_heads = attn_layer.n_heads // tp_mesh.size()`); nanoGPT's fused c_attn is
split at the local widths (Megatron's fused QKV keeps q, k, v of a head group together on one rank: the
same shapes; the even Shard(0) split of this un-permuted weight mixes q / k / v rows, which changes values,
not bytes). A tied GPT-2 embedding and head are tied again after parallelize_module (each style
distributes its own module's copy of the shared Parameter): one Shard(0) parameter, as RowwiseParallel
(embedding) and ColwiseParallel (linear) both shard it on the vocabulary. `parallelize` takes a pipeline stage
as well (traces/mesh_run.py, TP x PP): the plan's entries that name one of the stage's modules, its blocks'
attention on local heads (`localize_attention`), no tie to restore where the stage holds only one of the two.

The tracker (`DTensorTracker`) is `traces.tracker.AllocationTracker` whose dispatch mode steps aside for ops
on DTensors (returns NotImplemented): DTensor's own dispatch then runs with the mode still active, so the
plain aten ops it runs on the local shards (the masked lookup of a vocab-parallel embedding, loss_parallel's
softmax pieces, collectives it issues while propagating shardings) are seen one by one. Without that they
would run under the popped mode and only their final outputs would be seen.
"""

from __future__ import annotations

import functools
import time
import types
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch._subclasses.fake_tensor import FakeTensor
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)
from torch.utils._python_dispatch import is_traceable_wrapper_subclass
from torch.utils._pytree import tree_flatten

from ..models.config import TrainingSetup, TransformerConfig
from ..models.families import family_of
from ..models.traced.realpath import fake_mode_active
from ..simulator.events import EventLog
from .distributed import transformer_blocks
from .harness import (
    Job,
    ReleaseCount,
    batch_tensors,
    holders,
    measure_ranks,
    run_metadata,
    tracking,
    train_steps,
    wait_released,
)
from .reference import TORCH_DTYPES, build_model, make_batch, optimizer_class, torch_optimizer
from .tracker import allocation as _tracker  # (its `_Mode`, swapped while a DTensorTracker enters)


@dataclass(frozen=True, kw_only=True)
class TPJob(Job):
    """What every process of a tensor-parallel run is sent: the harness's job, the tp degree and whether the
    activations between blocks are sequence-parallel."""

    tp: int
    sequence_parallel: bool


def measure_tensor_parallel(model_cfg: TransformerConfig, setup: TrainingSetup, tp: int,
                            sequence_parallel: bool = False, *, seed: int = 0,
                            timeout_s: float = 120.0) -> list[EventLog]:
    """Run `setup.batch.steps` real DTensor tensor-parallel training steps of `model_cfg` on `tp` CPU processes (gloo,
    loopback only); one tracked `EventLog` per rank, in rank order. Uses micro_batch, seq_len, grad_accum, steps,
    precision ("fp32", "bf16" or "bf16-autocast"), optimizer, optimizer_impl and set_to_none. Call under
    `if __name__ == "__main__":` in a script; every process is joined within `timeout_s` seconds, else all are
    killed and TimeoutError is raised; a failing rank's traceback is raised as RuntimeError."""
    _check(model_cfg, setup, tp, sequence_parallel)
    job = functools.partial(TPJob, model_cfg, setup, seed=seed, timeout_s=timeout_s, tp=tp,
                            sequence_parallel=sequence_parallel)
    return measure_ranks(_measure_rank, job, tp, f"tp={tp} ranks", prefix="peakledger-tp-")


def _check(model_cfg, setup: TrainingSetup, tp: int, sequence_parallel: bool) -> None:
    if "tp" not in family_of(model_cfg).parallel:
        raise NotImplementedError("real tensor-parallel runs use the hand-written GPT-2 / Llama reference models")
    if tp < 2:
        raise ValueError(f"a tensor-parallel run needs tp >= 2, got {tp}")
    for what, heads in (("n_head", model_cfg.n_head), ("n_kv_head", model_cfg.kv_heads)):
        if heads % tp:
            raise ValueError(f"tp={tp} does not divide {what}={heads}")
    if sequence_parallel and setup.batch.seq_len % tp:
        raise ValueError(f"seq_len={setup.batch.seq_len} is not a multiple of tp={tp}")
    if not (setup.precision.uniform or setup.precision.autocast == "bf16"):
        raise NotImplementedError(f"tensor-parallel measurement runs fp32, bf16 or bf16-autocast, "
                                  f"not {setup.precision.name!r}")
    if setup.checkpointing.policy != "none" or setup.optimizer.frozen or setup.lora.r or model_cfg.dropout:
        raise NotImplementedError("tensor-parallel measurement runs without checkpointing, frozen parameters, "
                                  "LoRA or dropout")
    optimizer_class(setup)


# -- the plan ---------------------------------------------------------------------------------------------

def tp_plan(model: nn.Module, sequence_parallel: bool) -> dict:
    """The `parallelize_module` plan of a reference GPT (nanoGPT GPT-2 or the small Llama), or of a pipeline stage
    cut from one (traces/pipeline_run.py `StageModule`: the model's module names, its blocks keyed by their index
    in the whole model): see the module docstring. Every entry outside the blocks is written; `parallelize` drops
    those naming a module the stage does not hold."""
    sp = sequence_parallel
    act = Shard(1) if sp else Replicate()  # the layout of the activations between blocks
    plan: dict = {}
    gpt2 = hasattr(model, "transformer")
    if gpt2:
        plan["transformer.wte"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=act)
        if sp:
            plan["transformer.wpe"] = PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Shard(0))
        blocks = [(f"transformer.h.{i}", "ln_1", "attn", ("c_attn",), "c_proj", "ln_2", ("c_fc",), "c_proj")
                  for i, _ in model.transformer.h.named_children()]
        final_norm = "transformer.ln_f"
    else:
        plan["model.embed_tokens"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=act)
        blocks = [(f"model.layers.{i}", "input_layernorm", "self_attn", ("q_proj", "k_proj", "v_proj"), "o_proj",
                   "post_attention_layernorm", ("gate_proj", "up_proj"), "down_proj")
                  for i, _ in model.model.layers.named_children()]
        final_norm = "model.norm"
    for h, norm1, attn, cols, out, norm2, mlp_cols, mlp_out in blocks:
        n_args = 1 if gpt2 else 4  # Llama's attention takes (x, cos, sin, causal)
        if sp:
            plan[f"{h}.{norm1}"] = SequenceParallel()
            plan[f"{h}.{norm2}"] = SequenceParallel()
        plan[f"{h}.{attn}"] = PrepareModuleInput(input_layouts=(act,) + (None,) * (n_args - 1),
                                                 desired_input_layouts=(Replicate(),) + (None,) * (n_args - 1))
        for c in cols:
            plan[f"{h}.{attn}.{c}"] = ColwiseParallel()
        plan[f"{h}.{attn}.{out}"] = RowwiseParallel(output_layouts=act)
        plan[f"{h}.mlp"] = PrepareModuleInput(input_layouts=(act,), desired_input_layouts=(Replicate(),))
        for c in mlp_cols:
            plan[f"{h}.mlp.{c}"] = ColwiseParallel()
        plan[f"{h}.mlp.{mlp_out}"] = RowwiseParallel(output_layouts=act)
    if sp:
        plan[final_norm] = SequenceParallel()
    plan["lm_head"] = ColwiseParallel(input_layouts=act, output_layouts=Shard(-1), use_local_output=False)
    return plan


def _gpt2_local_attention(self, x: torch.Tensor) -> torch.Tensor:
    """nanoGPT's CausalSelfAttention.forward on this rank's heads: c_attn's local output is q, k, v of
    n_head / tp heads each (the same ops as the reference forward, at the local widths)."""
    B, T = x.shape[0], x.shape[1]
    C, kv = self.n_head * self.head_dim, self.n_kv * self.head_dim
    q, k, v = self.c_attn(x).split([C, kv, kv], dim=2)
    q = q.view(B, T, self.n_head, self.head_dim).transpose(1, 2)
    k = k.view(B, T, self.n_kv, self.head_dim).transpose(1, 2)
    v = v.view(B, T, self.n_kv, self.head_dim).transpose(1, 2)
    y = self.core(q, k, v)
    y = y.transpose(1, 2).contiguous().view(B, T, C)
    return self.resid_dropout(self.c_proj(y))


def parallelize(model: nn.Module, tp: int, sequence_parallel: bool, mesh=None) -> nn.Module:
    """Apply `tp_plan` to a reference GPT, or to a pipeline stage cut from one, on a one-dimensional "cpu" mesh of
    `tp` ranks (`mesh`: that mesh or a "tp" sub-mesh; None: a new one over the whole world): the plan's entries
    that name a module of `model` (a stage holds some of the model's modules), attention on local heads
    (`localize_attention`), a tied embedding re-tied when `model` holds both the embedding and the head."""

    mesh = mesh if mesh is not None else init_device_mesh("cpu", (tp,))
    names = {n for n, _ in model.named_modules()}
    parallelize_module(model, mesh, {k: v for k, v in tp_plan(model, sequence_parallel).items() if k in names})
    localize_attention(transformer_blocks(model), tp)
    embedding = "transformer.wte" if hasattr(model, "transformer") else "model.embed_tokens"
    if model.cfg.tied and embedding in names and "lm_head" in names:
        # both styles shard the shared weight on dim 0 (the vocabulary): one parameter again
        model.lm_head.weight = model.get_submodule(embedding).weight
    return model


def localize_attention(blocks, tp: int) -> None:
    """The attention of each of `blocks` (reference GPT-2 or Llama blocks) on this rank's heads after
    ColwiseParallel split its projections: n_head / tp and n_kv_head / tp heads, GPT-2's fused c_attn output
    split at the local widths (`_gpt2_local_attention`)."""
    for block in blocks:
        gpt2 = hasattr(block, "attn")
        attn = block.attn if gpt2 else block.self_attn
        attn.n_head //= tp
        attn.n_kv //= tp
        if gpt2:
            attn.forward = types.MethodType(_gpt2_local_attention, attn)


def optimizer_groups(model: nn.Module) -> list[dict]:
    """The parameters as torch.optim parameter groups, one per device mesh (the DTensors of each mesh, in order
    of appearance), then the plain tensors the plan leaves (norms without SP, GPT-2's position embedding): one
    group mixing them fails in torch.optim's foreach kernels ("got mixed torch.Tensor and DTensor"), as one
    mixing DTensors of two meshes does (after FSDP2 x TP, traces/mesh_run.py: the tensor-parallel parameters
    on the (dp, tp) mesh, the others on the dp mesh alone), and each group is stepped on its own
    (torch/optim/adam.py `step`: one `adam(...)` call per group). Tensor parallelism alone: the DTensors, then
    the plain tensors."""
    groups: dict = {}
    for p in model.parameters():
        key = id(p.device_mesh) if isinstance(p, DTensor) else None
        groups.setdefault(key, []).append(p)
    plain = groups.pop(None, [])
    return [{"params": g} for g in (*groups.values(), plain) if g]


# -- the tracker ----------------------------------------------------------------------------------------------

FUNCOL = ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single")


def _storage_key(t: torch.Tensor) -> int | None:
    """The data pointer of a plain tensor's storage (a wrapper subclass: None)."""
    if is_traceable_wrapper_subclass(t):
        return None
    try:
        return t.untyped_storage().data_ptr()
    except (NotImplementedError, RuntimeError):
        return None


class _DTensorAwareMode(_tracker._Mode):
    """The tracker's dispatch mode, stepping aside for ops on tensor subclasses (DTensor): the subclass's
    dispatch then runs with this mode active, and every plain op it runs on local tensors comes back here.

    It also makes gloo's frees land where DTensor drops its references. A functional collective
    (`_c10d_functional.*`) is a gloo work that holds its input and output tensors until gloo's worker thread
    resets it, a moment after `wait_tensor` returned on the caller (torch/csrc/distributed/c10d/
    ProcessGroupGloo.cpp `runLoop`, as traces/distributed.py `BackendReleased` explains for FSDP2): a
    reduce-scatter's concatenated input, or an all-gather's buffer, that DTensor drops right after the wait
    would then be freed on the worker thread at a moment that varies run to run. After each `wait_tensor`
    this mode waits until the collective's inputs have no more holders than before it was issued, and yields
    the GIL for a moment so the worker can let go of the output (allocates nothing)."""

    def __init__(self, tracker) -> None:
        super().__init__(tracker)
        self.pending: dict[int, tuple[list, list]] = {}  # output's storage -> (inputs, their holders before the call)

    def __torch_dispatch__(self, func, types_, args=(), kwargs=None):
        if func.namespace == "_c10d_functional":
            return self._collective(func, types_, args, kwargs)
        return self._dispatch(func, types_, args, kwargs)

    def _collective(self, func, types_, args, kwargs):
        if fake_mode_active():
            return self._dispatch(func, types_, args, kwargs)
        name = func.name().split("::")[-1].split(".")[0]
        if name == "wait_tensor":
            out = self._dispatch(func, types_, args, kwargs)
            key = _storage_key(args[0])
            inputs, before = self.pending.pop(key, ([], [])) if key is not None else ([], [])
            if inputs:
                wait_released(inputs, before, ReleaseCount(), 5.0)
            time.sleep(0.001)
            return out
        inputs = [a for a in args if isinstance(a, torch.Tensor)] if name in FUNCOL else []
        before = holders(inputs) if inputs else []
        out = self._dispatch(func, types_, args, kwargs)
        key = _storage_key(out) if isinstance(out, torch.Tensor) else None
        if inputs and key is not None:
            self.pending[key] = (inputs, before)
        return out

    def _dispatch(self, func, types_, args=(), kwargs=None):

        tensors = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)]
        # DTensor's shape propagation: no memory
        if fake_mode_active() or any(isinstance(a, FakeTensor) for a in tensors):
            return func(*args, **(kwargs or {}))
        if any(is_traceable_wrapper_subclass(a) for a in tensors):
            return NotImplemented
        return super().__torch_dispatch__(func, types_, args, kwargs)


class DTensorTracker(_tracker.AllocationTracker):
    """`AllocationTracker` that sees the plain ops inside DTensor's dispatch (see the module docstring)."""

    def __enter__(self):
        original = _tracker._Mode
        _tracker._Mode = _DTensorAwareMode
        try:
            return super().__enter__()
        finally:
            _tracker._Mode = original


# -- one rank -------------------------------------------------------------------------------------------------

def _measure_rank(rank: int, job: TPJob) -> EventLog:
    """One tensor-parallel rank's run (traces/harness.py `measure_ranks` runs it in a spawned process)."""
    setup = job.setup
    model = build_model(job.model_cfg, setup, seed=job.seed)
    parallelize(model, job.tp, job.sequence_parallel)
    optimizer = torch_optimizer(optimizer_groups(model), setup, job.lr)
    batches = make_batch(job.model_cfg, setup, seed=job.seed + 1)  # the same data on every tensor-parallel rank
    tracker = DTensorTracker(model, optimizer, known=batch_tensors(batches), rank=rank)
    autocast = TORCH_DTYPES[setup.precision.autocast] if setup.precision.autocast else None
    with tracking(tracker, job.seed, loss_parallel()):
        train_steps(tracker, model, optimizer, batches, setup, autocast)
    return tracker.log(run_metadata(rank, job.tp, job.model_cfg, setup).updated(
        engine="dtensor-tp", tp=job.tp, sequence_parallel=job.sequence_parallel))


__all__ = ["measure_tensor_parallel", "tp_plan", "parallelize", "localize_attention", "optimizer_groups",
           "DTensorTracker", "TPJob"]
