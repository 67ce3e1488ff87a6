"""The real torch programs peakledger measures, on the CPU with random weights: models/ describes, traces/
measures, and these are what is measured.

How the pieces compose:
- `nanogpt.py`  the plain-torch reference models built from the describers' own configs: nanoGPT (GPT-2), a
                small Llama, an MLP, HF's GPT2LMHeadModel behind nanoGPT's call; the checkpointing mechanisms
                (`run_segment`, `OP_POLICY`) and autocast as the describers assume them;
- `mixtral.py`  HF's MixtralForCausalLM of the same config, and the router hook recording routing counts;
- `lora.py`, `qlora.py`  peft's LoRA on any of them, over bitsandbytes 4-bit base linears for QLoRA;
- `traced.py`   a traced model's own program (a HF config or a user's factory, models/traced) built for real;
- `build.py`    what a run takes from them: `PROGRAMS`, each family's program and batches keyed by the family
                object (models/families/), `build_model` (the config's family's, for a setup), `make_optimizer` /
                `torch_optimizer` (with `StateOffload`), `make_batch`.
The tracker (traces/tracker/) and the multi-process harnesses (traces/*_run.py) run them.
"""

from .build import (
    PROGRAMS,
    Reference,
    StateOffload,
    build_model,
    freeze,
    make_batch,
    make_optimizer,
    optimizer_class,
    reference,
    torch_optimizer,
)
from .nanogpt import (
    HF_CHECKPOINTING,
    OP_POLICY,
    OP_POLICY_SAVES,
    REFERENCE_PRECISIONS,
    TORCH_DTYPES,
    attention_core,
    autocast_context,
    run_segment,
)

__all__ = ["PROGRAMS", "Reference", "reference", "build_model", "freeze", "make_batch", "make_optimizer",
           "optimizer_class", "torch_optimizer", "StateOffload", "HF_CHECKPOINTING", "OP_POLICY", "OP_POLICY_SAVES",
           "REFERENCE_PRECISIONS",
           "TORCH_DTYPES", "attention_core", "autocast_context", "run_segment"]
