"""Parameter names and shapes as `named_parameters()` lists them: nanoGPT's for gpt2, HF's for llama
(`transformer_params`, with MoE experts), and the MLP's `nn.Sequential` (`mlp_params`).
"""

from __future__ import annotations

from ..config import MLPConfig, TransformerConfig
from ..moe import moe_params
from ..tape import ParamSpec


def transformer_params(cfg: TransformerConfig) -> list[ParamSpec]:
    """Parameters in registration order; a tied output embedding is not listed twice."""
    D, F, V = cfg.d_model, cfg.ffn, cfg.vocab_size
    kv, A = cfg.kv_heads * cfg.head_size, cfg.attn_dim
    ps: list[ParamSpec] = []
    if cfg.architecture == "gpt2":
        ps += [ParamSpec("transformer.wte.weight", (V, D)), ParamSpec("transformer.wpe.weight", (cfg.max_seq_len, D))]
        for i in range(cfg.n_layer):
            h = f"transformer.h.{i}"
            ps += norm_params(f"{h}.ln_1", D, cfg.has_bias)
            ps += linear_params(f"{h}.attn.c_attn", D, 2 * kv + D, cfg.has_bias)
            ps += linear_params(f"{h}.attn.c_proj", D, D, cfg.has_bias) + norm_params(f"{h}.ln_2", D, cfg.has_bias)
            ps += linear_params(f"{h}.mlp.c_fc", D, F, cfg.has_bias)
            ps += linear_params(f"{h}.mlp.c_proj", F, D, cfg.has_bias)
        ps += norm_params("transformer.ln_f", D, cfg.has_bias)
        if not cfg.tied:
            ps += [ParamSpec("lm_head.weight", (V, D))]
    else:
        ps += [ParamSpec("model.embed_tokens.weight", (V, D))]
        for i in range(cfg.n_layer):
            h = f"model.layers.{i}"
            qkv_bias, mlp_bias = cfg.has_bias, cfg.has_mlp_bias
            ps += linear_params(f"{h}.self_attn.q_proj", D, A, qkv_bias)
            ps += linear_params(f"{h}.self_attn.k_proj", D, kv, qkv_bias)
            ps += linear_params(f"{h}.self_attn.v_proj", D, kv, qkv_bias)
            ps += linear_params(f"{h}.self_attn.o_proj", A, D, cfg.has_out_bias)
            if cfg.num_local_experts:  # HF Mixtral's sparse MoE block (models/moe.py)
                ps += moe_params(cfg, h)
            else:
                ps += linear_params(f"{h}.mlp.gate_proj", D, F, mlp_bias)
                ps += linear_params(f"{h}.mlp.up_proj", D, F, mlp_bias)
                ps += linear_params(f"{h}.mlp.down_proj", F, D, mlp_bias)
            ps += [ParamSpec(f"{h}.input_layernorm.weight", (D,)),
                   ParamSpec(f"{h}.post_attention_layernorm.weight", (D,))]
        ps += [ParamSpec("model.norm.weight", (D,))]
        if not cfg.tied:
            ps += [ParamSpec("lm_head.weight", (V, D))]
    return ps


def linear_params(name: str, d_in: int, d_out: int, bias: bool) -> list[ParamSpec]:
    return [ParamSpec(f"{name}.weight", (d_out, d_in))] + ([ParamSpec(f"{name}.bias", (d_out,))] if bias else [])


def norm_params(name: str, d: int, bias: bool) -> list[ParamSpec]:
    return [ParamSpec(f"{name}.weight", (d,))] + ([ParamSpec(f"{name}.bias", (d,))] if bias else [])


def mlp_params(cfg: MLPConfig) -> list[ParamSpec]:
    dims = (cfg.d_in, *cfg.hidden, cfg.d_out)
    ps: list[ParamSpec] = []
    for i in range(len(dims) - 1):
        ps += linear_params(f"layers.{2 * i}", dims[i], dims[i + 1], cfg.bias)
    return ps
