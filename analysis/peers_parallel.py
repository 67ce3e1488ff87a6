"""Peers for model parallelism (tensor / pipeline / sequence / context): what Megatron-LM's theoretical memory
and llm-analysis say per rank for a setup, next to what the simulation says, and why they differ.

Both are re-derived here as pure functions of plain numbers, term by term from their sources:

- Megatron-LM `megatron/training/theoretical_memory_usage.py` at commit 1bcb3b9e0b029c6109d8d32872645bd540052963
  (2026-06-16, its last change on main through d98e8a6 of 2026-08-22; the expert-parallel split since a7c9e8c,
  latent MoE since 1bcb3b9, neither modelled here beyond EP). Not importable: the file is in megatron/training,
  and megatron-core's wheel (0.16.1) ships megatron/core only, so this column is always the re-derivation:
  `compute_weight_and_optimizer_memory` (parameters of the most loaded shard x 18 bytes, or 6 + 12/d with the
  distributed optimizer), `compute_activation_memory` (sequence parallel + selective recompute: Korthikanti et al.
  2022, table 2) and `compute_activation_memory_without_sp` (every other setup), as `report_theoretical_memory`
  picks between them. Megatron prints MB (2^20 bytes); here everything is bytes.
- llm-analysis (cli99/llm-analysis) `llm_analysis/analysis.py` as released in 0.2.2 (PyPI; tag v0.2.2, 0571436):
  `LLMAnalysis.training` with its defaults (w16a16e16, Adam, fp32 master weights, fp32 layernorm inputs, flash
  attention, attention dropout mask on, no softmax dropout) and the `get_*` functions it calls. Its main since
  (08d7f8f, 2023-11-17) differs in memory only under full recompute: 0.2.2's get_activation_memory_per_layernorm
  returns 0 for FULL, so its training() adds no final-norm input; 08d7f8f adds it always. Where llm-analysis is
  installed, `parallel_peers` takes the row from its own `LLMAnalysis.training` instead (analysis/peers_own.py).

Each estimate is a dict: `source`, `model_states` (weights + gradients + optimizer states), `activations`, `total`
(bytes per rank, rounded), `detail` (the named terms, unrounded) and `why` (the modelling choices that make it
differ from a simulation). `parallel_peers` builds both from a peakledger TransformerConfig and training setup;
`render_parallel_peers` prints them with peakledger's own row in the style of `compare --peers`.
"""

from __future__ import annotations

from ..models.config import ConfigError
from ..models.devices import device_profile
from ..models.precision import PRECISION_TABLE
from .peers_own import LLM_ANALYSIS_VERSION, PeerFunction, llm_analysis_peer
from .units import Scale

RECOMPUTE = ("none", "selective", "full")
MEGATRON = "Megatron-LM theoretical"
LLM_ANALYSIS = "llm-analysis"
MEGATRON_COMMIT = "1bcb3b9e0b029c6109d8d32872645bd540052963"  # theoretical_memory_usage.py's version re-derived here
MEGATRON_SOURCE = (f"Megatron-LM {MEGATRON_COMMIT[:7]}'s formulas (megatron/training/theoretical_memory_usage.py, "
                   "re-derived: megatron-core does not ship megatron/training)")

# Megatron docs, "Distributed Optimizer" (docs/user-guide/features/dist_optimizer.md): theoretical bytes per
# parameter, (non-distributed, distributed as a function of d). theoretical_memory_usage.py uses only the bf16 row.
MEGATRON_DOCS_BYTES_PER_PARAM = {
    "fp16 params, fp16 grads": (20, lambda d: 4 + 16 / d),
    "bf16 params, fp32 grads": (18, lambda d: 6 + 12 / d),
    "fp32 params, fp32 grads": (16, lambda d: 8 + 8 / d),
}


def _check_recompute(recompute: str) -> None:
    if recompute not in RECOMPUTE:
        raise ConfigError("recompute", f"unknown value {recompute!r}; allowed: {', '.join(RECOMPUTE)}")


def megatron_padded_vocab(vocab: int, tp: int, divisible_by: int = 128) -> int:
    # megatron/training/tokenizer/tokenizer.py _vocab_size_with_padding: up to a multiple of 128 x tp
    multiple = divisible_by * tp
    return -(-vocab // multiple) * multiple


def megatron_bytes_per_param(distributed_optimizer: bool, dp: int) -> float:
    # theoretical_memory_usage.py compute_weight_and_optimizer_memory.num_bytes_per_parameter
    return 6 + 12 / dp if distributed_optimizer else 18


def megatron_weight_and_optimizer(*, h: int, ffn: int, layers: int, heads: int, kv_heads: int, head_dim: int,
                                  padded_vocab: int, tp: int, pp: int, dp: int, swiglu: bool, rmsnorm: bool,
                                  untied: bool, distributed_optimizer: bool, num_experts: int | None = None,
                                  moe_ffn: int | None = None, ep: int = 1, etp: int | None = None,
                                  world_size: int | None = None, bias: bool = False) -> dict:
    """Megatron's weight + gradient + optimizer bytes on the most loaded shard (first pipeline stage)."""
    # all terms: theoretical_memory_usage.py compute_weight_and_optimizer_memory (non-MLA attention, no MTP)
    glu = 3 / 2 if swiglu else 1
    norm = 1 if rmsnorm else 2
    attention = 2 * h * h * ((1 + kv_heads / heads) * (head_dim * heads / h))
    dense_mlp = 2 * h * ffn * glu
    layernorm = 2 * h * norm
    embedding = h * padded_vocab
    final_norm = norm * h
    moe = num_experts is not None
    n_moe = layers if moe else 0  # moe_layer_freq 1: every layer is an MoE layer
    n_dense = layers - n_moe
    routed = 2 * h * (moe_ffn or 0) * num_experts * glu if moe else 0
    router = h * num_experts + (num_experts if bias else 0) if moe else 0
    tp_sharded = (attention + dense_mlp) * n_dense + attention * n_moe
    replicated = layernorm * n_dense + (layernorm + router) * n_moe + final_norm
    expert_sharded = routed * n_moe
    etp = tp if etp is None else etp
    world_size = world_size or tp * pp * dp
    tp_shard = (tp_sharded / pp + embedding) / tp
    if untied and pp == 1:
        tp_shard += embedding / tp  # the output layer sits on the same (only) stage
    repl_shard = replicated / pp
    expert_shard = expert_sharded / pp / (etp * ep)
    expert_dp = world_size // (etp * ep * pp)
    total = ((tp_shard + repl_shard) * megatron_bytes_per_param(distributed_optimizer, dp)
             + expert_shard * megatron_bytes_per_param(distributed_optimizer, expert_dp))
    return {"params_most_loaded_shard": tp_shard + repl_shard + expert_shard,
            "params_total": (tp_sharded + replicated + expert_sharded + embedding * (2 if untied else 1)),
            "bytes_per_param": megatron_bytes_per_param(distributed_optimizer, dp), "bytes": total}


def megatron_pipeline_factor(pp: int, virtual_stages: int | None, num_microbatches: int | None) -> float:
    """The in-flight factor applied to the first stage's L-layer activations (p micro-batches x L/p layers)."""
    if virtual_stages is not None and virtual_stages > 1:
        # theoretical_memory_usage.py compute_activation_memory: interleaved_schedule_memory_penalty
        return 1 + (pp - 1) / (pp * virtual_stages)
    if pp > 1 and num_microbatches is not None:
        # theoretical_memory_usage.py compute_activation_memory: fewer micro-batches than stages in flight
        return min(1, num_microbatches / pp)
    return 1.0


def megatron_activations(*, h: int, ffn: int, layers: int, padded_vocab: int, seq: int, micro_batch: int, tp: int,
                         pp: int, sequence_parallel: bool, recompute: str, virtual_stages: int | None = None,
                         num_microbatches: int | None = None) -> dict:
    """Megatron's activation bytes on the first pipeline stage, by the formula report_theoretical_memory picks."""
    _check_recompute(recompute)
    sbh = seq * micro_batch * h
    factor = megatron_pipeline_factor(pp, virtual_stages, num_microbatches)
    embedding = 8 * seq * micro_batch * pp + sbh * pp  # input ids (8 B) + embedding dropout, p micro-batches
    if sequence_parallel and recompute == "selective":
        # theoretical_memory_usage.py compute_activation_memory: sbh(18 + 4 ffn/h) per layer, all / t
        per_layer = sbh * (18 + 4 * (ffn / h))
        output = sbh * 4 * (1 + padded_vocab / h) if pp == 1 else 0  # output-layer input and CE loss
        total = ((per_layer * layers + embedding) * factor + output) / tp
        return {"formula": "compute_activation_memory", "per_layer": per_layer / tp, "layers": per_layer * layers / tp,
                "embedding": embedding / tp, "pipeline_factor": factor, "output": output / tp, "overhead": 1.0,
                "bytes": total}
    # theoretical_memory_usage.py compute_activation_memory_without_sp: sbh(10 + 24/t) per layer, total x 1.05
    per_layer = sbh * (10 + 24 / tp)
    output = (seq * micro_batch * padded_vocab / tp + sbh) * 2 if pp == 1 else 0  # logits + final-norm output
    total = ((per_layer * layers + embedding) * factor + output) * 1.05
    return {"formula": "compute_activation_memory_without_sp", "per_layer": per_layer, "layers": per_layer * layers,
            "embedding": embedding, "pipeline_factor": factor, "output": output, "overhead": 1.05, "bytes": total}


def llm_analysis_layer_params(*, h: int, ffn: int, heads: int, kv_heads: int, tp: int, num_experts: int = 1) -> dict:
    # llm_analysis/analysis.py get_num_params_per_layer_attn / _mlp / _router / _layernorm
    kv = max(kv_heads / tp, 1) * tp  # at least one kv head per tensor-parallel rank
    return {"attn": 2 * h ** 2 + 2 * h * (h * kv / heads), "mlp": 2 * h * ffn * num_experts,
            "router": h * num_experts if num_experts > 1 else 0, "layernorm": 2 * h}


def llm_analysis_activation_per_layer(*, h: int, ffn: int, heads: int, seq: int, micro_batch: int, tp: int, sp: int,
                                      recompute: str, flash_attn: bool = True, act_bytes: float = 2,
                                      layernorm_bytes: float = 4, num_experts: int = 1, top_k: int = 1) -> dict:
    """llm-analysis's training activations of one layer (ActivationRecomputation NONE / ATTN_COMPUTE / FULL)."""
    _check_recompute(recompute)
    sbh = seq * micro_batch * h
    if recompute == "full":
        # analysis.py get_activation_memory_per_layer: FULL keeps the layer input, / tp
        return {"attn": 0, "mlp": 0, "layernorm": 0, "bytes": sbh * act_bytes / tp}
    # analysis.py get_activation_memory_per_layer_attn (selective = ATTN_COMPUTE drops the attention compute term)
    if recompute == "selective":
        compute = 0
    elif flash_attn:
        compute = (2 * sbh + 4 * heads * seq * micro_batch) * act_bytes / tp
    else:
        compute = 2 * heads * seq ** 2 * micro_batch * act_bytes / tp
    attn = (sbh / sp + 4 * sbh / tp) * act_bytes + compute + sbh / sp  # last: attention dropout mask, 1 B
    # analysis.py get_activation_memory_per_layer_mlp (no recompute_gelu, no dropout; experts x top-k as written)
    experts = num_experts * top_k
    mlp = act_bytes * sbh * experts / sp + 2 * act_bytes * (ffn / h) * sbh * experts / tp
    # analysis.py get_activation_memory_per_layernorm, two per layer
    norms = 2 * sbh / sp * layernorm_bytes
    return {"attn": attn, "mlp": mlp, "layernorm": norms, "bytes": attn + mlp + norms}


def llm_analysis_training(*, h: int, ffn: int, layers: int, heads: int, kv_heads: int, vocab: int, seq: int,
                          micro_batch: int, tp: int, pp: int, dp: int, sp: int, recompute: str, zero_stage: int = 0,
                          flash_attn: bool = True, weight_bytes: float = 2, act_bytes: float = 2,
                          layernorm_bytes: float = 4, master_bytes: float = 4, num_experts: int = 1,
                          top_k: int = 1) -> dict:
    """llm-analysis `LLMAnalysis.training` memory per GPU (its weight+op_state+grad and activation_memory_per_gpu)."""
    p = llm_analysis_layer_params(h=h, ffn=ffn, heads=heads, kv_heads=kv_heads, tp=tp, num_experts=num_experts)
    per_gpu_layers = int(layers / pp)  # analysis.py training: num_layers_per_gpu, the floor
    w_shard = dp if zero_stage == 3 else 1
    op_shard = dp if zero_stage >= 1 else 1
    g_shard = dp if zero_stage >= 2 else 1
    op_bytes = 4 + 2 * 4  # analysis.py get_memory_optimizer_state_and_gradient_per_layer: Adam, other_op_bytes None
    embedding = vocab * h  # analysis.py get_num_params_embedding(shared_embedding=True)
    others = p["attn"] + p["router"] + p["layernorm"]
    # analysis.py get_weight_memory_per_layer, get_memory_embedding (embedding_bits), get_weight_memory_last_layernorm
    weights = (per_gpu_layers * (p["attn"] + p["mlp"] + p["router"] + p["layernorm"]) * weight_bytes / tp / w_shard
               + embedding / tp * weight_bytes / w_shard + h * weight_bytes / tp / w_shard)
    # analysis.py get_memory_optimizer_state_and_gradient_per_layer / _embedding / _last_layernorm
    stage_params = per_gpu_layers * (p["mlp"] + others) / tp + (embedding + h) / tp
    optimizer = op_bytes * stage_params / op_shard
    gradients = master_bytes * stage_params / g_shard
    layer = llm_analysis_activation_per_layer(h=h, ffn=ffn, heads=heads, seq=seq, micro_batch=micro_batch, tp=tp,
                                              sp=sp, recompute=recompute, flash_attn=flash_attn, act_bytes=act_bytes,
                                              layernorm_bytes=layernorm_bytes, num_experts=num_experts, top_k=top_k)
    # analysis.py training: all L layers (p stages x L/p layers in flight), + logits, + one final norm input (0.2.2:
    # get_activation_memory_per_layernorm is 0 under FULL recompute)
    logits = vocab * micro_batch * seq * act_bytes / tp  # get_activation_memory_output_embedding
    final_norm = 0 if recompute == "full" else seq * micro_batch * h / sp * layernorm_bytes
    activations = layer["bytes"] * layers + logits + final_norm
    states = weights + gradients + optimizer
    return {"weights": weights, "gradients": gradients, "optimizer_states": optimizer, "model_states": states,
            "activation_per_layer": layer["bytes"], "logits": logits, "activations": activations,
            "layers_per_gpu": per_gpu_layers, "bytes": states + activations}


def _row(source: str, states: float, activations: float, detail: dict, why: list[str], estimate_source: str,
         version: str, own: bool) -> dict:
    """A peer's row; `estimate_source` says whose figure it is (the peer's own function, or which version's
    formulas and why), printed under the table."""
    return {"source": source, "model_states": round(states), "activations": round(activations),
            "total": round(states) + round(activations), "detail": detail, "why": why,
            "estimate_source": estimate_source, "estimate_version": version, "estimate_own": own}


def megatron_theoretical(*, h, ffn, layers, heads, kv_heads, head_dim, vocab, seq, micro_batch, tp=1, pp=1, dp=1,
                         cp=1, sequence_parallel=False, recompute="none", virtual_stages=None, num_microbatches=None,
                         distributed_optimizer=False, swiglu=False, rmsnorm=False, untied=False, num_experts=None,
                         moe_ffn=None, bias=False, precision="bf16-mixed", pp_schedule="1f1b", ep=1) -> dict:
    """Megatron's report_theoretical_memory for a setup, as a row with its breakdown and why it differs (`ep`:
    expert_model_parallel_size, inside dp)."""
    padded = megatron_padded_vocab(vocab, tp)
    states = megatron_weight_and_optimizer(
        h=h, ffn=ffn, layers=layers, heads=heads, kv_heads=kv_heads, head_dim=head_dim, padded_vocab=padded, tp=tp,
        pp=pp, dp=dp, swiglu=swiglu, rmsnorm=rmsnorm, untied=untied, distributed_optimizer=distributed_optimizer,
        num_experts=num_experts, moe_ffn=moe_ffn, world_size=tp * pp * dp * cp, bias=bias, ep=ep)
    acts = megatron_activations(h=h, ffn=ffn, layers=layers, padded_vocab=padded, seq=seq, micro_batch=micro_batch,
                                tp=tp, pp=pp, sequence_parallel=sequence_parallel, recompute=recompute,
                                virtual_stages=virtual_stages, num_microbatches=num_microbatches)
    bpp = f"6 + 12/d = {states['bytes_per_param']:.3g}" if distributed_optimizer else "18"
    why = [f"model states = the first stage's L/p layers + the input embedding (vocabulary padded to {padded:,}) over "
           f"tp, x {bpp} bytes per parameter: bf16 weights 2 + fp32 main gradients "
           "4 + fp32 master 4 + Adam 8, whatever the precision and optimizer; no biases, no buffers",
           f"activations of the first stage only, for all L layers (p micro-batches in flight x L/p layers) x "
           f"{acts['pipeline_factor']:.3g} (1F1B: min(1, m/p); interleaved: 1 + (p-1)/(p v)); the last stage's "
           "logits and loss are counted only when p = 1"]
    if acts["formula"] == "compute_activation_memory":
        why.append("per layer sbh(18 + 4 ffn/h)/t bytes (Korthikanti et al. table 2, SP + selective recompute): "
                   "no GQA, no SwiGLU third projection, no head_dim != h/a, no flash-attention statistics")
    else:
        why.append("not SP + selective, so compute_activation_memory_without_sp: sbh(10 + 24/t) per layer (table 2's "
                   "tensor-parallel + selective-recompute row, ffn fixed at 4h), the whole x 1.05 for temporaries"
                   + {"none": "; no recompute is modelled as selective (no attention scores counted)",
                      "full": "; full recompute is not modelled (it would keep only each layer's input)"}
                   .get(recompute, "") + ("; sequence parallelism ignored" if sequence_parallel else ""))
    if num_experts:
        why.append("MoE: expert weights counted, expert activations not (the dense ffn formula for every layer)"
                   + (f"; experts split over ep {ep}, no all-to-all dispatch / combine buffers, whatever the routing"
                      if ep > 1 else ""))
    if cp > 1:
        why.append(f"context parallelism is not in the formula: activations are for the whole sequence (x{cp} of a "
                   "rank's share), d excludes cp")
    if pp_schedule and pp_schedule.lower().startswith(("gpipe", "all-forward")):
        why.append("assumes 1F1B (at most p micro-batches in flight); GPipe keeps all m in flight")
    if not (PRECISION_TABLE[precision].mixed and PRECISION_TABLE[precision].param == "bf16"):
        why.append(f"precision {precision}: the formula still counts the bf16-params / fp32-grads row of Megatron's "
                   "docs (fp16 / fp16: 20 or 4 + 16/d; fp32: 16 or 8 + 8/d)")
    why.append("leaves out the allocator (fragmentation, cached blocks), the CUDA context and workspaces, "
               "communication buffers (TP/PP send-receive, DP buckets), optimizer-step temporaries")
    detail = {"weights_and_optimizer": states, "activations": acts, "padded_vocab": padded}
    return _row(MEGATRON, states["bytes"], acts["bytes"], detail, why, MEGATRON_SOURCE, MEGATRON_COMMIT[:7], False)


def llm_analysis(*, h, ffn, layers, heads, kv_heads, head_dim, vocab, seq, micro_batch, tp=1, pp=1, dp=1, cp=1,
                 sequence_parallel=False, recompute="none", zero_stage=0, flash_attn=True, weight_bytes=2,
                 act_bytes=2, swiglu=False, untied=False, num_experts=1, top_k=1, virtual_stages=None,
                 num_microbatches=None, peer: PeerFunction | None = None) -> dict:
    """llm-analysis's training memory for a setup, as a row with its breakdown and why it differs: from `peer`
    (analysis/peers_own.py: llm-analysis's own function where installed), else its 0.2.2 formulas."""
    sp = tp if sequence_parallel else 1  # train(): sp_size defaults to tp_size; 1 turns sequence parallelism off
    peer = peer or PeerFunction(LLM_ANALYSIS, "LLMAnalysis.training", LLM_ANALYSIS_VERSION, llm_analysis_training,
                                why="re-derived")
    d, source, own = peer(h=h, ffn=ffn, layers=layers, heads=heads, kv_heads=kv_heads, vocab=vocab, seq=seq,
                          micro_batch=micro_batch, tp=tp, pp=pp, dp=dp, sp=sp, recompute=recompute,
                          zero_stage=zero_stage, flash_attn=flash_attn, weight_bytes=weight_bytes,
                          act_bytes=act_bytes, num_experts=num_experts, top_k=top_k)
    why = [f"model states = floor(L/p) = {d['layers_per_gpu']} layers + the embedding (V h, once, unpadded) + the "
           "final norm on every stage, over tp; weights 2 B, gradients in the master dtype (4 B), Adam 12 B"
           + (f"; ZeRO-{zero_stage} shards over dp" if zero_stage else ""),
           "activations for all L layers on every rank (p micro-batches x L/p layers), whatever m, p and interleaving, "
           "+ logits V s b/t + one final-norm input (none under full recompute, as 0.2.2 counts it); no "
           "input-embedding or loss terms",
           "per layer (Korthikanti et al. with flash attention): layernorm inputs in fp32, a 1-byte attention-dropout "
           "mask even with dropout off" + ("" if flash_attn else ", s^2 attention scores")]
    shapes = []
    if swiglu:
        shapes.append("the MLP is 2 h ffn (no SwiGLU gate projection: a third of its weights missing)")
    if kv_heads != heads or head_dim * heads != h:
        shapes.append("attention is 2h^2 + 2h (h kv/a) (head_dim = h/a); activations ignore GQA")
    if shapes:
        why.append("; ".join(shapes))
    if num_experts > 1:
        why.append(f"MoE: MLP activations x experts x top-k ({num_experts} x {top_k}) as written, no routing buffers")
    if untied:
        why.append("the untied output layer is not counted (shared_embedding=True)")
    if cp > 1:
        why.append("no context parallelism: activations for the whole sequence")
    if virtual_stages and virtual_stages > 1:
        why.append("no interleaved-schedule penalty")
    why.append("leaves out the allocator, the CUDA context and workspaces, communication buffers, temporaries")
    return _row(LLM_ANALYSIS, d["model_states"], d["activations"], d, why, source,
                peer.version if own else peer.formula_version, own)


def _get(setup, name, default=None):
    return setup.get(name, default) if isinstance(setup, dict) else setup.knob(name)


def parallel_peers(cfg, setup, *, tp: int = 1, pp: int = 1, cp: int = 1, sequence_parallel: bool = False,
                   virtual_stages: int = 1, pp_schedule: str = "1f1b", distributed_optimizer: bool | None = None,
                   recompute: str | None = None, ep: int = 1, device: str = "H100-80GB") -> list[dict]:
    """Megatron's and llm-analysis's rows for a peakledger TransformerConfig and a TrainingSetup (or a dict with its
    fields). tp/pp/cp/... are arguments until the setup has them. `distributed_optimizer` None: zero_stage >= 1;
    `recompute` None: from setup.checkpointing.policy (none -> none, selective -> selective, any layer policy ->
    full). llm-analysis's row is its own `LLMAnalysis.training` where llm-analysis is installed (`device`: the GPU
    it is told of), else its 0.2.2 formulas; each row's `estimate_source` says which."""
    world = _get(setup, "world_size", 1)
    if world % (tp * pp * cp):
        raise ConfigError("world_size", f"{world} ranks do not divide into tp {tp} x pp {pp} x cp {cp}")
    dp = world // (tp * pp * cp)
    zero = _get(setup, "zero_stage", 0)
    if distributed_optimizer is None:
        distributed_optimizer = zero >= 1
    if recompute is None:
        policy = _get(setup, "checkpointing", "none")
        recompute = policy if policy in RECOMPUTE else "full"
    _check_recompute(recompute)
    precision = _get(setup, "precision", "bf16-mixed")
    experts = getattr(cfg, "num_local_experts", None)
    common = dict(h=cfg.d_model, ffn=cfg.ffn, layers=cfg.n_layer, heads=cfg.n_head, kv_heads=cfg.kv_heads,
                  head_dim=cfg.head_size, vocab=cfg.vocab_size, seq=_get(setup, "seq_len", 1024),
                  micro_batch=_get(setup, "micro_batch", 1), tp=tp, pp=pp, dp=dp, cp=cp,
                  sequence_parallel=sequence_parallel, recompute=recompute, swiglu=cfg.gated_mlp, untied=not cfg.tied,
                  virtual_stages=virtual_stages if virtual_stages and virtual_stages > 1 else None,
                  num_microbatches=_get(setup, "grad_accum", 1))
    mega = megatron_theoretical(**common, distributed_optimizer=distributed_optimizer,
                                rmsnorm=cfg.architecture == "llama", num_experts=experts,
                                moe_ffn=cfg.ffn if experts else None, bias=cfg.has_bias,
                                precision=precision, pp_schedule=pp_schedule, ep=ep)
    prec = PRECISION_TABLE[precision]
    weight_bytes = 2 if prec.param != "fp32" else 4  # autocast keeps fp32 weights
    peer = llm_analysis_peer(llm_analysis_training, device_profile(device), common["num_microbatches"])
    llm = llm_analysis(**common, zero_stage=max(zero, 1 if distributed_optimizer else 0),
                       flash_attn=cfg.attention == "sdpa", weight_bytes=weight_bytes,
                       act_bytes=4 if prec.compute == "fp32" else 2, num_experts=experts or 1,
                       top_k=getattr(cfg, "num_experts_per_tok", None) or 1, peer=peer)
    if ep > 1:
        llm["why"].insert(1, f"expert parallelism (ep {ep}) is not passed to this formula: every expert is counted on "
                             "every rank")
    if prec.mixed and not _get(setup, "fp32_grads", False):
        note = f"gradients: {precision} here keeps 16-bit gradients (fp32_grads off); the formula counts fp32 ones"
        mega["why"].insert(1, note)
        llm["why"].insert(1, note)
    optimizer = _get(setup, "optimizer", "adamw")
    if optimizer not in ("adam", "adamw"):
        for row in (mega, llm):
            row["why"].insert(1, f"optimizer {optimizer}: the formula counts Adam's two fp32 states and an fp32 master")
    setup_info = dict(tp=tp, pp=pp, cp=cp, dp=dp, world_size=world, micro_batch=common["micro_batch"],
                      seq_len=common["seq"], num_microbatches=common["num_microbatches"],
                      sequence_parallel=sequence_parallel, virtual_stages=virtual_stages, recompute=recompute,
                      distributed_optimizer=distributed_optimizer)
    for row in (mega, llm):
        row["setup"] = setup_info
    return [mega, llm]


PARALLEL_PEER_NOTES = [
    "bytes per rank: peakledger's worst rank; Megatron's most loaded shard + first-stage activations; llm-analysis's "
    "one GPU. Model states = weights + gradients + fp32 masters + optimizer states.",
    "neither formula counts the allocator's cache and fragmentation, temporaries, communication buffers or the CUDA "
    "context: a simulated peak above both is expected; below them, look at the activation rows.",
]


def render_parallel_peers(rows: list[dict], unit: str | None, name: str | None = None) -> str:
    """`compare --peers` with model parallelism as text: peakledger's row (source "peakledger", any missing field
    shown as "-") next to Megatron's and llm-analysis's, then why each differs."""
    keys = ("model_states", "activations", "total", "peak")
    g = Scale.of([r.get(k) for r in rows for k in keys], unit)  # one unit for the table
    f = lambda n: "-" if n is None else g.number(round(n))  # noqa: E731
    info = next((r["setup"] for r in rows if r.get("setup")), None)
    head = f"{name}: " if name else ""
    if info:
        head += (f"tp {info['tp']}, pp {info['pp']}" + (f", cp {info['cp']}" if info["cp"] > 1 else "")
                 + f", dp {info['dp']} ({info['world_size']} ranks); micro-batch {info['micro_batch']} x seq "
                 f"{info['seq_len']}, m = {info['num_microbatches']} micro-batches per step; sequence parallel "
                 f"{'on' if info['sequence_parallel'] else 'off'}, recompute {info['recompute']}, distributed "
                 f"optimizer {'on' if info['distributed_optimizer'] else 'off'} ")
    lines = [head + f"(bytes per rank; {g.unit})",
             f"{'source':<26}{'model states':>16}{'activations':>16}{'total / peak':>16}"]
    for r in rows:
        lines.append(f"{r['source']:<26}{f(r.get('model_states')):>16}{f(r.get('activations')):>16}"
                     f"{f(r.get('total', r.get('peak'))):>16}")
    lines += [f"{r['source']}: {r['estimate_source']}" for r in rows if r.get("estimate_source")]
    lines.append("why they differ:")
    lines += [f"  - {note}" for note in PARALLEL_PEER_NOTES]
    for r in rows:
        if r.get("why"):
            lines.append(f"  {r['source']}:")
            lines += [f"    - {w}" for w in r["why"]]
    return "\n".join(lines)


__all__ = ["megatron_padded_vocab", "megatron_bytes_per_param", "megatron_weight_and_optimizer",
           "megatron_pipeline_factor", "megatron_activations", "megatron_theoretical", "llm_analysis_layer_params",
           "llm_analysis_activation_per_layer", "llm_analysis_training", "llm_analysis", "parallel_peers",
           "render_parallel_peers", "PARALLEL_PEER_NOTES", "MEGATRON_DOCS_BYTES_PER_PARAM", "RECOMPUTE",
           "MEGATRON_COMMIT", "MEGATRON_SOURCE"]
