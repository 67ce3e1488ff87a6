"""torch 2.13's CUDA rules, read from the v2.13.0 wheel's own files (its headers, its Python, its yaml, its
libc10.so): what changed since 2.11 is listed in docs/gpu.md "What changed between torch 2.11 and 2.13". A wheel
ships no .cpp: the rules only they hold (round_size, the size checks of parseArgs, sdp_utils.cpp's kernel choice)
are 2.11's where the release's headers and Python show no change; torch 2.13.0's own parser (libc10.so,
`torch._C._accelerator_setAllocatorSettings`) refuses max_split_size_mb:19 and takes 20, as 2.11's."""

from .base import TorchRules
from .v2_11 import RULES as V2_11

_NEW_KEYS = {
    # c10/cuda/CUDAAllocatorConfig.h:174-175 (v2.13.0); not in v2.11.0's :146-161
    "pinned_free_catch_all", "throw_on_cudamalloc_oom",
    # c10/core/AllocatorConfig.h:330-336 parsePinnedMaxRoundThreshold / parsePinnedMaxCachedSize, :359-363 (host
    # allocator only); their names are the key strings of v2.13.0's libc10.so
    "pinned_max_round_threshold_mb", "pinned_max_cached_size_mb",
}

RULES = TorchRules(
    version="2.13",
    source="torch v2.13.0 (git cf30153c4c13), the wheel's files: c10/cuda/CUDAAllocatorConfig.h:158-175, "
           "c10/core/AllocatorConfig.h:17-25,228-236,330-363, ATen/cuda/CUDAContextLight.h:92-105, "
           "torch/backends/cuda/__init__.py:389-393, torch/_functorch/_aot_autograd/runtime_wrappers.py:3025-3026, "
           "torchgen/packaged/ATen/native/native_functions.yaml:3254-3256",
    alloc_keys=V2_11.alloc_keys | _NEW_KEYS,
    alloc_no_effect=V2_11.alloc_no_effect | {"pinned_free_catch_all", "pinned_max_round_threshold_mb",
                                             "pinned_max_cached_size_mb"},
    alloc_not_modelled=V2_11.alloc_not_modelled + (
        # CUDAAllocatorConfig.h:70-75: "throws OOM error before calling cudaMalloc if the allocation would likely
        # fail"; where it throws against freeing cached blocks is in CUDACachingAllocator.cpp, not read here
        ("throw_on_cudamalloc_oom", "2.13's OOM before cudaMalloc; its order against freeing cached blocks is not "
                                    "established"),
    ),
    max_split_strict=V2_11.max_split_strict,
    roundup_fill_after_last=V2_11.roundup_fill_after_last,
    # torch/backends/cuda/__init__.py:389-393: "When TORCH_CUBLASLT_UNIFIED_WORKSPACE is enabled (the default on
    # open-source CUDA builds), the cuBLASLt workspace is capped at the cuBLAS workspace size and physically reuses
    # the same allocation" (pytorch#168175, #175879, #173002): no block of its own
    cublaslt_workspace_bytes=0,
    fused_rms_norm=True,  # native_functions.yaml:3256 `CUDA: _fused_rms_norm_cuda`, as in 2.11
    sdpa="2.13",
    # PyPI's torch 2.13.0 (+cu130) requires nvidia-cudnn-cu13 9.20.0.48: torch.backends.cudnn.version() 92000 (the
    # library's own answer, bench/validate_fakecuda_rules.py); with CUDA >= 13, sdp_utils.cpp
    # check_prefer_cudnn_attention puts cuDNN first on any sm9x / sm10x ("cudnn_version > 91500 && (major == 9 ||
    # major == 10)"); torch 2.13.0's own `torch._fused_sdp_choice` on sm 9.0 answers CUDNN_ATTENTION for bf16/fp16
    sdpa_cudnn_version=92000,
    wheel_cuda_major=13,
    # runtime_wrappers.py:3025-3026: the generated backward's prologue `flat_args.clear()`
    compiled_backward_clears_grads=True,
    context_source=None,  # not measured under 2.13 yet (../shared/gpu-truth/PENDING.md item 2)
)
