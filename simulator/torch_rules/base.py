"""One torch release's CUDA rules, as one frozen value (`TorchRules`), and how a run picks the release.

Each rule set names what was read for it (`source`); its fields are the rules other modules branch on:
simulator/allocator/config.py (the PYTORCH_CUDA_ALLOC_CONF parser), models/gpu.py (cuBLAS(Lt) workspaces, the
fused RMSNorm kernel, the SDPA kernel rules), models/cuda_context.py (where the context was measured) and
models/compile/convert.py (what a compiled backward keeps alive). The constants of the caching allocator's sizes
(kMinBlockSize ... kRoundLarge) are the same in every modelled release (c10/core/AllocatorConfig.h:17-25 at v2.11.0
and v2.13.0; c10/cuda/CUDACachingAllocator.cpp in 2.6) and stay in simulator/allocator/config.py.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ..safe_io import InputError


@dataclass(frozen=True)
class TorchRules:
    """The CUDA rules of one torch minor release (module docstring)."""

    version: str  # "2.13": major.minor
    source: str  # what was read: the release's tag and git commit, the files
    # -- the caching allocator's settings parser (PYTORCH_CUDA_ALLOC_CONF) ------------------------------------
    alloc_keys: frozenset[str]  # every key its parser accepts; any other is an error
    alloc_no_effect: frozenset[str]  # accepted and validated, no effect on the device allocator's blocks
    alloc_not_modelled: tuple[tuple[str, str], ...]  # (key, why) accepted by torch, refused by the model
    max_split_strict: bool  # max_split_size_mb / max_non_split_rounding_mb: > 20 (True) or >= 20 MiB
    roundup_fill_after_last: bool  # roundup_power2_divisions' '>': from the interval after the last one given
    # -- cuBLAS / cuBLASLt (aten/src/ATen/cuda/CublasHandlePool.cpp) ----------------------------------------------
    cublaslt_workspace_bytes: int  # a block of its own per (handle, stream) beside the cuBLAS workspace; 0: none
    # -- kernel paths ------------------------------------------------------------------------------------------
    fused_rms_norm: bool  # aten::rms_norm on CUDA runs _fused_rms_norm_cuda
    sdpa: str  # the SDPA kernel rules of models/gpu.py: "2.6" or "2.13" (flash's rng state on the device, ...)
    # -- torch.compile (torch/_functorch/_aot_autograd/runtime_wrappers.py) -------------------------------------
    compiled_backward_clears_grads: bool  # the compiled backward clears the gradients list it is given
    # -- outside the allocator ------------------------------------------------------------------------------------
    context_source: str | None  # where the CUDA context was measured under this release (models/cuda_context.py)
    # -- SDPA: cuDNN attention (aten/src/ATen/native/transformers/cuda/sdp_utils.cpp check_prefer_cudnn_attention) -
    # the cuDNN version (cudnnGetVersion) and CUDA major of the release's default PyPI CUDA wheel, what the check
    # reads to put cuDNN attention first; None: not established here (cuDNN never first in the model)
    sdpa_cudnn_version: int | None = None
    wheel_cuda_major: int = 12

    def not_modelled(self) -> dict[str, str]:
        return dict(self.alloc_not_modelled)

    @property
    def key(self) -> tuple[int, int]:
        return major_minor(self.version)


def major_minor(text: str | None) -> tuple[int, int]:
    """"2.13", "2.13.0", "2.13.0+cpu" -> (2, 13); a text that is not a version is refused."""
    m = re.match(r"\s*(\d+)\.(\d+)", str(text or ""))
    if m is None:
        raise InputError("torch_version", f"{text!r} is not a torch version (major.minor, e.g. 2.13)")
    return int(m.group(1)), int(m.group(2))


def pick(rules: tuple[TorchRules, ...], version: str) -> tuple[TorchRules, bool]:
    """(the rule set for `version`, whether it is that release's own): its own when modelled, else the newest
    modelled release not newer than it, else (older than all) the oldest."""
    want = major_minor(version)
    own = next((r for r in rules if r.key == want), None)
    if own is not None:
        return own, True
    older = [r for r in rules if r.key < want]
    return (max(older, key=lambda r: r.key) if older else min(rules, key=lambda r: r.key)), False


def default_note(rules: tuple[TorchRules, ...], installed: str | None) -> tuple[TorchRules, str]:
    """The rule set a run follows when none is asked for, and why, in the report's words: the installed torch's
    own when modelled, else the nearest (`pick`); with no torch installed, the newest modelled."""
    if installed is None:
        newest = max(rules, key=lambda r: r.key)
        return newest, f"no torch installed: the newest modelled, torch {newest.version}'s rules"
    chosen, own = pick(rules, installed)
    short = installed.partition("+")[0]
    if own:
        return chosen, f"torch {short} installed: its rules"
    return chosen, f"torch {short} installed, not modelled: torch {chosen.version}'s rules, the nearest"


__all__ = ["TorchRules", "major_minor", "pick", "default_note"]
