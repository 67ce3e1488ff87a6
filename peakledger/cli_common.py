"""What every `peakledger` command shares: the scenario flags (model, training, run), sizes given as flags, the
`--case` syntax, and JSON output. peakledger/cli.py builds the commands from these; the command modules
(cmd_explain.py, cmd_calibrate.py) use them too."""

from __future__ import annotations

import argparse
import json
import sys

from .analysis.units import parse_bytes
from .inputs import DP_INT_FLAGS, MODEL_FLAG_TYPES
from .models.config import (
    BUILDS,
    CHECKPOINTING,
    DP_ENGINES,
    LOAD_MODES,
    OFFLOAD_FIRST_STEPS,
    OPTIMIZER_IMPLS,
    OPTIMIZER_OFFLOADS,
    OPTIMIZERS,
    PASSES,
    PP_SCHEDULES,
    PRECISIONS,
    QUANTIZE,
    REDUCE_DTYPES,
    SAVE_MODES,
    ConfigError,
)
from .models.costs import DEVICES
from .models.presets import PRESETS
from .scenario import parse_value


def _add_scenario_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model")
    g.add_argument("--scenario", help="TOML scenario file ([model], [training], [run]); flags override it")
    g.add_argument("--preset", help=f"one of: {', '.join(PRESETS)} (default gpt2)")
    g.add_argument("--hf-config", help="a HF transformers config.json (any model type transformers builds)")
    g.add_argument("--module", metavar="FILE.py:FACTORY",
                   help="your own model: FACTORY() returns (model, batch, loss_fn); traced on fake tensors")
    g.add_argument("--describer", help="auto (default), traced, hand-written: how --hf-config is described")
    for name, kind in MODEL_FLAG_TYPES:
        g.add_argument("--" + name.replace("_", "-"), type=kind, dest=f"model_{name}", help=argparse.SUPPRESS)
    t = p.add_argument_group("training")
    t.add_argument("--micro-batch", type=int)
    t.add_argument("--seq-len", type=int)
    t.add_argument("--grad-accum", type=int)
    t.add_argument("--steps", type=int, help="default 2, so the steady state is visible")
    t.add_argument("--precision", help=", ".join(PRECISIONS))
    t.add_argument("--passes", choices=PASSES, help="train (default): forward, loss, backward, optimizer step; "
                   "forward: `out = model(batch)` with autograd on, no loss, backward or step")
    t.add_argument("--fp32-grads", action="store_true", default=None, help="mixed precision: fp32 gradients")
    t.add_argument("--optimizer", help=", ".join(OPTIMIZERS))
    t.add_argument("--optimizer-impl", help=", ".join(OPTIMIZER_IMPLS))
    t.add_argument("--no-set-to-none", dest="set_to_none", action="store_false", default=None,
                   help="zero_grad(set_to_none=False): gradients stay allocated between steps")
    t.add_argument("--freeze", action="append", metavar="PATTERN", help="freeze parameters matching a glob")
    t.add_argument("--world-size", type=int)
    t.add_argument("--zero-stage", type=int)
    t.add_argument("--checkpointing", help=", ".join(CHECKPOINTING))
    t.add_argument("--checkpoint-every-k", type=int, help="checkpointing every-k: layers 0, k, 2k, ... (default 2)")
    t.add_argument("--checkpoint-layers", type=lambda v: tuple(int(x) for x in v.split(",") if x.strip()),
                   help="checkpointing layers: exactly these layer indices, e.g. 0,3,7")
    t.add_argument("--build", help=", ".join(BUILDS) + " (how the parameters reach the device: direct = once each, in "
                   "the training dtype; device-fp32 = built on the device in fp32, then model.to(dtype) where they are "
                   "16-bit, then fully_shard's copies under fsdp2)")
    k = p.add_argument_group("checkpoint save / load")
    k.add_argument("--checkpoint-every", type=int, help="save a checkpoint after every N-th optimizer step (0: never)")
    k.add_argument("--save-mode", help=", ".join(SAVE_MODES))
    k.add_argument("--load-mode", help=", ".join(LOAD_MODES) + " (a checkpoint loaded before the first step)")
    o = p.add_argument_group("optimizer-state offload")
    o.add_argument("--optimizer-offload", help=", ".join(OPTIMIZER_OFFLOADS) + " (states in host memory between steps)")
    o.add_argument("--offload-chunk-params", type=int,
                   help="chunked: parameter elements whose states are copied and updated together (default 100000000)")
    o.add_argument("--offload-prefetch", type=int,
                   help="chunked: chunks copied in ahead of the one updated (default 1)")
    o.add_argument("--offload-first-step", help=", ".join(OFFLOAD_FIRST_STEPS) +
                   " (chunked: step 1 as one torch step, or chunk by chunk)")
    lo = p.add_argument_group("LoRA / QLoRA (peft; the whole base model frozen)")
    lo.add_argument("--lora-r", type=int, help="adapter rank (0: no LoRA)")
    lo.add_argument("--lora-alpha", type=float, help="scaling = alpha / r (default 8, peft's)")
    lo.add_argument("--lora-dropout", type=float, help="dropout on the adapters' input, in [0, 1) (default 0)")
    lo.add_argument("--lora-targets", type=lambda v: tuple(x.strip() for x in v.split(",")),
                    help="peft target_modules, e.g. q_proj,k_proj,v_proj,o_proj (default: peft's for the family)")
    lo.add_argument("--quantize", help=", ".join(QUANTIZE) + " (nf4: bitsandbytes 4-bit base linears, QLoRA)")
    me = p.add_argument_group("mixture of experts")
    me.add_argument("--moe-routing", metavar="ROUTING",
                    help="tokens per expert: balanced (default), worst (every token "
                         "to the same top-k experts) or counts:FILE (measured, from capture --moe-counts)")
    d = p.add_argument_group("data parallelism")
    d.add_argument("--dp-engine", help=f"{', '.join(DP_ENGINES)} (default deepspeed: --zero-stage applies)")
    d.add_argument("--no-reshard-after-forward", dest="reshard_after_forward", action="store_false", default=None,
                   help="fsdp2: keep unsharded parameters from forward to backward")
    d.add_argument("--reduce-dtype", help=", ".join(REDUCE_DTYPES) + " (fsdp2: MixedPrecisionPolicy.reduce_dtype; "
                   "default grad: the gradients' own dtype, torch's None)")
    for name in DP_INT_FLAGS:
        d.add_argument("--" + name.replace("_", "-"), type=int, help=argparse.SUPPRESS)
    mp = p.add_argument_group("model parallelism (world_size = dp x tp x pp x cp)")
    mp.add_argument("--pp", type=int, help="pipeline-parallel ranks, one stage each (default 1); --grad-accum is the "
                    "number of micro-batches per step")
    mp.add_argument("--pp-schedule", help=", ".join(PP_SCHEDULES) + " (default 1f1b; torch.distributed.pipelining's)")
    mp.add_argument("--virtual-stages", type=int, help="stages per pipeline rank (interleaved-1f1b: >= 2, zbv: 2)")
    mp.add_argument("--tp", type=int,
                    help="tensor-parallel ranks (DTensor column / row-parallel linears, "
                         "vocab-parallel embedding and loss)")
    mp.add_argument("--cp", type=int,
                    help="context-parallel ranks (torch's context_parallel ring attention; cpu profile)")
    mp.add_argument("--ep", type=int, help="expert-parallel ranks, MoE models: experts placed on ranks, "
                    "tokens all-to-all'd as torchtitan does "
                    "(world_size = dp, a multiple of ep; dp_engine ddp)")
    mp.add_argument("--sequence-parallel", action="store_true", default=None,
                    help="sequence parallelism over the tp ranks (norms and residual stream sharded on the sequence)")
    r = p.add_argument_group("run")
    r.add_argument("--device", help=", ".join(DEVICES))
    r.add_argument("--headroom", type=float, help="capacity needed = peak x (1 + headroom); 0.1 = 10%%")
    r.add_argument("--alloc-conf", metavar="CONF", help="CUDA caching allocator settings on GPU device profiles, in "
                   "PYTORCH_CUDA_ALLOC_CONF syntax, e.g. expandable_segments:True,max_split_size_mb:128")
    r.add_argument("--empty-cache-before-save", action="store_true", default=None,
                   help="the program calls torch.cuda.empty_cache() before each checkpoint save (GPU profiles)")
    r.add_argument("--torch-version", help="whose CUDA caching-allocator rules apply: 2.6 (default) or 2.11")
    r.add_argument("--simulator", help="the discrete-event engine: builtin (default) or simpy (SimPy's own objects: "
                   "the same events, slower; simulator/simpy_engine.py takes processes of your own)")
    r.add_argument("--unit", choices=["GiB", "GB", "MiB", "MB"],
                   help="print sizes in this unit (default GiB; validate: MiB); --json always gives bytes")
    r.add_argument("--debug", action="store_true", help="on an internal error, print the whole traceback")
    r.add_argument("--module-timeout", type=float, metavar="SECONDS",
                   help="--module: the longest its import, factory or traced step may run (default 600; 0: no limit)")


def _budget(args, name: str = "budget") -> int | None:
    """A size flag as bytes (None when not given; an empty value is an error, never "no budget")."""
    value = getattr(args, name, None)
    return None if value is None else parse_bytes(value, name)


def _parse_case(text: str) -> tuple[str, dict]:
    name, sep, rest = text.partition(":")
    if not sep or not name.strip():
        raise ConfigError("case", f"expected 'name: key=value ...', got {text!r}")
    changes = {}
    for item in rest.split():
        key, eq, value = item.partition("=")
        if not eq:
            raise ConfigError("case", f"expected key=value in {text!r}, got {item!r}")
        if key == "name":
            raise ConfigError("case", f"the case's name is the text before ':' in {text!r}; 'name' is not a field "
                                      "to change")
        if key in changes:
            raise ConfigError("case", f"{key} is given twice in {text!r}")
        changes[key] = parse_value(value)
    return name.strip(), changes


def _write_json(obj) -> None:
    sys.stdout.write(json.dumps(obj, indent=2) + "\n")
