"""torch 2.6's CUDA rules: the release that recorded the real H100 snapshots (../shared/gpu-truth/snapshots)."""

from .base import TorchRules

RULES = TorchRules(
    version="2.6",
    source="torch 2.6 (c10/cuda/CUDAAllocatorConfig.cpp parseArgs, CUDACachingAllocator.cpp; aten/src/ATen/cuda/"
           "CublasHandlePool.cpp; aten/src/ATen/native/transformers/cuda/sdp_utils.cpp as of 2.5.1-2.6)",
    # CUDAAllocatorConfig::parseArgs: the allocator's keys and the host (pinned) allocator's, in one parser
    alloc_keys=frozenset({
        "max_split_size_mb", "max_non_split_rounding_mb", "garbage_collection_threshold", "roundup_power2_divisions",
        "expandable_segments", "backend", "release_lock_on_cudamalloc", "release_lock_on_hipmalloc",
        "pinned_use_cuda_host_register", "pinned_use_hip_host_register", "pinned_num_register_threads",
        "pinned_use_background_threads"}),
    alloc_no_effect=frozenset({
        "release_lock_on_cudamalloc", "release_lock_on_hipmalloc", "pinned_use_cuda_host_register",
        "pinned_use_hip_host_register", "pinned_num_register_threads", "pinned_use_background_threads"}),
    alloc_not_modelled=(),
    max_split_strict=True,  # parseMaxSplitSize: "> kLargeBuffer / (1024 * 1024)"
    roundup_fill_after_last=False,  # parseRoundUpPower2Divisions: '>' fills from last_index
    cublaslt_workspace_bytes=0,  # a workspace per Lt call, freed when it returns; its size not established here
    fused_rms_norm=False,  # no _fused_rms_norm: rms_norm is the composite of pow, mean, rsqrt and products
    sdpa="2.6",  # flash's seed/offset on the host, flash and efficient on sm50/sm80-sm90 only
    compiled_backward_clears_grads=False,
    context_source=None,  # the snapshots hold no device-wide free or total
)
