"""The fixes `explain` tries, by the phase they change: every knob that changes the memory of a load, a step's
forward / backward / optimizer step or a checkpoint save, each a change to the scenario that peakledger/diagnosis.py
re-simulates (a change that a setup refuses is skipped there, and one that does not lower the peak is not listed).

A candidate is (name, changes, changes the training?, what it costs). "Changes the training" means the model trained
or its numerics change (8-bit states, a frozen half, a shorter context), not only how memory is spent.
"""

from __future__ import annotations

from dataclasses import replace

from .analysis.checkpointing import compile_applies
from .models.config import CHECKPOINTING, LOAD_MODES, SAVE_MODES, ConfigError
from .models.devices import device_profile
from .models.families import family_of
from .models.optimizers import OPTIMIZERS
from .models.rl import engine_spec, training_in_use
from .models.traced import traced_layers
from .models.traced.model import TracedModel
from .models.transformer.params import transformer_params
from .models.vllm_engine import size_engine, utilization_for_blocks
from .scenario import Scenario

Candidate = tuple[str, dict, bool, str]

# what each save mode keeps where (models/checkpoint_io/)
SAVE_NOTES = {
    "torch-save": "torch.save of the rank's own tensors: one host copy at a time, nothing gathered on the device",
    "full-rank0": "the full state dict gathered on rank 0's device until written (FullStateDictConfig rank0_only)",
    "full-rank0-offload": "the full state dict on rank 0's host instead of its device (get_state_dict cpu_offload): "
                          "host memory for the whole checkpoint",
    "full-all": "every rank keeps the gathered full state dict until rank 0 has written it",
    "sharded": "torch.distributed.checkpoint: each rank writes its own shards (host staging, nothing gathered); "
               "the checkpoint is a folder of shards (DCP), resharded at load",
    "async": "dcp.async_save: a host copy of the rank's state kept across saves, written in the background",
}
LOAD_NOTES = {
    "full-then-device": "torch.load(map_location='cpu') then copied in: the whole file in host memory",
    "map-to-device": "torch.load(map_location='cuda'): the loaded tensors on the device beside the model's",
    "meta-assign": "the model built on the meta device, load_state_dict(assign=True): no second copy",
}


def allocator_fixes(scenario: Scenario) -> list[Candidate]:
    """The caching allocator's own settings (simulator/allocator/), each a run setting, on GPU profiles."""
    if not device_profile(scenario.device).is_cuda:
        return []
    conf = scenario.alloc_conf
    settings = dict(item.split(":", 1) for item in conf.split(",") if ":" in item)
    merged = lambda **kw: ",".join(f"{k}:{v}" for k, v in {**settings, **kw}.items())  # noqa: E731
    out = []
    if settings.get("expandable_segments") != "True":
        out.append(("allocator: expandable_segments:True", {"alloc_conf": merged(expandable_segments="True")}, False,
                    "none: segments grow page by page instead of leaving gaps between cached segments"))
    if "max_split_size_mb" not in settings and settings.get("expandable_segments") != "True":
        out.append(("allocator: max_split_size_mb:128", {"alloc_conf": merged(max_split_size_mb="128")}, False,
                    "none: blocks of 128 MiB and more are never split, so large requests find whole blocks"))
    if scenario.setup.checkpoint_io.every and not scenario.empty_cache_before_save:
        out.append(("torch.cuda.empty_cache() before each save", {"empty_cache_before_save": True}, False,
                    "the cache is rebuilt after the save (cudaMalloc calls, a short stall)"))
    return out


def save_load_fixes(scenario: Scenario) -> list[Candidate]:
    """A checkpoint save's other modes, a load's other modes, and building the model in its training dtype."""
    s = scenario.setup
    out: list[Candidate] = []
    if s.checkpoint_io.every:
        for mode in SAVE_MODES:
            if mode != s.checkpoint_io.save_mode:
                out.append(
                    (f"save_mode {s.checkpoint_io.save_mode} -> {mode}", {"save_mode": mode}, False, SAVE_NOTES[mode])
                )
    if s.checkpoint_io.load_mode != "none":
        for mode in LOAD_MODES[1:]:
            if mode != s.checkpoint_io.load_mode:
                out.append(
                    (f"load_mode {s.checkpoint_io.load_mode} -> {mode}", {"load_mode": mode}, False, LOAD_NOTES[mode])
                )
    if s.checkpoint_io.build == "device-fp32":
        out.append(("build direct (from_pretrained(torch_dtype=...), no fp32 build)", {"build": "direct"}, False,
                    "none: each parameter allocated once, in its training dtype"))
    return out


def data_parallel_fixes(scenario: Scenario) -> list[Candidate]:
    """Shard more (ZeRO stages, FSDP2), and FSDP2's own knobs: reshard after forward, fewer units prefetched."""
    s = scenario.setup
    out: list[Candidate] = []
    if s.mesh.world_size > 1 and s.data_parallel.engine == "deepspeed":
        for stage in range(s.data_parallel.deepspeed.zero_stage + 1, 4):
            out.append((f"ZeRO-{stage}", {"zero_stage": stage}, False,
                        "more communication: " + {1: "none extra", 2: "gradients reduce-scattered",
                                                  3: "parameters all-gathered per module"}[stage]))
    if s.mesh.world_size > 1 and s.data_parallel.engine in ("ddp", "zero-redundancy-optimizer"):
        out.append(("FSDP2", {"dp_engine": "fsdp2"}, False, "parameters all-gathered per block"))
    if s.data_parallel.engine == "fsdp2" and s.mesh.dp > 1:
        if not s.data_parallel.fsdp2.reshard_after_forward:
            out.append(("fsdp2 reshard_after_forward=True", {"reshard_after_forward": True}, False,
                        "parameters all-gathered again in backward"))
        if s.data_parallel.fsdp2.forward_prefetch:
            out.append(("fsdp2 forward_prefetch 0", {"forward_prefetch": 0}, False, "less overlap in forward"))
        if s.data_parallel.fsdp2.backward_prefetch > 1:
            out.append(("fsdp2 backward_prefetch 1", {"backward_prefetch": 1}, False, "less overlap in backward"))
    return out


def activation_fixes(scenario: Scenario) -> list[Candidate]:
    """What the forward keeps for backward: checkpointing policies, smaller micro-batches, a shorter context."""
    s, model = scenario.setup, scenario.model
    family = family_of(model)
    traced = isinstance(model, TracedModel)  # (a factory's own signature: `varies`)
    out: list[Candidate] = []
    for policy in CHECKPOINTING:
        if policy not in (s.checkpointing.policy, "none", "layers") and not (traced and policy == "selective"):
            # "layers" needs a set (`peakledger checkpointing`); "selective" names transformer-block parts
            cost = ("saved activations copied to the host and back over the host link" if policy == "offload"
                    else "recompute in backward")
            out.append((f"checkpointing={policy}", {"checkpointing": policy}, False, cost))
    from .models.families import nanogpt
    if (family is nanogpt.FAMILY and s.checkpointing.activation_offload == "none" and s.checkpointing.policy == "none"
            and s.mesh.world_size == 1 and not s.lora.r and not s.compile.on and s.batch.passes == "train"):
        # torchtune 0.6.1 OffloadActivations (models/replay/offload_streams.py): the forward's copies on their own
        # stream, the backward's waited for
        out.append(("activation_offload=streams", {"activation_offload": "streams"},
                    False, "torchtune OffloadActivations: saved activations copied to pinned host memory on a side "
                    "stream, copied back in backward"))
    mb = s.batch.micro_batch if not traced or "micro_batch" in model.varies else 1  # a fixed factory batch
    for d in sorted((d for d in range(1, mb) if mb % d == 0), reverse=True):
        out.append((f"micro-batch {mb} -> {d}, accumulation {s.batch.grad_accum} -> {s.batch.grad_accum * mb // d}",
                    {"micro_batch": d, "grad_accum": s.batch.grad_accum * mb // d}, False,
                    "same B_eff, more and smaller steps (lower arithmetic intensity)"))
    if family.tokens(model, s) and s.batch.seq_len > 1:
        out.append((f"seq_len {s.batch.seq_len} -> {s.batch.seq_len // 2}", {"seq_len": s.batch.seq_len // 2}, True,
                    "shorter context: changes what the model learns"))
    return out


def optimizer_fixes(scenario: Scenario) -> list[Candidate]:
    """The optimizer step's states and temporaries: 8-bit states, fused or per-parameter updates, offload,
    gradient and master dtypes."""
    s = scenario.setup
    out: list[Candidate] = []
    if s.optimizer.name in ("adam", "adamw"):
        out.append(("8-bit Adam (bitsandbytes)", {"optimizer": "adam-8bit"}, True, "quantised optimizer states"))
        # the low-bit optimizers (models/lowbit.py): torchao 0.18.0's, bitsandbytes 0.50.2's paged one; as the
        # recipes that use them train (torchtune's full_finetune_single_device: bf16 weights, no fp32 masters), a
        # mixed precision becomes its 16-bit half
        half, words = ({}, "") if s.precision.uniform else ({"precision": "bf16"}, " in bf16")
        out.append((f"8-bit AdamW (torchao AdamW8bit){words}", {"optimizer": "adamw-8bit-torchao", **half}, True,
                    "blockwise 8-bit states; a compiled update per parameter"))
        out.append((f"4-bit AdamW (torchao AdamW4bit){words}", {"optimizer": "adamw-4bit", **half}, True,
                    "blockwise 4-bit states; a compiled update per parameter, its dequantised copies the largest"))
        out.append((f"paged 8-bit AdamW (bitsandbytes PagedAdamW8bit){words}",
                    {"optimizer": "paged-adamw-8bit", **half}, True,
                    "8-bit states in CUDA unified memory, paged to the host under pressure (host memory)"))
    plain_step = s.optimizer.name != "adam-8bit" and not OPTIMIZERS[s.optimizer.name].per_param
    if s.optimizer.impl != "fused" and plain_step:
        out.append(("fused optimizer", {"optimizer_impl": "fused"}, False, "none: no step temporaries"))
    if s.optimizer.impl == "foreach" and plain_step:
        out.append(("for-loop optimizer (foreach=False)", {"optimizer_impl": "for-loop"}, False,
                    "one parameter's temporaries at a time instead of a whole group's; a slower step"))
    chunked = {"optimizer_offload": "chunked", "offload_first_step": "chunked"}
    copies = "optimizer states copied to the device and back every step, over the host link"
    if s.offload.mode == "none":
        out.append(("optimizer-state offload, chunked", chunked, False, copies))
        out.append(("optimizer-state offload", {"optimizer_offload": "states"}, False, copies))
    elif s.offload.mode == "states":
        out.append(("optimizer-state offload in chunks", chunked, False, copies + ", chunk by chunk"))
    elif s.offload.first_step == "whole":
        out.append(("first step chunk by chunk (offload_first_step=chunked)", {"offload_first_step": "chunked"}, False,
                    "none: the first step creates and offloads the states chunk by chunk"))
    out += library_offload_fixes(scenario)
    if s.precision.fp32_grads:
        out.append(("gradients in the parameters' dtype (fp32_grads off)", {"fp32_grads": False}, True,
                    "16-bit gradient accumulation"))
    if (
        s.data_parallel.engine == "fsdp2"
        and s.data_parallel.fsdp2.reduce_dtype == "fp32"
        and s.precision.param != "fp32"
    ):
        out.append(("fsdp2 reduce_dtype grad (the gradients' own dtype)", {"reduce_dtype": "grad"}, True,
                    "gradients reduced in 16 bits"))
    if s.precision.uniform and s.precision.param == "fp32":
        out.append(("bf16 mixed precision", {"precision": "bf16-mixed"}, True, "16-bit compute and gradients"))
    return out


def library_offload_fixes(scenario: Scenario) -> list[Candidate]:
    """The optimizer run on the host as the libraries do it (models/offload_libraries.py, models/parallel/): torchao's
    CPUOffloadOptimizer on one GPU (with and without offload_gradients), FSDP2's CPUOffloadPolicy and DeepSpeed's
    ZeRO-Offload on several; each modelled with the fused Adam step, torchao's in a precision without fp32 masters
    (a mixed one becomes its 16-bit half, which changes the numerics)."""
    s = scenario.setup
    if s.optimizer.name not in ("adam", "adamw") or s.offload.mode != "none":
        return []
    fused = {} if s.optimizer.impl == "fused" else {"optimizer_impl": "fused"}
    host_step = "the optimizer steps on the CPU over pinned host copies; gradients go to the host and parameters " \
                "back every step, over the host link"
    out: list[Candidate] = []
    if s.mesh.world_size == 1:
        half = {} if s.precision.uniform else {"precision": "bf16"}
        torchao = {"optimizer_offload": "cpu", **fused, **half}
        name = "torchao CPUOffloadOptimizer" + (" in bf16" if half else "")
        out.append((name, torchao, bool(half), host_step))
        out.append((name + " + offload_gradients", {**torchao, "offload_gradients": True}, bool(half),
                    host_step + "; each device gradient freed once copied"))
    elif s.data_parallel.engine == "fsdp2" and not s.data_parallel.fsdp2.cpu_offload:
        out.append(("fsdp2 CPUOffloadPolicy", {"fsdp_cpu_offload": True, **fused}, False,
                    host_step + "; the host shards all-gathered to the device per block"))
    elif s.data_parallel.engine == "deepspeed" and s.data_parallel.deepspeed.zero_stage == 2:
        out.append(("ZeRO-Offload (offload_optimizer cpu)", {"zero_offload_optimizer": "cpu", **fused}, False,
                    host_step + " (DeepSpeedCPUAdam)"))
    return out


def model_parallel_fixes(scenario: Scenario) -> list[Candidate]:
    """Pipeline schedules that hold fewer micro-batches in flight on the same GPUs, and more tensor-, context- or
    pipeline-parallel ranks, which say that they take more GPUs (models/parallel/)."""
    s = scenario.setup
    out: list[Candidate] = []
    if s.mesh.pp > 1 and s.mesh.pp_schedule == "gpipe" and s.batch.grad_accum >= s.mesh.pp:
        out.append(("pipeline schedule gpipe -> 1f1b", {"pp_schedule": "1f1b"}, False,
                    "same GPUs: at most pp micro-batches in flight on the first stage instead of all of them"))
    transformer = family_of(scenario.model).transformer  # (a candidate its family refuses is skipped)
    if s.mesh.tp > 1 or (s.mesh.pp == 1 and s.mesh.world_size == 1 and transformer):
        tp = s.mesh.tp * 2
        out.append((f"tp {s.mesh.tp} -> {tp} ({s.mesh.world_size} -> {s.mesh.world_size * 2} GPUs)",
                    {"tp": tp, "world_size": s.mesh.world_size * 2}, False,
                    f"twice the GPUs: each holds 1/{tp} of the weights and of the activations between linears"))
    if s.mesh.cp > 1 or (s.mesh.world_size == 1 and transformer and s.batch.seq_len % 4 == 0):
        cp = s.mesh.cp * 2  # skipped (a ConfigError) where context parallelism is not simulated for the scenario
        out.append((f"cp {s.mesh.cp} -> {cp} ({s.mesh.world_size} -> {s.mesh.world_size * 2} GPUs)",
                    {"cp": cp, "world_size": s.mesh.world_size * 2}, False,
                    f"twice the GPUs: each holds 1/{cp} of the sequence's activations (ring attention)"))
    if s.mesh.pp > 1:
        out.append(
            (
                f"pp {s.mesh.pp} -> {2 * s.mesh.pp} ({s.mesh.world_size} -> {s.mesh.world_size * 2} GPUs)",
                {
                    "pp": 2 * s.mesh.pp,
                    "world_size": s.mesh.world_size * 2,
                    "grad_accum": max(s.batch.grad_accum, 2 * s.mesh.pp),
                },
                False,
                "twice the GPUs: each stage holds half as many layers",
            )
        )
    return out


def freeze_fixes(scenario: Scenario) -> list[Candidate]:
    """Fine-tune the upper half only (no gradients nor states for the lower half)."""
    s, model = scenario.setup, scenario.model
    if s.lora.r:
        return []
    if isinstance(model, TracedModel) and s.checkpointing.policy == "none":
        layers = traced_layers(model, s)
        if len(layers) > 1:
            half = layers[:len(layers) // 2]
            return [(f"freeze {half[0]} .. {half[-1]}", {"frozen": tuple(f"{name}.*" for name in half)}, True,
                     "fine-tunes the upper half only")]
    if family_of(model).transformer and model.n_layer > 1:
        prefix = model.blocks
        half = model.n_layer // 2
        return [(f"freeze layers 0-{half - 1}", {"frozen": tuple(f"{prefix}.{i}.*" for i in range(half))}, True,
                 "fine-tunes the upper half only")]
    return []


QLORA_NOTE = ("base linears in 4 bits (bitsandbytes Linear4bit NF4, double quant), dequantised per linear in forward "
              "and backward: a slower step and a small quality change")


def lora_fixes(scenario: Scenario) -> list[Candidate]:
    """Train adapters instead of the whole model: LoRA r 16 on a full fine-tune, and QLoRA (the frozen base in 4
    bits) on either; QLoRA is modelled in a uniform precision (models/config/checks.py), so a mixed one becomes
    its 16-bit half."""
    s = scenario.setup
    if s.lora.quantize != "none" or s.mesh.world_size > 1:
        return []
    uniform = {} if s.precision.uniform else {"precision": "bf16"}
    out: list[Candidate] = []
    if not s.lora.r and not s.optimizer.frozen:
        out.append(("LoRA r 16 (adapters instead of a full fine-tune)", {"lora_r": 16}, True,
                    "only the adapters train: no gradients nor optimizer states for the base weights"))
    r = {} if s.lora.r else {"lora_r": 16}
    name = "QLoRA" + ("" if s.lora.r else " r 16") + (" in bf16" if uniform else "")
    out.append((f"{name} (4-bit NF4 base)", {**r, "quantize": "nf4", **uniform}, True, QLORA_NOTE))
    return out


def compile_fixes(scenario: Scenario) -> list[Candidate]:
    """torch.compile where it is modelled (analysis/checkpointing/policies.py `compile_applies`; elsewhere the setup
    refuses it and the fix is skipped): fewer saved activations, temporaries fused away."""
    if not compile_applies(scenario):
        return []
    return [("torch.compile (inductor)", {"compile": True}, False,
             "the first step compiles (tens of seconds to minutes), which its step time does not count; "
             "the step's FLOPs are eager's (the compiled graphs' aten ops), fusion's saved memory traffic is not "
             "modelled in its time")]


def in_backward_fixes(scenario: Scenario) -> list[Candidate]:
    """torchtune's optimizer step in backward (the gradients freed as they are made; no accumulation or clipping)
    and its chunked cross-entropy (the hand-written GPT / Llama describer's head and loss, 8 chunks)."""
    s = scenario.setup
    out: list[Candidate] = []
    if not s.optimizer.in_backward and s.batch.grad_accum == 1 and not s.loop.clips_gradients:
        out.append(("optimizer step in backward (torchtune optimizer_in_bwd)", {"optimizer_in_backward": True}, False,
                    "one optimizer per parameter, stepped by its gradient hook: no gradient accumulation or "
                    "clipping"))
    model = scenario.model
    if (not s.loop.chunked_loss and family_of(model).name == "nanogpt" and s.batch.seq_len % 8 == 0
            and s.precision.autocast is None):
        out.append(("chunked cross-entropy, 8 chunks (torchtune)", {"chunked_loss": 8}, False,
                    "the output projection and the loss chunk by chunk; no whole fp32 copy of the logits"))
    return out


def rl_fixes(scenario: Scenario) -> list[Candidate]:
    """An RL run's rollout and scoring (models/rl.py): vLLM's share, its sleep mode, the reference model offloaded,
    the KV cache in fp8, a smaller generation group."""
    s = scenario.setup
    rl = s.rl
    if not rl.on:
        return []
    out: list[Candidate] = []
    if rl.vllm == "colocate":
        u = rl.vllm_gpu_memory_utilization
        for lower in (0.2, 0.15, 0.1):
            if lower < u:
                out.append((f"vllm_gpu_memory_utilization {u} -> {lower}", {"vllm_gpu_memory_utilization": lower},
                            False, "a smaller KV-cache pool: fewer sequences generated at once (slower rollout)"))
        for level in (1, 2):
            if level != rl.vllm_sleep_level:
                out.append((f"vllm_sleep_level {rl.vllm_sleep_level} -> {level}", {"vllm_sleep_level": level}, False,
                            "the engine's weights " + ("copied to pinned host memory" if level == 1 else "discarded")
                            + " and its KV cache freed between rollouts; woken (and weights synced) every rollout"))
        if rl.kv_cache_dtype == "auto":
            out += _fp8_kv_fix(scenario)
    if rl.beta and not rl.offload_reference:
        out.append(("offload the reference model", {"offload_reference": True}, False,
                    "its weights copied to the device and back for every scoring pass, over the host link"))
    g, rows = rl.num_generations, s.batch.micro_batch * s.batch.grad_accum
    for d in sorted((d for d in range(2, g) if g % d == 0 and rows % d == 0), reverse=True)[:1]:
        out.append((f"num_generations {g} -> {d}", {"num_generations": d}, True,
                    "smaller groups: noisier advantages"))
    return out


def _fp8_kv_fix(scenario: Scenario) -> list[Candidate]:
    """vLLM's KV cache in fp8 with the utilization lowered until its pool holds the blocks the model dtype's pool
    holds now (the same tokens at once: the rollout no slower); the pool alone in fp8 holds twice the tokens in the
    same bytes, which lowers no peak. None when the engine does not start as it is."""
    s = scenario.setup
    if not family_of(scenario.model).transformer:
        return []
    try:
        spec = engine_spec(scenario.model, s)
        total = device_profile(scenario.device).memory_bytes
        in_use = training_in_use(scenario.model, s, sum(p.numel for p in transformer_params(scenario.model)),
                                 device_profile(scenario.device).context_bytes)
        now = size_engine(spec, total, in_use)
    except ConfigError:
        return []
    if now.error:
        return []
    u = utilization_for_blocks(replace(spec, kv_cache_dtype="fp8"), total, now.num_blocks)
    if u >= s.rl.vllm_gpu_memory_utilization:
        return []
    return [(f"kv_cache_dtype fp8, vllm_gpu_memory_utilization {s.rl.vllm_gpu_memory_utilization} -> {u}",
             {"kv_cache_dtype": "fp8", "vllm_gpu_memory_utilization": u}, True,
             f"vLLM's KV cache in fp8: the same {now.num_blocks:,} blocks ({now.concurrency:.1f} requests of "
             f"{spec.context} tokens) in half the bytes; small numeric change")]


RL_KNOBS = frozenset({"vllm_gpu_memory_utilization", "vllm_sleep_level", "kv_cache_dtype", "offload_reference",
                      "num_generations"})  # what rl_fixes changes


def candidate_fixes(scenario: Scenario, fragmentation: bool = False) -> list[Candidate]:
    """Every fix worth re-simulating, each phase's knobs: an RL run's rollout and scoring, save and load, data
    parallelism, activations, the optimizer step, model parallelism, freezing, adapters (LoRA, QLoRA),
    torch.compile, the allocator's settings (first when `fragmentation`: the allocator's cached free blocks cause
    the OOM)."""
    rest = rl_fixes(scenario) + save_load_fixes(scenario) + data_parallel_fixes(scenario) + \
        activation_fixes(scenario) + \
        optimizer_fixes(scenario) + model_parallel_fixes(scenario) + freeze_fixes(scenario) + lora_fixes(scenario) + \
        compile_fixes(scenario) + in_backward_fixes(scenario)
    allocator = allocator_fixes(scenario)
    return allocator + rest if fragmentation else rest + allocator


__all__ = ["Candidate", "candidate_fixes", "rl_fixes", "RL_KNOBS", "SAVE_NOTES", "LOAD_NOTES"]
