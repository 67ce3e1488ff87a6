"""The compiled describer: a traced model's training step as torch.compile (dynamo, AOTAutograd, inductor) runs it.

How the pieces compose:
- `step.py`    the region compiled: the traced loop's forward and loss as one function (`step_function`), the
               checkpointed layers wrapped as the real run wraps them; the measuring side compiles the same.
- `plan.py`    inductor's memory plan of each graph it lowers, read from the wrapper's planning lines
               (`PythonWrapperCodegen.memory_plan_reuse`): allocations, reuse, frees, with sizes from the IR; a
               multi-output fallback's outputs where the kernel returns them (the unread ones until its `del`);
               oneDNN's channels-last convolution backward's own weight-gradient copies.
- `workspace.py` what an extern GEMM takes for itself while it runs (oneDNN's scratchpad for 16-bit GEMMs, bmm's
               contiguous copies), measured on this CPU once per GEMM signature.
- `onednn.py`  which bf16 GEMMs oneDNN gives the same scratchpad (read from its brgemm configuration): a long K
               probed at a short one.
- `capture.py` dynamo + AOTAutograd + inductor run on the fake-tensor model (models/traced's build), codegen only:
               the plans, and one fake step through the real runtime: which graph ran when, on which storages;
               the forward's output layouts handed to AOTAutograd as a real compile hands them (the backward
               is lowered for inductor's channels-last layouts).
- `depth.py`   the capture of a HF model of many identical layers derived from compiles of few (3, 4 and 5; or 4,
               5 and 6; or 5, 6 and 7), checked on the deepest, instead of compiled whole.
- `convert.py` the plans replayed on those runs, as the project's tape (models/tape.py): forward ops, saves
               released at the backward graph's `del`, the compiled backward as recorded grad nodes,
               AccumulateGrad's copy of a gradient whose layout is not its parameter's.
- `gpu.py`     on a CUDA profile: whether this torch can lower the CUDA program for it (a CUDA build seeing a
               device of the profile's compute capability), and what its capture's cache key adds.
- here         `compiled_tape` (what `models.training.build_tape` calls when `setup.compile.on`) and the cache.

What is modelled: the CPU program (inductor's C++ kernels, as torch on this machine compiles them for
`step.CPU_THREADS` threads, which the real run uses too: the program depends on the count) and the CUDA program
(triton kernels, cuDNN attention, mix-order reductions: gpu.py, plan.py), one device, checkpointing none / full /
every-k / layers / op-policy (torch's selective checkpoint contexts) where dynamo keeps each checkpoint in its
graph (a checkpoint it runs eagerly between graphs, HF Llama's, is refused: capture.py `_eager_checkpoint`), fp32 /
bf16 / bf16-autocast, peft LoRA (not QLoRA's 4-bit base linears); the optimizer step stays eager. Not seen: the
internal temporaries of fallback kernels other than the convolution backward (SDPA's, for one; none measured on the
validated models), and the C++ kernels' own thread-local buffers (malloc, not torch's allocator: no run sees them
either).

The cache: per model digest, micro-batch, sequence length, parameter dtype, autocast, frozen parameters,
checkpointing (policy, k, layers), LoRA (rank, alpha, dropout, targets) and compile mode (`_CACHE`, the 16
latest), as the traced describer keeps its recordings.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING

from ..config import ConfigError, TrainingSetup
from ..tape import Tape
from ..traced import check_setup, model_key
from ..traced.model import TracedModel

if TYPE_CHECKING:
    from .capture import Capture

OPTIMIZER_STEP = "eager"  # the optimizer step is not compiled (torch.compile(opt.step) is not modelled yet)
_CACHE: OrderedDict = OrderedDict()
CACHE_SIZE = 16


def _key(model: TracedModel, setup: TrainingSetup) -> tuple:
    return (*model_key(model, setup), setup.precision.param, setup.precision.autocast, setup.optimizer.frozen,
            setup.checkpointing, setup.lora, setup.compile.mode)


def cached_capture(model: TracedModel, setup: TrainingSetup, cuda: bool = False) -> Capture:
    """The capture of `model` under `setup` (cached): derived from compiles of few layers where that is shown exact
    (depth.py), else compiled whole; `cuda`: the CUDA program of the device torch sees (gpu.py), compiled whole."""
    from .capture import compile_capture  # torch, dynamo and inductor: loaded for a compiled model only
    from .depth import capture_by_depth
    from .gpu import device_key

    key = (*_key(model, setup), *(device_key() if cuda else ()))
    hit = _CACHE.get(key)
    if hit is not None:
        _CACHE.move_to_end(key)
        return hit
    check_setup(model, setup)
    cap = None if cuda else capture_by_depth(model, setup)
    _CACHE[key] = cap = cap if cap is not None else compile_capture(model, setup, cuda=cuda)
    while len(_CACHE) > CACHE_SIZE:
        _CACHE.popitem(last=False)
    return cap


def compiled_tape(model, setup: TrainingSetup, cpu: bool, cuda: tuple | None = None) -> Tape:
    """The tape of `model`'s compiled training step under `setup` (see the module docstring); on a CUDA profile
    (`cuda`: its compute capability and the scenario's torch version) inductor's CUDA program (gpu.py)."""
    if not isinstance(model, TracedModel):
        raise ConfigError("compile", "torch.compile is modelled on traced models (--hf-config or --module; a "
                                     "scenario built from a preset runs its HF equivalent, peakledger/scenario.py); "
                                     "allowed here: compile off")
    if not cpu and cuda is None:
        raise ConfigError("device", "torch.compile is modelled on the cpu profile and on CUDA profiles; allowed "
                                    "with compile: cpu, a CUDA profile")
    if cuda is not None:
        from .gpu import gpu_check

        gpu_check(cuda[0])
        if setup.compile.mode == "reduce-overhead":  # torch/_inductor/__init__.py list_mode_options: cudagraphs
            raise ConfigError("compile_mode", "reduce-overhead records CUDA graphs, whose private memory pool "
                                              "(cudagraph trees) is not modelled yet; allowed on a CUDA profile: "
                                              "default")
    if setup.compile.mode == "max-autotune-no-cudagraphs":
        raise ConfigError("compile_mode", "max-autotune-no-cudagraphs benchmarks kernels to choose them, which a "
                                          "fake-tensor compile cannot; allowed: default, reduce-overhead")
    from .convert import to_tape  # (with .capture: torch)

    cap = cached_capture(model, setup, cuda=cuda is not None)
    graphs = f"{cap.graph_count} graph{'s' if cap.graph_count != 1 else ''}"
    from .gpu import running_torch

    program = "inductor CPU" if cuda is None else f"inductor CUDA (triton) of torch {running_torch()}"
    return to_tape(cap, setup, torch_version=running_torch(),
                   describer=f"compiled (torch.compile {setup.compile.mode}, {program}, {graphs}; "
                             f"optimizer step: {OPTIMIZER_STEP}; traced {model.kind}: {cap.model_class})")


__all__ = ["compiled_tape", "cached_capture", "OPTIMIZER_STEP"]
