"""torchtune's activation offloading (`OffloadActivations`, `NoOpManager`), run as it is on a CPU-only torch.

The code run is the installed torchtune 0.6.1's own file, torchtune/training/_activation_offloading.py, loaded
without the rest of the package: `import torchtune` fails beside torch 2.13 and torchao 0.18.0 (torchtune 0.6.1's
torchtune/modules/common_utils.py imports `torchao.dtypes.nf4tensor` and `torchao.dtypes.TensorCoreTiledLayoutType`,
which torchao 0.18.0 no longer has). The file's own imports are given what they name: `torchtune.modules.TiedLinear`
and `torchtune.utils.get_logger` from their own files (tied_linear.py, utils/_logging.py: torch only), and
`torchao.dtypes.nf4tensor.NF4Tensor` from torchao 0.18.0's new place (quantization/quantize_/workflows/nf4), or, without
torchao (torchtune does not require it), a Tensor subclass nothing is and a `torchao` module of version "0": the file
only names NF4Tensor, and torchao's version, in an `isinstance` after a failed `empty_like`.

A CPU-only torch has no CUDA: `OffloadActivations.__init__` calls `torch.cuda.default_stream()` (AssertionError
"Torch not compiled with CUDA enabled"), `torch.empty_like(..., pin_memory=True)` raises RuntimeError ("pin_memory=True
requires a CUDA or other accelerator backend"), and the unpack hook's `.to("cuda", non_blocking=True)` raises. So the
module's `torch` is a view of torch whose `cuda` is `_CpuCuda`: streams and events that do nothing (a CPU runs one op
at a time: every copy is done when the next op starts), `torch.cuda.stream(s)` a null context; and a `.to("cuda")`
called from that file returns the tensor itself, as `.to("cpu")` of a CPU tensor does (no copy). Everything else is
the library's: which tensors it packs, its forward stash and when it lets each go, the backward stash and its
post-node hooks, the end-of-backward callback. `use_pin_memory` must be False on a CPU (see above).
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import sys
import types
from pathlib import Path

import torch

from .torchtune_files import load_file, torchtune_root

MODULE = "peakledger_torchtune_activation_offloading"  # the loaded file's module name (the `.to` stub's scope)


class _Stream:
    """A CUDA stream on a CPU: every wait and event is already satisfied."""

    def wait_stream(self, other) -> None:
        pass

    def wait_event(self, event) -> None:
        pass

    def record_event(self, event=None):
        return None


class _CpuCuda(types.SimpleNamespace):
    pass


def _cpu_cuda() -> _CpuCuda:
    default = _Stream()
    return _CpuCuda(default_stream=lambda device=None: default, Stream=lambda *a, **k: _Stream(),
                    stream=lambda s: contextlib.nullcontext(), is_available=lambda: False)


class _TorchView(types.ModuleType):
    """torch as the loaded file sees it: `torch.cuda` is `_CpuCuda`, everything else is torch's own."""

    def __init__(self) -> None:
        super().__init__("torch")
        self.cuda = _cpu_cuda()

    def __getattr__(self, name):
        return getattr(torch, name)


_real_to = torch.Tensor.to


def _to(self, *args, **kwargs):
    """`Tensor.to`; called from the loaded file with device "cuda", the tensor itself (a CPU has one memory)."""
    device = args[0] if args else kwargs.get("device")
    if isinstance(device, str) and device == "cuda" and sys._getframe(1).f_globals.get("__name__") == MODULE:
        return self
    return _real_to(self, *args, **kwargs)


def torchtune_file() -> Path | None:
    """The installed torchtune's _activation_offloading.py, or None without torchtune."""
    root = torchtune_root()
    if root is None:
        return None
    path = root / "training" / "_activation_offloading.py"
    return path if path.exists() else None


def torchtune_version() -> str:
    from importlib.metadata import version
    return version("torchtune")


_LOADED: types.ModuleType | None = None


def load() -> types.ModuleType:
    """torchtune's _activation_offloading module (its `OffloadActivations`, `NoOpManager`), loaded once as the
    module docstring says. ImportError without torchtune (or torchao)."""
    global _LOADED
    if _LOADED is not None:
        return _LOADED
    path = torchtune_file()
    if path is None:
        raise ImportError("torchtune is not installed (pip install torchtune==0.6.1 --no-deps)")
    root = path.parent.parent
    nf4_class, stub_torchao = None, None
    try:
        import torchao  # noqa: F401
    except ImportError:  # torchtune does not require torchao; the file names it only for NF4Tensor's error path
        stub_torchao = types.ModuleType("torchao")
        stub_torchao.__version__ = "0"
    if stub_torchao is None:
        for where in ("torchao.quantization.quantize_.workflows.nf4.nf4_tensor", "torchao.dtypes.nf4tensor"):
            try:
                nf4_class = importlib.import_module(where).NF4Tensor
                break
            except (ImportError, AttributeError):
                continue
    if nf4_class is None:
        nf4_class = type("NF4Tensor", (torch.Tensor,), {})  # nothing here is one
    saved = {k: sys.modules.get(k) for k in ("torchtune", "torchtune.modules", "torchtune.utils",
                                             "torchao.dtypes.nf4tensor", "torchao")}
    try:
        if stub_torchao is not None:
            sys.modules["torchao"] = stub_torchao
        pkg = types.ModuleType("torchtune")
        pkg.__path__ = []
        modules = types.ModuleType("torchtune.modules")
        modules.TiedLinear = load_file("peakledger_torchtune_tied_linear", root / "modules" / "tied_linear.py"
                                        ).TiedLinear
        utils = types.ModuleType("torchtune.utils")
        utils.get_logger = load_file("peakledger_torchtune_logging", root / "utils" / "_logging.py").get_logger
        nf4mod = types.ModuleType("torchao.dtypes.nf4tensor")
        nf4mod.NF4Tensor = nf4_class
        sys.modules.update({"torchtune": pkg, "torchtune.modules": modules, "torchtune.utils": utils,
                            "torchao.dtypes.nf4tensor": nf4mod})
        spec = importlib.util.spec_from_file_location(MODULE, path)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
    finally:
        for k, v in saved.items():
            if v is None:
                sys.modules.pop(k, None)
            else:
                sys.modules[k] = v
    if not torch.cuda.is_available():
        mod.torch = _TorchView()
        torch.Tensor.to = _to
    _LOADED = mod
    return mod


def offload_activations(stash: int = 5, min_bytes: int = 1024):
    """torchtune's `OffloadActivations(use_pin_memory=<CUDA there>, use_streams=True, max_fwd_stash_size=stash,
    min_offload_size=min_bytes)` and a `NoOpManager` for the output head (`get_act_offloading_ctx_manager`)."""
    mod = load()
    ctx = mod.OffloadActivations(use_pin_memory=torch.cuda.is_available(), use_streams=True,
                                 max_fwd_stash_size=stash, min_offload_size=min_bytes)
    return ctx, mod.NoOpManager()
