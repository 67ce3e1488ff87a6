"""The sections of a `TrainingSetup` (models/config/setup.py), one frozen object per concern, each field a knob
(models/knobs.py) named as users write it. Precision's section is models/precision.py `Precision`; the
data-parallel section and each engine's knob class are models/dp_engines.py's. What a knob may be is checked by
the setup as a whole (models/config/checks.py), since its checks combine sections."""

from __future__ import annotations

from dataclasses import dataclass

from ..knobs import Section, knob
from ..optimizers import OPTIMIZERS, OptimizerSpec
from .choices import (
    ACTIVATION_OFFLOADS,
    BUILDS,
    CHECKPOINTING,
    COMPILE_MODES,
    FP8_RECIPES,
    LOAD_MODES,
    LOOPS,
    OFFLOAD_FIRST_STEPS,
    OPTIMIZER_IMPLS,
    OPTIMIZER_OFFLOADS,
    PASSES,
    PP_SCHEDULES,
    QUANTIZE,
    SAVE_MODES,
)


@dataclass(frozen=True, eq=False)
class Batch(Section):
    """What one step runs on: micro-batches of `micro_batch` x `seq_len`, `grad_accum` of them per optimizer step,
    `steps` steps; `passes` "forward" is `out = model(batch)` with autograd on and no loss, backward or step (every
    saved tensor and the output live until the step ends)."""

    micro_batch: int = knob(1, "batch")
    seq_len: int = knob(1024, "batch")
    grad_accum: int = knob(1, "batch")
    steps: int = knob(2, "batch", "default 2, so the steady state is visible")
    passes: str = knob("train", "batch", "train (default): forward, loss, backward, optimizer step; forward: "
                       "`out = model(batch)` with autograd on, no loss, backward or step", choices=PASSES,
                       argparse_choices=True)


@dataclass(frozen=True, eq=False)
class Loop(Section):
    """The training loop around the model (models/training.py)."""

    name: str = knob("plain", "batch", "the training loop: plain (default: `out = model(batch)` held through "
                     "backward) or hf-trainer (HF Trainer's step: outputs dropped before backward, loss / "
                     "accumulation, clip_grad_norm_ before the optimizer step)", choices=LOOPS, argparse_choices=True,
                     name="loop")
    logits_held: bool = knob(True, "batch", "the caller keeps `logits` alive until backward ends", cli="none")
    # torchtune 0.6.1: TransformerDecoder.chunked_output (the output projection chunk by chunk along the sequence)
    # with torchtune/modules/loss/ce_chunked_output_loss.py CEWithChunkedOutputLoss(num_output_chunks=N)
    chunked_loss: int = knob(0, "batch", "torchtune's chunked output and CEWithChunkedOutputLoss: the logits made "
                             "and upcast for the loss in N chunks along the sequence (0: one whole cross-entropy)",
                             name="chunked_loss", metavar="N")

    @property
    def holds_outputs(self) -> bool:
        """The caller keeps the model's output (its logits) alive until backward ends: the plain loop's `out`."""
        return self.logits_held and self.name == "plain"

    @property
    def clips_gradients(self) -> bool:
        """`clip_grad_norm_` runs before each optimizer step (HF Trainer's loop, max_grad_norm 1.0)."""
        return self.name == "hf-trainer"


@dataclass(frozen=True, eq=False)
class Optimizer(Section):
    """The optimizer (models/optimizers.py), its implementation, how zero_grad clears, and what it leaves out."""

    name: str = knob("adamw", "precision", choices=tuple(OPTIMIZERS), name="optimizer")
    impl: str = knob("foreach", "precision", choices=OPTIMIZER_IMPLS, name="optimizer_impl")
    set_to_none: bool = knob(True, "precision", "zero_grad(set_to_none=False): gradients stay allocated between "
                             "steps", cli="off")
    frozen: tuple[str, ...] = knob((), "precision", "freeze parameters matching a glob (fnmatch over parameter "
                                   "names; repeat the flag)", cli="append", flag="freeze", metavar="PATTERN")
    # torchtune 0.6.1 torchtune/training/memory.py `register_optim_in_bwd_hooks`: one optimizer per parameter,
    # stepped and zeroed by the parameter's post-accumulate-grad hook during backward (models/replay/grads.py)
    in_backward: bool = knob(False, "precision", "torchtune's optimizer_in_bwd: one optimizer per parameter, its "
                             "step() and zero_grad() run by the parameter's post-accumulate-grad hook as soon as its "
                             "gradient is made, so each gradient is freed during backward", cli="on",
                             name="optimizer_in_backward")

    @property
    def spec(self) -> OptimizerSpec:
        return OPTIMIZERS[self.name]


@dataclass(frozen=True, eq=False)
class Checkpointing(Section):
    """Activation checkpointing (models/tape.py): the policy and the layers it takes."""

    policy: str = knob("none", "checkpointing", choices=CHECKPOINTING, name="checkpointing")
    every_k: int = knob(2, "checkpointing", "checkpointing every-k: layers 0, k, 2k, ... (default 2)",
                        name="checkpoint_every_k")
    layers: tuple[int, ...] = knob((), "checkpointing", "checkpointing layers: exactly these layer indices, e.g. "
                                   "0,3,7", name="checkpoint_layers")
    # activation offload (models/replay/offload.py, offload_streams.py)
    activation_offload: str = knob("none", "checkpointing", "save-on-cpu: torch.autograd.graph.save_on_cpu("
                                   "pin_memory=True) per layer (= checkpointing offload); streams: torchtune "
                                   "OffloadActivations(use_streams=True) around the forward, the output head not "
                                   "offloaded", choices=ACTIVATION_OFFLOADS)
    offload_stash: int = knob(5, "checkpointing", "activation_offload streams: max_fwd_stash_size, the saved tensors "
                              "kept on the device until their copy is done (default 5)",
                              name="activation_offload_stash")
    offload_min_bytes: int = knob(1024, "checkpointing", "activation_offload streams: min_offload_size, smaller saved "
                                  "tensors stay on the device (default 1024)", name="activation_offload_min_bytes")


@dataclass(frozen=True, eq=False)
class Mesh(Section):
    """The ranks: world_size = dp x tp x pp x cp (checks.py `_model_parallel_fields`), each simulated on the device
    mesh (models/parallel/mesh.py); models/parallel/checks.py names the combinations that are not."""

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

    @property
    def dp(self) -> int:
        """Data-parallel ranks: world_size / (tp x pp x cp)."""
        return self.world_size // (self.tp * self.pp * self.cp)


@dataclass(frozen=True, eq=False)
class CheckpointIO(Section):
    """Model load and training checkpoints (models/checkpoint_io/). `build`: how the parameters reach the device
    before training (models/parallel/engine.py `Engine.load`): "direct" = each allocated once in its training dtype
    (from_pretrained(..., torch_dtype=...), or a model moved from the CPU); "device-fp32" = built on the device in
    fp32 (`with torch.device("cuda"): cls(config)`), cast by model.to(dtype) where the parameters are 16-bit, then
    under FSDP2 each unit's fully_shard copies. A checkpoint is saved after every `every`-th optimizer step."""

    build: str = knob("direct", "checkpoint-io", "how the parameters reach the device: direct = once each, in the "
                      "training dtype; device-fp32 = built on the device in fp32, then model.to(dtype) where they "
                      "are 16-bit, then fully_shard's copies under fsdp2", choices=BUILDS)
    every: int = knob(0, "checkpoint-io", "save a checkpoint after every N-th optimizer step (0: never)",
                      name="checkpoint_every")
    save_mode: str = knob("torch-save", "checkpoint-io", choices=SAVE_MODES)
    load_mode: str = knob("none", "checkpoint-io", "a checkpoint loaded before the first step", choices=LOAD_MODES)


@dataclass(frozen=True, eq=False)
class Offload(Section):
    """Optimizer-state offload (models/optimizers.py): the states live in host memory between steps."""

    mode: str = knob("none", "offload", "states in host memory between steps", choices=OPTIMIZER_OFFLOADS,
                     name="optimizer_offload")
    chunk_params: int = knob(100_000_000, "offload", "chunked: parameter elements whose states are copied and "
                             "updated together (default 100000000)", name="offload_chunk_params")
    prefetch: int = knob(1, "offload", "chunked: chunks copied in ahead of the one updated (default 1)",
                         name="offload_prefetch")
    first_step: str = knob("whole", "offload", "chunked: step 1 as one torch step, or chunk by chunk",
                           choices=OFFLOAD_FIRST_STEPS, name="offload_first_step")
    gradients: bool = knob(False, "offload", "optimizer_offload cpu: torchao's offload_gradients, each device "
                           "gradient freed once copied to the host in backward", cli="on", name="offload_gradients")


@dataclass(frozen=True, eq=False)
class Lora(Section):
    """LoRA / QLoRA (models/lora.py): peft adapters on the named linears, the whole base model frozen."""

    r: int = knob(0, "lora", "adapter rank (0: no LoRA)", name="lora_r")
    alpha: float = knob(8.0, "lora", "scaling = alpha / r (default 8, peft's LoraConfig)", name="lora_alpha")
    dropout: float = knob(0.0, "lora", "dropout on the adapters' input, in [0, 1) (default 0: nn.Identity, "
                          "nothing saved)", name="lora_dropout")
    targets: tuple[str, ...] = knob((), "lora", "peft target_modules, e.g. q_proj,k_proj,v_proj,o_proj "
                                    "(default: peft's for the family)", name="lora_targets")
    quantize: str = knob("none", "lora", "nf4: bitsandbytes 4-bit base linears (Linear4bit, double quant): QLoRA",
                         choices=QUANTIZE)


@dataclass(frozen=True, eq=False)
class Moe(Section):
    """Mixture of experts (models/moe.py)."""

    routing: str | None = knob(None, "moe", "tokens per expert: balanced (default), worst (every token to the "
                               "same top-k experts) or counts:FILE (measured, from capture --moe-counts)",
                               metavar="ROUTING", name="moe_routing")


@dataclass(frozen=True, eq=False)
class Compile(Section):
    """torch.compile (models/compile): the forward and loss compiled by inductor, the backward its compiled
    graph."""

    on: bool = knob(False, "compile", "torch.compile the forward and loss (the step's backward is compiled "
                    "with it; the optimizer step stays eager)", cli="on", name="compile")
    mode: str = knob("default", "compile", "torch.compile's mode", choices=COMPILE_MODES, name="compile_mode")


@dataclass(frozen=True, eq=False)
class Float8(Section):
    """float8 training (models/float8.py): torchao 0.18.0's convert_to_float8_training swaps the linears for
    Float8Linear with the recipe's Float8LinearConfig."""

    recipe: str = knob("none", "float8", "torchao Float8LinearConfig.from_recipe_name: tensorwise or rowwise "
                       "(GPU profiles of compute capability >= 8.9, precision bf16; on the cpu profile torchao's "
                       "emulate=True)", choices=FP8_RECIPES, name="fp8")


__all__ = ["Batch", "Loop", "Optimizer", "Checkpointing", "Mesh", "CheckpointIO", "Offload", "Lora", "Moe",
           "Compile", "Float8"]
