"""The checks of the offloads a setup may ask for, one function per offload, each run in models/config/checks.py's
SECTION_CHECKS order: the optimizer states' own offload (`optimizer_offload`, torchao's CPUOffloadOptimizer among
its modes), FSDP2's CPUOffloadPolicy (`fsdp_cpu_offload`), DeepSpeed's ZeRO-Offload (`zero_offload_optimizer`) and
the activations' offload (`activation_offload`)."""

from __future__ import annotations

from ..optimizers import OPTIMIZERS as OPTIMIZER_REGISTRY
from ..precision import PRECISION_TABLE
from .base import ConfigError, choice_of, non_negative_int, positive_int
from .choices import ACTIVATION_OFFLOADS, OFFLOAD_FIRST_STEPS, OPTIMIZER_OFFLOADS


def optimizer_offload_fields(knobs) -> None:
    """`optimizer_offload` and its knobs (models/optimizers.py): a mode this describer models, on an
    optimizer with tensor states, under an engine that leaves the torch optimizer's states alone."""
    choice_of(knobs, "optimizer_offload", OPTIMIZER_OFFLOADS)
    choice_of(knobs, "offload_first_step", OFFLOAD_FIRST_STEPS)
    positive_int(knobs, "offload_chunk_params")
    non_negative_int(knobs, "offload_prefetch")
    mode = knobs.optimizer_offload
    if knobs.offload_first_step != "whole" and mode != "chunked":
        raise ConfigError("offload_first_step", f"{knobs.offload_first_step!r} only applies to optimizer_offload "
                                                f"\"chunked\", not {mode!r}")
    if mode == "none":
        return
    if mode == "cpu":
        _torchao_cpu_offload_fields(knobs)
    if knobs.optimizer == "sgd":
        raise ConfigError("optimizer_offload", "optimizer 'sgd' keeps no state to offload; allowed with: "
                                               "sgd-momentum, adam, adamw, amsgrad")
    if knobs.optimizer == "adam-8bit":
        raise ConfigError("optimizer_offload", "bitsandbytes' 8-bit states (its paged optimizers) are not modelled "
                                               "for offload; allowed with: sgd-momentum, adam, adamw, amsgrad")
    if not OPTIMIZER_REGISTRY[knobs.optimizer].lazy:
        raise ConfigError("optimizer_offload", f"{knobs.optimizer} makes its states in its constructor, not in the "
                                               "first step: its offload is not modelled; allowed with: "
                                               "sgd-momentum, adam, adamw, amsgrad, rmsprop")
    if OPTIMIZER_REGISTRY[knobs.optimizer].by_shape:
        raise ConfigError("optimizer_offload", f"{knobs.optimizer}'s states follow each parameter's shape: their "
                                               "offload is not modelled; allowed with it: none")
    if knobs.dp_engine == "deepspeed" and (knobs.world_size > 1 or knobs.zero_stage):
        raise ConfigError("optimizer_offload", "DeepSpeed offloads through its own offload_optimizer (ZeRO-Offload: "
                                               "zero_offload_optimizer cpu, stage 2); allowed here: none, or one "
                                               "device, fsdp2, ddp or zero-redundancy-optimizer")
    if knobs.load_mode != "none":
        raise ConfigError("load_mode", f"{knobs.load_mode!r} with optimizer_offload {mode!r} (states loaded, then "
                                       "moved to the host) is not modelled; allowed there: none")
    if knobs.save_mode.startswith("full-") and knobs.world_size > 1:
        raise ConfigError("save_mode", f"{knobs.save_mode!r} gathers sharded states on the device; with host-resident "
                                       "offloaded states that is not modelled; allowed there: torch-save, sharded, "
                                       "async")


def _torchao_cpu_offload_fields(knobs) -> None:
    """optimizer_offload "cpu" (torchao 0.18.0 torchao/optim/cpu_offload.py `CPUOffloadOptimizer`, models/
    offload_libraries.py): "for single-GPU training"; its default optimizer, AdamW with fused=True, or Adam /
    AMSGrad fused, over the parameters themselves (no master copy); offload_gradients "not compatible with
    gradient accumulation"."""
    if knobs.optimizer not in ("adam", "adamw", "amsgrad") or knobs.optimizer_impl != "fused":
        raise ConfigError("optimizer_offload", f"'cpu' (torchao CPUOffloadOptimizer) is modelled with its default, a "
                                               f"fused Adam step on the host, not {knobs.optimizer} "
                                               f"{knobs.optimizer_impl}; allowed with: adam, adamw, amsgrad with "
                                               "optimizer_impl fused")
    if knobs.world_size != 1 or knobs.dp_engine == "fsdp2" or knobs.zero_stage:
        raise ConfigError("optimizer_offload", "'cpu' (torchao CPUOffloadOptimizer) is for single-GPU training "
                                               "over plain parameters; allowed with: world_size 1, no fsdp2, "
                                               "zero_stage 0")
    if PRECISION_TABLE[knobs.precision].mixed:
        allowed = ", ".join(p.name for p in PRECISION_TABLE.values() if not p.mixed)
        raise ConfigError("optimizer_offload", f"'cpu' (torchao CPUOffloadOptimizer) steps the parameters' own "
                                               f"host copies; precision {knobs.precision!r} keeps a master copy, "
                                               f"not modelled; allowed with: {allowed}")
    if knobs.offload_gradients and knobs.grad_accum > 1:
        raise ConfigError("offload_gradients", "torchao: offload_gradients is not compatible with gradient "
                                               "accumulation; allowed with: grad_accum 1")


def fsdp_cpu_offload(knobs) -> None:
    """fsdp_cpu_offload (torch 2.13 fully_shard's CPUOffloadPolicy, models/parallel/fsdp.py): modelled with a fused
    Adam step on the host, over plain data parallelism, without another offload, checkpoint I/O or LoRA."""
    if not knobs.fsdp_cpu_offload or knobs.dp_engine != "fsdp2" or knobs.world_size < 2:
        return  # elsewhere the knob is refused as never read (models/dp_engines.py)
    if knobs.optimizer not in ("adam", "adamw", "amsgrad") or knobs.optimizer_impl != "fused":
        raise ConfigError("fsdp_cpu_offload", f"modelled with a fused Adam step on the CPU, not {knobs.optimizer} "
                                              f"{knobs.optimizer_impl}; allowed with: adam, adamw, amsgrad with "
                                              "optimizer_impl fused")
    for name, ok, allowed in (("optimizer_offload", knobs.optimizer_offload == "none", "none"),
                              ("pp", knobs.pp == 1, "1"), ("tp", knobs.tp == 1, "1"), ("cp", knobs.cp == 1, "1"),
                              ("checkpoint_every", knobs.checkpoint_every == 0, "0"),
                              ("load_mode", knobs.load_mode == "none", "none"),
                              ("build", knobs.build == "direct", "direct"), ("lora_r", knobs.lora_r == 0, "0"),
                              ("loop", knobs.loop == "plain", "plain (clipping host gradients is not modelled)")):
        if not ok:
            raise ConfigError(name, f"{getattr(knobs, name)!r} with fsdp_cpu_offload is not modelled; allowed with "
                                    f"it: {allowed}")


def zero_offload(knobs) -> None:
    """zero_offload_optimizer cpu (DeepSpeed 0.19.8 runtime/zero/stage_1_and_2.py `cpu_offload`, models/parallel/
    deepspeed.py): DeepSpeedCPUAdam (Adam / AdamW, one fused kernel: optimizer_impl fused), stage 2 over plain data
    parallelism, without another offload, checkpoint I/O or LoRA."""
    choice_of(knobs, "zero_offload_optimizer", ("none", "cpu"))
    if knobs.zero_offload_optimizer == "none" or knobs.dp_engine != "deepspeed" or knobs.zero_stage != 2 \
            or knobs.world_size < 2:
        return  # elsewhere the knob is refused as never read (models/dp_engines.py)
    if knobs.optimizer not in ("adam", "adamw") or knobs.optimizer_impl != "fused":
        raise ConfigError("zero_offload_optimizer", f"ZeRO-Offload steps with DeepSpeedCPUAdam (one fused kernel), "
                                                    f"not {knobs.optimizer} {knobs.optimizer_impl}; allowed with: "
                                                    "adam, adamw with optimizer_impl fused")
    for name, ok, allowed in (("pp", knobs.pp == 1, "1"), ("tp", knobs.tp == 1, "1"), ("cp", knobs.cp == 1, "1"),
                              ("checkpoint_every", knobs.checkpoint_every == 0, "0"),
                              ("load_mode", knobs.load_mode == "none", "none"), ("lora_r", knobs.lora_r == 0, "0"),
                              ("grad_accum", knobs.grad_accum == 1, "1 (accumulating in host buffers is not "
                                                                    "modelled)")):
        if not ok:
            raise ConfigError(name, f"{getattr(knobs, name)!r} with zero_offload_optimizer cpu is not modelled; "
                                    f"allowed with it: {allowed}")


def activation_offload(knobs) -> None:
    """`activation_offload` and its two knobs (torchtune's OffloadActivations raises ValueError for a forward stash
    under 1: torchtune/training/_activation_offloading.py, 0.6.1), and what it is modelled with."""
    choice_of(knobs, "activation_offload", ACTIVATION_OFFLOADS)
    positive_int(knobs, "activation_offload_stash")
    non_negative_int(knobs, "activation_offload_min_bytes")
    mode = knobs.activation_offload
    if mode == "none":
        for name, default in (("activation_offload_stash", 5), ("activation_offload_min_bytes", 1024)):
            if getattr(knobs, name) != default:
                raise ConfigError(name, "only applies to activation_offload streams")
        return
    if mode == "save-on-cpu" and knobs.checkpointing not in ("none", "offload"):
        raise ConfigError("activation_offload", f"save-on-cpu is checkpointing \"offload\"; with checkpointing "
                                                f"{knobs.checkpointing!r} it is not modelled; allowed with: none, "
                                                "offload")
    for name, ok, allowed in (
            ("checkpointing", mode != "streams" or knobs.checkpointing == "none", "none"),
            ("compile", not knobs.compile, "off"),
            ("lora_r", knobs.lora_r == 0, "0"),
            ("world_size", mode != "streams" or knobs.world_size == 1, "1"),
            ("pp", knobs.pp == 1, "1"),
            ("passes", mode != "streams" or knobs.passes == "train", "train")):
        if not ok:
            raise ConfigError(name, f"{getattr(knobs, name)!r} with activation_offload {mode} is not modelled yet; "
                                    f"allowed with it: {allowed}")
