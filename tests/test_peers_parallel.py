"""Model-parallel peers: Megatron-LM's theoretical memory and llm-analysis, term by term from their sources,
on hand-computed cases, published figures, and the llama-3-70b tp 8 pp 4 world 64 case; where llm-analysis is
installed its column is its own LLMAnalysis.training, else its 0.2.2 formulas, labelled."""

from __future__ import annotations

import importlib.metadata
import json
import sys

import pytest
from tables import cell_equals

from peakledger.analysis.peers_parallel import (
    LLM_ANALYSIS,
    MEGATRON,
    MEGATRON_COMMIT,
    MEGATRON_DOCS_BYTES_PER_PARAM,
    llm_analysis_activation_per_layer,
    llm_analysis_layer_params,
    llm_analysis_training,
    megatron_activations,
    megatron_bytes_per_param,
    megatron_padded_vocab,
    megatron_pipeline_factor,
    megatron_weight_and_optimizer,
    parallel_peers,
    render_parallel_peers,
)
from peakledger.models.config import ConfigError, TrainingSetup
from peakledger.models.presets import preset

# -- Megatron-LM: megatron/training/theoretical_memory_usage.py -----------------------------------------------------

def test_padded_vocab_published():
    # GPT-2's 50257 tokens pad to 50304 in Megatron (a multiple of 128); Llama 3's 128256 is 1002 x 128, but with
    # tp 8 the multiple is 1024: ceil(128256 / 1024) = 126 -> 129024
    assert megatron_padded_vocab(50257, 1) == 50304
    assert megatron_padded_vocab(128256, 1) == 128256
    assert megatron_padded_vocab(128256, 8) == 129024


@pytest.mark.parametrize("d", [1, 2, 8, 64])
def test_bytes_per_param_is_the_docs_bf16_row(d):
    # Megatron docs (Distributed Optimizer): bf16 params + fp32 grads, 18 bytes, or 6 + 12/d distributed
    plain, dist = MEGATRON_DOCS_BYTES_PER_PARAM["bf16 params, fp32 grads"]
    assert megatron_bytes_per_param(False, d) == plain == 18
    assert megatron_bytes_per_param(True, d) == dist(d)
    assert megatron_bytes_per_param(True, 2) == 12


def test_megatron_weights_small_case():
    # h 4, ffn 8, L 2, a 2, kv 2, head_dim 2, LayerNorm (norm_size 2), tied, padded vocab 128:
    # attention 2 h h (1 + kv/a)(head_dim a / h) = 2*16*2*1 = 64; MLP 2 h ffn = 64; layernorms 2 h 2 = 16
    # tp-sharded block (64 + 64) * 2 = 256; replicated 16 * 2 + final norm 2*4 = 40; embedding 4 * 128 = 512
    kw = dict(h=4, ffn=8, layers=2, heads=2, kv_heads=2, head_dim=2, padded_vocab=128, swiglu=False, rmsnorm=False,
              untied=False)
    one = megatron_weight_and_optimizer(**kw, tp=1, pp=1, dp=1, distributed_optimizer=False)
    assert one["params_most_loaded_shard"] == 256 + 512 + 40 == 808
    assert one["bytes"] == 808 * 18
    # tp 2, pp 2: (256/2 + 512)/2 = 320 tp-sharded + 40/2 = 20 replicated = 340; d 4 distributed: 6 + 3 = 9 B
    two = megatron_weight_and_optimizer(**kw, tp=2, pp=2, dp=4, distributed_optimizer=True)
    assert two["params_most_loaded_shard"] == 340 and two["bytes"] == 340 * 9
    # untied: the output layer is counted on the only stage (pp 1), not on the first of several
    assert megatron_weight_and_optimizer(**{**kw, "untied": True}, tp=1, pp=1, dp=1,
                                         distributed_optimizer=False)["params_most_loaded_shard"] == 808 + 512
    assert megatron_weight_and_optimizer(**{**kw, "untied": True}, tp=2, pp=2, dp=4,
                                         distributed_optimizer=True)["params_most_loaded_shard"] == 340


def test_megatron_parameter_count_is_llama3_70b():
    # published: Llama-3-70B has 70,553,706,496 parameters (GQA 8 of 64 heads, SwiGLU 28672, RMSNorm, untied)
    cfg = preset("llama-3-70b")
    out = megatron_weight_and_optimizer(h=cfg.d_model, ffn=cfg.ffn, layers=cfg.n_layer, heads=cfg.n_head,
                                        kv_heads=cfg.kv_heads, head_dim=cfg.head_size, padded_vocab=cfg.vocab_size,
                                        tp=1, pp=1, dp=1, swiglu=True, rmsnorm=True, untied=True,
                                        distributed_optimizer=False)
    assert out["params_total"] == out["params_most_loaded_shard"] == 70_553_706_496


def test_megatron_activations_sp_selective_small_case():
    # s 3, b 2, h 4 -> sbh 24; ffn 16 = 4h -> 18 + 4*4 = 34 per sbh (table 2: sbhL 34/t); L 2, t 2, p 1, V 128
    # layers 24*34*2 = 1632; embedding 8*3*2*1 + 24*1 = 72; output 24*4*(1 + 128/4) = 3168; all / t
    out = megatron_activations(h=4, ffn=16, layers=2, padded_vocab=128, seq=3, micro_batch=2, tp=2, pp=1,
                               sequence_parallel=True, recompute="selective")
    assert out["formula"] == "compute_activation_memory"
    assert out["per_layer"] == 24 * 34 / 2  # Korthikanti et al. 2022, table 2: TP + SP + selective, sbh 34/t
    assert out["bytes"] == (1632 + 72 + 3168) / 2 == 2436


def test_megatron_activations_without_sp_small_case():
    # any other setup: sbh(10 + 24/t) per layer = 24 * 22 = 528 (table 2: TP + selective, no SP); x L 2 = 1056;
    # + 72 embedding; output (s b V / t + sbh) * 2 = (384 + 24) * 2 = 816; the whole x 1.05
    for sp, recompute in ((False, "selective"), (False, "none"), (True, "none"), (True, "full")):
        out = megatron_activations(h=4, ffn=16, layers=2, padded_vocab=128, seq=3, micro_batch=2, tp=2, pp=1,
                                   sequence_parallel=sp, recompute=recompute)
        assert out["formula"] == "compute_activation_memory_without_sp"
        assert out["bytes"] == pytest.approx((1056 + 72 + 816) * 1.05)  # = 2041.2


def test_megatron_pipeline_factor():
    assert megatron_pipeline_factor(4, None, 2) == 0.5  # 1F1B with 2 micro-batches on 4 stages
    assert megatron_pipeline_factor(4, None, 8) == 1 and megatron_pipeline_factor(4, None, None) == 1
    assert megatron_pipeline_factor(4, 2, 1) == 1 + 3 / 8  # interleaved: 1 + (p-1)/(p v), m not looked at
    assert megatron_pipeline_factor(1, None, 1) == 1
    # p 4, m 2, SP + selective: (L terms + embedding with p micro-batches) x 0.5, no output term when p > 1
    out = megatron_activations(h=4, ffn=16, layers=2, padded_vocab=128, seq=3, micro_batch=2, tp=2, pp=4,
                               sequence_parallel=True, recompute="selective", num_microbatches=2)
    assert out["bytes"] == (1632 + 8 * 3 * 2 * 4 + 24 * 4) * 0.5 / 2


# -- llm-analysis: llm_analysis/analysis.py ---------------------------------------------------------------------------

def test_llm_analysis_params_gqa_rounds_kv_heads_up_to_tp():
    # 2h^2 + 2h (h kv/a), kv = max(kv/tp, 1) tp: h 8, a 4, kv 1, tp 2 -> kv 2: 128 + 2*8*(8*2/4) = 192
    p = llm_analysis_layer_params(h=8, ffn=32, heads=4, kv_heads=1, tp=2)
    assert p == {"attn": 192, "mlp": 2 * 8 * 32, "router": 0, "layernorm": 16}


def test_llm_analysis_activation_per_layer_small_case():
    # s 2, b 1, h 8 -> sbh 16; a 4, ffn 32 (ratio 4), tp 2, sp 2, 2-byte activations, fp32 layernorm inputs
    kw = dict(h=8, ffn=32, heads=4, seq=2, micro_batch=1, tp=2)
    # none + flash: compute (2*16 + 4*4*2*1)*2/2 = 64; attn (16/2 + 4*16/2)*2 + 64 + 16/2 (dropout mask) = 152
    # mlp 2*16/2 + (2+2)*4*16/2 = 16 + 128 = 144; norms 2 * 16/2 * 4 = 64 -> 360
    none = llm_analysis_activation_per_layer(**kw, sp=2, recompute="none")
    assert (none["attn"], none["mlp"], none["layernorm"], none["bytes"]) == (152, 144, 64, 360)
    # selective (ATTN_COMPUTE) drops the 64; no flash: 2 a s^2 b * 2 / t = 32 instead of 64
    assert llm_analysis_activation_per_layer(**kw, sp=2, recompute="selective")["bytes"] == 296
    assert llm_analysis_activation_per_layer(**kw, sp=2, recompute="none", flash_attn=False)["bytes"] == 328
    # full: the layer input only, sbh * 2 / tp
    assert llm_analysis_activation_per_layer(**kw, sp=2, recompute="full")["bytes"] == 16
    # no sequence parallelism (sp 1): the sp-divided terms double: attn input +16, dropout mask +8, MLP input +16,
    # norms +64
    assert llm_analysis_activation_per_layer(**kw, sp=1, recompute="none")["bytes"] == 360 + 16 + 8 + 16 + 64


def test_llm_analysis_published_llama_13b_example():
    # llm-analysis examples/llama/outputs_train_h100/...llama-13b-hf-h100-sxm-80gb-w16a16e16-tp8-pp8-dp32-sp8-...
    # summary.json: h 5120, a 40, L 40, ffn 20480, V 32000, seq 2048, selective recompute, no ZeRO:
    # activation_memory_bs1 1939865600 and weight_memory_per_gpu 434176000, printed by an older analysis.py that
    # had no layernorm parameters and no logits / final-norm activation terms (added since)
    out = llm_analysis_training(h=5120, ffn=20480, layers=40, heads=40, kv_heads=40, vocab=32000, seq=2048,
                                micro_batch=1, tp=8, pp=8, dp=32, sp=8, recompute="selective")
    assert out["activation_per_layer"] * 40 == 1_939_865_600  # per layer sbh 37/8, exactly the published figure
    assert out["activations"] == 1_939_865_600 + 32000 * 2048 * 2 / 8 + 2048 * 5120 / 8 * 4
    # 5 layers x 2 layernorms + the final one, h each, 2 bytes / tp 8: 14,080 bytes more than published
    assert out["weights"] == 434_176_000 + (5 * 2 * 5120 + 5120) * 2 / 8


def test_llm_analysis_zero1_is_6_plus_12_over_d():
    # weights 2 + gradients 4 + Adam 12 (master + 2 moments): 18 B/param; ZeRO-1 shards only the 12
    kw = dict(h=8, ffn=32, layers=4, heads=4, kv_heads=4, vocab=16, seq=2, micro_batch=1, tp=1, pp=2, sp=1,
              recompute="none")
    params = 2 * (4 * 64 + 2 * 8 * 32 + 16) + 16 * 8 + 8  # 2 of 4 layers, embedding, final norm: 1704
    assert llm_analysis_training(**kw, dp=4)["model_states"] == params * 18
    assert llm_analysis_training(**kw, dp=4, zero_stage=1)["model_states"] == params * (6 + 12 / 4)


# -- from peakledger's model description --------------------------------------------------------------------------

LLAMA_70B = dict(micro_batch=8, seq_len=1024, precision="bf16-mixed", world_size=64)  # compare's defaults, 64 ranks


def test_llama_3_70b_tp8_pp4_world64(capsys):
    cfg = preset("llama-3-70b")
    rows = parallel_peers(cfg, TrainingSetup(**LLAMA_70B), tp=8, pp=4)
    mega, llm = rows
    assert (mega["source"], llm["source"]) == (MEGATRON, LLM_ANALYSIS)
    assert mega["setup"]["dp"] == 2
    # Megatron: (68,451,041,280 / 4 + 8192 * 129024) / 8 + (80 * 16384 + 8192) / 4 = 2,271,545,344 params x 18
    assert mega["model_states"] == 2_271_545_344 * 18 == 40_887_816_192
    # without SP: sbh(10 + 24/8) x 80 + embedding (8 s b p + sbh p), x min(1, m/p) = 1/4, x 1.05; sbh = 1024*8*8192
    sbh = 1024 * 8 * 8192
    assert mega["activations"] == round((13 * sbh * 80 + 8 * 1024 * 8 * 4 + sbh * 4) / 4 * 1.05) == 18_391_252_992
    # llm-analysis: 20 layers of 2.25 h^2 + 2 h ffn + 2h, + V h + h, x 18 / 8
    assert llm["model_states"] == (20 * (150_994_944 + 469_762_048 + 16_384) + 128256 * 8192 + 8192) * 18 // 8
    assert llm["activations"] == 87_814_569_984
    rows_sp = parallel_peers(cfg, TrainingSetup(**LLAMA_70B, zero_stage=1), tp=8, pp=4, sequence_parallel=True,
                             recompute="selective")
    assert rows_sp[0]["model_states"] == 2_271_545_344 * 12  # distributed optimizer, d 2: 6 + 12/2
    assert rows_sp[0]["activations"] == round((sbh * (18 + 4 * 3.5) * 80 + 8 * 1024 * 8 * 4 + sbh * 4) / 4 / 8)
    peakledger = {"source": "peakledger", "model_states": None, "activations": None, "total": None}
    with capsys.disabled():
        for r in (rows, rows_sp):
            print("\n" + render_parallel_peers([peakledger] + r, "GiB", "llama-3-70b"))
    text = render_parallel_peers([peakledger] + rows, "GiB", "llama-3-70b")
    assert "tp 8, pp 4, dp 2 (64 ranks)" in text and "(bytes per rank; GiB)" in text and "why they differ:" in text
    table = text.splitlines()[2:2 + len(rows) + 1]  # peakledger's row (all "-") and each formula's, in GiB
    for r, line in zip([peakledger] + rows, table):
        cells = line[26:].split()
        for cell, key in zip(cells, ("model_states", "activations", "total")):
            value = r.get(key, r.get("peak")) if key == "total" else r.get(key)
            assert cell == "-" if value is None else cell_equals(cell, value, "GiB"), (line, key)
    assert "compute_activation_memory_without_sp" in text and "shared_embedding=True" in text


def test_setup_maps_recompute_optimizer_and_notes():
    cfg = preset("llama-3-70b")
    full = parallel_peers(cfg, TrainingSetup(**LLAMA_70B, checkpointing="full"), tp=8, pp=4, cp=2)
    assert full[0]["setup"]["recompute"] == "full" and full[0]["setup"]["dp"] == 1
    assert any("full recompute is not modelled" in w for w in full[0]["why"])
    assert any("context parallelism" in w for w in full[0]["why"])
    assert full[1]["detail"]["activation_per_layer"] == 1024 * 8 * 8192 * 2 / 8
    sgd = parallel_peers(cfg, dict(LLAMA_70B, optimizer="sgd", fp32_grads=True), tp=8, pp=4, virtual_stages=2)
    assert sgd[0]["detail"]["activations"]["pipeline_factor"] == 1 + 3 / 8
    assert any("optimizer sgd" in w for w in sgd[1]["why"])
    assert not any("16-bit gradients" in w for w in sgd[0]["why"])


def test_bad_parallel_input_names_the_field():
    cfg = preset("llama-3-70b")
    with pytest.raises(ConfigError) as err:
        parallel_peers(cfg, TrainingSetup(**dict(LLAMA_70B, world_size=48)), tp=8, pp=4)
    assert err.value.field == "world_size"
    with pytest.raises(ConfigError) as err:
        parallel_peers(cfg, TrainingSetup(**LLAMA_70B), tp=8, pp=4, recompute="some")
    assert err.value.field == "recompute"


# -- the peers' own functions where installed, else their formulas, labelled (analysis/peers_own.py) --------------

LLAMA_70B_CASE = ["compare", "--preset", "llama-3-70b", "--tp", "8", "--pp", "4", "--world-size", "64",
                  "--grad-accum", "8", "--peers"]


def _case(capsys, *extra):
    from peakledger.cli import main

    assert main([*LLAMA_70B_CASE, *extra]) == 0
    out = capsys.readouterr().out
    return json.loads(out) if "--json" in extra else out


def test_llm_analysis_column_is_its_own_training(capsys):
    pytest.importorskip("llm_analysis")
    from llm_analysis.analysis import ActivationRecomputation, DSZeRO, LLMAnalysis
    from llm_analysis.config import (
        ModelConfig,
        ParallelismConfig,
        get_dtype_config_by_name,
        get_gpu_config_by_name,
    )

    # Meta's Llama-3-70B, in llm-analysis's own objects: 80 layers, 64 heads (8 kv), h 8192, ffn 28672 (3.5 h: the
    # ratio given, as its ModelConfig asserts ffn % h == 0 otherwise), vocabulary 128256; compare's defaults:
    # micro-batch 8 x 1024 tokens, bf16 (w16a16e16), sequence parallelism off (sp 1), no recompute, no ZeRO
    model = ModelConfig(name="llama-3-70b", num_layers=80, n_head=64, hidden_dim=8192, vocab_size=128256,
                        max_seq_len=1024, num_key_value_heads=8, ffn_embed_dim=28672, expansion_ratio=3.5)
    run = LLMAnalysis(model, get_gpu_config_by_name("h100-sxm-80gb"), get_dtype_config_by_name("w16a16e16"),
                      ParallelismConfig(tp_size=8, pp_size=4, dp_size=2, sp_size=1))
    summary = run.training(batch_size_per_gpu=8, gradient_accumulation_steps=8, global_batch_size=8 * 8 * 2,
                           seq_len=1024, activation_recomputation=ActivationRecomputation.NONE, ds_zero=DSZeRO.NONE)
    out = {r["source"]: r for r in _case(capsys, "--json")["peers"]}
    llm = out[LLM_ANALYSIS]
    assert llm["estimate_own"] is True and llm["estimate_version"] == importlib.metadata.version("llm-analysis")
    assert llm["model_states"] == round(summary["(weight+op_state+grad)_memory_per_gpu"])
    assert llm["activations"] == round(summary["activation_memory_per_gpu"])
    for key in ("weight_memory_per_gpu", "gradient_memory_per_gpu", "optimizer_state_memory_per_gpu",
                "activation_memory_per_gpu", "activation_memory_embedding_output_per_gpu"):
        assert llm["detail"]["summary"][key] == summary[key], key  # bytes, as llm-analysis reports them
    text = _case(capsys)
    assert f"llm-analysis: llm-analysis {llm['estimate_version']}, its own LLMAnalysis.training" in text
    assert "Megatron-LM theoretical: Megatron-LM 1bcb3b9's formulas (megatron/training/" in text


@pytest.mark.parametrize("recompute,sp,zero", [("none", False, 0), ("selective", True, 1), ("full", False, 3),
                                               ("full", True, 2)])
def test_llm_analysis_formulas_are_its_released_0_2_2(recompute, sp, zero):
    pytest.importorskip("llm_analysis")
    from peakledger.analysis.peers_own import llm_analysis_peer

    # the fallback re-derives llm-analysis 0.2.2: installed (0.2.2), its own function gives the same bytes; under
    # full recompute 0.2.2 counts no final-norm input (08d7f8f, on its main since, does)
    cfg = preset("llama-3-70b")
    setup = TrainingSetup(**LLAMA_70B, zero_stage=zero)
    own = parallel_peers(cfg, setup, tp=8, pp=4, sequence_parallel=sp, recompute=recompute)[1]
    peer = llm_analysis_peer(llm_analysis_training)
    assert own["estimate_own"] and peer.version == "0.2.2"
    formulas = peer.formulas(h=8192, ffn=28672, layers=80, heads=64, kv_heads=8, vocab=128256, seq=1024,
                             micro_batch=8, tp=8, pp=4, dp=2, sp=8 if sp else 1, recompute=recompute,
                             zero_stage=zero)
    for key in ("weights", "gradients", "optimizer_states", "activations", "logits", "activation_per_layer"):
        assert own["detail"][key] == pytest.approx(formulas[key], rel=1e-12), key


def test_without_llm_analysis_the_formulas_say_their_version(capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "llm_analysis", None)  # `import llm_analysis` now fails as if not installed
    out = {r["source"]: r for r in _case(capsys, "--json")["peers"]}
    llm, mega = out[LLM_ANALYSIS], out[MEGATRON]
    assert llm["estimate_source"] == "llm-analysis 0.2.2's formulas (llm-analysis not installed)"
    assert (llm["estimate_own"], llm["estimate_version"]) == (False, "0.2.2")
    d = llm_analysis_training(h=8192, ffn=28672, layers=80, heads=64, kv_heads=8, vocab=128256, seq=1024,
                              micro_batch=8, tp=8, pp=4, dp=2, sp=1, recompute="none")
    assert (llm["model_states"], llm["activations"]) == (round(d["model_states"]), round(d["activations"]))
    assert (mega["estimate_own"], mega["estimate_version"]) == (False, MEGATRON_COMMIT[:7])
    text = _case(capsys)
    assert "llm-analysis: llm-analysis 0.2.2's formulas (llm-analysis not installed)" in text
    assert "Megatron-LM theoretical: Megatron-LM 1bcb3b9's formulas" in text


def test_a_setup_llm_analysis_refuses_is_its_formulas_saying_why():
    pytest.importorskip("llm_analysis")
    # fp32 weights and activations: 0.2.2's get_TFLOPS_per_gpu asserts 4, 8 or 16 bits, in training()
    rows = parallel_peers(preset("llama-3-70b"), TrainingSetup(**dict(LLAMA_70B, precision="fp32")), tp=8, pp=4)
    llm = rows[1]
    assert not llm["estimate_own"] and llm["estimate_version"] == "0.2.2"
    assert llm["estimate_source"] == ("llm-analysis 0.2.2's formulas (its own LLMAnalysis.training refused the "
                                      "setup: weight_bits and activation_bits must be 4, 8, or 16)")
    assert llm["detail"]["weights"] == llm_analysis_training(
        h=8192, ffn=28672, layers=80, heads=64, kv_heads=8, vocab=128256, seq=1024, micro_batch=8, tp=8, pp=4, dp=2,
        sp=1, recompute="none", weight_bytes=4, act_bytes=4)["weights"]
