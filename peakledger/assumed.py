"""What a result assumes, printed with it: the training loop, the batch, the steps, the precision and optimizer,
the device's rules and what no run of peakledger simulates. Every command that answers from a scenario (where,
explain, max-batch, compare, checkpointing, sweep; `simulate` prints the same in its report's head) ends its text
with these lines and carries them in --json as "assumed", so a figure is never read apart from the loop and batch
it was computed for (an HF Trainer step drops the logits before backward; the default loop holds them: on GPT-2
that is 1.5 GiB).
"""

from __future__ import annotations

from .analysis.report_text import LOOP_WORDS
from .models.devices import device_profile
from .models.families import family_of
from .scenario import Scenario
from .simulator.torch_rules import rules_reason

NOT_SIMULATED = ("not simulated: evaluation or generation inside training (peakledger run records them from the "
                 "script: docs/generation.md), other processes on the GPU, the data loader's pinned buffers, "
                 "variable-length batches (every micro-batch is at the full length)")
NOT_SIMULATED_RL = ("not simulated: evaluation inside training, other processes on the GPU than the colocated vLLM "
                    "engine, the data loader's pinned buffers, completions shorter than --max-completion-length "
                    "(every rollout generates the full length), the reward model's own memory")


def assumed(scenario: Scenario, micro_batch: str | None = None, devices: str | None = None) -> dict[str, str]:
    """The scenario's assumptions, by topic, in the report's words. `micro_batch` and `devices`: what stands for
    the scenario's micro-batch and device where the command varies them (max-batch searches the one, where
    tries each card)."""
    s, model = scenario.setup, scenario.model
    out: dict[str, str] = {}
    if s.batch.passes == "train":
        out["loop"] = LOOP_WORDS.get(s.loop.name, s.loop.name)
    note = family_of(model).batch_note(model, s)
    b_eff = s.effective_batch
    out["batch"] = ((f"micro-batch {micro_batch} x accumulation {s.batch.grad_accum} x dp {s.mesh.dp}, "
                     if micro_batch else f"micro-batch {s.batch.micro_batch} x accumulation {s.batch.grad_accum} x "
                     f"dp {s.mesh.dp} = {b_eff} per step, ") + (note if note else f"seq_len {s.batch.seq_len}")
                    + f"; {s.batch.steps} steps, passes {s.batch.passes}")
    world = s.mesh.world_size
    out["training"] = (f"precision {s.precision.name}, optimizer {s.optimizer.name} ({s.optimizer.impl}; its states "
                       f"created in the first step()), checkpointing {s.checkpointing.policy}, "
                       + (f"{world} GPUs (tp {s.mesh.tp}, pp {s.mesh.pp}, cp {s.mesh.cp}, dp {s.mesh.dp}, "
                          f"{s.data_parallel.engine})" if world > 1 else "one GPU"))
    profile = device_profile(scenario.device)
    allocator = f" ({scenario.alloc_conf})" if scenario.alloc_conf else " (default settings)"
    why = rules_reason(scenario.torch_version)
    out["device"] = (f"{devices or scenario.device}: torch {scenario.torch_version}'s CUDA kernels and caching "
                     f"allocator{allocator}; {why}" if profile.is_cuda or devices
                     else f"{scenario.device}: no CUDA context or caching allocator")
    if scenario.headroom:
        out["headroom"] = f"{scenario.headroom:g} added to what each run needs before it is judged"
    if s.rl.trainer != "none":
        out["rl"] = (f"TRL 1.16.0's {s.rl.trainer.upper()}Trainer: {s.rl.num_generations} completions per prompt of "
                     f"{s.rl.max_completion_length} tokens, beta {s.rl.beta:g} ("
                     + ("a reference model" + (" in host memory" if s.rl.offload_reference else "")
                        if s.rl.beta else "no reference model")
                     + "), rollout by "
                     + (f"a colocated vLLM engine (utilization {s.rl.vllm_gpu_memory_utilization:g}, sleep level "
                        f"{s.rl.vllm_sleep_level}; vLLM 0.32.0's sizing)" if s.rl.vllm != "none"
                        else "HF generate (dynamic cache)"))
    out["not simulated"] = (NOT_SIMULATED_RL if s.rl.trainer != "none" else NOT_SIMULATED).removeprefix(
        "not simulated: ")
    return out


def assumed_lines(scenario: Scenario, micro_batch: str | None = None, devices: str | None = None) -> list[str]:
    """The text block: a head line and one line per topic."""
    return topic_lines(assumed(scenario, micro_batch, devices))


def topic_lines(topics: dict[str, str]) -> list[str]:
    """An `assumed:` block of any command's topics (`peakledger plan`'s have no scenario): the head, a line each."""
    return ["assumed:"] + [f"  {topic}: {text}" for topic, text in topics.items()]


__all__ = ["assumed", "assumed_lines", "topic_lines", "NOT_SIMULATED"]
