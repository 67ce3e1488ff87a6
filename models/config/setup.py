"""`TrainingSetup`: how the model is trained, one frozen dataclass whose fields are declared section by section
(models/config/knobs.py), checked section by section (models/config/checks.py), and decoded where a field is a
code (`prec`: models/precision.py)."""

from __future__ import annotations

from dataclasses import dataclass

from ..fields import check_types
from ..precision import PRECISION_TABLE, PRECISIONS, Precision
from .base import ConfigError
from .checks import (
    BUILDS,
    CHECKPOINTING,
    COMPILE_MODES,
    DP_ENGINES,
    LOAD_MODES,
    LOOPS,
    OFFLOAD_FIRST_STEPS,
    OPTIMIZER_IMPLS,
    OPTIMIZER_OFFLOADS,
    OPTIMIZERS,
    PASSES,
    PP_SCHEDULES,
    QUANTIZE,
    REDUCE_DTYPES,
    SAVE_MODES,
    check_setup,
)
from .knobs import knob, setup_knobs


@dataclass(frozen=True)
class TrainingSetup:
    """How the model is trained.

    precision:
      fp32           everything fp32.
      bf16-mixed     16-bit parameters and gradients, fp32 master weights and optimizer states
      fp16-mixed     (DeepSpeed / Megatron style; `fp32_grads` keeps gradients in fp32).
      bf16-autocast  torch.autocast: fp32 parameters, gradients and states, 16-bit activations and
      fp16-autocast  16-bit weight copies cached for the forward pass.
      bf16           pure bf16: parameters, gradients and states all bf16.
    """

    # batch, sequence, steps
    micro_batch: int = knob(1, "batch")
    seq_len: int = knob(1024, "batch")
    grad_accum: int = knob(1, "batch")
    steps: int = knob(2, "batch", "default 2, so the steady state is visible")
    # "train": forward, loss, backward, step; "forward": `out = model(batch)` with autograd on (no torch.no_grad)
    # and no loss, backward or optimizer step; every saved tensor and the output live until the step ends
    passes: str = knob("train", "batch", "train (default): forward, loss, backward, optimizer step; forward: "
                       "`out = model(batch)` with autograd on, no loss, backward or step", choices=PASSES,
                       argparse_choices=True)
    logits_held: bool = knob(True, "batch", "the caller keeps `logits` alive until backward ends", cli="none")
    loop: str = knob("plain", "batch", "the training loop: plain (default: `out = model(batch)` held through "
                     "backward) or hf-trainer (HF Trainer's step: outputs dropped before backward, loss / "
                     "accumulation, clip_grad_norm_ before the optimizer step)", choices=LOOPS, argparse_choices=True)

    # precision and optimizer (models/precision.py, models/optimizers.py)
    precision: str = knob("fp32", "precision", choices=PRECISIONS)
    fp32_grads: bool = knob(False, "precision", "mixed precision: fp32 gradients", cli="on")
    optimizer: str = knob("adamw", "precision", choices=OPTIMIZERS)
    optimizer_impl: str = knob("foreach", "precision", choices=OPTIMIZER_IMPLS)
    set_to_none: bool = knob(True, "precision", "zero_grad(set_to_none=False): gradients stay allocated between "
                             "steps", cli="off")
    frozen: tuple[str, ...] = knob((), "precision", "freeze parameters matching a glob (fnmatch over parameter "
                                   "names; repeat the flag)", cli="append", flag="freeze", metavar="PATTERN")

    # activation checkpointing (models/tape.py)
    checkpointing: str = knob("none", "checkpointing", choices=CHECKPOINTING)
    checkpoint_every_k: int = knob(2, "checkpointing", "checkpointing every-k: layers 0, k, 2k, ... (default 2)")
    checkpoint_layers: tuple[int, ...] = knob((), "checkpointing", "checkpointing layers: exactly these layer "
                                              "indices, e.g. 0,3,7")

    # data parallelism (models/dp_engines.py): which engine shards what, and its knobs
    dp_engine: str = knob("deepspeed", "data-parallel", "default deepspeed: --zero-stage applies", choices=DP_ENGINES)
    zero_stage: int = knob(0, "data-parallel", "deepspeed: 0, 1, 2, 3")
    reshard_after_forward: bool = knob(True, "data-parallel", "fsdp2: keep unsharded parameters from forward to "
                                       "backward", cli="off")
    reduce_dtype: str = knob("grad", "data-parallel", "fsdp2: MixedPrecisionPolicy.reduce_dtype; default grad: the "
                             "gradients' own dtype, torch's None", choices=REDUCE_DTYPES)
    forward_prefetch: int = knob(0, "data-parallel", "fsdp2: units all-gathered ahead of the one running, in forward",
                                 hidden=True)
    backward_prefetch: int = knob(1, "data-parallel", "fsdp2: likewise in backward (FSDP2's default implicit "
                                  "prefetch is 1)", hidden=True)
    ddp_bucket_cap_mb: int = knob(25, "data-parallel", "ddp / zero-redundancy-optimizer: DDP gradient bucket size "
                                  "(MiB)", hidden=True)
    reduce_bucket_size: int = knob(500_000_000, "data-parallel", "deepspeed: elements per gradient reduce bucket",
                                   hidden=True)
    allgather_bucket_size: int = knob(500_000_000, "data-parallel", "deepspeed stages 1-2: elements per parameter "
                                      "all-gather", hidden=True)
    stage3_prefetch_bucket_size: int = knob(50_000_000, "data-parallel", "deepspeed stage 3: elements fetched ahead",
                                            hidden=True)
    stage3_max_live_parameters: int = knob(1_000_000_000, "data-parallel", "deepspeed stage 3: gathered elements "
                                           "kept at most", hidden=True)
    stage3_param_persistence_threshold: int = knob(100_000, "data-parallel", "deepspeed stage 3: smaller parameters "
                                                   "stay whole", hidden=True)

    # the mesh: world_size = dp x tp x pp x cp (checks.py `_model_parallel_fields`), each simulated on the device
    # mesh (models/parallel/mesh.py); models/parallel/checks.py names the combinations that are not
    world_size: int = knob(1, "mesh", "ranks in all")
    pp: int = knob(1, "mesh", "pipeline-parallel ranks, one stage each (default 1); --grad-accum is the number of "
                   "micro-batches per step")
    pp_schedule: str = knob("1f1b", "mesh", "default 1f1b; torch.distributed.pipelining's", choices=PP_SCHEDULES)
    virtual_stages: int = knob(1, "mesh", "stages per pipeline rank (interleaved-1f1b: >= 2, zbv: 2)")
    tp: int = knob(1, "mesh", "tensor-parallel ranks (DTensor column / row-parallel linears, vocab-parallel "
                   "embedding and loss)")
    cp: int = knob(1, "mesh", "context-parallel ranks (torch's context_parallel ring attention; cpu profile)")
    ep: int = knob(1, "mesh", "expert-parallel ranks, MoE models: experts placed on ranks, tokens all-to-all'd as "
                   "torchtitan does (world_size = dp, a multiple of ep; dp_engine ddp)")
    sequence_parallel: bool = knob(False, "mesh", "sequence parallelism over the tp ranks (norms and residual "
                                   "stream sharded on the sequence)", cli="on")

    # model load and training checkpoints (models/checkpoint_io.py): saved after every N-th optimizer step
    # how the parameters reach the device before training (models/parallel/engine.py `Engine.load`): "direct" = each
    # allocated once in its training dtype (from_pretrained(..., torch_dtype=...), or a model moved from the CPU);
    # "device-fp32" = built on the device in fp32 (`with torch.device("cuda"): cls(config)`), cast by model.to(dtype)
    # where the parameters are 16-bit, then under FSDP2 each unit's fully_shard copies
    build: str = knob("direct", "checkpoint-io", "how the parameters reach the device: direct = once each, in the "
                      "training dtype; device-fp32 = built on the device in fp32, then model.to(dtype) where they "
                      "are 16-bit, then fully_shard's copies under fsdp2", choices=BUILDS)
    checkpoint_every: int = knob(0, "checkpoint-io", "save a checkpoint after every N-th optimizer step (0: never)")
    save_mode: str = knob("torch-save", "checkpoint-io", choices=SAVE_MODES)
    load_mode: str = knob("none", "checkpoint-io", "a checkpoint loaded before the first step", choices=LOAD_MODES)

    # optimizer-state offload (models/optimizers.py): the states live in host memory between steps
    optimizer_offload: str = knob("none", "offload", "states in host memory between steps",
                                  choices=OPTIMIZER_OFFLOADS)
    offload_chunk_params: int = knob(100_000_000, "offload", "chunked: parameter elements whose states are copied and "
                                     "updated together (default 100000000)")
    offload_prefetch: int = knob(1, "offload", "chunked: chunks copied in ahead of the one updated (default 1)")
    offload_first_step: str = knob("whole", "offload", "chunked: step 1 as one torch step, or chunk by chunk",
                                   choices=OFFLOAD_FIRST_STEPS)

    # LoRA / QLoRA (models/lora.py): peft adapters on the named linears, the whole base model frozen
    lora_r: int = knob(0, "lora", "adapter rank (0: no LoRA)")
    lora_alpha: float = knob(8.0, "lora", "scaling = alpha / r (default 8, peft's LoraConfig)")
    lora_dropout: float = knob(0.0, "lora", "dropout on the adapters' input, in [0, 1) (default 0: nn.Identity, "
                               "nothing saved)")
    lora_targets: tuple[str, ...] = knob((), "lora", "peft target_modules, e.g. q_proj,k_proj,v_proj,o_proj "
                                         "(default: peft's for the family)")
    quantize: str = knob("none", "lora", "nf4: bitsandbytes 4-bit base linears (Linear4bit, double quant): QLoRA",
                         choices=QUANTIZE)

    # mixture of experts (models/moe.py)
    moe_routing: str | None = knob(None, "moe", "tokens per expert: balanced (default), worst (every token to the "
                                   "same top-k experts) or counts:FILE (measured, from capture --moe-counts)",
                                   metavar="ROUTING")

    # torch.compile (models/compile): the forward and loss compiled by inductor, the backward its compiled graph
    compile: bool = knob(False, "compile", "torch.compile the forward and loss (the step's backward is compiled "
                         "with it; the optimizer step stays eager)", cli="on")
    compile_mode: str = knob("default", "compile", "torch.compile's mode", choices=COMPILE_MODES)

    def __post_init__(self) -> None:
        check_types(self, ConfigError)
        check_setup(self)

    def knob_values(self) -> dict[str, object]:
        """The setup's one serialised form: every knob by its flag's name (the scenario file's [training] keys), in
        declaration order. `from_knob_values` reads it back."""
        return {k.name: getattr(self, k.name) for k in setup_knobs(type(self))}

    @classmethod
    def from_knob_values(cls, values: dict) -> TrainingSetup:
        """The setup `knob_values` wrote (lists read back as the tuples they were)."""
        return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in values.items()})

    @property
    def holds_outputs(self) -> bool:
        """The caller keeps the model's output (its logits) alive until backward ends: the plain loop's `out`."""
        return self.logits_held and self.loop == "plain"

    @property
    def clips_gradients(self) -> bool:
        """`clip_grad_norm_` runs before each optimizer step (HF Trainer's loop, max_grad_norm 1.0)."""
        return self.loop == "hf-trainer"

    @property
    def prec(self) -> Precision:
        """`precision` decoded (models/precision.py): each kind of tensor's dtype, and autocast's."""
        return PRECISION_TABLE[self.precision]

    @property
    def param_dtype(self) -> str:
        return PRECISION_TABLE[self.precision].param

    @property
    def compute_dtype(self) -> str:
        """The dtype of activations."""
        return PRECISION_TABLE[self.precision].compute

    @property
    def grad_dtype(self) -> str:
        return "fp32" if self.fp32_grads else self.param_dtype

    @property
    def master_dtype(self) -> str | None:
        """fp32 master weights exist only in the mixed-precision modes."""
        return PRECISION_TABLE[self.precision].master

    @property
    def state_dtype(self) -> str:
        return PRECISION_TABLE[self.precision].state

    @property
    def dp(self) -> int:
        """Data-parallel ranks: world_size / (tp x pp x cp)."""
        return self.world_size // (self.tp * self.pp * self.cp)

    @property
    def effective_batch(self) -> int:
        """B_eff = micro-batch x accumulation x data-parallel degree (world_size without tp, pp, cp)."""
        return self.micro_batch * self.grad_accum * self.dp


__all__ = ["TrainingSetup"]
