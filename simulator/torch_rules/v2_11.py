"""torch 2.11's CUDA rules: the release that recorded the H200 snapshots (../shared/gpu-truth/h200)."""

from .base import TorchRules
from .v2_6 import RULES as V2_6

RULES = TorchRules(
    version="2.11",
    source="torch v2.11.0 (git 70d99e998b49): c10/cuda/CUDAAllocatorConfig.h:146-161 and c10/core/AllocatorConfig.h"
           ":238-248 (the keys), c10/core/AllocatorConfig.cpp AcceleratorAllocatorConfig::parseArgs, "
           "CUDAAllocatorConfig.cpp; aten/src/ATen/cuda/CublasHandlePool.cpp getCUDABlasLtWorkspace; "
           "native_functions.yaml:3349-3351 (_fused_rms_norm)",
    alloc_keys=V2_6.alloc_keys | {"large_segment_size_mb", "per_process_memory_fraction",
                                  "graph_capture_record_stream_reuse", "pinned_reserve_segment_size_mb"},
    alloc_no_effect=V2_6.alloc_no_effect | {"graph_capture_record_stream_reuse", "pinned_reserve_segment_size_mb"},
    alloc_not_modelled=(
        ("large_segment_size_mb", "2.11's setting of the large pool's segment and page size, kLargeBuffer by default"),
        ("per_process_memory_fraction", "pass the allowed bytes as the capacity instead"),
    ),
    max_split_strict=False,  # parseMaxSplitSize: ">= kLargeBuffer / (1024 * 1024)"
    roundup_fill_after_last=True,  # parseRoundUpPower2Divisions: '>' fills from last_index + 1
    # getCUDABlasLtWorkspace: CUBLASLT_WORKSPACE_SIZE's default 1024 KiB, a block of its own per (handle, stream)
    # (seen in the H200 snapshots: 1,048,576 B after the 33,554,432 B cuBLAS workspace)
    cublaslt_workspace_bytes=1024 * 1024,
    fused_rms_norm=True,  # native_functions.yaml:3351 `CUDA: _fused_rms_norm_cuda` (pytorch#153666)
    sdpa="2.13",  # flash's rng state on the device (2.7+), flash/efficient up to sm121
    # runtime_wrappers.py:2673 `def backward(ctx, *flat_args)`: the engine's gradients held in the tuple to its end
    compiled_backward_clears_grads=False,
    context_source="../shared/gpu-truth/h200",  # H200, torch 2.11.0+cu130 (hf-runs/measured.json)
)
