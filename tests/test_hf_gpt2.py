"""HF transformers' GPT-2 (GPT2LMHeadModel, random weights, nothing downloaded), simulated from its config.

Each case builds a small GPT2Config, reads it back through `from_hf_config` (implementation "hf"), runs
real CPU training steps on HF's own model under the exact allocation tracker, and holds the simulation
of the same scenario against it: the overall peak and every forward/backward phase peak within 1%, and
the static rows (parameters, gradients, optimizer states) equal to the byte.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

transformers = pytest.importorskip("transformers")

from realrun import assert_matches_real_run  # noqa: E402

from peakledger import build_scenario  # noqa: E402
from peakledger.analysis.validate import static_rows  # noqa: E402
from peakledger.cli import main  # noqa: E402
from peakledger.models.config import ConfigError, TransformerConfig  # noqa: E402
from peakledger.models.transformer import transformer_params  # noqa: E402
from peakledger.models.transformer.hf_config import from_hf_config  # noqa: E402
from peakledger.traces.reference import build_model  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]

TINY = dict(n_layer=2, n_embd=64, n_head=4, vocab_size=256, n_positions=64)


def hf_config_file(tmp_path: Path, attention: str, dropout: float, **extra) -> Path:
    """A config.json as HF's `save_pretrained` writes it (keys equal to GPT2Config's defaults left out),
    plus the attention implementation the model is built with."""
    config = transformers.GPT2Config(**TINY, resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout, **extra)
    data = json.loads(config.to_json_string())
    data["attn_implementation"] = attention
    path = tmp_path / "config.json"
    path.write_text(json.dumps(data))
    return path


CASES = [  # attention, dropout, precision, checkpointing
    ("eager", 0.0, "fp32", "none"),
    ("eager", 0.1, "bf16-autocast", "full"),
    ("sdpa", 0.0, "fp32", "full"),
    ("sdpa", 0.1, "bf16-autocast", "full"),  # SDPA's CPU math path (dropout), fp32 upcast, recompute
    ("sdpa", 0.1, "bf16", "none"),
]


@pytest.mark.parametrize("attention,dropout,precision,checkpointing", CASES, ids=lambda v: str(v))
def test_real_hf_gpt2_step_matches_the_simulation(tmp_path, attention, dropout, precision, checkpointing):
    path = hf_config_file(tmp_path, attention, dropout)
    scenario = build_scenario({"hf_config": str(path), "describer": "hand-written"},
                              {"micro_batch": 4, "seq_len": 64, "steps": 2, "precision": precision,
                               "optimizer": "sgd-momentum", "checkpointing": checkpointing})
    assert scenario.model.implementation == "hf" and scenario.model.attention == attention
    measured, simulated = assert_matches_real_run(scenario)
    assert static_rows(measured)["parameter"] > 0


def test_gpt2_config_reads_as_what_hf_builds():
    cfg = from_hf_config(transformers.GPT2Config(**TINY).to_dict(), name="tiny-hf")
    assert (cfg.implementation, cfg.attention, cfg.activation, cfg.dropout) == ("hf", "sdpa", "gelu_new", 0.1)
    model = build_model(cfg)
    assert type(model).__mro__[1] is transformers.GPT2LMHeadModel
    names = [(n, p.numel()) for n, p in model.named_parameters()]
    assert names == [(p.name, p.numel) for p in transformer_params(cfg)]
    assert model.config._attn_implementation == "sdpa" and not list(model.named_buffers())


@pytest.mark.parametrize("data,field", [
    ({"resid_pdrop": 0.1, "embd_pdrop": 0.0}, "resid_pdrop"),
    ({"activation_function": "relu"}, "activation_function"),
    ({"reorder_and_upcast_attn": True}, "reorder_and_upcast_attn"),
    ({"attn_implementation": "flash_attention_2"}, "attention"),
])
def test_hf_gpt2_options_outside_the_model_are_refused_by_field(data, field):
    with pytest.raises(ConfigError) as e:
        from_hf_config({"model_type": "gpt2", **TINY, **data})
    assert e.value.field == field


@pytest.mark.parametrize("kwargs,field", [
    (dict(implementation="keras"), "implementation"),
    (dict(implementation="hf", architecture="llama"), "implementation"),
    (dict(implementation="hf", n_kv_head=2), "n_kv_head"),
    (dict(implementation="hf", bias=False), "bias"),
    (dict(activation="gelu_new"), "activation"),  # nanoGPT runs nn.GELU()
    (dict(activation="swish", implementation="hf"), "activation"),
])
def test_transformer_config_implementation_fields_are_validated(kwargs, field):
    base = dict(name="x", architecture="gpt2", n_layer=2, d_model=64, n_head=4, vocab_size=256, max_seq_len=64)
    with pytest.raises(ConfigError) as e:
        TransformerConfig(**{**base, **kwargs})
    assert e.value.field == field


def test_cli_validates_the_committed_example_config(capsys):
    config = ROOT / "examples" / "hf-gpt2-tiny" / "config.json"
    rc = main(["validate", "--hf-config", str(config), "--precision", "fp32", "--micro-batch", "2",
               "--seq-len", "32", "--tolerance", "0.01"])
    assert rc == 0, capsys.readouterr()
