"""HF transformers' MixtralForCausalLM (5.24, use_cache=False, SDPA, no sliding window) as torch runs it.

The Llama-family layout with a sparse MoE block in place of the dense MLP (models/moe.py). What differs
from peakledger's own Llama (`_llama_block`), every item read from transformers/models/mixtral/modeling_mixtral.py:

- positions are `arange(T) + 0` (1, T), checked for packed sequences (small int64 temporaries);
- the rotary tables are built per forward from two fp32 buffers (`inv_freq`, `original_inv_freq`) in the
  embeddings' dtype: fp32 under autocast, so `q * cos + rotate_half(q) * sin` promotes the 16-bit q and k
  to fp32, and SDPA's autocast casts them back (k first, then q) and saves the casts;
- SDPA (`enable_gqa`, `is_causal=True`, no mask) writes its output already in (B, T, heads, head_dim)
  order: the head merge is a view, not a copy;
- the attention's locals (the rotated q and k) live until the attention returns; the router's logits,
  the top-k tensors and the block's input until the MoE block returns;
- MixtralRMSNorm on a 16-bit input upcasts it (the fp32 copy is what pow and the product save), keeps the fp32
  normalised x as a local until it returns, and multiplies the weight by a 16-bit cast of it (`_MixtralWriter`);
- the loss is HF's `ForCausalLMLoss` (`models/transformer/hf_gpt2.py hf_causal_lm_loss`).
"""

from __future__ import annotations

from dataclasses import replace

from .config import ConfigError, TrainingSetup, TransformerConfig
from .moe import moe_block
from .parallel.expert import EXPERT_WEIGHTS, ExpertParallelTape
from .tape import Tape, TensorSpec
from .transformer import HFWriter, hf_causal_lm_loss, transformer_params

MIXTRAL_CHECKPOINTING = ("none",)


class _MixtralWriter(HFWriter):
    """`HFWriter` with HF's own RMSNorm (MixtralRMSNorm), which differs from torch's for 16-bit inputs."""

    def rmsnorm(self, name: str, x: TensorSpec) -> TensorSpec:
        """`MixtralRMSNorm.forward`: x.to(fp32), pow(2).mean, rsqrt, x32 * rstd (a local until it returns), then
        `weight * normed.to(input_dtype)`. For an fp32 input the casts are no-ops: `_Writer.rmsnorm`. For a 16-bit
        one: pow and x32 * rstd save the fp32 copy, rsqrt its result, the weight product the 16-bit normed x."""
        if x.dtype == "fp32":
            return super().rmsnorm(name, x)
        B, T, D = x.shape
        t = lambda suffix, dt, shape=x.shape: self.t(f"{name}.{suffix}", shape, dt)  # noqa: E731
        (x32,) = self.op(f"{name}.upcast", "to_copy", [x], [t("upcast", "fp32")])
        # pow and mean, rsqrt, x32 * rstd; the backward holds three fp32 temporaries of x's shape at its highest
        normed32, rstd = self.op(f"{name}.normalise", "rmsnorm", [x32], [t("normed_fp32", "fp32"),
                                                                      self.t(f"{name}.rstd", (B, T, 1), "fp32", False)],
                                 saves=(x32.name, f"{name}.rstd", f"{name}.rstd", x32.name), flops=4 * B * T * D,
                                 bwd_workspace=tuple(t(f"grad_temp{i}", "fp32") for i in range(3)))
        (n16,) = self.op(f"{name}.downcast", "to_copy", [normed32], [t("normed", x.dtype)])
        (y,) = self.op(f"{name}.weight_mul", "mul", [n16], [t("out", x.dtype)], saves=(n16.name,),
                       params=(f"{name}.weight",), saved_params=(f"{name}.weight",), flops=B * T * D,
                       bwd_workspace=(self.t(f"{name}.grad_weight_temp", x.shape, x.dtype, False),))
        self.release(f"{name}.return", [normed32])  # `hidden_states`, a local until forward returns
        return y


def hf_mixtral_tape(cfg: TransformerConfig, setup: TrainingSetup, cpu: bool = False, ep_rank: int = 0) -> Tape:
    """`MixtralForCausalLM.forward(input_ids=idx, labels=idx)` (see the notes above); with expert parallelism
    (`setup.mesh.ep` > 1) the tape of expert-parallel rank `ep_rank` (models/parallel/expert.py): its own experts and
    its token dispatch and combine."""
    if setup.checkpointing.policy not in MIXTRAL_CHECKPOINTING:
        raise ConfigError("checkpointing", f"HF Mixtral (experts) is modelled without activation checkpointing, "
                                           f"not {setup.checkpointing.policy!r}; allowed: none")
    if cfg.experts_implementation == "eager" and setup.precision.autocast:
        raise ConfigError("experts_implementation", "the eager experts loop under torch.autocast (16-bit copies of "
                                                    "weight slices, not cached) is not modelled; allowed there: "
                                                    "grouped_mm")
    B, T, D, hd = setup.batch.micro_batch, setup.batch.seq_len, cfg.d_model, cfg.head_size
    params = transformer_params(cfg)
    if setup.mesh.ep > 1:  # Shard(0) of the experts' 3-D weights: this rank's E / ep experts
        local = tuple(p.name for p in params if p.name.endswith(EXPERT_WEIGHTS))
        params = [
            replace(p, shape=(p.shape[0] // setup.mesh.ep,) + p.shape[1:]) if p.name in local else p for p in params
        ]
        tape = ExpertParallelTape(params=params, ep=setup.mesh.ep, ep_rank=ep_rank, local_params=local)
    else:
        tape = Tape(params=params)
    w = _MixtralWriter(tape, setup, cpu)
    w.ep_rank = ep_rank
    idx = TensorSpec("batch.idx", (B, T), "int64", False)
    tape.inputs = [idx, TensorSpec("batch.targets", (B, T), "int64", False)]
    tape.buffers = [TensorSpec(f"model.rotary_emb.{n}", (hd // 2,), "fp32", False)
                    for n in ("inv_freq", "original_inv_freq")]
    emb_dt = w.fp32_op_dtype() if w.autocast else setup.precision.param
    (x,) = w.op("model.embed_tokens", "embedding", [idx], [w.t("model.embed_tokens.out", (B, T, D), emb_dt)],
                saves=(idx.name,), params=("model.embed_tokens.weight",))
    (pos,) = w.op("model.position_ids", "arange", [], [w.t("model.position_ids", (1, T), "int64", False)],
                  workspace=(w.t("model.position_ids.arange", (T,), "int64", False),))
    _packed_sequence_check(w, T)
    # MixtralRotaryEmbedding.forward: position_ids[..., None].float() * inv_freq, cat, cos / sin * scaling
    ws = (w.t("model.rotary_emb.freqs", (1, T, hd // 2), "fp32", False),
          w.t("model.rotary_emb.emb", (1, T, hd), "fp32", False),
          w.t("model.rotary_emb.raw", (1, T, hd), "fp32", False))
    cos, sin = w.op("model.rotary_emb", "rotary_tables", [pos], [w.t("model.rotary_emb.cos", (1, T, hd), emb_dt, False),
                                                              w.t("model.rotary_emb.sin", (1, T, hd), emb_dt, False)],
                    workspace=ws)
    embeds = x
    for i in range(cfg.n_layer):
        x = _decoder_layer(w, cfg, f"model.layers.{i}", x, cos, sin, i)
    x = w.rmsnorm("model.norm", x)
    w.release("model.return", [embeds, pos, cos, sin])  # locals of MixtralModel.forward
    head_weight = "model.embed_tokens.weight" if cfg.tied else "lm_head.weight"
    logits = w.linear("lm_head", x, cfg.vocab_size, False, weight=head_weight)
    hf_causal_lm_loss(w, logits, idx)
    w.release("causal_lm.return", [x])  # `hidden_states`, a local of MixtralForCausalLM.forward
    tape.held = (logits.name,) if setup.loop.holds_outputs else ()
    return tape


def _packed_sequence_check(w: HFWriter, T: int) -> None:
    """`find_packed_sequence_indices` on (1, T) positions: first position, (1, T+1) concatenation, diff,
    `!= 1`, cumsum. Temporaries only; the workspace is the largest set alive at one moment."""
    name = "model.packed_sequence_check"
    first, diff = w.t(f"{name}.first", (1, 1), "int64", False), w.t(f"{name}.diff", (1, T), "int64", False)
    with_prepend = (first, w.t(f"{name}.prepended", (1, T + 1), "int64", False), diff)
    with_cumsum = (first, diff, w.t(f"{name}.ne", (1, T), "bool", False), w.t(f"{name}.cumsum", (1, T), "int64", False))
    w.op(name, "cumsum", [], [], workspace=max(with_prepend, with_cumsum, key=lambda ts: sum(t.nbytes for t in ts)))


def _decoder_layer(w: HFWriter, cfg: TransformerConfig, h: str, x: TensorSpec, cos, sin, layer: int) -> TensorSpec:
    a = w.rmsnorm(f"{h}.input_layernorm", x)
    y = _attention(w, cfg, f"{h}.self_attn", a, cos, sin)
    h1 = w.add(f"{h}.attn_residual", x, y)
    m = w.rmsnorm(f"{h}.post_attention_layernorm", h1)
    return moe_block(w, cfg, h, m, layer, h1)


def _attention(w: HFWriter, cfg: TransformerConfig, p: str, a: TensorSpec, cos, sin) -> TensorSpec:
    B, T = a.shape[0], a.shape[1]
    H, Hkv, hd = cfg.n_head, cfg.kv_heads, cfg.head_size
    q = w.linear(f"{p}.q_proj", a, H * hd, False)
    k = w.linear(f"{p}.k_proj", a, Hkv * hd, False)
    v = w.linear(f"{p}.v_proj", a, Hkv * hd, False)
    q_rot, k_rot = (_rotate(w, f"{p}.rotary_{n}", t, heads, cos, sin) for n, t, heads in (("q", q, H), ("k", k, Hkv)))
    w.release(f"{p}.apply_rotary.return", [q, k])
    # SDPA under autocast casts its fp32 inputs (k, then q) to 16 bits; the casts are what it saves
    k_in, q_in = (w.autocast_input(f"{p}.sdpa.{n}", t) for n, t in (("k", k_rot), ("q", q_rot)))
    out, lse = w.op(f"{p}.sdpa", "sdpa", [q_in, k_in, v],
                    [w.t(f"{p}.sdpa.out", (B, T, H * hd)), w.t(f"{p}.sdpa.lse", (B, H, T), "fp32", False)],
                    saves=(q_in.name, k_in.name, v.name, f"{p}.sdpa.out", f"{p}.sdpa.lse"),
                    flops=4 * B * H * T * T * hd)
    y = w.linear(f"{p}.o_proj", out, cfg.d_model, False)
    w.release(f"{p}.return", [q_rot, k_rot, v, out, lse])
    return y


def _rotate(w: HFWriter, name: str, x: TensorSpec, heads: int, cos: TensorSpec, sin: TensorSpec) -> TensorSpec:
    """`x * cos + rotate_half(x) * sin` (apply_rotary_pos_emb): each product saves its table; the two products
    (in the promoted dtype) are temporaries, and rotate_half's cat of x's dtype lives until its product is made."""
    B, T, width = x.shape
    dt = "fp32" if "fp32" in (x.dtype, cos.dtype) else x.dtype
    shape = (B, heads, T, width // heads)
    (y,) = w.op(name, "rotary", [x, cos, sin], [w.t(f"{name}.out", shape, dt)], saves=(cos.name, sin.name),
                workspace=(w.t(f"{name}.x_cos", shape, dt, False), w.t(f"{name}.rot_sin", shape, dt, False)),
                bwd_workspace=(w.t(f"{name}.grad_temp", shape, dt, False),), flops=3 * B * T * width)
    return y
