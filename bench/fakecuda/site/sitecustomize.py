"""Loaded at start by bench/fakecuda/run.sh (PEAKLEDGER_FAKE_CUDA=1): the one Python patch a fake CUDA device needs
for torch.compile's memory plans. Triton's `CudaUtils` compiles and dlopens a helper against the real driver just to
exist (triton/backends/nvidia/driver.py), while torch only asks the driver for its target, which it takes from torch's
device capability (torch/utils/_triton.py); codegen never loads or launches a kernel."""

import os

if os.environ.get("PEAKLEDGER_FAKE_CUDA"):
    import triton.backends.nvidia.driver as _driver

    class _NoCudaUtils:
        def __getattr__(self, name):
            raise RuntimeError(f"fake CUDA device: triton's CudaUtils.{name} needs a real driver")

    _driver.CudaUtils = _NoCudaUtils
