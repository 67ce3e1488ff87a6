"""Measure every rank of a real context-parallel CPU run: torch's `context_parallel` (ring attention) on gloo.

`measure_context_parallel` spawns `setup.mesh.world_size` processes (cp alone, or dp x cp with FSDP2) joined as every
real run joins its ranks (traces/harness.py `measure_ranks`: a TCPStore rank 0 binds to 127.0.0.1 at a free port,
gloo on `lo`), builds torchtitan's CP mesh

    init_device_mesh("cpu", (cp,), mesh_dim_names=("cp",))                       # cp alone
    init_device_mesh("cpu", (dp, cp), mesh_dim_names=("dp", "cp"))               # dp x cp: rank = dp_i x cp + cp_i
    init_device_mesh("cpu", (cp, tp), mesh_dim_names=("cp", "tp"))               # cp x tp: rank = cp_i x tp + tp_i

(cp x tp: traces/tensor_run.py `parallelize` with torchtitan's plan on "tp" first, without sequence parallelism, so
that attention runs on the rank's local heads, whose q, k and v `context_parallel` shards on the sequence over
"cp"; the loss under `loss_parallel()`; the gradients' local shards averaged over "cp"; the optimizer over
`optimizer_groups`.)

and the same reference model on every rank (`traces.reference.build_model`, same seed: the parameters are
replicated over the cp ranks), and runs `setup.batch.steps` training steps the way torchtitan's trainer runs them
under CP (torchtitan/train.py `forward_backward_step`, torchtitan/distributed/utils.py
`create_context_parallel_ctx` / `maybe_enable_context_parallel`). For every micro-batch:

    inputs, labels = the whole (B, T) micro-batch          # the same data on every cp rank
    with context_parallel(mesh, buffers=[inputs, labels, positions], buffer_seq_dims=[1, 1, 0],
                          no_restore_buffers={inputs, labels}):
        logits, loss = model(inputs, labels)               # loss: mean cross-entropy of the rank's tokens
        loss.backward()

`context_parallel` (torch/distributed/tensor/experimental/_context_parallel/_attention.py) reorders every
buffer with the head-tail load balancer (`_HeadTailLoadBalancer`: rank r keeps sequence chunks r and 2cp-1-r of
2cp), keeps the rank's T / cp positions *in place* (`buffer.resize_` + `copy_`), clones the buffers it must
restore at exit (here the position buffer), and monkey-patches `F.scaled_dot_product_attention` so that q, k, v
become `Shard(2)` DTensors whose SDPA runs torch's ring attention (`_templated_ring_attention` and its
backward: k and v rotated around the cp group, all-gathered once by default; the k / v gradients always
rotated by all-to-all; partial outputs merged in fp32 by `_SDPAMerger`).

cp alone: after the last micro-batch's backward each gradient is all-reduced over the cp group with a plain
`dist.all_reduce` (sum) and divided by cp: the *average*, so the step equals a single-process step on the
whole micro-batch (every rank holds the same number of tokens; the mean of the rank losses is the loss of the
whole sequence); parameters, gradients and optimizer states stay whole on every rank. With `dp_engine="fsdp2"`
the harness folds cp into FSDP2's mesh as torchtitan does ("dp_shard_cp": the (dp, cp) mesh flattened):
traces/distributed.py `apply_fsdp2` on every block and the root over it, whose reduce-scatter averages the
gradients of all dp x cp ranks; each data-parallel rank trains on its own batch (`seed + 1 + dp_i`), the same
on its cp ranks.

Deviations from the reference models, all local to this harness
---------------------------------------------------------------
- Attention runs as SDPA with `is_causal=True` (CP exists for SDPA only): a config with `attention="eager"`
  (the "tiny" preset) is run as `attention="sdpa"`; the model config in the metadata is the one run, and
  `attention_requested` the one given.
- Positions come from a sequence buffer, as torchtitan's `freqs_cis` does: the reference GPT-2 and Llama build
  `torch.arange(T)` in forward, which under CP would be the *local* length and the wrong positions. The harness
  registers a non-persistent int64 (T,) buffer `cp_positions` (on the GPT-2 root; on the Llama `model.model`),
  hands it to `context_parallel` (sequence dimension 0, restored at exit, as torchtitan's freqs_cis is) and
  binds forwards that are the reference ones with `arange(T)` replaced by that buffer (`_gpt2_forward`,
  `_llama_forward`; Llama converts it to fp32 for its rotary table as the reference's float arange is).

CPU support (`enable_cpu_ring_attention`)
----------------------------------------
torch 2.13's ring attention knows the CUDA SDPA kernels only (flash, efficient, cudnn); on CPU,
F.scaled_dot_product_attention runs `aten._scaled_dot_product_flash_attention_for_cpu`, for which DTensor has no
sharding strategy (NotImplementedError from `propagate_op_sharding_non_cached`). `enable_cpu_ring_attention`
adds exactly two things: a Shard(2) sharding strategy for that op and its backward (the same rule torch registers
for the CUDA flash op), and the dispatch of both ops to torch's own `_templated_ring_attention` /
`_templated_ring_attention_backward` (whose `op(q, k, v, is_causal=..., **kwargs)` and backward calls the CPU
ops' signatures accept). Everything the measurement sees inside an attention call (the k/v concatenation, the
all-gather / all-to-all buffers, the per-step SDPA outputs, the merger's fp32 copies and updates, the gradient
accumulators) is torch's ring attention code.

The tracker is traces/tensor_run.py's `DTensorTracker` (it sees the plain ops DTensor runs on the local shards,
so every allocation of the ring attention, and makes gloo's frees after a functional collective land where the
caller drops its references). Labels: LOAD, then per step and micro-batch FORWARD (the context's entry named
`context_parallel.enter.<op>`) and BACKWARD (its exit `context_parallel.exit.<op>`; after the last micro-batch
the gradient all-reduce), OPTIMIZER and ZERO_GRAD, as `traces.tracker.training_loop` labels them.

Metadata: engine "context-parallel", cp, cp_rank, world_size, rank, the `_cp_options` in force (rotate_method,
enable_load_balance, convert_to_f32), the load balancer's class, grad_reduce ("all_reduce-average"), the
attention run and requested, the per-micro-batch losses of the rank (`losses`: [[step, micro_batch, loss]]), the
local sequence length, torch version, model and setup.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import types
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed.tensor.experimental._context_parallel._attention as attention
import torch.distributed.tensor.experimental._context_parallel._sharding_rules as rules
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._op_schema import RuntimeSchemaInfo
from torch.distributed.tensor._ops.utils import expand_to_full_mesh_op_strategy
from torch.distributed.tensor.experimental import context_parallel
from torch.distributed.tensor.experimental._attention import set_rotate_method
from torch.distributed.tensor.experimental._context_parallel._attention import _cp_options, _RotateMethod
from torch.distributed.tensor.experimental._context_parallel._load_balancer import _create_default_load_balancer
from torch.distributed.tensor.parallel import loss_parallel
from torch.distributed.tensor.placement_types import Shard

from ..models.config import TrainingSetup, TransformerConfig
from ..models.families import family_of
from ..simulator.events import Category, EventLog, Phase
from .distributed import apply_fsdp2, fsdp_details
from .harness import Job, batch_tensors, measure_ranks, run_metadata, tracking
from .reference import build_model, make_batch, optimizer_class, run_segment, torch_optimizer
from .tensor_run import DTensorTracker, optimizer_groups, parallelize

ROTATE_METHODS = ("allgather", "alltoall")
GRAD_REDUCE = "all_reduce-average"


@dataclass(frozen=True)
class CPJob(Job):
    """What every process of a context-parallel run is sent: the harness's job (the setup says cp), the k / v
    rotate method, and measure_context_parallel's longer default timeout."""

    rotate_method: str = "allgather"
    timeout_s: float = 180.0


def measure_context_parallel(model_cfg: TransformerConfig, setup: TrainingSetup, *, rotate_method: str = "allgather",
                             seed: int = 0, timeout_s: float = 180.0) -> list[EventLog]:
    """Run `setup.batch.steps` real context-parallel training steps of `model_cfg` on `setup.mesh.cp` CPU processes
    (gloo, loopback only; `setup.mesh.world_size` must equal `setup.mesh.cp`); one tracked `EventLog` per rank, in rank
    order, every Block carrying its rank. Uses micro_batch, seq_len (a multiple of 2 x cp: the load balancer's chunks),
    grad_accum, steps, precision ("fp32" or "bf16"), optimizer, optimizer_impl and set_to_none. `rotate_method`:
    torch's `set_rotate_method` ("allgather", its default, or "alltoall") for k / v in forward and backward (the
    k / v gradients always rotate by all-to-all). Call under `if __name__ == "__main__":` in a script; every
    process is joined within `timeout_s` seconds, else all are killed and TimeoutError is raised; a failing
    rank's traceback is raised as RuntimeError."""
    _check(model_cfg, setup, rotate_method)
    job = functools.partial(CPJob, model_cfg, setup, seed=seed, timeout_s=timeout_s, rotate_method=rotate_method)
    return measure_ranks(_measure_rank, job, setup.mesh.world_size, f"cp={setup.mesh.cp} x dp={setup.mesh.dp} ranks",
                         prefix="peakledger-cp-")


def _check(model_cfg, setup: TrainingSetup, rotate_method: str) -> None:
    if "cp" not in family_of(model_cfg).parallel:
        raise NotImplementedError("real context-parallel runs use the hand-written GPT-2 / Llama reference models")
    cp = setup.mesh.cp
    if cp < 2:
        raise ValueError(f"a context-parallel run needs cp >= 2, got {cp}")
    if setup.mesh.pp != 1 or (
        setup.mesh.tp > 1 and (setup.mesh.world_size != cp * setup.mesh.tp or setup.mesh.sequence_parallel)
    ):
        raise NotImplementedError(
            f"context-parallel measurement runs dp x cp, or cp x tp (no sequence parallelism): "
            f"pp 1 (got world_size {setup.mesh.world_size}, tp {setup.mesh.tp}, pp {setup.mesh.pp})"
        )
    if setup.mesh.dp > 1 and setup.data_parallel.engine != "fsdp2":
        raise NotImplementedError("context parallelism with data parallelism runs FSDP2 over dp x cp (torchtitan's "
                                  f"dp_shard_cp): dp_engine fsdp2, not {setup.data_parallel.engine!r}")
    if setup.batch.seq_len % (2 * cp):
        raise ValueError(
            f"seq_len={setup.batch.seq_len} is not a multiple of 2 x cp={2 * cp} (the load balancer's chunks)"
        )
    if setup.batch.seq_len > model_cfg.max_seq_len:
        raise ValueError(f"seq_len={setup.batch.seq_len} exceeds max_seq_len={model_cfg.max_seq_len}")
    if rotate_method not in ROTATE_METHODS:
        raise ValueError(f"unknown rotate_method {rotate_method!r}; allowed: {', '.join(ROTATE_METHODS)}")
    if not setup.precision.uniform:
        raise NotImplementedError(f"context-parallel measurement runs fp32 or pure bf16, not {setup.precision.name!r}")
    if setup.checkpointing.policy != "none" or setup.optimizer.frozen or setup.lora.r or model_cfg.dropout \
            or setup.offload.mode != "none":
        raise NotImplementedError("context-parallel measurement runs without checkpointing, frozen parameters, "
                                  "LoRA, dropout or optimizer offload")
    optimizer_class(setup)


# -- CPU ring attention -------------------------------------------------------------------------------------

_CPU_FWD = "_scaled_dot_product_flash_attention_for_cpu"
_enabled = False


def enable_cpu_ring_attention() -> None:
    """Let torch's context parallelism run on CPU (idempotent; per process; no torch file is edited).

    torch 2.13's CP knows `aten._scaled_dot_product_{flash,efficient,cudnn}_attention` (CUDA) only; a CPU SDPA is
    `aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, dropout_p, is_causal, *, attn_mask, scale)
    -> (out, logsumexp)` and its backward `(grad_out, q, k, v, out, logsumexp, dropout_p, is_causal, *,
    attn_mask, scale) -> (grad_q, grad_k, grad_v)`. This adds only:

    1. the sharding rule: every input and output Shard(2) (the sequence dimension), the rule torch registers
       for the CUDA flash op (`_sharding_rules._scaled_dot_product_flash_attention_cp_strategy`), registered and
       unregistered together with torch's own CP rules (`register_cp_sharding_rules`, which
       `context_parallel` calls at entry; unregistered at exit);
    2. the dispatch: CP's DTensor custom-op table (`_attention.custom_ops`, installed by `context_parallel`)
       maps both ops to a handler that, like torch's `_sdpa_handler`, propagates the sharding, unwraps the
       local q / k / v and calls torch's own `_templated_ring_attention(group, 2, op, q, k, v, is_causal=...,
       dropout_p=..., **kwargs)` or `_templated_ring_attention_backward(group, 2, op, grad_out, "grad_out", q,
       k, v, out, logsumexp, is_causal, dropout_p=..., **kwargs)` with the CPU op as `op`, and wraps the
       local results as Shard(2) DTensors.

    All memory behaviour inside an attention call is therefore torch's ring attention code (its rotater,
    merger and gradient accumulation), with the CPU flash kernel for each block.
    """
    global _enabled
    if _enabled:
        return

    aten = torch.ops.aten
    fwd = getattr(aten, _CPU_FWD).default
    bwd = getattr(aten, _CPU_FWD + "_backward").default
    seq = Shard(2)

    def fwd_strategy(op_schema):  # outputs (out, logsumexp), inputs (q, k, v)
        return expand_to_full_mesh_op_strategy(op_schema.get_mesh_from_args(), op_schema, [[seq] * 5],
                                               input_index=2)

    def bwd_strategy(op_schema):  # outputs (dq, dk, dv), inputs (grad_out, q, k, v, out, logsumexp)
        return expand_to_full_mesh_op_strategy(op_schema.get_mesh_from_args(), op_schema, [[seq] * 9],
                                               input_index=3)

    def handler(op_call, args, kwargs):
        op_info = DTensor._op_dispatcher.unwrap_to_op_info(op_call, args, kwargs)
        DTensor._op_dispatcher.sharding_propagator.propagate(op_info)
        sharding = op_info.output_sharding
        if sharding is None or sharding.needs_redistribute:
            raise AssertionError("CPU ring attention: q, k, v must all be Shard(2) on the cp mesh")
        group = op_info.compute_mesh.get_group()
        local, kw = op_info.local_args, dict(op_info.local_kwargs)
        if op_call is fwd:
            q, k, v = local[:3]
            dropout_p = local[3] if len(local) > 3 else kw.pop("dropout_p", 0.0)
            is_causal = local[4] if len(local) > 4 else kw.pop("is_causal", False)
            out = attention._templated_ring_attention(group, 2, fwd, q, k, v, is_causal=is_causal,
                                                      dropout_p=dropout_p, **kw)
        else:
            grad_out, q, k, v, o, lse, dropout_p, is_causal = local[:8]
            out = attention._templated_ring_attention_backward(group, 2, bwd, grad_out, "grad_out", q, k, v, o,
                                                               lse, is_causal, dropout_p=dropout_p, **kw)
        return DTensor._op_dispatcher.wrap(tuple(out), sharding.output_spec)

    attention.custom_ops[fwd] = handler
    attention.custom_ops[bwd] = handler
    torch_register = rules.register_cp_sharding_rules

    def register_cp_sharding_rules():
        first = not rules._cp_strategy_contexts
        torch_register()
        if first:  # added to torch's registry of CP rules: unregister_cp_sharding_rules exits them with torch's
            for op, strategy, schema_info in ((fwd, fwd_strategy, RuntimeSchemaInfo(3)), (bwd, bwd_strategy, None)):
                ctx = rules._op_strategy_context(op, strategy, schema_info)
                ctx.__enter__()
                rules._cp_strategy_contexts[op] = ctx

    rules.register_cp_sharding_rules = register_cp_sharding_rules
    _enabled = True


def cp_options() -> dict:
    """torch's `_cp_options` now: rotate_method ("allgather" / "alltoall"), enable_load_balance, convert_to_f32."""
    rotate = {_RotateMethod.ALL_GATHER: "allgather", _RotateMethod.ALL_TO_ALL: "alltoall"}[_cp_options.rotate_method]
    return {"rotate_method": rotate, "enable_load_balance": bool(_cp_options.enable_load_balance),
            "convert_to_f32": bool(_cp_options.convert_to_f32)}


# -- the model under CP -------------------------------------------------------------------------------------

def _gpt2_forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
    """traces/reference/nanogpt.py `GPT.forward` (GPT-2) with the positions read from the `cp_positions` buffer (the
    rank's load-balanced positions under CP) instead of `arange(t)`."""
    x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(self.cp_positions))
    for seg in self.segments:
        x = run_segment(torch.nn.Sequential(*(self.transformer.h[i] for i in seg.layers)), seg.wrap, x)
    logits = self.lm_head(self.transformer.ln_f(x))
    loss = None
    if targets is not None:
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
    return logits, loss


def _llama_forward(self, idx: torch.Tensor) -> torch.Tensor:
    """traces/reference/nanogpt.py `LlamaModel.forward` with the rotary positions read from the `cp_positions` buffer
    (as fp32, as the reference's float arange) instead of `arange(T)`."""
    x = self.embed_tokens(idx)
    pos = self.cp_positions.to(torch.float32)
    freqs = torch.outer(pos, self.inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
    for seg in self.segments:
        def run(x_, layers=[self.layers[i] for i in seg.layers]):
            for layer in layers:
                x_ = layer(x_, cos, sin, None)
            return x_
        x = run_segment(run, seg.wrap, x)
    return self.norm(x)


def run_config(model_cfg: TransformerConfig) -> TransformerConfig:
    """The config the harness runs: SDPA attention (CP replaces F.scaled_dot_product_attention(is_causal=True))."""
    return dataclasses.replace(model_cfg, attention="sdpa") if model_cfg.attention != "sdpa" else model_cfg


def build_cp_model(model_cfg: TransformerConfig, setup: TrainingSetup, seed: int = 0) -> torch.nn.Module:
    """The reference model of `run_config(model_cfg)` with its positions in a `cp_positions` buffer (int64, the
    whole sequence `setup.batch.seq_len`) read by the bound `_gpt2_forward` / `_llama_forward`: the model a CP rank
    runs, and, outside `context_parallel`, the same computation as the reference model."""
    model = build_model(run_config(model_cfg), setup, seed=seed)
    positions = torch.arange(setup.batch.seq_len, dtype=torch.long)
    holder = model if model_cfg.architecture == "gpt2" else model.model
    holder.register_buffer("cp_positions", positions, persistent=False)
    holder.forward = types.MethodType(_gpt2_forward if model_cfg.architecture == "gpt2" else _llama_forward, holder)
    return model


def position_buffer(model: torch.nn.Module) -> torch.Tensor:
    return model.cp_positions if hasattr(model, "transformer") else model.model.cp_positions


# -- one rank -----------------------------------------------------------------------------------------------

def _measure_rank(rank: int, job: CPJob) -> EventLog:
    """One rank's run (traces/harness.py `measure_ranks` runs it in a spawned process, in the process group)."""
    enable_cpu_ring_attention()
    set_rotate_method(job.rotate_method)
    setup = job.setup
    fsdp = setup.data_parallel.engine == "fsdp2"
    dp_rank = rank // (setup.mesh.cp * setup.mesh.tp)
    tp_mesh = None
    if setup.mesh.tp > 1:  # torchtitan's mesh: (cp, tp), tp innermost; TP on "tp" first, then CP on "cp"
        world = init_device_mesh("cpu", (setup.mesh.cp, setup.mesh.tp), mesh_dim_names=("cp", "tp"))
        mesh = shard_mesh = world["cp"]
        tp_mesh = world["tp"]
    elif setup.mesh.dp > 1:  # torchtitan's mesh: (dp_shard, cp), FSDP2 over both flattened ("dp_shard_cp")
        world = init_device_mesh("cpu", (setup.mesh.dp, setup.mesh.cp), mesh_dim_names=("dp", "cp"))
        mesh, shard_mesh = world["cp"], world["dp", "cp"]._flatten("dp_cp")
    else:
        mesh = shard_mesh = init_device_mesh("cpu", (setup.mesh.cp,), mesh_dim_names=("cp",))
    model = build_cp_model(job.model_cfg, setup, seed=job.seed)
    if tp_mesh is not None:
        parallelize(model, setup.mesh.tp, False, mesh=tp_mesh)
    release = apply_fsdp2(model, setup.data_parallel.fsdp2.reshard_after_forward, mesh=shard_mesh) if fsdp else None
    optimizer = torch_optimizer(optimizer_groups(model) if tp_mesh is not None else model.parameters(), setup,
                                job.lr)
    batches = make_batch(job.model_cfg, setup, seed=job.seed + 1 + dp_rank)  # the same data on every cp rank
    options = cp_options()
    balancer = _create_default_load_balancer(setup.batch.seq_len, setup.mesh.cp, "cpu")
    tracker = DTensorTracker(model, optimizer, known=batch_tensors(batches), rank=rank)
    positions = position_buffer(model)
    losses: list[list] = []
    with tracking(tracker, job.seed, loss_parallel() if tp_mesh is not None else contextlib.nullcontext()):
        for step in range(1, setup.batch.steps + 1):
            for mb in range(setup.batch.grad_accum):
                with tracker.phase(Phase.FORWARD, step, mb):
                    inputs, labels = (t.clone() for t in batches[mb])
                    tracker.mark_input(inputs, labels)
                    ctx = context_parallel(mesh, buffers=[inputs, labels, positions], buffer_seq_dims=[1, 1, 0],
                                           no_restore_buffers={inputs, labels})
                    with tracker.scope("context_parallel.enter"):
                        ctx.__enter__()
                    try:
                        out, loss = model(inputs, labels)
                        tracker.mark(out, Category.ACTIVATION)  # held by the caller until backward ends
                        with tracker.phase(Phase.BACKWARD, step, mb):
                            loss.backward()
                            losses.append([step, mb, float(loss.detach())])
                            del out, loss
                    finally:
                        with tracker.phase(Phase.BACKWARD, step, mb), tracker.scope("context_parallel.exit"):
                            ctx.__exit__(None, None, None)
                with tracker.phase(Phase.BACKWARD, step, mb):
                    del inputs, labels, ctx
                    if mb == setup.batch.grad_accum - 1 and not fsdp:  # FSDP2 reduce-scatters (averages) itself
                        with tracker.scope("cp.grad_all_reduce"):
                            for p in model.parameters():  # (no local name: it would keep the last gradient)
                                if p.grad is not None:
                                    local = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
                                    dist.all_reduce(local, group=mesh.get_group())
                                    local.div_(setup.mesh.cp)
                                    del local
                    tracker.scan()
            with tracker.phase(Phase.OPTIMIZER, step):
                optimizer.step()
                tracker.scan()
            with tracker.phase(Phase.ZERO_GRAD, step):
                optimizer.zero_grad(set_to_none=setup.optimizer.set_to_none)
                tracker.scan()
    fsdp_run = (
        {**fsdp_details(model, setup.data_parallel.fsdp2.reshard_after_forward, release), "fsdp_mesh": "dp_shard_cp"}
        if fsdp
        else {}
    )
    return tracker.log(
        run_metadata(rank, setup.mesh.world_size, run_config(job.model_cfg), setup).updated(
            engine="context-parallel",
            cp=setup.mesh.cp,
            cp_rank=rank // setup.mesh.tp % setup.mesh.cp,
            tp=setup.mesh.tp,
            dp=setup.mesh.dp,
            dp_rank=dp_rank,
            cp_options=options,
            load_balancer=type(balancer).__name__ if balancer else None,
            grad_reduce="fsdp2-reduce-scatter" if fsdp else GRAD_REDUCE,
            attention="sdpa",
            **fsdp_run,
            attention_requested=job.model_cfg.attention,
            local_seq_len=setup.batch.seq_len // setup.mesh.cp,
            losses=losses,
        )
    )


def reference_losses(model_cfg: TransformerConfig, setup: TrainingSetup, seed: int = 0, lr: float = 1e-3) -> list:
    """The same steps in this process without CP (the whole sequence, `build_cp_model`, same data and optimizer):
    [[step, micro_batch, loss]], to compare with the mean over cp ranks of each rank's `losses` (ring attention
    is exact; the averaged gradients make every step the same)."""
    model = build_cp_model(model_cfg, setup, seed=seed)
    optimizer = torch_optimizer(model.parameters(), setup, lr)
    batches = make_batch(model_cfg, setup, seed=seed + 1)
    out = []
    torch.manual_seed(seed)
    for step in range(1, setup.batch.steps + 1):
        for mb in range(setup.batch.grad_accum):
            _, loss = model(*batches[mb])
            loss.backward()
            out.append([step, mb, float(loss.detach())])
        optimizer.step()
        optimizer.zero_grad(set_to_none=setup.optimizer.set_to_none)
    return out


__all__ = ["measure_context_parallel", "enable_cpu_ring_attention", "cp_options", "build_cp_model", "run_config",
           "reference_losses", "CPJob", "ROTATE_METHODS", "GRAD_REDUCE"]
