"""The checks of a `TrainingSetup`, one function per concern, run in one order by `check_setup` on the setup's
knobs by name (`knobs.lora_r`: each error names the knob as the user gave it). What each knob may be (the CHOICES
tuples) is models/config/choices.py; the offloads' checks are offload_checks.py's, the RL section's rl.py's; which
knobs a setup reads (`check_given_knobs`: a knob the user set that this setup never reads is refused, not ignored)
is applies.py."""

from __future__ import annotations

from ..dp_engines import DP_ENGINES as DP_ENGINE_REGISTRY
from ..dp_engines import ENGINE_ALIASES, REDUCE_DTYPES
from ..optimizers import OPTIMIZERS as OPTIMIZER_REGISTRY
from ..precision import PRECISION_ALIASES, PRECISIONS
from .base import INT64_MAX, ConfigError, at_most, choice_of, positive_int
from .choices import (
    BUILDS,
    CHECKPOINTING,
    COMPILE_CHECKPOINTING,
    COMPILE_MODES,
    COMPILE_PRECISIONS,
    FP8_RECIPES,
    LOAD_MODES,
    LOOPS,
    OPTIMIZER_IMPLS,
    OPTIMIZERS,
    PASSES,
    PP_SCHEDULES,
    QUANTIZE,
    SAVE_MODES,
)
from .offload_checks import activation_offload, fsdp_cpu_offload, optimizer_offload_fields, zero_offload
from .rl import check_rl


def _checkpoint_layers(knobs) -> None:
    """`checkpoint_layers`: distinct layer indices >= 0, given only with checkpointing "layers"."""
    layers = knobs.checkpoint_layers
    if not isinstance(layers, tuple) or any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in layers):
        raise ConfigError("checkpoint_layers", f"must be a list of layer indices >= 0, got {layers!r}")
    if len(set(layers)) != len(layers):
        raise ConfigError("checkpoint_layers", f"lists a layer twice: {layers!r}")
    if layers and knobs.checkpointing != "layers":
        raise ConfigError("checkpoint_layers", f"only applies to checkpointing \"layers\", not {knobs.checkpointing!r}")


def _checkpoint_io_fields(knobs) -> None:
    """`checkpoint_every` >= 0, `save_mode` / `load_mode` known; a full state dict needs an engine whose
    gather is modelled (not ZeroRedundancyOptimizer's consolidate_state_dict)."""
    every = knobs.checkpoint_every
    if isinstance(every, bool) or not isinstance(every, int) or every < 0:
        raise ConfigError("checkpoint_every", f"must be an integer >= 0 (0 = never save), got {every!r}")
    choice_of(knobs, "save_mode", SAVE_MODES)
    choice_of(knobs, "load_mode", LOAD_MODES)
    if knobs.save_mode.startswith("full-") and knobs.dp_engine == "zero-redundancy-optimizer":
        raise ConfigError("save_mode", f"{knobs.save_mode!r} with zero-redundancy-optimizer (consolidate_state_dict) "
                                       "is not modelled; allowed there: torch-save, sharded, async")


def _lora_fields(knobs) -> None:
    """LoRA knobs (models/lora.py): rank >= 0, alpha > 0, dropout in [0, 1), quantize known; nf4 needs adapters
    (transformers' Trainer refuses to fine-tune a purely quantized model); one device only."""
    r = knobs.lora_r
    if isinstance(r, bool) or not isinstance(r, int) or r < 0 or r > INT64_MAX:
        raise ConfigError("lora_r", f"must be an integer >= 0 (0 = no LoRA), got {r!r}")
    alpha, p = knobs.lora_alpha, knobs.lora_dropout
    if not 0 < alpha < float("inf"):
        raise ConfigError("lora_alpha", f"must be a finite number > 0 (scaling = lora_alpha / lora_r), got {alpha!r}")
    if not 0 <= p < 1:
        raise ConfigError("lora_dropout", f"must be a number in [0, 1), got {p!r}")
    if len(set(knobs.lora_targets)) != len(knobs.lora_targets) or not all(knobs.lora_targets):
        raise ConfigError("lora_targets", f"must be distinct non-empty module names, got {knobs.lora_targets!r}")
    choice_of(knobs, "quantize", QUANTIZE)
    if knobs.quantize != "none" and r == 0:
        raise ConfigError("quantize", f"{knobs.quantize!r} freezes every base linear in 4 bits: nothing would train; "
                                      "give lora_r > 0 (QLoRA), or quantize none")
    if knobs.quantize != "none" and not knobs.prec.uniform:
        raise ConfigError("quantize", f"{knobs.quantize!r} is modelled with precision fp32 or bf16 "
                                      f"(Linear4bit's compute "
                                      f"dtype), not {knobs.precision!r}; allowed: fp32, bf16")
    if r and (knobs.world_size > 1 or knobs.zero_stage or knobs.dp_engine != "deepspeed"):
        raise ConfigError("lora_r", "LoRA is modelled on one device without a data-parallel engine; allowed with it: "
                                    "world_size 1, zero_stage 0, dp_engine left out")
    if r and knobs.checkpointing in ("offload", "op-policy"):  # what they keep of frozen / 4-bit linears: unmodelled
        raise ConfigError("checkpointing", f"{knobs.checkpointing!r} with LoRA is not modelled; allowed with it: none, "
                                           "full, every-k, selective, sqrt, layers")
    if r and knobs.optimizer_offload != "none":
        raise ConfigError("lora_r", "LoRA with optimizer_offload is not modelled; allowed with it: optimizer_offload "
                                    "none")


def _build_field(knobs) -> None:
    """`build` (BUILDS): "device-fp32" is the program of one device, or of FSDP2 ranks, that builds the model on its
    GPU; what model parallelism, DeepSpeed's or DDP's wrapping, the fp32 master copies of a mixed precision outside
    FSDP2, 4-bit base weights or a model built on the meta device (meta-assign) would do to it is not modelled."""
    choice_of(knobs, "build", BUILDS)
    if knobs.build == "direct":
        return
    if knobs.tp * knobs.pp * knobs.cp * knobs.ep > 1:
        what, needs = f"tp {knobs.tp}, pp {knobs.pp}, cp {knobs.cp}, ep {knobs.ep}", "tp, pp, cp and ep 1"
    elif knobs.dp_engine != "fsdp2" and (knobs.world_size > 1 or knobs.zero_stage or knobs.dp_engine != "deepspeed"):
        what = f"dp_engine {knobs.dp_engine}, world_size {knobs.world_size}, zero_stage {knobs.zero_stage}"
        needs = "one device (dp_engine and zero_stage left out) or dp_engine fsdp2"
    elif knobs.prec.master and knobs.dp_engine != "fsdp2":
        what, needs = (f"precision {knobs.precision} outside fsdp2",
                       "precision fp32, bf16 or *-autocast, or dp_engine fsdp2")
    elif knobs.quantize != "none":
        what, needs = f"quantize {knobs.quantize}", "quantize none"
    elif knobs.load_mode == "meta-assign":
        what, needs = "load_mode meta-assign (a model built on the meta device)", "load_mode none, full-then-device " \
                                                                                  "or map-to-device"
    else:
        return
    raise ConfigError("build", f"{knobs.build!r} is not modelled with {what} (it needs {needs}); allowed here: "
                               f"{BUILDS[0]}")


def _model_parallel_fields(knobs) -> None:
    """The model-parallel degrees: positive, dividing world_size (= dp x tp x pp x cp), ep borrowed from dp x cp
    as torchtitan's ParallelDims._validate takes it (ep % cp == 0 and (dp x cp) % ep == 0, its etp = tp case);
    the schedule's own micro-batch rules, as torch.distributed.pipelining checks them; and what pipeline
    parallelism is not simulated with yet. What needs the model (tp dividing the heads, stages <= layers, ep
    needing experts) is checked when the model is described (models/parallel/checks.py `check_model_parallel`),
    and so are the combinations of tp, cp, ep and sequence_parallel not simulated yet."""
    positive_int(knobs, "pp", "virtual_stages", "tp", "cp", "ep")
    at_most(knobs, "pp", "virtual_stages")
    choice_of(knobs, "pp_schedule", PP_SCHEDULES)
    n = knobs.world_size
    for name in ("tp", "pp", "cp", "ep"):
        degree = getattr(knobs, name)
        if n % degree:
            raise ConfigError(name, f"{name}={degree} does not divide world_size={n} (world_size = dp x tp x pp x cp): "
                                    f"give a world_size that is a multiple of {degree}")
    model_parallel = knobs.tp * knobs.pp * knobs.cp
    if n % model_parallel:
        raise ConfigError("world_size", f"world_size={n} is not a multiple of tp x pp x cp = {knobs.tp} x {knobs.pp} x "
                                        f"{knobs.cp} = {model_parallel} (world_size = dp x tp x pp x cp)")
    dp = n // model_parallel
    if knobs.ep > 1 and (knobs.ep % knobs.cp or (dp * knobs.cp) % knobs.ep):
        raise ConfigError("ep", f"ep={knobs.ep} takes its ranks from dp x cp = {dp} x {knobs.cp} (torchtitan "
                                "ParallelDims): ep must be a multiple of cp and divide dp x cp")
    if knobs.sequence_parallel and knobs.tp == 1:
        raise ConfigError("sequence_parallel", "sequence parallelism splits the sequence over the tensor-parallel "
                                               "ranks: it needs tp > 1")
    _pipeline_schedule(knobs)


def _optimizer_state_shapes(knobs) -> None:
    """An optimizer whose states follow each parameter's shape (models/optimizers.py `OptimizerSpec.by_shape`:
    Adafactor's row and column factors) is modelled on whole parameters, not on the parts of them a rank updates
    under ZeRO (flat partitions), FSDP2 (dim-0 shards) or tensor and expert parallelism (DTensor shards)."""
    if not OPTIMIZER_REGISTRY[knobs.optimizer].by_shape:
        return
    for name, partitions, allowed in (("zero_stage", knobs.zero_stage > 0, "0"),
                                      ("dp_engine", knobs.dp_engine == "fsdp2",
                                       "deepspeed (zero_stage 0), ddp, zero-redundancy-optimizer"),
                                      ("tp", knobs.tp > 1, "1"), ("ep", knobs.ep > 1, "1")):
        if partitions:
            raise ConfigError(name, f"{knobs.optimizer}'s states follow each whole parameter's shape: with {name} "
                                    f"{getattr(knobs, name)} a rank updates parts of parameters, not modelled; "
                                    f"allowed with it: {allowed}")


def _pipeline_schedule(knobs) -> None:
    """Stages per rank and micro-batches per step for `pp_schedule`, as torch/distributed/pipelining/schedules.py
    refuses them (torch 2.13): ScheduleGPipe and Schedule1F1B are single-stage schedules (one stage per rank);
    Schedule1F1B.__init__ raises when n_microbatches < the number of stages; ScheduleInterleaved1F1B.__init__
    when n_microbatches % number_of_rounds != 0, number_of_rounds = max(1, n_microbatches // pp_group_size) (a
    multi-stage schedule: torchtitan's pipeline_llm asks for >= 2 stages per rank); ScheduleZBVZeroBubble.__init__
    when a rank does not hold exactly 2 stages. grad_accum is the number of micro-batches (n_microbatches)."""
    schedule, v, pp, m = knobs.pp_schedule, knobs.virtual_stages, knobs.pp, knobs.grad_accum
    if schedule in ("gpipe", "1f1b") and v != 1:
        raise ConfigError("virtual_stages", f"{schedule} runs one stage per rank (a single-stage schedule), got "
                                            f"virtual_stages={v}; allowed: 1, or pp_schedule interleaved-1f1b / zbv")
    if schedule == "interleaved-1f1b" and v < 2:
        raise ConfigError("virtual_stages", f"interleaved-1f1b runs several stages per rank: virtual_stages must be "
                                            f">= 2, got {v}")
    if schedule == "zbv" and v != 2:
        raise ConfigError("virtual_stages", f"zbv runs exactly 2 stages per rank (a V: stages r and 2 x pp - 1 - r), "
                                            f"got virtual_stages={v}")
    if pp == 1:
        return
    if schedule == "1f1b" and m < pp:
        raise ConfigError("grad_accum", f"1f1b needs at least as many micro-batches as stages (torch's Schedule1F1B): "
                                        f"grad_accum={m} < pp={pp}; give grad_accum >= {pp}")
    rounds = max(1, m // pp)
    if schedule == "interleaved-1f1b" and m % rounds:
        raise ConfigError("grad_accum", f"interleaved-1f1b runs the micro-batches in rounds of pp: number_of_rounds = "
                                        f"max(1, {m} // {pp}) = {rounds} must divide grad_accum={m} (torch's "
                                        f"ScheduleInterleaved1F1B); allowed e.g. {', '.join(map(str, _rounds_ok(pp)))}")


def _rounds_ok(pp: int) -> list[int]:
    """The first few micro-batch counts ScheduleInterleaved1F1B accepts on `pp` ranks."""
    return [m for m in range(1, 4 * pp + 1) if m % max(1, m // pp) == 0][:6]


def _batch(knobs) -> None:
    positive_int(knobs, "micro_batch", "seq_len", "grad_accum", "steps", "world_size")
    at_most(knobs, "grad_accum", "world_size")


def _precision_optimizer(knobs) -> None:
    choice_of(knobs, "precision", PRECISIONS, PRECISION_ALIASES)
    choice_of(knobs, "optimizer", OPTIMIZERS)
    choice_of(knobs, "optimizer_impl", OPTIMIZER_IMPLS)
    spec = OPTIMIZER_REGISTRY[knobs.optimizer]
    if knobs.optimizer_impl not in spec.impls:
        raise ConfigError("optimizer_impl", f"torch's {spec.torch_class or knobs.optimizer} has no "
                                            f"{knobs.optimizer_impl} implementation; allowed: {', '.join(spec.impls)}")


def _activation_checkpointing(knobs) -> None:
    choice_of(knobs, "checkpointing", CHECKPOINTING)
    positive_int(knobs, "checkpoint_every_k")
    _checkpoint_layers(knobs)


def _data_parallel(knobs) -> None:
    """The engine (models/dp_engines.py) and its knobs; ZeRO stages are DeepSpeed's."""
    if knobs.zero_stage not in (0, 1, 2, 3):
        raise ConfigError("zero_stage", f"unknown value {knobs.zero_stage!r}; allowed: 0, 1, 2, 3")
    choice_of(knobs, "dp_engine", tuple(DP_ENGINE_REGISTRY), ENGINE_ALIASES)
    if knobs.zero_stage and knobs.dp_engine != "deepspeed":
        raise ConfigError("zero_stage", f"ZeRO stages are DeepSpeed's (dp_engine deepspeed); {knobs.dp_engine} "
                                        "shards by itself: fsdp2 = parameters, gradients and states "
                                        "(reshard_after_forward false: like stage 2), "
                                        "zero-redundancy-optimizer = states (like stage 1), ddp = none")
    positive_int(knobs, "ddp_bucket_cap_mb", "reduce_bucket_size", "allgather_bucket_size",
                  "stage3_prefetch_bucket_size", "stage3_max_live_parameters")
    for name in ("forward_prefetch", "backward_prefetch", "stage3_param_persistence_threshold"):
        value = getattr(knobs, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ConfigError(name, f"must be an integer >= 0, got {value!r}")
    choice_of(knobs, "reduce_dtype", REDUCE_DTYPES)
    if not isinstance(knobs.reshard_after_forward, bool):
        raise ConfigError("reshard_after_forward", f"must be true or false, got {knobs.reshard_after_forward!r}")


def _fp32_grads(knobs) -> None:
    if knobs.fp32_grads and not knobs.prec.mixed:
        raise ConfigError("fp32_grads", "only applies to bf16-mixed or fp16-mixed precision")
    # FSDP2 has no unsharded fp32 gradient buffer: fp32 gradients are its MixedPrecisionPolicy(reduce_dtype=
    # torch.float32), reduce-scattered into fp32 shards (torch/distributed/fsdp/_fully_shard/_fsdp_api.py)
    if knobs.fp32_grads and knobs.dp_engine == "fsdp2":
        raise ConfigError("fp32_grads", "fsdp2 keeps fp32 gradients as MixedPrecisionPolicy(reduce_dtype=fp32): "
                                        "sharded fp32 gradients, not a full fp32 copy on every rank; give "
                                        "--reduce-dtype fp32 instead of --fp32-grads")


def _moe(knobs) -> None:
    routing = knobs.moe_routing
    if routing is not None and not (routing in ("balanced", "worst") or routing.startswith("counts:") and routing[7:]):
        raise ConfigError("moe_routing", f"unknown value {routing!r}; allowed: balanced, worst, "
                                         "counts:PATH (a peakledger-moe-counts JSON file)")


def _optimizer_in_backward(knobs) -> None:
    """Optimizer-in-backward as torchtune 0.6.1 runs it (recipes/full_finetune_distributed.py refuses gradient
    clipping and accumulation with optimizer_in_bwd; torchtune/training/memory.py `register_optim_in_bwd_hooks`):
    one device, nothing between the gradient and its parameter's step (no master copy, no offload)."""
    if not isinstance(knobs.optimizer_in_backward, bool):
        raise ConfigError("optimizer_in_backward", f"must be true or false, got {knobs.optimizer_in_backward!r}")
    if not knobs.optimizer_in_backward:
        return
    if knobs.grad_accum != 1:
        raise ConfigError("grad_accum", "gradient accumulation is not supported with optimizer_in_backward (each "
                                        "gradient is stepped and freed in backward; torchtune 0.6.1 refuses it too): "
                                        "set grad_accum 1")
    if knobs.loop != "plain":
        raise ConfigError("loop", f"{knobs.loop!r} clips gradients before the step; gradient clipping is not supported "
                                  "with optimizer_in_backward (torchtune 0.6.1 refuses it too): use loop plain")
    for name, ok, allowed in (
            ("passes", knobs.passes == "train", "train"),
            ("world_size", knobs.world_size == 1, "1 (one device)"),
            ("precision", knobs.prec.master is None, "fp32, bf16 or an autocast precision (no fp32 master copy)"),
            ("set_to_none", knobs.set_to_none, "true (torchtune's hook calls zero_grad(), set_to_none=True)"),
            ("optimizer_offload", knobs.optimizer_offload == "none", "none"),
            ("load_mode", knobs.load_mode == "none", "none"),
            ("checkpoint_every", knobs.checkpoint_every == 0, "0"),
            ("compile", not knobs.compile, "false")):
        if not ok:
            raise ConfigError(name, f"{getattr(knobs, name)!r} with optimizer_in_backward is not modelled; allowed "
                                    f"with it: {allowed}")


def _chunked_loss(knobs) -> None:
    """`chunked_loss` N: torchtune 0.6.1's chunked output + CEWithChunkedOutputLoss, N chunks along the sequence
    (`last_hidden_state.chunk(N, dim=1)`: N equal chunks where N divides seq_len, modelled so)."""
    n = knobs.chunked_loss
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ConfigError("chunked_loss", f"must be an integer >= 0 (0 = one whole cross-entropy), got {n!r}")
    if n and knobs.seq_len % n:
        raise ConfigError("chunked_loss", f"{n} chunks must divide seq_len {knobs.seq_len} (equal chunks)")
    if not n:
        return
    for name, ok, allowed in (
            ("passes", knobs.passes == "train", "train (passes \"forward\" computes no loss)"),
            ("precision", knobs.prec.autocast is None, "fp32, bf16 or a mixed precision without autocast"),
            ("lora_r", knobs.lora_r == 0, "0"),
            ("tp", knobs.tp == 1, "1"), ("pp", knobs.pp == 1, "1"), ("cp", knobs.cp == 1, "1"),
            ("compile", not knobs.compile, "false")):
        if not ok:
            raise ConfigError(name, f"{getattr(knobs, name)!r} with chunked_loss is not modelled; allowed with it: "
                                    f"{allowed}")


def _passes(knobs) -> None:
    choice_of(knobs, "passes", PASSES)
    choice_of(knobs, "loop", LOOPS)
    if knobs.loop != "plain" and knobs.passes != "train":
        raise ConfigError("loop", f"{knobs.loop!r} is a training loop; passes \"forward\" runs no loss, backward or "
                                  "optimizer step: use loop plain")
    if knobs.passes == "forward":
        for name, ok, allowed in (("world_size", knobs.world_size == 1, "1"),
                                  ("grad_accum", knobs.grad_accum == 1, "1"),
                                  ("checkpoint_every", knobs.checkpoint_every == 0, "0"),
                                  ("optimizer_offload", knobs.optimizer_offload == "none", "none")):
            if not ok:
                raise ConfigError(name, f"passes \"forward\" runs forward passes on one device without an "
                                        f"optimizer: {name} must be {allowed}")


def _compile(knobs) -> None:
    """torch.compile (models/compile): its mode only with it; what is not modelled under it yet refused by name."""
    if not isinstance(knobs.compile, bool):
        raise ConfigError("compile", f"must be true or false, got {knobs.compile!r}")
    choice_of(knobs, "compile_mode", COMPILE_MODES)
    if not knobs.compile:
        if knobs.compile_mode != "default":
            raise ConfigError("compile_mode", f"{knobs.compile_mode!r} only applies with compile (--compile)")
        return
    for name, ok, allowed in (
            ("passes", knobs.passes == "train", "train"),
            ("loop", knobs.loop == "plain", "plain"),
            ("precision", knobs.precision in COMPILE_PRECISIONS, ", ".join(COMPILE_PRECISIONS)),
            ("checkpointing", knobs.checkpointing in COMPILE_CHECKPOINTING, ", ".join(COMPILE_CHECKPOINTING)),
            ("world_size", knobs.world_size == 1, "1 (data or model parallelism under compile is not modelled yet)"),
            ("grad_accum", knobs.grad_accum == 1, "1 (a compiled backward hands every gradient on at its end: "
                                                  "accumulation into kept gradients is not modelled yet)"),
            ("set_to_none", knobs.set_to_none, "true (gradients kept between steps are not modelled yet)"),
            ("quantize", knobs.quantize == "none", "none (QLoRA's 4-bit base linears under compile are not "
                                                   "modelled yet)"),
            ("optimizer_offload", knobs.optimizer_offload == "none", "none"),
            ("load_mode", knobs.load_mode == "none", "none"),
            ("checkpoint_every", knobs.checkpoint_every == 0, "0")):
        if not ok:
            raise ConfigError(name, f"{getattr(knobs, name)!r} with compile is not modelled yet; allowed with it: "
                                    f"{allowed}")


def _float8(knobs) -> None:
    """float8 training (models/float8.py): modelled in pure bf16 (the weights' dtype Float8Linear casts from), on one
    device, eager, without LoRA; the device's compute capability is checked by models/training.py `describe`."""
    choice_of(knobs, "fp8", FP8_RECIPES)
    if knobs.fp8 == "none":
        return
    if knobs.precision != "bf16":
        raise ConfigError("fp8", f"float8 training is modelled with precision bf16 (bf16 weights, inputs and "
                                 f"gradients around the float8 matmuls), not {knobs.precision!r}; allowed: bf16")
    if knobs.lora_r or knobs.compile or knobs.world_size > 1 or knobs.checkpointing != "none":
        raise ConfigError("fp8", "float8 training is modelled on one device, eager, without LoRA or activation "
                                 "checkpointing; allowed with it: world_size 1, compile off, lora_r 0, "
                                 "checkpointing none")


def _lowbit_optimizer(knobs) -> None:
    """The low-bit optimizers (models/lowbit.py: torchao's, bitsandbytes' adamw-8bit-bnb / paged-adamw-8bit) are
    modelled in a plain training loop: their states offloaded, saved or loaded are not."""
    if not OPTIMIZER_REGISTRY[knobs.optimizer].per_param:
        return
    for name, value, allowed in (("optimizer_offload", knobs.optimizer_offload, "none"),
                                 ("checkpoint_every", knobs.checkpoint_every, 0),
                                 ("load_mode", knobs.load_mode, "none")):
        if value != allowed:
            raise ConfigError(name, f"{value!r} with optimizer {knobs.optimizer} (low-bit states, models/lowbit.py) "
                                    f"is not modelled; allowed with it: {allowed}")


# One order, so the first problem named is always the same: each section's own values, then what combines them.
SECTION_CHECKS = (_batch, _precision_optimizer, _activation_checkpointing, activation_offload, _data_parallel,
                  _fp32_grads,
                  _checkpoint_io_fields, optimizer_offload_fields, _moe, _lora_fields, _model_parallel_fields,
                  _optimizer_state_shapes, _build_field, _passes, _compile, _float8,
                  _optimizer_in_backward, _chunked_loss, fsdp_cpu_offload, zero_offload,
                  _lowbit_optimizer, check_rl)


def check_setup(knobs) -> None:  # (the RL section's checks: models/config/rl.py)
    """Every check of a setup's `knobs` (models/config/setup.py KnobValues: the knobs by name, as each error names
    them; their types are checked before, by models/fields.py), in SECTION_CHECKS order."""
    for check in SECTION_CHECKS:
        check(knobs)
