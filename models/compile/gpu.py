"""The compiled program on a CUDA device profile: inductor's CUDA (triton) program, as torch lowers it for the device
it sees, on fake `cuda:0` tensors (capture.py with `cuda`), cached with the other captures (`__init__.cached_capture`,
its key holding `device_key`).

Inductor's program depends on the torch that lowers it and on the device: its kernels and fusions (triton's heuristics
read the SM count and the compute capability), the SDPA kernel aten picks (cuDNN attention on sm90 under compile, where
HF passes an explicit mask), the layouts it pads. So the program is obtained from a CUDA build of torch, for the device
it sees: a device profile of another compute capability than that device's is refused, naming both. The program is
the running torch's (its describer line names the version; plans differ between versions: bench/COMPILE_GPU_FINDINGS
.md), the scenario's `torch_version` choosing the allocator's rules as for any program. On a machine without a GPU a
CUDA build of torch still lowers for a device when one answers for it (bench/fakecuda: a fake CUDA runtime, for
validation).

What the GPU program adds to a plan (plan.py): a mix-order reduction's eager reduce written as a text line, the cuDNN
attention backward's workspace, padded layouts' storage sizes; cuBLAS's workspaces are the replay's (models/gpu.py).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

from ..config import ConfigError

# a CUDA (or ROCm) build of torch ships c10's device code as a library of its own: torch/lib/libc10_cuda.so,
# c10_cuda.dll, libc10_hip.so (c10/cuda/CMakeLists.txt `add_library(c10_cuda ...)`, torch 2.6 to 2.13)
DEVICE_LIBRARIES = ("libc10_cuda.*", "c10_cuda.*", "libc10_hip.*")


def running_torch() -> str:
    """The running torch's major.minor version ("2.11")."""
    import torch

    return ".".join(torch.__version__.split("+")[0].split(".")[:2])


def gpu_check(capability: tuple[int, int] | None) -> None:
    """Refuse a CUDA profile whose program this torch cannot lower: no CUDA build, no device, another compute
    capability than the profile's. (The scenario's `torch_version`, the allocator's rules, is not checked: the
    program is the running torch's, as its describer line says.)"""
    import torch

    if not torch.backends.cuda.is_built():
        raise ConfigError("device", f"torch.compile's CUDA program is lowered by torch's CUDA build for the device "
                                    f"it sees; this torch ({torch.__version__}) has no CUDA: install a CUDA build of "
                                    "torch to simulate it; allowed with compile on this install: cpu")
    if not torch.cuda.is_available():
        raise ConfigError("device", f"torch.compile's CUDA program is lowered for the device torch sees, and this "
                                    f"torch ({torch.__version__}) sees none; allowed with compile here: cpu")
    seen = torch.cuda.get_device_capability(0)
    if capability is not None and tuple(seen) != tuple(capability):
        raise ConfigError("device", f"the device profile is sm {capability[0]}.{capability[1]}, torch sees "
                                    f"{torch.cuda.get_device_name(0)} (sm {seen[0]}.{seen[1]}): inductor's program "
                                    "depends on the device; simulate compile on a profile of the device torch sees")


def cuda_build_possible() -> bool:
    """False when the installed torch is surely no CUDA build (its lib folder holds no c10 device library), found
    without importing torch (seconds); True when it may be one, or when torch is imported already."""
    if "torch" in sys.modules:
        return True
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return True  # (no torch found here: gpu_check's import says what there is)
    lib = Path(next(iter(spec.submodule_search_locations))) / "lib"
    return not lib.is_dir() or any(any(lib.glob(pattern)) for pattern in DEVICE_LIBRARIES)


def lowerable(capability: tuple[int, int] | None) -> bool:
    """Whether `gpu_check` lets this torch lower a CUDA profile's program (a torch without CUDA, without importing
    it: `explain` asks for every GPU run)."""
    if not cuda_build_possible():
        return False
    try:
        gpu_check(capability)
    except ConfigError:
        return False
    return True


def device_key() -> tuple:
    """What a CUDA capture depends on beyond the setup: the device torch sees and the lowering torch."""
    import torch

    return ("cuda", torch.cuda.get_device_name(0), running_torch())


__all__ = ["gpu_check", "lowerable", "device_key", "running_torch"]
