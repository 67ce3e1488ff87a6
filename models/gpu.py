"""What a CUDA device allocates that the program's tensors do not show: rules of torch 2.6's CUDA paths.

The describers emit tensors; on a GPU device profile the replay adds what torch's CUDA libraries hold in
the caching allocator (so it counts in allocated and reserved memory), and the device profile names what
lies outside the allocator (counted in the device total only):

- cuBLAS workspace: one block per (cuBLAS handle, stream), allocated through the caching allocator at the
  handle's first GEMM and never freed (aten/src/ATen/cuda/CublasHandlePool.cpp, cublas_handle_stream_to_
  workspace). Handles are per thread: the forward runs on the Python thread, backward on autograd's
  device thread, so a training step holds two. Size (getChosenWorkspaceSize): 32 MiB (":4096:8") on sm90,
  else ":4096:2:16:8" = 8 MiB + 128 KiB. Seen in the shared H100 snapshots: 33,554,432 B blocks.
- CUDA context and the loaded kernels: outside the allocator; an assumption per device profile.
- NCCL communicator buffers (world size > 1): outside the allocator; NCCL_BUFFSIZE (4 MiB, NCCL's default)
  per channel for the ring's send and receive peers, times an assumed channel count.
"""

from __future__ import annotations

MiB = 1 << 20
NCCL_BUFFSIZE = 4 * MiB  # NCCL's default (docs: NCCL_BUFFSIZE)
NCCL_CHANNELS = 16  # assumption: NCCL's channel count on NVLink-connected H100/A100 nodes varies (8-32)


def cublas_workspace_bytes(compute_capability: tuple[int, int]) -> int:
    """getChosenWorkspaceSize (CublasHandlePool.cpp, torch 2.6): ":4096:8" on sm90, else ":4096:2:16:8"."""
    if compute_capability == (9, 0):
        return 4096 * 1024 * 8
    return 4096 * 1024 * 2 + 16 * 1024 * 8


def nccl_buffer_bytes(world_size: int) -> int:
    """Assumed NCCL buffers of one rank's data-parallel communicator: send + receive per channel."""
    return 0 if world_size <= 1 else 2 * NCCL_CHANNELS * NCCL_BUFFSIZE
