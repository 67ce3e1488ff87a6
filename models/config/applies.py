"""Which knobs a setup reads: `KNOB_APPLIES` (knob -> (does it apply to these knobs?, what it needs)), with each
data-parallel engine's own rules (models/dp_engines.py `knob_rules`), and `check_given_knobs`: a knob the user set
that this setup never reads is refused, not ignored."""

from __future__ import annotations

from ..dp_engines import knob_rules as engine_knob_rules
from .base import ConfigError

# A knob set by the user that the rest of the setup never reads is refused, not ignored: field -> (applies?, to what);
# a data-parallel engine's own knobs are declared with the engine (models/dp_engines.py).
# Which engine reads which knob: models/dp_engines.py; offload: models/offload.py.
KNOB_APPLIES = {
    "checkpoint_every_k": (lambda s: s.checkpointing == "every-k", "checkpointing every-k"),
    "checkpoint_every": (lambda s: s.checkpoint_every <= s.steps,
                         "checkpoint_every <= steps (a save within the steps simulated; raise --steps)"),
    "save_mode": (lambda s: s.checkpoint_every > 0, "checkpoint_every > 0 (a run that saves)"),
    "offload_chunk_params": (lambda s: s.optimizer_offload == "chunked", "optimizer_offload chunked"),
    "offload_prefetch": (lambda s: s.optimizer_offload == "chunked", "optimizer_offload chunked"),
    "offload_gradients": (lambda s: s.optimizer_offload == "cpu", "optimizer_offload cpu"),
    "lora_alpha": (lambda s: s.lora_r > 0, "lora_r > 0 (LoRA)"),
    "lora_dropout": (lambda s: s.lora_r > 0, "lora_r > 0 (LoRA)"),
    "lora_targets": (lambda s: s.lora_r > 0, "lora_r > 0 (LoRA)"),
    "frozen": (lambda s: s.lora_r == 0, "lora_r 0 (LoRA freezes the whole base model itself)"),
    "pp_schedule": (lambda s: s.pp > 1, "pp > 1 (pipeline parallelism)"),
    "virtual_stages": (lambda s: s.pp > 1, "pp > 1 (pipeline parallelism)"),
    "compile_mode": (lambda s: s.compile, "compile (--compile)"),
}


def check_given_knobs(setup, given) -> None:
    """Each knob in `given` (the ones the user set) must be read by `setup` (a TrainingSetup): ConfigError naming
    the first that is not (a DeepSpeed bucket size under FSDP2, a chunk size without chunked offload, ...)."""
    knobs = setup.knob_view()
    rules = {**engine_knob_rules(), **KNOB_APPLIES}  # an engine's own knobs: models/dp_engines.py
    for name in sorted(given):
        rule = rules.get(name)
        if rule is not None and not rule[0](knobs):
            raise ConfigError(name, f"only applies with {rule[1]}; this setup never reads it (dp_engine "
                                    f"{knobs.dp_engine}, zero_stage {knobs.zero_stage}, checkpointing "
                                    f"{knobs.checkpointing}, optimizer_offload {knobs.optimizer_offload}, "
                                    f"checkpoint_every {knobs.checkpoint_every}): drop it or change what it needs")
