"""Describer rows against published figures and scaling laws of the saved activations."""

from dataclasses import replace

import pytest

from peakledger.models.config import TrainingSetup
from peakledger.models.families import family_of
from peakledger.models.presets import PRESETS, preset
from peakledger.models.transformer import transformer_params
from peakledger.simulator.events import Action, Category, OptimizerState, Phase


def test_gpt2_parameter_count_matches_hf_with_tied_embedding_once():
    transformers = pytest.importorskip("transformers")
    import torch
    with torch.device("meta"):
        hf = transformers.GPT2LMHeadModel(transformers.GPT2Config())
    expected = sum(p.numel() for p in hf.parameters())
    ours = sum(p.numel for p in transformer_params(preset("gpt2")))
    assert ours == expected == 124_439_808  # the published GPT-2 small count
    names = [p.name for p in transformer_params(preset("gpt2"))]
    assert "lm_head.weight" not in names and len(names) == len(set(names))


def test_llama_parameter_count_matches_hf():
    transformers = pytest.importorskip("transformers")
    import torch
    cfg = preset("tiny-llama")
    hf_cfg = transformers.LlamaConfig(vocab_size=cfg.vocab_size, hidden_size=cfg.d_model, intermediate_size=cfg.ffn,
                                      num_hidden_layers=cfg.n_layer, num_attention_heads=cfg.n_head,
                                      num_key_value_heads=cfg.kv_heads, tie_word_embeddings=False)
    with torch.device("meta"):
        hf = transformers.LlamaForCausalLM(hf_cfg)
    assert {n: tuple(p.shape) for n, p in hf.named_parameters()} == {p.name: p.shape for p in transformer_params(cfg)}


def _forward_activations(log, step=1):
    return {e.block.name: e.block.nbytes for e in log.events
            if e.action is Action.ALLOC and e.block.category is Category.ACTIVATION
            and e.phase is Phase.FORWARD and e.step == step}


def test_sequence_x2_doubles_linear_terms_and_quadruples_eager_scores(sim):
    cfg = replace(preset("tiny"), attention="eager", max_seq_len=64)
    short = _forward_activations(sim(cfg, micro_batch=2, seq_len=12, steps=1))
    long = _forward_activations(sim(cfg, micro_batch=2, seq_len=24, steps=1))
    assert short.keys() == long.keys()
    h = "transformer.h.0"
    for linear_term in (f"{h}.ln_1.out", f"{h}.attn.v_contig", f"{h}.attn.merged", f"{h}.mlp.c_fc.out",
                        f"{h}.mlp.gelu.out", f"{h}.attn.q_contig"):
        assert long[linear_term] == 2 * short[linear_term], linear_term
    assert long[f"{h}.attn.softmax"] == 4 * short[f"{h}.attn.softmax"]
    ratios = {long[n] / short[n] for n in short if n != "loss.total_weight"}  # a scalar
    assert ratios <= {2.0, 4.0}


def test_sdpa_saves_logsumexp_not_scores(sim):
    cfg = replace(preset("tiny"), attention="sdpa")
    acts = _forward_activations(sim(cfg, micro_batch=2, seq_len=16, steps=1))
    assert not any("softmax" in n and "log_softmax" not in n for n in acts)
    B, H = 2, cfg.n_head
    # fp32 on a GPU profile: CUDA's memory-efficient kernel, whose logsumexp has ceil(T / 32) * 32 rows
    # (models/gpu.py sdpa_kernel; attention.cu); the CPU's flash kernel keeps T rows
    assert acts["transformer.h.0.attn.sdpa.lse"] == B * H * 32 * 4


def test_optimizer_state_is_created_lazily_at_the_first_step(sim):
    log = sim("tiny", micro_batch=1, seq_len=16, steps=2)
    first_opt = next(e.seq for e in log.events if e.phase is Phase.OPTIMIZER)
    creations = [e for e in log.events if e.action is Action.ALLOC and e.block.category is Category.OPTIMIZER_STATE]
    assert creations and all(e.seq >= first_opt and e.step == 1 for e in creations)


def test_adamw_state_rows_equal_two_moments_plus_step_scalars(sim):
    cfg = preset("tiny")
    log = sim(cfg, micro_batch=1, seq_len=16, steps=1)
    params = transformer_params(cfg)
    by_state = {}
    for e in log.events:
        if e.action is Action.ALLOC and e.block.category is Category.OPTIMIZER_STATE:
            by_state[e.block.state] = by_state.get(e.block.state, 0) + e.block.nbytes
    n = sum(p.numel for p in params)
    assert by_state == {OptimizerState.EXP_AVG: 4 * n, OptimizerState.EXP_AVG_SQ: 4 * n,
                        OptimizerState.STEP: 4 * len(params)}


def test_frozen_parameters_have_no_grad_and_no_state(sim):
    log = sim("tiny", micro_batch=1, seq_len=16, steps=1, frozen=("transformer.h.0.*",))
    touched = {e.block.name for e in log.events if e.block.category in (Category.GRADIENT, Category.OPTIMIZER_STATE)}
    assert touched and not any(n.startswith("transformer.h.0.") for n in touched)


def test_zero_stages_shard_the_right_rows(sim):
    rows = {}
    for stage in range(4):
        log = sim("tiny", micro_batch=1, seq_len=16, steps=1, precision="bf16-mixed", world_size=4, zero_stage=stage,
                  stage3_param_persistence_threshold=0)
        rows[stage] = {c: {e.block.shard_factor for e in log.events if e.block.category is c}
                       for c in (Category.PARAMETER, Category.GRADIENT, Category.MASTER_PARAMETER)}
    assert rows[0] == {c: {1} for c in rows[0]}
    assert rows[1][Category.MASTER_PARAMETER] == {4} and rows[1][Category.GRADIENT] == {1}
    assert rows[2][Category.GRADIENT] == {4} and rows[2][Category.PARAMETER] == {1}
    assert rows[3][Category.PARAMETER] == {4}


def test_presets_all_describe():
    for name in PRESETS:
        cfg = PRESETS[name]
        assert sum(p.numel for p in transformer_params(cfg)) > 0 if family_of(cfg).transformer else True


def test_effective_batch():
    assert TrainingSetup(micro_batch=4, grad_accum=8, world_size=16).effective_batch == 512


def test_hf_config_files_read_into_the_same_describer(tmp_path):
    transformers = pytest.importorskip("transformers")
    from peakledger.models.transformer.hf_config import load_hf_config
    path = tmp_path / "config.json"
    path.write_text(transformers.GPT2Config().to_json_string())
    cfg = load_hf_config(path)
    assert [(p.name, p.shape) for p in transformer_params(cfg)] == \
        [(p.name, p.shape) for p in transformer_params(preset("gpt2"))]
    llama = transformers.LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                                     num_attention_heads=32, num_key_value_heads=8, vocab_size=128256)
    path.write_text(llama.to_json_string())
    assert sum(p.numel for p in transformer_params(load_hf_config(path))) == \
        sum(p.numel for p in transformer_params(preset("llama-3-8b")))
