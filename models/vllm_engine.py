"""A vLLM engine colocated with training on one device, sized as vLLM 0.32.0 sizes it (and TRL 1.16.0 runs it).

The rules, each from vLLM 0.32.0's source:
  requested = ceil(total * gpu_memory_utilization); start refused when the device's free memory at the engine's
      start is below it (vllm/v1/worker/utils.py request_memory). `total` is the device's, not what is free: the
      training process's holdings only decide whether the engine starts.
  KV pool = requested - non_kv - cudagraph_estimate (vllm/v1/worker/gpu_worker.py determine_available_memory);
      non_kv = what the engine took since its start snapshot (weights + what the profile run left + non-torch
      memory) + the profile run's transient peak (vllm/utils/mem_utils.py memory_profiling) = weights + non-torch
      + the torch peak increase of the profile run; the CUDA-graph estimate is subtracted by default
      (VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS=1, vllm/envs.py) unless enforce_eager.
  page = num_kv_heads_per_rank * block_size * (head_size + head_size_v) * kv dtype bytes, per layer
      (vllm/v1/kv_cache_interface.py AttentionSpec.page_size_bytes); kv heads per rank = max(1, kv_heads // tp)
      (vllm/config/model.py get_num_kv_heads); num_blocks = available // (n_layer * page), the pool num_blocks *
      n_layer * page (vllm/v1/core/kv_cache_utils.py get_kv_cache_config_from_groups); refused when
      available - one block <= 0 or below one max_model_len request (get_kv_cache_configs, the null block held
      back); concurrency = num_blocks / cdiv(max_model_len, block_size) (get_max_concurrency_for_kv_cache_config).
  sleep (vllm/device_allocator/sleep_mode_backend.py CuMemBackend.suspend, cumem.py CuMemAllocator.sleep): level 1
      copies the "weights" pool to host (pinned: vllm/utils/torch_utils.py PIN_MEMORY) and discards the KV cache;
      level 2 discards both, keeping only the model's buffers on the host (gpu_worker.py Worker.sleep:
      `buffer.cpu().clone()`, pageable); "runtime" state is copied to host at every level. CUDA graphs are kept on
      the device (sleep_mode_offload_cudagraph defaults to False, vllm/config/model.py). wake_up(tags) maps the
      tags back; weights after level 2 come back empty and are filled by the trainer's weight sync.
  weights = the checkpoint's parameters with vocabularies padded to 64 rows (vllm/model_executor/layers/
      vocab_parallel_embedding.py DEFAULT_VOCAB_PADDING_SIZE) split over tensor-parallel ranks, plus the rotary
      table (max_position, head_size) in the model dtype (rotary_embedding/base.py cos_sin_cache).
TRL 1.16.0 (trl/generation/vllm_generation.py): LLM(gpu_memory_utilization=vllm_gpu_memory_utilization (0.3),
max_num_seqs=per_device_train_batch_size * tp * steps_per_generation, max_num_batched_tokens=4096,
enable_sleep_mode=vllm_enable_sleep_mode); with sleep mode: sleep(level=2) after start and after every generate,
wake_up(tags=["weights"]) then load_weights per parameter (the weight sync), wake_up(tags=["kv_cache"]) before
generate.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

from .config import ConfigError, TransformerConfig, dtype_bytes
from .config.base import choice_of, non_negative_int, positive_int
from .families import family_of
from .transformer.params import transformer_params

VOCAB_PADDING = 64  # vocab_parallel_embedding.py DEFAULT_VOCAB_PADDING_SIZE
DEFAULT_BLOCK_SIZE = 16  # vllm/config/cache.py CacheConfig.DEFAULT_BLOCK_SIZE
KV_CACHE_DTYPES = {"auto": None, "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1}  # None: the model's dtype
SLEEP_LEVELS = (0, 1, 2)  # 0: sleep mode off
TRL_MAX_NUM_BATCHED_TOKENS = 4096  # trl/generation/vllm_generation.py


@dataclass(frozen=True)
class VllmEngineSpec:
    """One engine as `vllm.LLM(...)` is called. `cudagraph_bytes`: vLLM's CUDA-graph estimate (its log's "CUDA graph
    pool memory"; measured by capturing graphs, no formula); `profile_peak_bytes`: the torch peak increase of its
    profile run (its log's "torch peak memory increase"), None for `profile_peak_estimate`; `non_torch_bytes`:
    memory outside torch the engine adds (NCCL, custom all-reduce buffers); 0 for one GPU."""

    model: TransformerConfig
    dtype: str = "bf16"
    gpu_memory_utilization: float = 0.9  # vllm/config/cache.py; TRL's colocate default is 0.3
    block_size: int = DEFAULT_BLOCK_SIZE
    max_num_seqs: int = 128  # vllm/config/scheduler.py DEFAULT_MAX_NUM_SEQS
    max_num_batched_tokens: int = TRL_MAX_NUM_BATCHED_TOKENS
    max_model_len: int | None = None  # None: the model's max_seq_len
    enforce_eager: bool = False
    kv_cache_dtype: str = "auto"
    sleep_level: int = 0
    tensor_parallel: int = 1
    cudagraph_bytes: int = 0
    profile_peak_bytes: int | None = None
    non_torch_bytes: int = 0

    def __post_init__(self) -> None:
        if not family_of(self.model).transformer:
            raise ConfigError("model", "a vLLM engine is modelled for decoder-only transformers (TransformerConfig)")
        if self.model.num_local_experts:
            raise ConfigError("model", "a vLLM engine of a mixture of experts is not modelled")
        u = self.gpu_memory_utilization
        if isinstance(u, bool) or not isinstance(u, (int, float)) or not 0 < u <= 1:
            raise ConfigError("gpu_memory_utilization", f"must be in (0, 1], got {u!r}")
        positive_int(self, "block_size", "max_num_seqs", "max_num_batched_tokens", "tensor_parallel")
        non_negative_int(self, "cudagraph_bytes", "non_torch_bytes")
        if self.profile_peak_bytes is not None:
            non_negative_int(self, "profile_peak_bytes")
        if self.max_model_len is not None:
            positive_int(self, "max_model_len")
            if self.max_model_len > self.model.max_seq_len:  # vllm/config/model.py: derived max_model_len
                raise ConfigError("max_model_len", f"{self.max_model_len} is over the model's max_seq_len "
                                                   f"{self.model.max_seq_len} (vLLM refuses it)")
        choice_of(self, "kv_cache_dtype", tuple(KV_CACHE_DTYPES))
        choice_of(self, "sleep_level", SLEEP_LEVELS)
        dtype_bytes(self.dtype)
        m, tp = self.model, self.tensor_parallel
        if m.n_head % tp or m.ffn % tp:
            raise ConfigError("tensor_parallel", f"{tp} must divide n_head={m.n_head} and d_ff={m.ffn}")
        if tp > 1 and m.architecture != "llama":
            raise ConfigError("tensor_parallel", "tensor parallelism is modelled for family llama only")

    @property
    def context(self) -> int:
        return self.model.max_seq_len if self.max_model_len is None else self.max_model_len


def padded_vocab(vocab: int) -> int:
    return -(-vocab // VOCAB_PADDING) * VOCAB_PADDING


def kv_heads_per_rank(spec: VllmEngineSpec) -> int:
    return max(1, spec.model.kv_heads // spec.tensor_parallel)


def parameter_count(spec: VllmEngineSpec) -> int:
    """One rank's parameters as vLLM loads them: embeddings padded to 64 rows, projections split over `tp` (K/V heads
    replicated where fewer than the ranks), norms whole."""
    m, tp = spec.model, spec.tensor_parallel
    extra_rows = padded_vocab(m.vocab_size) - m.vocab_size
    n = 0
    for p in transformer_params(m):
        name, numel = p.name, p.numel
        if name.endswith(("wte.weight", "embed_tokens.weight", "lm_head.weight")):
            numel = (numel + extra_rows * m.d_model) // tp
        elif any(k in name for k in ("k_proj", "v_proj")):
            numel = numel // m.kv_heads * kv_heads_per_rank(spec)
        elif any(k in name for k in ("q_proj", "gate_proj", "up_proj")) or (
                name.endswith(("o_proj.weight", "down_proj.weight"))):
            numel //= tp
        n += numel
    return n


def rotary_table_bytes(spec: VllmEngineSpec) -> int:
    """The rotary cos/sin table: (max_position_embeddings, head_size) in the model's dtype; one per model (get_rope
    caches it), registered as a buffer. None in gpt2 (learned positions)."""
    m = spec.model
    return m.max_seq_len * m.head_size * dtype_bytes(spec.dtype) if m.architecture == "llama" else 0


def weight_bytes(spec: VllmEngineSpec) -> int:
    """What loading takes (the worker's model_memory_usage): parameters and buffers."""
    return parameter_count(spec) * dtype_bytes(spec.dtype) + rotary_table_bytes(spec)


def page_bytes(spec: VllmEngineSpec) -> int:
    """One layer's page: block_size tokens of K and V for the rank's KV heads."""
    size = KV_CACHE_DTYPES[spec.kv_cache_dtype] or dtype_bytes(spec.dtype)
    return kv_heads_per_rank(spec) * spec.block_size * 2 * spec.model.head_size * size


def block_bytes(spec: VllmEngineSpec) -> int:
    return spec.model.n_layer * page_bytes(spec)


def profile_peak_estimate(spec: VllmEngineSpec) -> int:
    """An estimate, not vLLM's rule (vLLM measures it): the larger of the profile forward's MLP step (max_num_batched
    _tokens tokens: the residual and hidden state, gate_up's output and the activation's, model dtype) and the
    dummy sampler run's logits (min(max_num_seqs, max_num_batched_tokens) rows of the padded vocabulary: the model
    dtype's logits and two fp32 copies). Give `profile_peak_bytes` from vLLM's log to replace it."""
    m, tp, b = spec.model, spec.tensor_parallel, dtype_bytes(spec.dtype)
    t = spec.max_num_batched_tokens
    mlp = t * (2 * m.d_model + 3 * m.ffn // tp) * b
    rows = min(spec.max_num_seqs, t)
    sampler = rows * padded_vocab(m.vocab_size) * (b + 8)
    return max(mlp, sampler)


def profile_peak(spec: VllmEngineSpec) -> int:
    return profile_peak_estimate(spec) if spec.profile_peak_bytes is None else spec.profile_peak_bytes


def cudagraph_estimate(spec: VllmEngineSpec) -> int:
    return 0 if spec.enforce_eager else spec.cudagraph_bytes


def requested_bytes(spec: VllmEngineSpec, total: int) -> int:
    return math.ceil(total * spec.gpu_memory_utilization)


def non_kv_bytes(spec: VllmEngineSpec) -> int:
    return weight_bytes(spec) + spec.non_torch_bytes + profile_peak(spec)


class EngineSizing(NamedTuple):
    """The engine's start on a device of `total` bytes with `in_use` bytes in use (the training process's tensors,
    the CUDA context, other processes). `error`: why vLLM refuses to start ("" when it starts)."""

    requested: int
    free_at_start: int
    kv_available: int  # determine_available_memory's answer
    num_blocks: int
    kv_pool: int  # the KV cache tensors' bytes
    concurrency: float  # requests of max_model_len at once
    error: str = ""


def size_engine(spec: VllmEngineSpec, total: int, in_use: int) -> EngineSizing:
    requested, free = requested_bytes(spec, total), total - in_use
    if free < requested:
        return EngineSizing(requested, free, 0, 0, 0, 0.0,
                            f"free memory on startup ({free:,} B) is less than desired GPU memory utilization "
                            f"({spec.gpu_memory_utilization}, {requested:,} B)")
    available = requested - non_kv_bytes(spec) - cudagraph_estimate(spec)
    blocks, error = kv_blocks(spec, available)
    per_request = -(-spec.context // spec.block_size)
    return EngineSizing(requested, free, available, blocks, blocks * block_bytes(spec), blocks / per_request, error)


def kv_blocks(spec: VllmEngineSpec, available: int) -> tuple[int, str]:
    """The KV cache blocks `available` bytes make, or 0 and why vLLM refuses (get_kv_cache_configs: one block is
    held back for the BlockPool's null block before the checks)."""
    per_block = block_bytes(spec)
    per_request = -(-spec.context // spec.block_size)
    if available - per_block <= 0:
        return 0, "no available memory for the cache blocks"
    if per_request * per_block > available - per_block:
        return 0, (f"one request of max_model_len {spec.context} needs {per_request * per_block:,} B of KV cache, "
                   f"more than the {available - per_block:,} B available")
    return available // per_block, ""


def max_utilization(total: int, in_use: int) -> float:
    """The largest gpu_memory_utilization (4 decimals) that starts: ceil(total * u) <= total - in_use."""
    u = math.floor((total - in_use) * 10_000 / total) / 10_000
    while u > 0 and math.ceil(total * u) > total - in_use:
        u = round(u - 0.0001, 4)
    return max(u, 0.0)


def min_utilization(spec: VllmEngineSpec, total: int) -> float:
    """The smallest utilization (4 decimals) whose KV pool holds one request of max_model_len (and the null block)."""
    need = non_kv_bytes(spec) + cudagraph_estimate(spec) + block_bytes(spec) * (
        1 + -(-spec.context // spec.block_size))
    u = math.ceil(need * 10_000 / total) / 10_000
    return min(u, 1.0)


def utilization_for_blocks(spec: VllmEngineSpec, total: int, blocks: int) -> float:
    """The smallest utilization (4 decimals) whose KV pool makes at least `blocks` blocks of `spec`'s page:
    ceil(total * u) - non_kv - cudagraph_estimate >= blocks * block_bytes (determine_available_memory, kv_blocks)."""
    need = non_kv_bytes(spec) + cudagraph_estimate(spec) + blocks * block_bytes(spec)
    u = math.ceil(need * 10_000 / total) / 10_000
    return min(u, 1.0)


def max_rollout_batch(spec: VllmEngineSpec, sizing: EngineSizing, seq_len: int) -> int:
    """Sequences of `seq_len` tokens (prompt + completion) the pool holds at once: the BlockPool holds one block back
    (vllm/v1/core/block_pool.py null_block); each sequence takes cdiv(seq_len, block_size) blocks. The scheduler also
    caps it at max_num_seqs."""
    if sizing.error or sizing.num_blocks < 1:
        return 0
    per_seq = -(-seq_len // spec.block_size)
    return min((sizing.num_blocks - 1) // per_seq, spec.max_num_seqs)


class Item(NamedTuple):
    """One holding, in the event schema's words: name, category hint, bytes, phase hint, pool ("device" | "host");
    `outside_allocator`: device memory mapped outside torch's caching allocator (simulator/events.py
    Block.outside_allocator)."""

    name: str
    category: str
    nbytes: int
    phase: str
    pool: str
    outside_allocator: bool = False


# Sleep mode turns on the CuMemAllocator (vllm/config/model.py ModelConfig.__post_init__: enable_cumem_allocator);
# the worker then loads the weights, makes the KV cache and captures the CUDA graphs in its pool (gpu_worker.py
# _maybe_get_memory_pool_context tags "weights" / "kv_cache", cumem.py cudagraph_pool), outside torch's caching
# allocator. Without sleep mode they are torch's allocator's blocks (the context is a nullcontext). The profile run's
# activations are torch's either way.
CUMEM_POOLED = ("weights", "kv_cache", "cuda_graphs")


PHASES = ("engine_start", "generate", "sleep", "wake_weights", "weight_sync", "wake_kv_cache")


def engine_items(spec: VllmEngineSpec, sizing: EngineSizing, phase: str) -> list[Item]:
    """What the engine holds in `phase` (one of PHASES): weights, the KV pool, the CUDA graph pool, the profile
    run's transient peak (engine_start only; generation's activations are the generate describer's), non-torch
    memory, and the host copies sleep keeps. Phases after "generate" follow TRL's colocate loop with sleep mode:
    sleep (level spec.sleep_level), wake_up(["weights"]), load_weights, wake_up(["kv_cache"])."""
    if phase not in PHASES:
        raise ConfigError("phase", f"unknown value {phase!r}; allowed: {', '.join(PHASES)}")
    if sizing.error:
        raise ConfigError("gpu_memory_utilization", f"vLLM refuses to start: {sizing.error}")
    if phase in PHASES[2:] and not spec.sleep_level:
        raise ConfigError("sleep_level", f"phase {phase!r} needs sleep mode: sleep_level 1 or 2")
    weights, kv, graphs = weight_bytes(spec), sizing.kv_pool, cudagraph_estimate(spec)

    def dev(name, cat, n):
        outside = name == "non_torch" or bool(spec.sleep_level) and name in CUMEM_POOLED
        return Item(f"vllm.{name}", cat, n, phase, "device", outside)

    items = [dev("cuda_graphs", "workspace", graphs), dev("non_torch", "workspace", spec.non_torch_bytes)]
    if phase == "engine_start":
        items.append(dev("profile_run", "temporary", profile_peak(spec)))
    if phase != "sleep":
        items.insert(0, dev("weights", "parameter", weights))
    if phase in ("engine_start", "generate", "wake_kv_cache"):
        items.insert(1, dev("kv_cache", "kv_cache", kv))
    if phase == "sleep" and spec.sleep_level == 1:  # the host copies are let go at wake_up
        items.append(Item("vllm.weights.offloaded", "parameter", weights, phase, "host"))
    elif phase == "sleep":
        items.append(Item("vllm.buffers.saved", "buffer", rotary_table_bytes(spec), phase, "host"))
    return [i for i in items if i.nbytes]
