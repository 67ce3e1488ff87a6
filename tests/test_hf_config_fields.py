"""HF config.json keys read strictly, and the Llama-family keys that change the model: head_dim, mlp_bias,
attention_bias (Llama: q/k/v and o_proj), Qwen2's fixed q/k/v biases, attn_implementation.

Every wrong key is a ConfigError naming it ("hf_config.<key>"); every modelled key is checked twice: the
parameters against transformers' own model (built on the meta device, nothing downloaded), and a real
CPU training run of a tiny config against the simulation (peakledger.validation.validate, within 1%).
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
from realrun import assert_matches_real_run

from peakledger import build_scenario
from peakledger.models.config import ConfigError, TransformerConfig
from peakledger.models.transformer import transformer_params
from peakledger.models.transformer.hf_config import from_hf_config, load_hf_config
from peakledger.validation import validate

ROOT = Path(__file__).resolve().parents[1]

TINY = dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=176, vocab_size=256, max_position_embeddings=64)
GPT2_TINY = dict(model_type="gpt2", n_layer=2, n_embd=64, n_head=4, vocab_size=256, n_positions=64)

# tiny configs, one per key that changes the model
MODELLED = {
    "llama head_dim 24": dict(model_type="llama", head_dim=24),
    "mistral head_dim 32": dict(model_type="mistral", head_dim=32),
    "qwen2 head_dim 8": dict(model_type="qwen2", head_dim=8),
    "llama mlp_bias": dict(model_type="llama", mlp_bias=True),
    "llama attention_bias": dict(model_type="llama", attention_bias=True),
    "qwen2": dict(model_type="qwen2"),
    "llama eager": dict(model_type="llama", attn_implementation="eager"),
    "llama all": dict(model_type="llama", head_dim=24, mlp_bias=True, attention_bias=True,
                      attn_implementation="eager", tie_word_embeddings=True),
}


def llama_like(**extra) -> dict:
    return {"model_type": "llama", **TINY, **extra}


def refused(data: dict) -> ConfigError:
    with pytest.raises(ConfigError) as e:
        from_hf_config(data)
    return e.value


# -- strict types ---------------------------------------------------------------------------------

@pytest.mark.parametrize("data,key", [
    (llama_like(num_hidden_layers="32"), "num_hidden_layers"),
    (llama_like(hidden_size=[1]), "hidden_size"),
    (llama_like(num_attention_heads=4.0), "num_attention_heads"),
    (llama_like(num_key_value_heads=True), "num_key_value_heads"),
    (llama_like(head_dim="24"), "head_dim"),
    (llama_like(intermediate_size={"value": 176}), "intermediate_size"),
    (llama_like(vocab_size=256.5), "vocab_size"),
    (llama_like(max_position_embeddings="4096"), "max_position_embeddings"),
    (llama_like(num_hidden_layers=0), "num_hidden_layers"),
    ({**GPT2_TINY, "n_layer": "12"}, "n_layer"),
    ({**GPT2_TINY, "n_embd": 64.0}, "n_embd"),
    ({**GPT2_TINY, "n_inner": "256"}, "n_inner"),
    ({**GPT2_TINY, "n_positions": True}, "n_positions"),
])
def test_a_non_integer_where_an_integer_belongs_names_the_key(data, key):
    e = refused(data)
    assert e.field == f"hf_config.{key}"
    assert "must be a positive integer" in str(e) and str(e).startswith(f"hf_config.{key}: ")


@pytest.mark.parametrize("data,key", [
    (llama_like(tie_word_embeddings="false"), "tie_word_embeddings"),  # bool("false") is True: once read as tied
    (llama_like(attention_bias="true"), "attention_bias"),
    (llama_like(mlp_bias=1), "mlp_bias"),
    ({"model_type": "qwen2", **TINY, "tie_word_embeddings": 0}, "tie_word_embeddings"),
    ({**GPT2_TINY, "tie_word_embeddings": "false"}, "tie_word_embeddings"),
    ({**GPT2_TINY, "add_cross_attention": "false"}, "add_cross_attention"),
    ({**GPT2_TINY, "reorder_and_upcast_attn": 0}, "reorder_and_upcast_attn"),
])
def test_a_string_or_number_is_never_a_boolean(data, key):
    e = refused(data)
    assert e.field == f"hf_config.{key}" and "true or false" in str(e)


@pytest.mark.parametrize("data,key,words", [
    (llama_like(attention_dropout="0.0"), "attention_dropout", "a number in [0, 1)"),
    (llama_like(attention_dropout=True), "attention_dropout", "a number in [0, 1)"),
    (llama_like(attention_dropout=1.5), "attention_dropout", "a number in [0, 1)"),
    ({**GPT2_TINY, "resid_pdrop": "0.1"}, "resid_pdrop", "a number in [0, 1)"),
    (llama_like(attn_implementation=["eager"]), "attn_implementation", "a string"),
    ({**GPT2_TINY, "_attn_implementation": 1}, "_attn_implementation", "a string"),
    (llama_like(hidden_act=None, num_hidden_layers=None), "num_hidden_layers", "missing"),
    ({"model_type": "mistral", **{k: v for k, v in TINY.items() if k != "hidden_size"}}, "hidden_size", "missing"),
])
def test_other_wrong_keys_name_the_key(data, key, words):
    e = refused(data)
    assert e.field == f"hf_config.{key}" and words in str(e), str(e)


def test_null_means_left_out_and_defaults_are_transformers_own():
    cfg = from_hf_config({"model_type": "qwen2", **TINY, "head_dim": None, "num_key_value_heads": None,
                          "max_position_embeddings": None, "tie_word_embeddings": None})
    assert (cfg.head_dim, cfg.kv_heads, cfg.max_seq_len, cfg.tied) == (None, 4, 32768, False)
    assert from_hf_config(llama_like(max_position_embeddings=None)).max_seq_len == 2048  # configuration_llama.py


@pytest.mark.parametrize("data,field", [
    (llama_like(hidden_act="gelu"), "hf_config.hidden_act"),
    (llama_like(head_dim=23), "hf_config.head_dim"),  # rotary embeddings rotate half of a head
    (llama_like(num_key_value_heads=3), "hf_config.num_key_value_heads"),
    (llama_like(hidden_size=66), "hf_config.num_attention_heads"),  # LlamaConfig.validate_architecture
    (llama_like(attn_implementation="flash_attention_2"), "attention"),
    ({"model_type": "gemma", **TINY}, "model_type"),
    ({"model_type": ["llama"], **TINY}, "model_type"),
])
def test_values_outside_the_model_are_refused_by_key(data, field):
    e = refused(data)
    assert e.field == field, str(e)


def test_mistral_and_qwen2_build_what_their_modeling_files_build_for_indivisible_heads():
    """Only LlamaConfig refuses hidden_size % heads != 0; modeling_mistral.py builds hidden // heads heads."""
    cfg = from_hf_config({"model_type": "mistral", **TINY, "hidden_size": 66})
    assert (cfg.head_size, cfg.attn_dim) == (16, 64)


# -- TransformerConfig's own fields ---------------------------------------------------------------

@pytest.mark.parametrize("kwargs,field", [
    (dict(architecture="gpt2", head_dim=8), "head_dim"),  # gpt2 splits d_model into its heads
    (dict(architecture="gpt2", out_bias=False), "out_bias"),
    (dict(architecture="gpt2", mlp_bias=False), "mlp_bias"),
    (dict(head_dim="16"), "head_dim"),
    (dict(head_dim=0), "head_dim"),
    (dict(head_dim=7), "head_dim"),
    (dict(out_bias="false"), "out_bias"),
    (dict(mlp_bias=1), "mlp_bias"),
    (dict(d_model=66), "n_head"),  # without head_dim, n_head must divide d_model
])
def test_transformer_config_head_and_bias_fields_are_validated(kwargs, field):
    base = dict(name="x", architecture="llama", n_layer=2, d_model=64, n_head=4, vocab_size=256, max_seq_len=64)
    with pytest.raises(ConfigError) as e:
        TransformerConfig(**{**base, **kwargs})
    assert e.value.field == field


def test_head_dim_sets_the_attention_width():
    base = dict(name="x", architecture="llama", n_layer=2, d_model=66, n_head=4, vocab_size=256, max_seq_len=64)
    cfg = TransformerConfig(**base, head_dim=24, n_kv_head=2)
    assert (cfg.head_size, cfg.attn_dim) == (24, 96)
    shapes = {p.name: p.shape for p in transformer_params(cfg)}
    assert shapes["model.layers.0.self_attn.q_proj.weight"] == (96, 66)
    assert shapes["model.layers.0.self_attn.k_proj.weight"] == (48, 66)
    assert shapes["model.layers.0.self_attn.o_proj.weight"] == (66, 96)
    gpt2 = TransformerConfig(**{**base, "architecture": "gpt2", "d_model": 64}, head_dim=16)  # = d_model // n_head
    assert gpt2.head_size == 16


# -- parameters against transformers --------------------------------------------------------------

def _hf_meta_params(data: dict) -> dict[str, tuple[int, ...]]:
    transformers = pytest.importorskip("transformers")
    import torch
    keys = {k: v for k, v in data.items() if k != "model_type"}
    hf_cfg = transformers.AutoConfig.for_model(data["model_type"], **keys)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(hf_cfg)
    return {n: tuple(p.shape) for n, p in model.named_parameters()}


def test_mistral_nemo_parameter_count_matches_transformers():
    """Mistral-NeMo: hidden 5120, 32 heads of head_dim 128 (not 5120 / 32 = 160), 8 kv heads, 40 layers."""
    cfg = load_hf_config(ROOT / "examples" / "hf-mistral-nemo" / "config.json")
    assert cfg.head_dim == 128 and cfg.attn_dim == 4096
    ours = sum(p.numel for p in transformer_params(cfg))
    data = json.loads((ROOT / "examples" / "hf-mistral-nemo" / "config.json").read_text())
    hf = _hf_meta_params({k: v for k, v in data.items() if k != "architectures"})
    assert ours == sum(math.prod(s) for s in hf.values()) == 12_247_782_400
    ignoring_head_dim = dataclasses.replace(cfg, head_dim=None)  # what was simulated before head_dim was read
    assert sum(p.numel for p in transformer_params(ignoring_head_dim)) == 12_772_070_400


@pytest.mark.parametrize("name", list(MODELLED))
def test_parameters_match_transformers_and_the_reference_model(name):
    """Names and shapes of every parameter: ours = transformers' own model = the reference torch model."""
    from peakledger.traces.reference import build_model
    data = {**TINY, **MODELLED[name]}
    cfg = from_hf_config(data)
    ours = {p.name: p.shape for p in transformer_params(cfg)}
    hf = _hf_meta_params({k: v for k, v in data.items() if k != "attn_implementation"})
    if cfg.tied:
        hf.pop("lm_head.weight", None)
    assert ours == hf
    assert {n: tuple(p.shape) for n, p in build_model(cfg).named_parameters()} == ours


def test_bias_keys_follow_each_modeling_file():
    """modeling_llama.py: attention_bias on q, k, v and o_proj, mlp_bias on gate, up, down_proj;
    modeling_qwen2.py: q/k/v biases always (Qwen2Config has no attention_bias key), none on o_proj."""
    def biases(data):
        return sorted(p.name.split(".")[-2] for p in transformer_params(from_hf_config(data))
                      if p.name.startswith("model.layers.0.") and p.name.endswith(".bias"))

    assert biases(llama_like(attention_bias=True)) == ["k_proj", "o_proj", "q_proj", "v_proj"]
    assert biases(llama_like(mlp_bias=True)) == ["down_proj", "gate_proj", "up_proj"]
    assert biases({"model_type": "qwen2", **TINY}) == ["k_proj", "q_proj", "v_proj"]
    assert biases({"model_type": "qwen2", **TINY, "attention_bias": False}) == ["k_proj", "q_proj", "v_proj"]
    assert biases({"model_type": "mistral", **TINY, "attention_bias": True}) == []  # not a MistralConfig key


# -- real CPU runs --------------------------------------------------------------------------------

def _scenario(tmp_path: Path, data: dict, precision: str):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(data))
    return build_scenario({"hf_config": str(path), "describer": "hand-written"},
                          {"micro_batch": 4, "seq_len": 64, "steps": 2, "precision": precision, "optimizer": "adamw"})


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("name", list(MODELLED))
def test_real_cpu_run_matches_the_simulation(tmp_path, name, precision):
    scenario = _scenario(tmp_path, {**TINY, **MODELLED[name]}, precision)
    measured, simulated = assert_matches_real_run(scenario)


def test_eager_attn_implementation_is_honoured(tmp_path):
    """An eager Llama config once read as SDPA: -10.8% against the real eager run (fp32, B=4, T=64)."""
    scenario = _scenario(tmp_path, llama_like(attn_implementation="eager"), "fp32")
    assert scenario.model.attention == "eager"
    v, measured, _ = validate(scenario)
    as_sdpa = dataclasses.replace(scenario, model=dataclasses.replace(scenario.model, attention="sdpa"))
    before, _, _ = validate(as_sdpa, measured=measured)
    assert abs(v.overall.error) <= 0.01 < abs(before.overall.error)
    assert from_hf_config(llama_like(_attn_implementation="eager")).attention == "eager"
    assert from_hf_config(llama_like()).attention == "sdpa"  # what LlamaForCausalLM picks when the file says none


def test_cli_validates_the_llama_example_config(capsys):
    """`peakledger validate --hf-config examples/hf-llama-tiny/config.json --tolerance 0.01`: head_dim 24
    (not 64 / 4), attention_bias, mlp_bias, eager attention, GQA."""
    from peakledger.cli import main
    config = ROOT / "examples" / "hf-llama-tiny" / "config.json"
    rc = main(["validate", "--hf-config", str(config), "--precision", "fp32", "--micro-batch", "2",
               "--seq-len", "32", "--tolerance", "0.01"])
    assert rc == 0, capsys.readouterr()
