"""The RL post-training section of a setup (models/rl.py simulates it): TRL 1.16.0's GRPOTrainer around the
training step, its reference model and its rollout (HF generate, or a vLLM engine colocated on the GPU), and the
checks of its knobs. Defaults are TRL's (trl/trainer/grpo_config.py, trl 1.16.0) where TRL has the knob."""

from __future__ import annotations

from dataclasses import dataclass

from ..knobs import Section, knob
from .base import ConfigError, choice_of

RL_TRAINERS = ("none", "grpo")
VLLM_MODES = ("none", "colocate")
VLLM_SLEEP_LEVELS = (0, 1, 2)
KV_CACHE_DTYPES = ("auto", "fp8")


@dataclass(frozen=True, eq=False)
class Rl(Section):
    """GRPO as TRL runs it: each step's rollout generates `num_generations` completions per prompt for the whole
    generation batch (micro_batch x grad_accum rows: TRL's steps_per_generation = gradient_accumulation_steps),
    scores them with the reference model (beta != 0), then updates the policy on rows of seq_len tokens (the
    prompt, seq_len - max_completion_length tokens, and the completion)."""

    trainer: str = knob("none", "rl", "grpo: TRL's GRPOTrainer around the training step (models/rl.py)",
                        choices=RL_TRAINERS, argparse_choices=True, name="rl")
    num_generations: int = knob(8, "rl", "completions per prompt (TRL's default 8); must divide micro_batch x "
                                "grad_accum", name="num_generations")
    max_completion_length: int = knob(256, "rl", "generated tokens per completion (TRL's default 256), within "
                                      "seq_len", name="max_completion_length")
    beta: float = knob(0.0, "rl", "KL coefficient (TRL's default 0.0: no reference model)", name="rl_beta")
    offload_reference: bool = knob(False, "rl", "the reference model's weights in host memory, copied to the "
                                   "device for its pass only", cli="on", name="offload_reference")
    vllm: str = knob("none", "rl", "colocate: a vLLM engine on the same GPU generates (TRL vllm_mode colocate); "
                     "none: HF generate", choices=VLLM_MODES, argparse_choices=True, name="vllm")
    vllm_gpu_memory_utilization: float = knob(0.3, "rl", "vLLM's share of the device's total memory (TRL's "
                                              "default 0.3)", name="vllm_gpu_memory_utilization")
    vllm_sleep_level: int = knob(0, "rl", "0: no sleep mode; 1: weights to host, KV cache freed between rollouts; "
                                 "2: both freed (TRL's vllm_enable_sleep_mode sleeps at level 2)",
                                 choices=VLLM_SLEEP_LEVELS, name="vllm_sleep_level")
    kv_cache_dtype: str = knob("auto", "rl", "the rollout's KV cache: auto (the compute dtype) or fp8 (vLLM "
                               "kv_cache_dtype)", choices=KV_CACHE_DTYPES, name="kv_cache_dtype")
    vllm_cudagraph_mb: int = knob(0, "rl", "vLLM's CUDA graph pool from its log (\"CUDA graph pool memory\"), MiB; "
                                  "0 with enforce_eager", name="vllm_cudagraph_mb")

    @property
    def on(self) -> bool:
        return self.trainer != "none"


def check_rl(knobs) -> None:
    """The RL knobs against each other and the batch (TRL's own refusals where it has them)."""
    choice_of(knobs, "rl", RL_TRAINERS)
    choice_of(knobs, "vllm", VLLM_MODES)
    choice_of(knobs, "vllm_sleep_level", VLLM_SLEEP_LEVELS)
    choice_of(knobs, "kv_cache_dtype", KV_CACHE_DTYPES)
    u = knobs.vllm_gpu_memory_utilization
    if not 0 < u <= 1:
        raise ConfigError("vllm_gpu_memory_utilization", f"must be in (0, 1], got {u!r}")
    for name in ("num_generations", "max_completion_length"):
        if getattr(knobs, name) < 1:
            raise ConfigError(name, f"must be a positive integer, got {getattr(knobs, name)!r}")
    if knobs.vllm_cudagraph_mb < 0:
        raise ConfigError("vllm_cudagraph_mb", f"must be >= 0, got {knobs.vllm_cudagraph_mb!r}")
    if knobs.rl == "none":
        given = [n for n, default in (("vllm", "none"), ("offload_reference", False), ("vllm_sleep_level", 0),
                                      ("rl_beta", 0.0), ("kv_cache_dtype", "auto"))
                 if getattr(knobs, n) != default]
        if given:
            raise ConfigError(given[0], "is an RL knob: give --rl grpo with it")
        return
    if knobs.max_completion_length >= knobs.seq_len:
        raise ConfigError("max_completion_length", f"{knobs.max_completion_length} leaves no prompt in seq_len "
                                                   f"{knobs.seq_len} (seq_len = prompt + completion tokens)")
    rows = knobs.micro_batch * knobs.grad_accum
    if rows % knobs.num_generations:  # trl/trainer/grpo_config.py __post_init__
        raise ConfigError("num_generations", f"{knobs.num_generations} must divide the generation batch, "
                                             f"micro_batch x grad_accum = {rows} (TRL refuses it)")
    if knobs.num_generations < 2:  # grpo_config.py: the group's std needs two
        raise ConfigError("num_generations", "must be at least 2 (TRL refuses 1: the group's advantages need two)")
    if knobs.vllm_sleep_level and knobs.vllm == "none":
        raise ConfigError("vllm_sleep_level", "is vLLM's sleep mode: give --vllm colocate with it")
    if knobs.offload_reference and knobs.rl_beta == 0:
        raise ConfigError("offload_reference", "there is no reference model with rl_beta 0 (TRL's default)")
    if knobs.world_size != 1 or knobs.pp != 1 or knobs.tp != 1:
        raise ConfigError("rl", "an RL step is modelled on one device (world_size 1, no tp / pp)")
