"""What each knob of a `TrainingSetup` may be: one tuple of choices per knob with a set of values (its flag's
choices, and what models/config/checks.py holds the knob to), each beside what its values mean and where they are
modelled."""

from __future__ import annotations

from ..dp_engines import DP_ENGINES as DP_ENGINE_REGISTRY
from ..optimizers import OPTIMIZERS as OPTIMIZER_REGISTRY

OPTIMIZERS = tuple(OPTIMIZER_REGISTRY)  # models/optimizers.py: one entry per optimizer
OPTIMIZER_IMPLS = ("foreach", "for-loop", "fused")
# "forward": each step is `out = model(batch)` with autograd on (no torch.no_grad) and no loss, backward or
# optimizer step; every saved tensor and the output live until the step ends and the caller drops `out`
PASSES = ("train", "forward")
# the training loop around the model (models/training.py): "plain" `out = model(batch); loss = loss_fn(out);
# loss.backward()`, the caller holding `out` (its logits) until backward ends; "hf-trainer" HF Trainer's
# training_step: `loss = compute_loss(model, inputs)` (the outputs dropped before backward), the loss divided by
# the accumulation steps, and `clip_grad_norm_` (max_grad_norm 1.0) before the optimizer step
LOOPS = ("plain", "hf-trainer")
CHECKPOINTING = ("none", "full", "every-k", "selective", "sqrt", "op-policy", "offload", "layers")  # models/tape.py
# activation offload (models/replay/offload.py): save-on-cpu = torch.autograd.graph.save_on_cpu(pin_memory=True) per
# layer (the same as checkpointing "offload"); streams = torchtune 0.6.1's OffloadActivations(use_streams=True)
# around the model's forward, its output head under NoOpManager (models/replay/offload_streams.py)
ACTIVATION_OFFLOADS = ("none", "save-on-cpu", "streams")
DP_ENGINES = tuple(DP_ENGINE_REGISTRY)  # models/dp_engines.py
# the checkpoint save and load modes (models/checkpoint_io/save_load.py)
SAVE_MODES = ("torch-save", "full-rank0", "full-rank0-offload", "full-all", "sharded", "async")
LOAD_MODES = ("none", "full-then-device", "map-to-device", "meta-assign")
# how the parameters reach the device before training (models/parallel/engine.py `Engine.load`): "direct" = each
# allocated once in its training dtype (from_pretrained(..., torch_dtype=...), or a model moved from the CPU);
# "device-fp32" = built on the device in fp32 (`with torch.device("cuda"): cls(config)`), cast by model.to(dtype)
# where the parameters are 16-bit, then under FSDP2 each unit's fully_shard copies
BUILDS = ("direct", "device-fp32")
# models/optimizers.py; "cpu": torchao's CPUOffloadOptimizer, models/offload_libraries.py
OPTIMIZER_OFFLOADS = ("none", "states", "chunked", "cpu")
OFFLOAD_FIRST_STEPS = ("whole", "chunked")
# pipeline schedules (models/parallel/stages.py), as torch.distributed.pipelining names their classes:
# ScheduleGPipe, Schedule1F1B, ScheduleInterleaved1F1B, ScheduleZBVZeroBubble
PP_SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zbv")
QUANTIZE = ("none", "nf4")  # models/lora.py
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune-no-cudagraphs")  # torch.compile(mode=...)
# checkpointing policies modelled under compile (models/compile): single layers under non-reentrant checkpoint, which
# dynamo keeps in its graph as one higher-order op (the partitioner recomputes them in the backward graph); where
# it cannot (Llama: a side effect in the checkpointed forward), the layers run eagerly between compiled graphs and
# the compiled describer refuses the model (models/compile/capture.py `_eager_checkpoint`); op-policy's layers under
# torch's selective checkpoint contexts, whose tags the partitioner follows. sqrt (regions of several layers),
# selective (a part of each layer) and offload are not modelled under compile yet
COMPILE_CHECKPOINTING = ("none", "full", "every-k", "layers", "op-policy")
COMPILE_PRECISIONS = ("fp32", "bf16", "bf16-autocast")  # the CPU program's (inductor's CPU kernels)
# torchao 0.18.0 torchao/float8/config.py Float8LinearRecipeName (models/float8.py); "none": plain nn.Linear
FP8_RECIPES = ("none", "tensorwise", "rowwise")
