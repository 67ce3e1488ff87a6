"""Named model configs, and HF `config.json` files read into the same `TransformerConfig`.

Figures are the published architectures (layer count, widths, heads, vocabulary); weights are never
downloaded: describers need shapes only, and reference torch models are built with random weights.
"""

from __future__ import annotations

import json
from pathlib import Path

from .config import GPT2_ACTIVATIONS, ConfigError, MLPConfig, TransformerConfig, read_config_file

PRESETS: dict[str, TransformerConfig | MLPConfig] = {
    "tiny": TransformerConfig(name="tiny", family="gpt2", n_layer=2, d_model=64, n_head=4, vocab_size=256,
                              max_seq_len=64, attention="eager"),
    "tiny-llama": TransformerConfig(name="tiny-llama", family="llama", n_layer=2, d_model=64, n_head=4,
                                    n_kv_head=2, d_ff=176, vocab_size=256, max_seq_len=64),
    "tiny-mlp": MLPConfig(name="tiny-mlp", d_in=512, hidden=(512, 512), d_out=512),
    "gpt2": TransformerConfig(name="gpt2", family="gpt2", n_layer=12, d_model=768, n_head=12,
                              vocab_size=50257, max_seq_len=1024),
    "gpt2-medium": TransformerConfig(name="gpt2-medium", family="gpt2", n_layer=24, d_model=1024, n_head=16,
                                     vocab_size=50257, max_seq_len=1024),
    "llama-3-8b": TransformerConfig(name="llama-3-8b", family="llama", n_layer=32, d_model=4096, n_head=32,
                                    n_kv_head=8, d_ff=14336, vocab_size=128256, max_seq_len=8192),
    "llama-3-70b": TransformerConfig(name="llama-3-70b", family="llama", n_layer=80, d_model=8192, n_head=64,
                                     n_kv_head=8, d_ff=28672, vocab_size=128256, max_seq_len=8192),
    "mistral-7b": TransformerConfig(name="mistral-7b", family="llama", n_layer=32, d_model=4096, n_head=32,
                                    n_kv_head=8, d_ff=14336, vocab_size=32000, max_seq_len=32768),
}


def preset(name: str) -> TransformerConfig | MLPConfig:
    try:
        return PRESETS[name]
    except KeyError:
        raise ConfigError("preset", f"unknown preset {name!r}; allowed: {', '.join(PRESETS)}") from None


def _get(cfg: dict, *keys: str, default=None):
    for k in keys:
        if k in cfg and cfg[k] is not None:
            return cfg[k]
    return default


def from_hf_config(data: dict, name: str = "hf") -> TransformerConfig:
    """Read a HF transformers config dict (GPT-2, Llama, Mistral, Qwen2-style) into a TransformerConfig.

    GPT-2 configs describe HF's own GPT2LMHeadModel (`implementation="hf"`); see `_hf_gpt2`.
    """
    model_type = data.get("model_type")
    if model_type == "gpt2":
        return _hf_gpt2(data, name)
    if model_type in ("llama", "mistral", "qwen2"):
        return TransformerConfig(
            name=name, family="llama", n_layer=_get(data, "num_hidden_layers"), d_model=_get(data, "hidden_size"),
            n_head=_get(data, "num_attention_heads"), n_kv_head=_get(data, "num_key_value_heads"),
            d_ff=_get(data, "intermediate_size"), vocab_size=_get(data, "vocab_size"),
            max_seq_len=_get(data, "max_position_embeddings", default=4096),
            tied_embeddings=bool(_get(data, "tie_word_embeddings", default=False)),
            bias=bool(_get(data, "attention_bias", default=False)) or None,
            dropout=float(_get(data, "attention_dropout", default=0.0)))
    raise ConfigError("model_type", f"unsupported HF model_type {model_type!r}; allowed: gpt2, llama, mistral, qwen2")


# GPT2Config's defaults: `save_pretrained` leaves out keys that equal them
GPT2_DEFAULTS = dict(n_layer=12, n_embd=768, n_head=12, vocab_size=50257, resid_pdrop=0.1,
                     embd_pdrop=0.1, attn_pdrop=0.1, activation_function="gelu_new", tie_word_embeddings=True)
GPT2_DROPOUTS = ("resid_pdrop", "embd_pdrop", "attn_pdrop")


def _hf_gpt2(data: dict, name: str) -> TransformerConfig:
    """A GPT-2 config.json as the model HF builds from it.

    Missing keys take GPT2Config's defaults. The attention is `attn_implementation` when the file names
    one, else "sdpa": what `GPT2LMHeadModel(config)` picks on torch >= 2.1.1 (config.json files rarely
    say). The three dropout rates become one `dropout`: the byte count depends only on whether a rate is
    zero, so rates that disagree on that are refused. Options that change the graph beyond what is
    modelled (cross-attention, reordered fp32 attention) are refused too.
    """
    cfg = {**GPT2_DEFAULTS, **{k: v for k, v in data.items() if v is not None}}
    rates = {k: _rate(cfg, k) for k in GPT2_DROPOUTS}
    if len({r > 0 for r in rates.values()}) > 1:
        raise ConfigError("resid_pdrop", f"HF GPT-2 dropout rates {rates} mix zero and non-zero; peakledger "
                                         "models one rate for all three: set them all to zero or all above zero")
    for key in ("add_cross_attention", "reorder_and_upcast_attn"):
        if cfg.get(key):
            raise ConfigError(key, "not modelled for HF GPT-2; allowed: false")
    attention = cfg.get("attn_implementation") or cfg.get("_attn_implementation") or "sdpa"
    activation = cfg["activation_function"]
    if activation not in GPT2_ACTIVATIONS:
        raise ConfigError("activation_function",
                          f"unknown value {activation!r}; allowed: {', '.join(GPT2_ACTIVATIONS)}")
    return TransformerConfig(
        name=name, family="gpt2", implementation="hf", n_layer=cfg["n_layer"], d_model=cfg["n_embd"],
        n_head=cfg["n_head"], vocab_size=cfg["vocab_size"],
        max_seq_len=_get(cfg, "n_positions", "n_ctx", default=1024), d_ff=cfg.get("n_inner"),
        dropout=rates["resid_pdrop"], attention=attention, activation=activation,
        tied_embeddings=bool(cfg["tie_word_embeddings"]))


def _rate(cfg: dict, key: str) -> float:
    value = cfg[key]
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(key, f"must be a number in [0, 1), got {value!r}")
    return float(value)


def load_hf_config(path: str | Path) -> TransformerConfig:
    path = Path(path)
    data = read_config_file(path, "hf_config", json.loads, json.JSONDecodeError, "JSON")
    if not isinstance(data, dict):
        raise ConfigError("hf_config", f"{path} must hold a JSON object")
    return from_hf_config(data, name=path.stem if path.stem != "config" else path.parent.name or "hf")
