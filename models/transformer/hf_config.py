"""HF `config.json` files read into the hand-written describers' `TransformerConfig` (`from_hf_config`), and a
hand-written config's HF equivalent (`hf_equivalent`, what a compiled preset runs as). The three transformer
families (models/families/: nanogpt, hf-gpt2, mixtral) read and write their configs here.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from pydantic_core import PydanticUndefined

from ...simulator import strict_json
from ..config import ATTENTION, GPT2_ACTIVATIONS, ConfigError, TransformerConfig, read_config_file
from ..fields import keys_of

# -- HF config.json files -------------------------------------------------------------------------
#
# The keys read from a config.json, with their types, checked strictly (pydantic strict mode): "32" is not
# an integer, 32.0 is not an integer, true is not a number, and a string is never a boolean ("false" is
# not false). A null value counts as left out (HF writes null for unset options). Each wrong key is a
# ConfigError naming it, "hf_config.<key>", with what it must be. Keys not listed are not read.

PositiveInt = Annotated[int, Field(gt=0)]
Rate = Annotated[float, Field(ge=0.0, lt=1.0)]


def _key(words: str, default=PydanticUndefined, **kw):
    """A config.json key: `words` says what it must be (for the error message); no default = required."""
    return Field(default, description=words, **kw)


INT, OPT_INT = "a positive integer", "a positive integer (or null)"
BOOL, RATE, STR = "true or false (a JSON boolean)", "a number in [0, 1)", "a string"


class _HFKeys(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False, frozen=True)

    attn_implementation: str | None = _key(STR, None)
    attn_implementation_private: str | None = _key(STR, None, alias="_attn_implementation")

    @classmethod
    def read(cls, data: dict):
        """The keys of `data`, checked; the first wrong or missing one is a ConfigError naming it."""
        try:
            return cls.model_validate({k: v for k, v in data.items() if v is not None})
        except ValidationError as e:
            error = e.errors()[0]
            key = str(error["loc"][0])
            field = next(f for name, f in cls.model_fields.items() if key in (name, f.alias))
            if error["type"] == "missing":
                raise ConfigError(f"hf_config.{key}", f"missing: a {data.get('model_type')} config.json must give it "
                                                      f"({field.description})") from None
            value = error["input"]
            raise ConfigError(f"hf_config.{key}", f"must be {field.description}, got {value!r} "
                                                  f"({type(value).__name__})") from None

    def attention(self, default: str = "sdpa") -> str:
        """`attn_implementation` (or `_attn_implementation`): "eager" or "sdpa"; a config.json that names
        none gets what HF picks on torch >= 2.1.1, "sdpa" (files rarely say)."""
        value = self.attn_implementation or self.attn_implementation_private or default
        if value not in ATTENTION:
            raise ConfigError("attention", f"hf_config.attn_implementation {value!r} is not modelled; "
                                           f"allowed: {', '.join(ATTENTION)}")
        return value


class HFGPT2Keys(_HFKeys):
    """GPT2Config's keys and defaults (configuration_gpt2.py): save_pretrained may leave out keys equal to them."""

    n_layer: PositiveInt = _key(INT, 12)
    n_embd: PositiveInt = _key(INT, 768)
    n_head: PositiveInt = _key(INT, 12)
    vocab_size: PositiveInt = _key(INT, 50257)
    n_positions: PositiveInt | None = _key(OPT_INT, None)
    n_ctx: PositiveInt | None = _key(OPT_INT, None)
    n_inner: PositiveInt | None = _key(OPT_INT, None)
    resid_pdrop: Rate = _key(RATE, 0.1)
    embd_pdrop: Rate = _key(RATE, 0.1)
    attn_pdrop: Rate = _key(RATE, 0.1)
    activation_function: str = _key(STR, "gelu_new")
    tie_word_embeddings: bool = _key(BOOL, True)
    add_cross_attention: bool = _key(BOOL, False)
    reorder_and_upcast_attn: bool = _key(BOOL, False)


class HFDecoderKeys(_HFKeys):
    """The keys a Mistral or Qwen2 config.json is read by (configuration_mistral.py, configuration_qwen2.py).
    The shape keys are required: transformers' own config.json files always carry them."""

    num_hidden_layers: PositiveInt = _key(INT)
    hidden_size: PositiveInt = _key(INT)
    num_attention_heads: PositiveInt = _key(INT)
    num_key_value_heads: PositiveInt | None = _key(OPT_INT, None)  # None: num_attention_heads
    head_dim: PositiveInt | None = _key(OPT_INT, None)  # None: hidden_size // num_attention_heads
    intermediate_size: PositiveInt = _key(INT)
    vocab_size: PositiveInt = _key(INT)
    max_position_embeddings: PositiveInt = _key(INT, 4096 * 32)  # configuration_mistral.py's default
    tie_word_embeddings: bool = _key(BOOL, False)
    attention_dropout: Rate = _key(RATE, 0.0)
    hidden_act: str = _key(STR, "silu")


class HFQwen2Keys(HFDecoderKeys):
    max_position_embeddings: PositiveInt = _key(INT, 32768)  # configuration_qwen2.py's default


class HFLlamaKeys(HFDecoderKeys):
    """LlamaConfig adds the bias switches (configuration_llama.py)."""

    max_position_embeddings: PositiveInt = _key(INT, 2048)
    attention_bias: bool = _key(BOOL, False)
    mlp_bias: bool = _key(BOOL, False)


class HFMixtralKeys(HFDecoderKeys):
    """MixtralConfig's MoE keys and defaults (configuration_mixtral.py)."""

    num_local_experts: PositiveInt = _key(INT, 8)
    num_experts_per_tok: PositiveInt = _key(INT, 2)
    output_router_logits: bool = _key(BOOL, False)
    router_jitter_noise: Rate = _key(RATE, 0.0)
    sliding_window: PositiveInt | None = _key(OPT_INT, None)
    experts_implementation: str | None = _key(STR, None)  # from_pretrained's kwarg; None: transformers' default


HF_DECODERS = {"llama": HFLlamaKeys, "mistral": HFDecoderKeys, "qwen2": HFQwen2Keys}
SILU_NAMES = ("silu", "swish")  # transformers' ACT2FN: both are SiLU

# TransformerConfig's fields by the config.json key they come from, so that an error a TransformerConfig
# raises (n_kv_head not dividing n_head, an odd head width) names the key
DECODER_KEYS = dict(n_layer="num_hidden_layers", d_model="hidden_size", n_head="num_attention_heads",
                    n_kv_head="num_key_value_heads", head_dim="head_dim", d_ff="intermediate_size",
                    vocab_size="vocab_size", max_seq_len="max_position_embeddings", dropout="attention_dropout")
GPT2_KEYS = dict(n_layer="n_layer", d_model="n_embd", n_head="n_head", vocab_size="vocab_size",
                 max_seq_len="n_positions", d_ff="n_inner", dropout="resid_pdrop")


def from_hf_config(data: dict, name: str = "hf") -> TransformerConfig:
    """Read a HF transformers config dict (GPT-2, Llama, Mistral, Qwen2-style) into a TransformerConfig.

    GPT-2 configs describe HF's own GPT2LMHeadModel (`implementation="hf"`); see `_hf_gpt2`. Llama,
    Mistral and Qwen2 configs become architecture "llama" (`_hf_decoder`).
    """
    if not isinstance(data, dict):
        raise ConfigError("hf_config", f"must be a JSON object, got {type(data).__name__}")
    model_type = data.get("model_type")
    if model_type == "gpt2":
        return _hf_gpt2(data, name)
    if isinstance(model_type, str) and model_type in HF_DECODERS:
        return _hf_decoder(data, model_type, name)
    if model_type == "mixtral":
        return _hf_mixtral(data, name)
    raise ConfigError("model_type", f"unsupported HF model_type {model_type!r}; allowed: gpt2, "
                                    f"{', '.join(HF_DECODERS)}, mixtral")


MIXTRAL_KEYS = dict(DECODER_KEYS, num_local_experts="num_local_experts", num_experts_per_tok="num_experts_per_tok",
                    experts_implementation="experts_implementation")


def _hf_mixtral(data: dict, name: str) -> TransformerConfig:
    """A Mixtral config.json as MixtralForCausalLM (models/hf_mixtral.py): no biases, experts `intermediate_size`
    wide. Options that change the program beyond what is modelled are refused: the router's aux loss
    (`output_router_logits`), router jitter, a sliding-window mask."""
    keys = HFMixtralKeys.read(data)
    if keys.hidden_act not in SILU_NAMES:
        raise ConfigError("hf_config.hidden_act", f"{keys.hidden_act!r} is not modelled: Mixtral's experts run a gated "
                                                  f"SiLU; allowed: {', '.join(SILU_NAMES)}")
    for key, off in (("output_router_logits", False), ("router_jitter_noise", 0.0), ("sliding_window", None)):
        if getattr(keys, key) != off:
            raise ConfigError(f"hf_config.{key}", f"{getattr(keys, key)!r} is not modelled for Mixtral; allowed: "
                                                  f"{json.dumps(off)}")
    fields = dict(
        name=name, architecture="llama", implementation="hf", n_layer=keys.num_hidden_layers, d_model=keys.hidden_size,
        n_head=keys.num_attention_heads, n_kv_head=keys.num_key_value_heads, head_dim=keys.head_dim,
        d_ff=keys.intermediate_size, vocab_size=keys.vocab_size, max_seq_len=keys.max_position_embeddings,
        tied_embeddings=keys.tie_word_embeddings, dropout=float(keys.attention_dropout), attention=keys.attention(),
        num_local_experts=keys.num_local_experts, num_experts_per_tok=keys.num_experts_per_tok,
        experts_implementation=keys.experts_implementation)
    return _config(fields, MIXTRAL_KEYS)


def _hf_decoder(data: dict, model_type: str, name: str) -> TransformerConfig:
    """A Llama, Mistral or Qwen2 config.json as the model its transformers modeling file builds.

    Heads are `head_dim` wide where the file says (modeling_llama.py / _mistral.py / _qwen2.py:
    `getattr(config, "head_dim", ...)`), else hidden_size // num_attention_heads. Biases:
    modeling_llama.py puts `attention_bias` on q, k, v and o_proj and `mlp_bias` on gate, up and
    down_proj; modeling_qwen2.py always has q/k/v biases and none on o_proj or the MLP;
    modeling_mistral.py has none. `attn_implementation` picks the attention, "sdpa" when not given.
    """
    keys = HF_DECODERS[model_type].read(data)
    window = _sliding_window(data, model_type)
    if window is not None and window < keys.max_position_embeddings:  # (a window no sequence exceeds binds nothing)
        raise ConfigError("hf_config.sliding_window", f"{window}: the hand-written describer does not model "
                                                      "sliding-window attention (its mask and what SDPA saves); the "
                                                      "traced describer runs transformers' own class (the default for "
                                                      "an HF config, without tp / pp / cp / ep / QLoRA)")
    if keys.hidden_act not in SILU_NAMES:
        raise ConfigError("hf_config.hidden_act", f"{keys.hidden_act!r} is not modelled: the llama family runs a "
                                                  f"gated SiLU MLP; allowed: {', '.join(SILU_NAMES)}")
    head_dim = keys.head_dim
    if keys.hidden_size % keys.num_attention_heads:
        if model_type == "llama":  # configuration_llama.py: validate_architecture
            raise ConfigError("hf_config.num_attention_heads", f"{keys.num_attention_heads} must divide hidden_size "
                                                               f"{keys.hidden_size} (LlamaConfig refuses it otherwise)")
        head_dim = head_dim or keys.hidden_size // keys.num_attention_heads  # what the modeling file builds
    llama = model_type == "llama"
    fields = dict(
        name=name, architecture="llama", n_layer=keys.num_hidden_layers, d_model=keys.hidden_size,
        n_head=keys.num_attention_heads, n_kv_head=keys.num_key_value_heads, head_dim=head_dim,
        d_ff=keys.intermediate_size, vocab_size=keys.vocab_size, max_seq_len=keys.max_position_embeddings,
        tied_embeddings=keys.tie_word_embeddings, dropout=float(keys.attention_dropout),
        attention=keys.attention(),
        # q/k/v biases: Llama's attention_bias, always in Qwen2; o_proj's: Llama's attention_bias only
        bias=keys.attention_bias if llama else model_type == "qwen2",
        out_bias=keys.attention_bias if llama else False,
        mlp_bias=keys.mlp_bias if llama else False)
    return _config(fields, DECODER_KEYS)


def _sliding_window(data: dict, model_type: str) -> int | None:
    """The sliding window a config turns on, as transformers reads it: configuration_mistral.py defaults
    `sliding_window` to 4096 (None turns it off); configuration_qwen2.py applies it only with
    `use_sliding_window`; Llama has none."""
    if model_type == "mistral":
        window = data.get("sliding_window", 4096)
    elif model_type == "qwen2" and data.get("use_sliding_window"):
        window = data.get("sliding_window", 4096)
    else:
        window = None
    return window if isinstance(window, int) and not isinstance(window, bool) else None


def _config(fields: dict, keys: dict[str, str]) -> TransformerConfig:
    """`TransformerConfig(**fields)`; an error about a field read from the file names its key."""
    try:
        return TransformerConfig(**fields)
    except ConfigError as e:
        if e.field not in keys:
            raise
        message = str(e)[len(e.field) + 2:]
        raise ConfigError(f"hf_config.{keys[e.field]}", message) from None


GPT2_DROPOUTS = ("resid_pdrop", "embd_pdrop", "attn_pdrop")


def _hf_gpt2(data: dict, name: str) -> TransformerConfig:
    """A GPT-2 config.json as the model HF builds from it.

    Missing keys take GPT2Config's defaults. The attention is `attn_implementation` when the file names
    one, else "sdpa": what `GPT2LMHeadModel(config)` picks on torch >= 2.1.1 (config.json files rarely
    say). The three dropout rates become one `dropout`: the byte count depends only on whether a rate is
    zero, so rates that disagree on that are refused. Options that change the graph beyond what is
    modelled (cross-attention, reordered fp32 attention) are refused too.
    """
    keys = HFGPT2Keys.read(data)
    rates = {k: float(getattr(keys, k)) for k in GPT2_DROPOUTS}
    if len({r > 0 for r in rates.values()}) > 1:
        raise ConfigError("resid_pdrop", f"HF GPT-2 dropout rates {rates} mix zero and non-zero; peakledger "
                                         "models one rate for all three: set them all to zero or all above zero")
    for key in ("add_cross_attention", "reorder_and_upcast_attn"):
        if getattr(keys, key):
            raise ConfigError(key, "not modelled for HF GPT-2; allowed: false")
    activation = keys.activation_function
    if activation not in GPT2_ACTIVATIONS:
        raise ConfigError("activation_function",
                          f"{activation!r} is not one the hand-written GPT-2 describer models (allowed: "
                          f"{', '.join(GPT2_ACTIVATIONS)}); transformers takes it, and the traced describer (the "
                          "default for an HF config, without tp / pp / cp / ep / QLoRA) describes it")
    fields = dict(
        name=name, architecture="gpt2", implementation="hf", n_layer=keys.n_layer, d_model=keys.n_embd,
        n_head=keys.n_head, vocab_size=keys.vocab_size, max_seq_len=keys.n_positions or keys.n_ctx or 1024,
        d_ff=keys.n_inner, dropout=rates["resid_pdrop"], attention=keys.attention(), activation=activation,
        tied_embeddings=keys.tie_word_embeddings)
    return _config(fields, GPT2_KEYS)


HAND_WRITTEN_HF = ("gpt2", *HF_DECODERS, "mixtral")  # the model types the hand-written describers read


def read_hf_json(path: str | Path) -> dict:
    """A config.json's object (bounded, checked to be a JSON object)."""
    path = Path(path)
    data = read_config_file(path, "hf_config", strict_json.loads, json.JSONDecodeError, "JSON")
    if not isinstance(data, dict):
        raise ConfigError("hf_config", f"{path} must hold a JSON object")
    return data


def load_hf_config(path: str | Path, name: str | None = None) -> TransformerConfig:
    """The config.json at `path` as a TransformerConfig named `name` (None: the file's name, or its folder's)."""
    path = Path(path)
    return from_hf_config(read_hf_json(path), name=name or (path.stem if path.stem != "config" else
                                                            path.parent.name or "hf"))


# -- a hand-written config's HF equivalent ----------------------------------------------------------------------

KEYS = {name: key for key, name in keys_of(TransformerConfig).items()}  # a field as messages name it
_SAME = ("architecture", "n_layer", "d_model", "n_head", "kv_heads", "head_size", "ffn", "vocab_size", "max_seq_len",
         "tied", "has_bias", "has_out_bias", "has_mlp_bias", "dropout", "attention", "mlp_activation",
         "num_local_experts", "num_experts_per_tok")


def hf_equivalent(cfg: TransformerConfig) -> dict:
    """The HF config.json of the model transformers builds with `cfg`'s architecture: GPT2LMHeadModel
    (architecture gpt2), LlamaForCausalLM (llama), MixtralForCausalLM (llama with experts), read back by
    `from_hf_config` to the same sizes, biases, tying, dropout and attention (checked: `_SAME`), else a ConfigError
    naming the first field that differs. What only a traced model has (torch.compile's program) runs a preset as this
    equivalent: a nanoGPT-style preset becomes HF's code of the same shapes. The transformer families' hook
    (`Family.hf_equivalent`, models/families/transformer.py); the other families have none."""
    if cfg.architecture == "gpt2":
        data = {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "n_layer": cfg.n_layer,
                "n_embd": cfg.d_model, "n_head": cfg.n_head, "n_inner": cfg.d_ff, "vocab_size": cfg.vocab_size,
                "n_positions": cfg.max_seq_len, "activation_function": cfg.mlp_activation,
                "resid_pdrop": cfg.dropout, "embd_pdrop": cfg.dropout, "attn_pdrop": cfg.dropout,
                "tie_word_embeddings": cfg.tied, "attn_implementation": cfg.attention}
    else:
        experts = cfg.num_local_experts is not None
        data = {"model_type": "mixtral" if experts else "llama",
                "architectures": ["MixtralForCausalLM" if experts else "LlamaForCausalLM"],
                "num_hidden_layers": cfg.n_layer, "hidden_size": cfg.d_model, "num_attention_heads": cfg.n_head,
                "num_key_value_heads": cfg.kv_heads, "head_dim": cfg.head_size, "intermediate_size": cfg.ffn,
                "vocab_size": cfg.vocab_size, "max_position_embeddings": cfg.max_seq_len,
                "tie_word_embeddings": cfg.tied, "attention_dropout": cfg.dropout,
                "attn_implementation": cfg.attention, "hidden_act": "silu"}
        if experts:
            data.update(num_local_experts=cfg.num_local_experts, num_experts_per_tok=cfg.num_experts_per_tok,
                        sliding_window=None)
        else:
            data.update(attention_bias=cfg.has_bias, mlp_bias=cfg.has_mlp_bias)
    back = from_hf_config(data, cfg.name)
    for key in _SAME:
        if getattr(back, key) != getattr(cfg, key):
            raise ConfigError("model", f"{cfg.name} has no HF equivalent: transformers' "
                                       f"{data['architectures'][0]} would have {KEYS.get(key, key)} "
                                       f"{getattr(back, key)!r}, the preset {getattr(cfg, key)!r}")
    return {k: v for k, v in data.items() if v is not None}
