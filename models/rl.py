"""TRL 1.16.0's GRPOTrainer around the simulated training step (setup.rl, models/config/rl.py): the reference model,
the rollout (HF generate's KV cache, or a vLLM engine colocated on the GPU, models/vllm_engine.py) and the scoring
pass, each step before the update's micro-batches (the existing replay). docs/rl.md has the rules and citations.

Per step (grpo_trainer.py _prepare_inputs :1522-1551, _generate_and_score_completions :2324):
  ROLLOUT    the generation batch's new buffer (prompt / completion ids and masks int64, advantages fp32, the
             reference log-probs fp32), the previous one freed once it is replaced (:1545); with vLLM and sleep
             mode: wake_up(["weights"]), load_weights, wake_up(["kv_cache"]) (trl/generation/vllm_generation.py)
  PREFILL / DECODE   HF generate: the DynamicCache of n = micro_batch x grad_accum rows growing to prompt +
             completion - 1 positions (the last growth's concatenation holds one layer's old keys beside the new),
             the prompt's MLP step and the last token's logits (compute dtype and an fp32 copy);
  GENERATE   vLLM: the engine generates in its own pool; then sleeps (level 1: weights to pinned host memory)
  REFERENCE  (rl_beta != 0) the reference model's no_grad forward in chunks of micro_batch rows: per chunk the
             fused LM head's tile [min(N, 4096), 32768] (trl/kernels/chunked_logprob.py), the hidden states and
             the MLP step; with offload_reference its weights copied in for the pass and freed after.
The training process's memory when the engine starts (the trainer's __init__: policy and its buffers, reference, CUDA
context), as simulated up to that moment (`device_holdings`), is what `size_engine` checks vLLM's requested share
against. Peakledger's estimates, not a library's rule: the
prefill / reference forward's transient (the MLP step), the vLLM sampler's logits during generation."""

from __future__ import annotations

from ..simulator.events import Category, Phase, Pool
from .config import ConfigError, TransformerConfig, dtype_bytes
from .families import family_of
from .vllm_engine import VllmEngineSpec, engine_items, size_engine

TILE_TOKENS, TILE_VOCAB = 4096, 32768  # trl/kernels/chunked_logprob.py:31 TOKEN_CHUNK_SIZE, utils.py:1506


def engine_spec(model: TransformerConfig, setup) -> VllmEngineSpec:
    """The engine TRL builds (vllm_generation.py): max_num_seqs = per_device_train_batch_size x steps_per_generation,
    max_model_len = prompt + completion."""
    rl = setup.rl
    return VllmEngineSpec(model=model, dtype=setup.precision.compute,
                          gpu_memory_utilization=rl.vllm_gpu_memory_utilization,
                          max_num_seqs=setup.batch.micro_batch * setup.batch.grad_accum,
                          max_model_len=setup.batch.seq_len, kv_cache_dtype=rl.kv_cache_dtype,
                          sleep_level=rl.vllm_sleep_level, cudagraph_bytes=rl.vllm_cudagraph_mb << 20)


def training_in_use(model: TransformerConfig, setup, params: int, context: int) -> int:
    """The training process's device bytes when TRL starts the engine (the trainer's __init__): the CUDA context,
    the policy's parameters (+ fp32 master weights), the reference model's unless offloaded. No optimizer state
    yet (torch makes it at the first step). A formula, without the models' buffers (a few bytes); the simulated run
    checks the engine's start against its own holdings (`device_holdings`)."""
    p = setup.precision
    policy = params * (dtype_bytes(p.param) + (dtype_bytes(p.master) if p.master else 0))
    ref = 0 if setup.rl.beta == 0 or setup.rl.offload_reference else params * dtype_bytes(p.param)
    return context + policy + ref


def device_holdings(graph, rank: int) -> int:
    """The device bytes `rank`'s ops in `graph` hold live so far (its tensors, torch's or mapped outside it)."""
    live: dict[int, int] = {}
    for op in graph.ops_in_order():
        if op.rank == rank:
            for b in op.allocs:
                if b.pool is Pool.DEVICE:
                    live[b.id] = b.nbytes
            for i in op.frees:
                live.pop(i, None)
    return sum(live.values())


class GrpoRun:
    """The RL work of one rank's run, written through the rank's GraphBuilder."""

    def __init__(self, model, builder, context: int = 0) -> None:
        if not family_of(model).transformer:
            raise ConfigError("rl", "GRPO is simulated for decoder-only transformers (--preset, --hf-config)")
        self.m, self.b, self.setup = model, builder, builder.setup
        rl, batch = self.setup.rl, self.setup.batch
        self.rows = batch.micro_batch * batch.grad_accum
        self.completion = rl.max_completion_length
        self.prompt = batch.seq_len - self.completion
        self.params = sum(p.numel for p in builder.tape.params)
        self.cdtype = self.setup.precision.compute
        self.buffer: list = []
        self.ref_device: list = []
        self.engine = None
        self.context = context
        if rl.vllm == "colocate":
            self.spec = engine_spec(model, self.setup)
        elif rl.kv_cache_dtype != "auto":
            raise ConfigError("kv_cache_dtype", "fp8 is vLLM's KV cache: give --vllm colocate with it")

    # -- helpers ----------------------------------------------------------------------------------------------
    def _blk(self, name, nbytes, cat, dtype, shape=(), pool=Pool.DEVICE, pinned=False, outside=False):
        return self.b.block(name, nbytes, cat, dtype, shape, pool=pool, pinned=pinned, outside_allocator=outside)

    def _op(self, name, phase, step, allocs=(), frees=()):
        self.b.op(name, phase, step, -1, list(allocs), [b.id for b in frees], gemm=None)

    def _engine(self, phase_name: str) -> list:
        out = []
        for item in engine_items(self.spec, self.sizing, phase_name):
            cat = {"parameter": Category.PARAMETER, "kv_cache": Category.KV_CACHE, "workspace": Category.WORKSPACE,
                   "buffer": Category.BUFFER}.get(item.category, Category.TEMPORARY)
            pool = Pool.HOST if item.pool == "host" else Pool.DEVICE
            out.append(self._blk(item.name, item.nbytes, cat, self.spec.dtype, pool=pool,
                                 pinned=pool is Pool.HOST and item.name.endswith("offloaded"),
                                 outside=item.outside_allocator))
        return out

    # -- load: the reference model, the engine's start ------------------------------------------------------
    def load(self) -> None:
        p, rl = self.setup.precision, self.setup.rl
        if rl.beta:
            pool = Pool.HOST if rl.offload_reference else Pool.DEVICE
            self.ref = self._blk("ref_model.parameters", self.params * dtype_bytes(p.param), Category.PARAMETER,
                                 p.param, (self.params,), pool=pool)
            self._op("ref_model.load", Phase.LOAD, 0, [self.ref])
        if rl.vllm != "colocate":
            return
        in_use = self.context + device_holdings(self.b.graph, self.b.rank)
        self.sizing = size_engine(self.spec, self.b.device.memory_bytes, in_use)
        if self.sizing.error:
            raise ConfigError("vllm_gpu_memory_utilization", f"vLLM refuses to start: {self.sizing.error}")
        start = self._engine("engine_start")
        self._op("vllm.LLM", Phase.LOAD, 0, start)
        profile = [b for b in start if b.name == "vllm.profile_run"]
        self._op("vllm.profile_run.done", Phase.LOAD, 0, [], profile)
        self.engine = [b for b in start if b.name != "vllm.profile_run"]
        if rl.vllm_sleep_level:
            self._sleep(0, Phase.LOAD)

    def _sleep(self, step: int, phase: Phase) -> None:
        kept = {"vllm.cuda_graphs", "vllm.non_torch"}
        freed = [b for b in self.engine if b.name not in kept]
        self.engine = [b for b in self.engine if b.name in kept]
        host = [b for b in self._engine("sleep") if b.pool is Pool.HOST]
        self._op(f"vllm.sleep(level={self.spec.sleep_level})", phase, step, host, freed)
        self.host = host

    # -- one step's rollout and scoring -------------------------------------------------------------------
    def rollout(self, step: int) -> None:
        n, P, C = self.rows, self.prompt, self.completion
        new = [self._blk(f"rollout.{k}", n * t * 8, Category.INPUT, "int64", (n, t))
               for k, t in (("prompt_ids", P), ("prompt_mask", P), ("completion_ids", C), ("completion_mask", C))]
        new.append(self._blk("rollout.advantages", n * 4, Category.INPUT, "fp32", (n,)))
        if self.setup.rl.vllm == "colocate":
            self._vllm_generate(step)
        else:
            self._hf_generate(step)
        self._op("rollout.buffer", Phase.ROLLOUT, step, new)
        if self.setup.rl.beta:
            new.append(self._reference(step))
        self._op("rollout.buffer_replaced", Phase.ROLLOUT, step, [], self.buffer)
        self.buffer = new

    def _vllm_generate(self, step: int) -> None:
        if self.spec.sleep_level:
            host = getattr(self, "host", [])
            weights = [b for b in self._engine("wake_weights") if b.name == "vllm.weights"]
            self._op("vllm.wake_up(weights)", Phase.ROLLOUT, step, weights, host)
            self._op("vllm.load_weights", Phase.ROLLOUT, step)  # the weight sync, into the engine's own weights
            kv = [b for b in self._engine("wake_kv_cache") if b.name == "vllm.kv_cache"]
            self._op("vllm.wake_up(kv_cache)", Phase.ROLLOUT, step, kv)
            self.engine += weights + kv
        self._op("vllm.generate", Phase.GENERATE, step)
        if self.spec.sleep_level:
            self._sleep(step, Phase.ROLLOUT)

    def _hf_generate(self, step: int) -> None:
        m, n, cb = self.m, self.rows, dtype_bytes(self.cdtype)
        per_pos = n * m.kv_heads * m.head_size * cb  # one layer's keys (or values), one position
        prefill = [self._blk("generate.prefill.mlp", 3 * n * self.prompt * m.ffn * cb, Category.TEMPORARY, self.cdtype)]
        cache = [self._blk(f"kv_cache.layers.{i}.{kv}", per_pos * self.prompt, Category.KV_CACHE, self.cdtype)
                 for i in range(m.n_layer) for kv in ("keys", "values")]
        self._op("generate.prefill", Phase.PREFILL, step, prefill + cache)
        self._op("generate.prefill.done", Phase.PREFILL, step, [], prefill)
        last = self.prompt + self.completion - 1
        logits = [self._blk("generate.logits", n * m.vocab_size * cb, Category.TEMPORARY, self.cdtype),
                  self._blk("generate.logits.float", n * m.vocab_size * 4, Category.TEMPORARY, "fp32")]
        grown = [self._blk(b.name, per_pos * (last - 1), Category.KV_CACHE, self.cdtype) for b in cache]
        self._op("generate.decode", Phase.DECODE, step, grown + logits, cache)
        final = self._blk("kv_cache.layers.0.keys", per_pos * last, Category.KV_CACHE, self.cdtype)
        self._op("generate.decode.last", Phase.DECODE, step, [final], [grown[0]])  # the last cat: old beside new
        rest = [self._blk(b.name, per_pos * last, Category.KV_CACHE, self.cdtype) for b in grown[1:]]
        self._op("generate.decode.grown", Phase.DECODE, step, rest, grown[1:])
        self._op("generate.done", Phase.GENERATE, step, [], [final] + rest + logits)

    def _reference(self, step: int):
        m, cb, b = self.m, dtype_bytes(self.cdtype), self.setup.batch.micro_batch
        T = self.prompt + self.completion
        if self.setup.rl.offload_reference:
            dev = self._blk("ref_model.parameters.on_device", self.ref.nbytes, Category.PARAMETER, self.ref.dtype)
            self._op("ref_model.to(device)", Phase.REFERENCE, step, [dev])
        N = b * (T - 1)
        chunk = [self._blk("ref.mlp", 3 * b * T * m.ffn * cb, Category.TEMPORARY, self.cdtype),
                 self._blk("ref.hidden", 2 * b * T * m.d_model * cb, Category.TEMPORARY, self.cdtype),
                 self._blk("ref.lm_head_tile", min(N, TILE_TOKENS) * TILE_VOCAB * cb, Category.TEMPORARY, self.cdtype)]
        self._op("ref_model.forward", Phase.REFERENCE, step, chunk)
        out = self._blk("rollout.ref_per_token_logps", self.rows * self.completion * 4, Category.INPUT, "fp32",
                        (self.rows, self.completion))
        self._op("ref_model.forward.done", Phase.REFERENCE, step, [out], chunk)
        if self.setup.rl.offload_reference:
            self._op("ref_model.to(cpu)", Phase.REFERENCE, step, [], [dev])
        return out
