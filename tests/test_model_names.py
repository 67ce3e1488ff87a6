"""Models by name and "did you mean" (issue 37): the bundled config.json files of current open models resolve offline,
by name or hub id, to the model their published architecture describes (its parameter count, from the config's
fields by each architecture's formula, written here); a hub id not bundled is read from the local hub cache; and
every name the user types that is none of the allowed ones is refused in one line that names the one meant."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

import pytest

from peakledger.cli import main
from peakledger.models.catalog import DATA, MODELS, parameters
from peakledger.models.config import ConfigError
from peakledger.models.names import normal
from peakledger.models.presets import PRESETS
from peakledger.models.traced.model import TracedModel
from peakledger.scenario import build_scenario

REPO = Path(__file__).resolve().parents[1]

NAMES = ("qwen2.5-3b", "qwen2.5-7b", "qwen2.5-14b", "qwen2.5-32b", "qwen3-0.6b", "qwen3-1.7b", "qwen3-4b", "qwen3-8b",
         "qwen3-14b", "qwen3-32b", "qwen3-30b-a3b", "llama-3.1-8b", "llama-3.1-70b-instruct", "llama-3.2-1b-instruct",
         "llama-3.2-3b", "gemma-2-2b-it", "gemma-2-9b-it", "gemma-3-1b-it", "phi-3.5-mini-instruct",
         "phi-4-mini-instruct", "mistral-7b-v0.3", "mistral-nemo-base-2407", "mixtral-8x7b-v0.1",
         "smollm2-135m-instruct", "smollm2-360m-instruct")


def published_parameters(c: dict) -> int:
    """The parameter count of a decoder-only model from its config.json, by its architecture's layout: the token
    embedding, each layer's attention (q, k, v, o projections; Qwen2's q/k/v biases; Qwen3's and Gemma 3's q/k
    RMSNorms over a head; Phi-3's fused qkv and gate_up), its MLP (gated: gate, up, down; a mixture of experts:
    that per expert plus the router), its RMSNorms (two; Gemma 2 and 3 four), the final norm, and the LM head unless
    tied to the embedding (Gemma ties by default: Gemma2Config / Gemma3TextConfig tie_word_embeddings=True)."""
    kind = c["model_type"]
    H, V, L = c["hidden_size"], c["vocab_size"], c["num_hidden_layers"]
    heads = c["num_attention_heads"]
    kv = c.get("num_key_value_heads") or heads
    d = c.get("head_dim") or H // heads
    q, k = heads * d, kv * d
    attention = H * q + 2 * H * k + q * H
    if kind == "qwen2":
        attention += q + 2 * k  # q_proj, k_proj, v_proj biases
    if kind in ("qwen3", "qwen3_moe", "gemma3_text"):
        attention += 2 * d  # q_norm, k_norm
    if kind == "qwen3_moe":
        E = c["num_experts"]
        mlp = E * 3 * H * c["moe_intermediate_size"] + H * E
    elif kind == "mixtral":
        E = c["num_local_experts"]
        mlp = E * 3 * H * c["intermediate_size"] + H * E
    else:
        mlp = 3 * H * c["intermediate_size"]
    norms = (4 if kind in ("gemma2", "gemma3_text") else 2) * H
    tied = c.get("tie_word_embeddings", kind in ("gemma2", "gemma3_text"))
    return V * H + L * (attention + mlp + norms) + H + (0 if tied else V * H)


def bundled(name: str) -> dict:
    return json.loads((REPO / "models" / "catalog" / "data" / f"{name}.json").read_text())


@pytest.fixture
def offline(tmp_path, monkeypatch):
    """An empty hub cache: only what is bundled resolves."""
    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    return cache


@pytest.mark.parametrize("name", NAMES)
def test_a_bundled_model_resolves_offline_to_its_published_parameter_count(name, offline):
    scenario = build_scenario({"preset": name}, {"micro_batch": 1, "seq_len": 16})
    assert isinstance(scenario.model, TracedModel) and scenario.name == name
    assert scenario.model.hf_dict() == bundled(name)
    assert parameters(scenario.model) == published_parameters(bundled(name))


def test_there_are_at_least_20_and_each_file_is_in_the_catalog():
    assert set(MODELS) == set(NAMES) and len(NAMES) >= 20
    assert {p.stem for p in DATA.glob("*.json")} == set(NAMES)
    assert all(MODELS[n].source for n in NAMES)


@pytest.mark.parametrize("given", ["Qwen/Qwen2.5-7B", "qwen/qwen2.5-7b", "QWEN2.5-7B", " qwen2.5-7b "])
def test_a_hub_id_or_name_in_any_case_is_the_same_model(given, offline):
    for source in ("preset", "hf_config"):
        model = build_scenario({source: given}, {"micro_batch": 1}).model
        assert model.hf_dict() == bundled("qwen2.5-7b") and model.name == "qwen2.5-7b"


def test_a_hub_id_not_bundled_is_read_from_the_local_hub_cache(tmp_path, monkeypatch):
    config = dict(bundled("smollm2-135m-instruct"), num_hidden_layers=2)
    folder = tmp_path / "hf" / "hub" / "models--Acme--Tiny-Llama"
    (folder / "refs").mkdir(parents=True)
    (folder / "refs" / "main").write_text("c0ffee\n")
    (folder / "snapshots" / "c0ffee").mkdir(parents=True)
    (folder / "snapshots" / "c0ffee" / "config.json").write_text(json.dumps(config))
    (folder / "snapshots" / "0ld").mkdir()  # another snapshot: refs/main says which is current
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    scenario = build_scenario({"preset": "acme/tiny-llama"}, {"micro_batch": 1})
    assert scenario.model.hf_dict() == config and scenario.name == "Tiny-Llama"
    assert parameters(scenario.model) == published_parameters(config)
    with pytest.raises(ConfigError) as e:
        build_scenario({"hf_config": "Acme/Tiny-Llama-2"})
    assert e.value.field == "hf_config" and str(tmp_path / "hf" / "hub") in str(e.value)


def test_model_names_stay_apart_once_case_and_punctuation_are_dropped():
    """A catalog name never shadows a preset, and no two names differ only by case or punctuation (a misspelling's
    suggestion is then one name)."""
    names = [*PRESETS, *MODELS]
    assert len({normal(n) for n in names}) == len(names)


def test_the_catalog_ships_with_the_package():
    tool = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert "peakledger.models.catalog" in tool["packages"]
    assert tool["package-data"]["peakledger.models.catalog"] == ["data/*.json"]


# three end to end: the simulation's parameters are the published count, held in bf16 (bf16-mixed's parameters)
@pytest.mark.parametrize("flags, name", [
    (["--preset", "qwen3-0.6b"], "qwen3-0.6b"),
    (["--hf-config", "HuggingFaceTB/SmolLM2-135M-Instruct"], "smollm2-135m-instruct"),
    (["--preset", "google/gemma-3-1b-it"], "gemma-3-1b-it"),
])
def test_a_named_model_simulates_with_its_published_parameters(flags, name, offline, capsys):
    code = main(["simulate", *flags, "--micro-batch", "1", "--seq-len", "16", "--steps", "1", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0 and out["scenario"] == name
    assert out["n_params"] == published_parameters(bundled(name))
    assert out["peak"]["live_by_category"]["parameter"] == 2 * published_parameters(bundled(name))


@pytest.mark.parametrize("argv, field, meant", [
    (["simulate", "--preset", "llama3-8b"], "preset", "'llama-3-8b'"),
    (["simulate", "--preset", "qwen2.5-7b-instruct"], "preset", "'qwen2.5-7b'"),
    (["simulate", "--preset", "gemma2-2b"], "preset", "'gemma-2-2b-it'"),
    (["simulate", "--hf-config", "Qwen/Qwen2.5-7B-Instruct"], "hf_config", "'Qwen/Qwen2.5-7B'"),
    (["simulate", "--preset", "tiny", "--precision", "bfloat16"], "precision", "'bf16'"),
    (["simulate", "--preset", "tiny", "--precision", "fp16"], "precision", "'fp16-mixed'"),
    (["simulate", "--preset", "tiny", "--device", "RTX4090"], "device", "'RTX-4090-24GB'"),
    (["simulate", "--preset", "tiny", "--device", "a100"], "device", "'A100-80GB' or 'A100-40GB'"),
    (["where", "--preset", "tiny", "--devices", "H100"], "devices", "'H100-80GB' or 'H100-PCIe-80GB'"),
    (["simulate", "--preset", "tiny", "--dp-engine", "fsdp", "--world-size", "2"], "dp_engine", "'fsdp2'"),
    (["simulate", "--preset", "tiny", "--dp-engine", "zero3"], "dp_engine", "'deepspeed'"),
    (["simulate", "--preset", "tiny", "--optimizer", "adamW"], "optimizer", "'adamw'"),
    (["simulate", "--preset", "tiny", "--optimizer", "adam8bit"], "optimizer", "'adam-8bit'"),
    (["compare", "--preset", "tiny", "--case", "a: micro_bach=2"], "micro_bach", "'micro_batch'"),
])
def test_a_misspelt_name_is_refused_in_one_line_naming_the_one_meant(argv, field, meant, offline, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"peakledger: error: {field}: ")
    assert err.endswith(f"; did you mean {meant}?\n")


@pytest.mark.parametrize("argv", [["simulate", "--preset", "tiny", "--device", "TPU-v5e"],
                                  ["simulate", "--preset", "bert-base"]])
def test_a_name_close_to_none_gets_no_guess(argv, offline, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "allowed:" in err and "did you mean" not in err


def test_peakledger_models_lists_each_with_its_parameters_and_source(offline, capsys):
    assert main(["models", "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert [r["name"] for r in listed["models"]] == [MODELS[n].name for n in MODELS]
    for row in listed["models"]:
        assert row["parameters"] == published_parameters(bundled(row["name"]))
        assert row["hub_id"] == MODELS[row["name"]].hub_id and row["source"].startswith("github.com/")
    assert listed["presets"] == list(PRESETS) and listed["hub_cache"] == str(offline)
    assert main(["models"]) == 0
    text = capsys.readouterr().out
    assert all(f"\n{n} " in text for n in NAMES)
