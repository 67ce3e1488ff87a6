"""Measure every rank of a real expert-parallel CPU run: HF Mixtral with its experts placed on `ep` ranks and the
tokens moved by all-to-all, as torchtitan's `ExpertParallel` moves them, on gloo over 127.0.0.1.

torch has no expert-parallel module of its own, and transformers' (`distributed_config` "ep" plans) keeps every
token on every rank and all-reduces the experts' outputs: no all-to-all. torchtitan's, the layout Megatron-LM and
DeepSpeed-MoE share, sends each token to the rank that owns its expert and back. `measure_expert_parallel` runs
that, with nothing in it that torch does not run: `ep` processes joined as every real run joins its ranks
(traces/harness.py `measure_ranks`), each building the same reference model (`traces.reference.build_model`, HF's
MixtralForCausalLM, same seed), then on every decoder layer:

- the experts' 3-D weights cut to this rank's `num_local_experts / ep` experts (rank r owns experts
  [r x E_l, (r + 1) x E_l), torchtitan's `ExpertParallel._partition_fn`: Shard(0));
- `experts.forward` replaced by `ep_experts_forward`: transformers' `grouped_mm_experts_forward`
  (transformers/integrations/moe.py) up to its histogram, torchtitan's token dispatch (torchtitan/distributed/
  expert_parallel.py `ExpertParallel._token_dispatch` and `_permute`: the per-expert counts exchanged by an
  all-to-all, the (token, expert) rows by an all-to-all into this rank's experts, regrouped by local expert with
  each group padded to TOKEN_GROUP_ALIGN_SIZE_M rows from an appended zero row), the two grouped matmuls on the
  local experts, torchtitan's combine (`_unpermute`, then the all-to-all back), and transformers' weighting and
  un-sorting again.
- the all-to-all of the rows is `AllToAll` (Megatron-LM's `_AllToAll`, megatron/core/tensor_parallel/mappings.py:
  `dist.all_to_all_single` into a new tensor; backward the same with the splits swapped), returning only once gloo
  has let go of its tensors (traces/harness.py `wait_released`), so every free lands where Python drops the
  reference.

The dense parameters (attention, norms, routers, embeddings) are replicas trained by `DistributedDataParallel`
(traces/distributed.py `wrap_ddp`), which is told to leave the experts alone
(`_set_params_and_buffers_to_ignore_for_model`, torch/nn/parallel/distributed.py). Ranks are laid out as Megatron
lays them with tp = 1: expert-parallel groups of `ep` consecutive ranks (ep rank = rank % ep); with dp = ep every
expert lives on one rank and needs no gradient sync; with dp a multiple of ep, the ranks holding the same experts
(rank % ep equal: the expert-data-parallel group) average their experts' gradients in place before the optimizer
step (an all-reduce and a division, as Megatron-LM syncs expert gradients over its expert-data-parallel group).

Routing: every rank trains on the same micro-batch (the same one for every micro-batch and step) with lr 0, so
every rank routes every token the same way in every forward, and one counts table (`RoutingRecorder`, recorded in
an untracked forward before the run) says what each rank sends and receives: the simulation's "every rank routes
like the counts file" holds exactly. `routing="worst"` zeroes the routers (ties in top-k send every token to
experts 0..k-1, all on rank 0 when k <= E / ep).
"""

from __future__ import annotations

import functools
import types
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..models.config import TrainingSetup, TransformerConfig
from ..models.families import family_of
from ..models.parallel.expert import TOKEN_GROUP_ALIGN_SIZE_M
from ..simulator.events import EventLog
from .distributed import wrap_ddp
from .harness import (
    Job,
    ReleaseCount,
    holders,
    measure_ranks,
    run_metadata,
    tracking,
    train_steps,
    wait_released,
)
from .reference import build_model, make_batch, torch_optimizer
from .reference.mixtral import RoutingRecorder
from .tracker import AllocationTracker

ROUTINGS = ("measured", "worst")
RELEASE_TIMEOUT_S = 5.0


@dataclass(frozen=True, kw_only=True)
class ExpertJob(Job):
    """What every process of an expert-parallel run is sent: the harness's job with lr 0 (the weights, so every
    forward's routing, stay as recorded) and the routing."""

    lr: float = 0.0
    routing: str


def measure_expert_parallel(model_cfg: TransformerConfig, setup: TrainingSetup, *, routing: str = "measured",
                            seed: int = 0, timeout_s: float = 120.0) -> tuple[list[EventLog], dict]:
    """Run `setup.batch.steps` real training steps of an HF Mixtral `model_cfg` on `setup.mesh.ep` CPU processes (gloo,
    loopback only), experts placed on ranks; (one tracked `EventLog` per rank, the routing counts document every
    rank routed by: "peakledger-moe-counts", what `moe_routing="counts:FILE"` reads). Uses ep, world_size (= dp, a
    multiple of ep),
    micro_batch, seq_len, grad_accum, steps, precision ("fp32" or "bf16"), optimizer and set_to_none. Call under
    `if __name__ == "__main__":` in a script; a failing rank's traceback is raised as RuntimeError."""
    check_expert_run(model_cfg, setup, routing)
    job = functools.partial(ExpertJob, model_cfg, setup, seed=seed, timeout_s=timeout_s, routing=routing)
    logs = measure_ranks(
        _measure_rank,
        job,
        setup.mesh.world_size,
        f"expert parallel ep{setup.mesh.ep} dp{setup.mesh.dp}",
        prefix="peakledger-ep-",
    )
    return logs, logs[0].metadata.routing_counts


def check_expert_run(model_cfg, setup: TrainingSetup, routing: str) -> None:
    """Refuse, before any process starts, what `measure_expert_parallel` does not run."""
    if not family_of(model_cfg).experts:
        raise ValueError("expert-parallel runs need a mixture-of-experts model (num_local_experts)")
    if model_cfg.experts_implementation not in (None, "grouped_mm"):
        raise NotImplementedError("expert-parallel runs replace the grouped_mm experts path, not "
                                  f"{model_cfg.experts_implementation!r}")
    if routing not in ROUTINGS:
        raise ValueError(f"routing {routing!r}; allowed: {', '.join(ROUTINGS)}")
    if setup.mesh.ep < 2 or setup.mesh.world_size != setup.mesh.dp or setup.mesh.dp % setup.mesh.ep:
        raise NotImplementedError(
            f"expert-parallel runs are data parallel with experts placed: ep >= 2, world_size "
            f"= dp a multiple of ep (got ep {setup.mesh.ep}, world_size {setup.mesh.world_size}, dp "
            f"{setup.mesh.dp})"
        )
    if model_cfg.num_local_experts % setup.mesh.ep:
        raise ValueError(f"ep={setup.mesh.ep} does not divide num_local_experts={model_cfg.num_local_experts}")
    if not setup.precision.uniform:
        raise NotImplementedError(f"expert-parallel runs measure fp32 or bf16, not {setup.precision.name!r}")
    if setup.checkpointing.policy != "none" or setup.optimizer.frozen or setup.lora.r:
        raise NotImplementedError("expert-parallel runs measure without checkpointing, frozen parameters or LoRA")
    if setup.offload.mode != "none" or setup.checkpoint_io.every or setup.checkpoint_io.load_mode != "none":
        raise NotImplementedError("expert-parallel runs measure without offload or checkpoint saves / loads")


# -- the all-to-all and the experts' forward ---------------------------------------------------------------

class AllToAll(torch.autograd.Function):
    """Megatron-LM's `_AllToAll` (megatron/core/tensor_parallel/mappings.py): rows to the ranks, `input_splits`
    rows to each, `output_splits` from each, into a new tensor; the backward the same with the splits swapped."""

    @staticmethod
    def forward(ctx, x, output_splits, input_splits, group):
        ctx.splits, ctx.group = (output_splits, input_splits), group
        return _all_to_all(x, output_splits, input_splits, group)

    @staticmethod
    def backward(ctx, grad):
        output_splits, input_splits = ctx.splits
        return _all_to_all(grad.contiguous(), input_splits, output_splits, ctx.group), None, None, None


def _all_to_all(x, output_splits, input_splits, group):
    out = x.new_empty((sum(output_splits),) + tuple(x.shape[1:]))
    before = holders((out, x))
    dist.all_to_all_single(out, x, output_splits, input_splits, group=group)
    wait_released((out, x), before, ReleaseCount(), RELEASE_TIMEOUT_S)
    return out


def ep_experts_forward(self, hidden_states, top_k_index, top_k_weights):
    """transformers' `grouped_mm_experts_forward` with torchtitan's token dispatch and combine around the grouped
    matmuls (see the module notes); `self` is a MixtralExperts cut to `self.ep_local` experts."""
    from transformers.integrations.moe import _grouped_linear

    ep, E_l, E = self.ep_size, self.ep_local, self.num_experts
    num_top_k = top_k_index.size(-1)
    num_tokens, hidden_dim = hidden_states.size(0), hidden_states.size(-1)
    sample_weights = top_k_weights.reshape(-1)
    expert_ids = top_k_index.reshape(-1)
    expert_ids_g, perm = torch.sort(expert_ids)
    selected_hidden_states_g = hidden_states[perm // num_top_k]
    sample_weights_g = sample_weights[perm]
    histc_input = expert_ids_g.float()
    tokens_per_expert = torch.histc(histc_input, bins=E, min=0, max=E - 1)
    # torchtitan ExpertParallel._token_dispatch: the counts, then the rows, to the experts' ranks
    with torch.no_grad():
        counts = tokens_per_expert.long()
        received = torch.empty_like(counts)
        dist.all_to_all_single(received, counts, group=self.ep_group)
    sent, got = counts.tolist(), received.tolist()  # got[j x E_l + e]: rows rank j sends local expert e
    input_splits = [sum(sent[j * E_l:(j + 1) * E_l]) for j in range(ep)]
    output_splits = [sum(got[j * E_l:(j + 1) * E_l]) for j in range(ep)]
    routed = AllToAll.apply(selected_hidden_states_g, output_splits, input_splits, self.ep_group)
    input_shape, routed, permuted_indices, offsets = _permute(routed, got, ep, E_l)
    proj_out = _grouped_linear(routed, self.gate_up_proj, offsets, is_transposed=self.is_transposed)
    proj_out = self._apply_gate(proj_out)
    proj_out = _grouped_linear(proj_out, self.down_proj, offsets, is_transposed=self.is_transposed)
    # torchtitan ExpertParallel._token_combine: unpermute, then the rows back to their tokens' ranks
    proj_out = _unpermute(proj_out, input_shape, permuted_indices)
    proj_out = AllToAll.apply(proj_out, input_splits, output_splits, self.ep_group)
    weighted_out = proj_out * sample_weights_g.unsqueeze(-1)
    inv_perm = torch.empty_like(perm)
    inv_perm[perm] = torch.arange(perm.size(0), device=perm.device)
    weighted_out = weighted_out[inv_perm]
    final_hidden_states = weighted_out.view(num_tokens, num_top_k, hidden_dim).sum(dim=1)
    return final_hidden_states.to(hidden_states.dtype)


def permute_indices(got: list[int], ep: int, E_l: int, align: int = TOKEN_GROUP_ALIGN_SIZE_M):
    """torchtitan's `generate_permute_indices` (torchtitan/experiments/kernels/moe/indices.py, `fill_indices_cpu`):
    the received rows (source-rank major, local-expert minor) regrouped by local expert, each group's size
    round_up(max(rows, align), align), the rest -1 (the appended zero row), in a buffer of
    round_up(rows + E_l x align, align) rows; (indices, the groups' end offsets)."""
    max_len = -(-(sum(got) + E_l * align) // align) * align
    starts, k = [], 0
    for n in got:
        starts.append(k)
        k += n
    indices, offsets, end = [-1] * max_len, [], 0
    for e in range(E_l):
        at = end
        for j in range(ep):
            n = got[j * E_l + e]
            indices[at:at + n] = range(starts[j * E_l + e], starts[j * E_l + e] + n)
            at += n
        total = sum(got[j * E_l + e] for j in range(ep))
        end += -(-max(total, align) // align) * align
        offsets.append(end)
    return indices, offsets


def _permute(x, got, ep, E_l):
    """torchtitan's `_permute`: the indices (no grad), a zero row appended (vstack), the rows gathered."""
    indices, offsets = permute_indices(got, ep, E_l)
    with torch.no_grad():
        permuted_indices = torch.tensor(indices, dtype=torch.int32)
        offs = torch.tensor(offsets, dtype=torch.int32)
    x = torch.vstack((x, x.new_zeros((x.shape[-1]))))
    input_shape = x.shape
    x = x[permuted_indices, :]
    return input_shape, x, permuted_indices, offs


def _unpermute(out, input_shape, permuted_indices):
    """torchtitan's `_unpermute`: the rows put back in received order, the zero row dropped (a view)."""
    out_unpermuted = out.new_empty(input_shape)
    out_unpermuted[permuted_indices, :] = out
    return out_unpermuted[:-1]


def place_experts(model, ep: int, rank: int, group) -> list[str]:
    """Every decoder layer's experts cut to rank `rank`'s E / ep and run by `ep_experts_forward`; the names of the
    experts' parameters (what DDP leaves alone)."""
    names = []
    for name, module in model.named_modules():
        if not name.endswith(".mlp.experts"):
            continue
        E = module.num_experts
        E_l = E // ep
        for p in ("gate_up_proj", "down_proj"):
            full = getattr(module, p)
            setattr(module, p, torch.nn.Parameter(full.detach()[rank * E_l:(rank + 1) * E_l].clone()))
            names.append(f"{name}.{p}")
        module.ep_size, module.ep_local, module.ep_group = ep, E_l, group
        module.forward = types.MethodType(ep_experts_forward, module)
    return names


# -- one process --------------------------------------------------------------------------------------------

def _measure_rank(rank: int, job: ExpertJob) -> EventLog:
    """One rank's run (traces/harness.py `measure_ranks` runs it in a spawned process, in the process group)."""
    cfg, setup = job.model_cfg, job.setup
    model = build_model(cfg, setup, seed=job.seed)
    if job.routing == "worst":
        for name, module in model.named_modules():
            if name.endswith(".mlp.gate"):
                torch.nn.init.zeros_(module.weight)
    ep, dp = setup.mesh.ep, setup.mesh.dp
    # Megatron's layout with tp = 1: expert-parallel groups of consecutive ranks, expert-data-parallel groups of the
    # ranks that hold the same experts (every rank creates every group, as new_group requires)
    ep_groups = [dist.new_group(list(range(g * ep, (g + 1) * ep))) for g in range(dp // ep)]
    edp_groups = [dist.new_group(list(range(e, dp, ep))) for e in range(ep)] if dp > ep else None
    ignored = place_experts(model, ep, rank % ep, ep_groups[rank // ep])
    batch = make_batch(cfg, setup, seed=job.seed + 1, n=1)[0]  # the same micro-batch on every rank, every time
    batches = [batch] * setup.batch.grad_accum
    recorder = RoutingRecorder().attach(model)
    with torch.no_grad():  # untracked: the routing every forward of the run repeats (lr 0: the weights stay)
        model(*batch)
    recorder.detach()
    counts = recorder.document(setup.batch.micro_batch, setup.batch.seq_len, cfg.name)
    optimizer = torch_optimizer(model.parameters(), setup, job.lr)
    if edp_groups is not None:  # the experts' replicas average their gradients in place before the step
        names = set(ignored)
        experts = [p for n, p in model.named_parameters() if n in names]
        step = optimizer.step

        def synced_step(*args, **kwargs):
            for p in experts:
                dist.all_reduce(p.grad, group=edp_groups[rank % ep])
                p.grad.div_(dp // ep)
            return step(*args, **kwargs)

        optimizer.step = synced_step
    tracker = AllocationTracker(model, optimizer, known=batch, rank=rank, ddp_buckets=True)
    with tracking(tracker, job.seed):
        wrapped = wrap_ddp(model, tracker, ignored=ignored)
        train_steps(tracker, wrapped, optimizer, batches, setup)
    return tracker.log(run_metadata(rank, setup.mesh.world_size, cfg, setup).updated(
        engine="expert-parallel", engines=["ddp", "expert-parallel"], ep=ep, ep_rank=rank % ep, dp=dp,
        expert_grad_sync="all_reduce-average over rank % ep" if dp > ep else None,
        routing=job.routing, routing_counts=counts, ddp_ignored=ignored,
        ddp_bucket_cap_bytes=int(wrapped.bucket_bytes_cap), model_kind=type(cfg).__name__))


__all__ = ["measure_expert_parallel", "check_expert_run", "ep_experts_forward", "place_experts", "permute_indices",
           "AllToAll", "TOKEN_GROUP_ALIGN_SIZE_M", "ROUTINGS"]
