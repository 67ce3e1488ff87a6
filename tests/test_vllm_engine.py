"""models/vllm_engine.py: worked examples, each expected value computed here from vLLM 0.32.0's formulas as its source
writes them (bench/validate_vllm.py holds the same model against vLLM's own code run on a CPU)."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from peakledger.models.config import ConfigError
from peakledger.models.presets import preset
from peakledger.models.vllm_engine import (
    PHASES,
    VllmEngineSpec,
    block_bytes,
    engine_items,
    kv_blocks,
    max_rollout_batch,
    max_utilization,
    min_utilization,
    page_bytes,
    parameter_count,
    size_engine,
    weight_bytes,
)

H100 = 85_017_755_648
L8 = preset("llama-3-8b")  # 32 layers, d 4096, 32 heads, 8 KV heads of 128, d_ff 14336, vocab 128256, 8192 positions


def engine(**kw) -> VllmEngineSpec:
    base = dict(model=L8, gpu_memory_utilization=0.3, max_model_len=4096, cudagraph_bytes=512 << 20,
                profile_peak_bytes=1_500_000_000, non_torch_bytes=0)
    return VllmEngineSpec(**{**base, **kw})


def test_page_and_block_bytes_follow_attention_spec():
    # AttentionSpec.page_size_bytes: num_kv_heads * block_size * (head_size + head_size_v) * dtype size
    assert page_bytes(engine()) == 8 * 16 * (128 + 128) * 2 == 65_536
    assert page_bytes(engine(kv_cache_dtype="fp8")) == 8 * 16 * 256 * 1
    assert page_bytes(engine(tensor_parallel=2)) == 4 * 16 * 256 * 2
    assert page_bytes(engine(tensor_parallel=16)) == 1 * 16 * 256 * 2  # max(1, 8 // 16): replicated KV heads
    assert block_bytes(engine(block_size=32)) == 32 * (8 * 32 * 256 * 2)


def test_weights_pad_the_vocabulary_to_64_and_add_the_rotary_table():
    V, D, F, L = 128_256, 4096, 14_336, 32
    assert V % 64 == 0  # Llama 3's vocabulary is already a multiple of 64
    per_layer = D * D + 2 * D * 1024 + D * D + 3 * D * F + 2 * D
    params = 2 * V * D + L * per_layer + D
    assert parameter_count(engine()) == params == 8_030_261_248
    assert weight_bytes(engine()) == 2 * params + 8192 * 128 * 2  # cos_sin_cache (max_position, head_size), bf16
    odd = replace(L8, vocab_size=32_001)
    assert parameter_count(engine(model=odd)) == params - 2 * (V - 32_064) * D  # 32,001 padded to 32,064
    # tp 2: embeddings, q/o, gate/up/down halved, 4 of 8 KV heads per rank, norms whole on every rank
    assert parameter_count(engine(tensor_parallel=2)) == V * D + L * (D * D + D * 1024 + 3 * D * F // 2 + 2 * D) + D


def test_kv_pool_is_requested_minus_what_profiling_saw():
    s = engine()
    requested = math.ceil(H100 * 0.3)  # request_memory
    non_kv = weight_bytes(s) + 1_500_000_000  # memory_profiling: consumed + transient peak headroom
    available = requested - non_kv - (512 << 20)  # determine_available_memory: minus the CUDA-graph estimate
    per_block = 32 * 65_536
    sizing = size_engine(s, H100, in_use=30 * (1 << 30))
    assert sizing.error == ""
    assert (sizing.requested, sizing.kv_available) == (requested, available)
    assert sizing.num_blocks == available // per_block
    assert sizing.kv_pool == available // per_block * per_block
    assert sizing.concurrency == (available // per_block) / (4096 // 16)
    # what the training process holds does not size the pool: only the device's total does
    assert size_engine(s, H100, in_use=1 << 30)[2:] == sizing[2:]
    assert size_engine(engine(enforce_eager=True), H100, 0).kv_available == available + (512 << 20)


def test_start_refused_when_free_is_under_the_request():
    s = engine(gpu_memory_utilization=0.7)
    in_use = H100 - math.ceil(H100 * 0.7) + 1
    assert "less than desired GPU memory utilization" in size_engine(s, H100, in_use).error
    assert size_engine(s, H100, in_use - 1).error == ""
    top = max_utilization(H100, 30 * (1 << 30))
    assert math.ceil(H100 * top) <= H100 - 30 * (1 << 30) < math.ceil(H100 * (top + 0.0001))


def test_kv_refusals_hold_back_the_null_block():
    s = engine()
    per_block, per_req = 32 * 65_536, 4096 // 16
    assert kv_blocks(s, per_block)[0] == 0 and "no available memory" in kv_blocks(s, per_block)[1]
    assert "one request of max_model_len 4096" in kv_blocks(s, per_block * per_req)[1]
    assert kv_blocks(s, per_block * (per_req + 1)) == (per_req + 1, "")
    low = min_utilization(s, H100)
    assert size_engine(replace(s, gpu_memory_utilization=low), H100, 0).error == ""
    assert size_engine(replace(s, gpu_memory_utilization=round(low - 0.0001, 4)), H100, 0).error != ""


def test_max_rollout_batch_counts_blocks_per_sequence():
    s = engine(max_num_seqs=10_000)
    sizing = size_engine(s, H100, 0)
    assert max_rollout_batch(s, sizing, 1000) == (sizing.num_blocks - 1) // math.ceil(1000 / 16)
    assert max_rollout_batch(replace(s, max_num_seqs=8), sizing, 1000) == 8


@pytest.mark.parametrize("level", [1, 2])
def test_sleep_items_per_level(level):
    s = engine(sleep_level=level)
    sizing = size_engine(s, H100, 0)
    asleep = {(i.name, i.pool): i.nbytes for i in engine_items(s, sizing, "sleep")}
    assert ("vllm.weights", "device") not in asleep and ("vllm.kv_cache", "device") not in asleep
    assert asleep[("vllm.cuda_graphs", "device")] == 512 << 20  # sleep_mode_offload_cudagraph is off by default
    if level == 1:  # the weights pool copied to host, the KV cache discarded
        assert asleep[("vllm.weights.offloaded", "host")] == weight_bytes(s)
    else:  # both discarded; the buffers (the rotary table) kept on the host
        assert asleep == {("vllm.cuda_graphs", "device"): 512 << 20, ("vllm.buffers.saved", "host"): 8192 * 128 * 2}
    sync = {i.name: i.nbytes for i in engine_items(s, sizing, "weight_sync")}
    assert sync == {"vllm.weights": weight_bytes(s), "vllm.cuda_graphs": 512 << 20}
    gen = {i.name: i.nbytes for i in engine_items(s, sizing, "wake_kv_cache")}
    assert gen["vllm.kv_cache"] == sizing.kv_pool


def test_items_and_inputs_refused_with_the_field_named():
    s = engine()
    sizing = size_engine(s, H100, 0)
    assert [i.phase for i in engine_items(s, sizing, "engine_start")] == ["engine_start"] * 4
    assert set(PHASES) >= {"generate", "sleep"}
    for phase, field in (("sleep", "sleep_level"), ("nope", "phase")):
        with pytest.raises(ConfigError) as e:
            engine_items(s, sizing, phase)
        assert e.value.field == field
    with pytest.raises(ConfigError) as e:
        engine_items(s, size_engine(s, H100, H100 - 10**9), "generate")
    assert e.value.field == "gpu_memory_utilization"
    for kw, field in ((dict(gpu_memory_utilization=1.5), "gpu_memory_utilization"),
                      (dict(kv_cache_dtype="int4"), "kv_cache_dtype"), (dict(sleep_level=3), "sleep_level"),
                      (dict(max_model_len=8193), "max_model_len"), (dict(tensor_parallel=3), "tensor_parallel"),
                      (dict(block_size=0), "block_size")):
        with pytest.raises(ConfigError) as e:
            engine(**kw)
        assert e.value.field == field
