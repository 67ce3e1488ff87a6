"""The peers' own functions where they are installed, else their formulas labelled with the version they follow.

- llm-analysis (PyPI llm-analysis, cli99/llm-analysis): `LLMAnalysis(...).training(...)` on ModelConfig /
  GPUConfig / DtypeConfig / ParallelismConfig objects built from the same inputs as the re-derived
  `peers_parallel.llm_analysis_training`, which follows the released 0.2.2 (tag v0.2.2, the PyPI wheel's source).
- accelerate's `accelerate estimate-memory` (accelerate/commands/estimate.py): `calculate_maximum_sizes` on the model
  built with empty weights the way its `create_empty_model` builds it (`AutoModel.from_config`, fp32; never its hub
  path), and `estimate_training_usage`, whose largest term is the table's "Training using Adam" figure.

Each is imported here, on demand, its logging and warnings silenced (llm-analysis logs its analysis through a
handler of its own, and warns at every `LLMAnalysis` whose flops efficiency is above 0.55). A peer that is not
installed, does not import, or refuses the setup (llm-analysis asserts 4-, 8- or 16-bit weights and activations)
gives its formulas' figure, the reason in its source line: a labelled column, never a failed command.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import logging
import warnings
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, replace

LLM_ANALYSIS = "llm-analysis"
LLM_ANALYSIS_VERSION = "0.2.2"  # the llm-analysis whose formulas peers_parallel.llm_analysis_training follows
ACCELERATE_VERSION = "1.16.0"  # the accelerate whose estimate_training_usage `accelerate_training_usage` copies
ACCELERATE_FUNCTIONS = "calculate_maximum_sizes + estimate_training_usage"
MIXED_PRECISION = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}  # compute dtype -> accelerate's name
ACCELERATE_16_BIT = ("float16", "bfloat16", "fp8")  # the names its estimate_training_usage counts as mixed precision


@contextmanager
def quiet():
    """Third-party logging (below ERROR) and warnings silenced for the block."""
    previous = logging.root.manager.disable
    logging.disable(logging.WARNING)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        logging.disable(previous)


def first_line(e: BaseException) -> str:
    return (str(e) or type(e).__name__).splitlines()[0]


def installed(module: str, dist: str) -> tuple[object | None, str, str]:
    """(the module, its distribution's version, "") where it imports, else (None, "", why): "<dist> not installed",
    or the import's error. The top package is imported first: a blocked or missing one fails there."""
    top = module.split(".")[0]
    with quiet():
        try:
            importlib.import_module(top)
            found = importlib.import_module(module)
        except Exception as e:  # noqa: BLE001 - any failure of a third party's import is a column from the formulas
            if isinstance(e, ImportError) and e.name == top:
                return None, "", f"{dist} not installed"
            return None, "", f"{dist} did not import: {first_line(e)}"
    try:
        version = importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        version = "unknown version"
    return found, version, ""


@dataclass(frozen=True)
class PeerFunction:
    """A peer's figure: its own function (`own` not None, `version` installed) or `formulas` (a re-derivation of
    `formula_version`). Calling it gives (result, source line, whether the peer's own function made it)."""

    name: str
    function: str  # the peer's function, in its words
    formula_version: str
    formulas: Callable[..., dict]
    own: Callable[..., dict] | None = None
    version: str = ""
    why: str = ""  # why the formulas, when `own` is None

    @property
    def source(self) -> str:
        if self.own is not None:
            return f"{self.name} {self.version}, its own {self.function}"
        return f"{self.name} {self.formula_version}'s formulas ({self.why})"

    def __call__(self, **kw) -> tuple[dict, str, bool]:
        if self.own is not None:
            try:
                with quiet():
                    return self.own(**kw), self.source, True
            except Exception as e:  # noqa: BLE001 - the peer's own checks (asserts) refusing the setup
                why = f"its own {self.function} refused the setup: {first_line(e)}"
                return self.formulas(**kw), f"{self.name} {self.formula_version}'s formulas ({why})", False
        return self.formulas(**kw), self.source, False


# -- llm-analysis -----------------------------------------------------------------------------------------------------

def llm_analysis_peer(formulas: Callable[..., dict], device=None, grad_accum: int = 1) -> PeerFunction:
    """llm-analysis's `LLMAnalysis.training` when llm_analysis imports, else `formulas` (llm-analysis 0.2.2's,
    re-derived). `device`: a models.devices DeviceProfile for its GPUConfig, `grad_accum` its gradient accumulation
    steps (its memory figures read neither)."""
    analysis, version, why = installed("llm_analysis.analysis", LLM_ANALYSIS)
    peer = PeerFunction(LLM_ANALYSIS, "LLMAnalysis.training", LLM_ANALYSIS_VERSION, formulas)
    if analysis is None:
        return replace(peer, why=why)
    config = importlib.import_module("llm_analysis.config")
    return replace(peer, version=version,
                   own=lambda **kw: llm_analysis_own(analysis, config, device, **kw, grad_accum=grad_accum))


def llm_analysis_gpu(config, device):
    """llm-analysis's GPUConfig of a peakledger DeviceProfile (memory in GiB: it multiplies by 1024^3)."""
    flops = device.flops.get("fp16") or device.flops.get("bf16") or device.flops["fp32"]
    return config.GPUConfig(name=device.name, mem_per_GPU_in_GB=device.memory_bytes / 2**30,
                            hbm_bandwidth_in_GB_per_sec=device.bandwidth / 1e9,
                            intra_node_bandwidth_in_GB_per_sec=device.interconnect / 1e9,
                            intra_node_min_message_latency=device.interconnect_latency,
                            peak_fp16_TFLOPS=flops / 1e12)


def llm_analysis_recompute(analysis, recompute: str):
    # 0.2.2: NONE, SELECTIVE, FULL; its main since 08d7f8f calls selective ATTN_COMPUTE
    names = {"none": ("NONE",), "selective": ("SELECTIVE", "ATTN_COMPUTE"), "full": ("FULL",)}[recompute]
    return next(getattr(analysis.ActivationRecomputation, n) for n in names
                if hasattr(analysis.ActivationRecomputation, n))


def llm_analysis_own(analysis, config, device, *, h, ffn, layers, heads, kv_heads, vocab, seq, micro_batch, tp, pp,
                     dp, sp, recompute, zero_stage=0, flash_attn=True, weight_bytes=2, act_bytes=2, layernorm_bytes=4,
                     master_bytes=4, num_experts=1, top_k=1, grad_accum=1) -> dict:
    """`LLMAnalysis(...).training(...)` on the inputs of `peers_parallel.llm_analysis_training`, read back into its
    keys (bytes per GPU as llm-analysis reports them, unrounded) plus `summary`, the memory entries of its summary.
    The global batch is given with the micro-batch and accumulation steps, so llm-analysis takes the three as set
    (a micro-batch above what its GPU memory fits would otherwise fail its assert)."""
    if device is None:
        from ..models.devices import device_profile
        device = device_profile("H100-80GB")
    model = config.ModelConfig(name="peakledger", num_layers=layers, n_head=heads, hidden_dim=h, vocab_size=vocab,
                               max_seq_len=seq, num_key_value_heads=kv_heads, ffn_embed_dim=ffn,
                               expansion_ratio=ffn / h, moe_num_experts=num_experts, moe_top_k=top_k)
    bits = dict(weight_bits=round(weight_bytes * 8), activation_bits=round(act_bytes * 8),
                embedding_bits=round(weight_bytes * 8))
    dtype = config.DtypeConfig(name="w{weight_bits}a{activation_bits}e{embedding_bits}".format(**bits), **bits)
    parallel = config.ParallelismConfig(tp_size=tp, pp_size=pp, dp_size=dp, sp_size=sp)
    run = analysis.LLMAnalysis(model, llm_analysis_gpu(config, device), dtype, parallel)
    recomputation = llm_analysis_recompute(analysis, recompute)
    summary = run.training(batch_size_per_gpu=micro_batch, gradient_accumulation_steps=grad_accum,
                           global_batch_size=micro_batch * grad_accum * dp, seq_len=seq,
                           activation_recomputation=recomputation, ds_zero=analysis.DSZeRO(zero_stage),
                           layernorm_dtype_bytes=layernorm_bytes, master_weights_dtype_bytes=master_bytes,
                           flash_attn=flash_attn)
    per_layer = run.get_activation_memory_per_layer(micro_batch, seq, is_inference=False,
                                                    activation_recomputation=recomputation,
                                                    layernorm_dtype_bytes=layernorm_bytes, flash_attn=flash_attn)
    states = summary["(weight+op_state+grad)_memory_per_gpu"]
    activations = summary["activation_memory_per_gpu"]
    return {"weights": summary["weight_memory_per_gpu"], "gradients": summary["gradient_memory_per_gpu"],
            "optimizer_states": summary["optimizer_state_memory_per_gpu"], "model_states": states,
            "activation_per_layer": per_layer, "logits": summary["activation_memory_embedding_output_per_gpu"],
            "activations": activations, "layers_per_gpu": int(layers / pp), "bytes": states + activations,
            "summary": {k: v for k, v in summary.items() if "memory" in k and "efficiency" not in k}}


# -- accelerate estimate-memory ---------------------------------------------------------------------------------------

def accelerate_training_usage(nbytes: int, mixed: str) -> dict:
    """accelerate 1.16.0 `estimate_training_usage(bytes, mixed_precision)` (accelerate/commands/estimate.py): the
    training memory of a model of `nbytes` fp32 bytes, per term; -1 for a name it does not know."""
    fp32, fp16 = nbytes, nbytes // 2
    if mixed == "float32":
        return {"model": fp32, "optimizer": fp32 * 2, "gradients": fp32, "step": fp32 * 4}
    if mixed in ACCELERATE_16_BIT:
        # fp32 weights, gradients 1.5x (weight gradient + GEMM), Adam 2x, the step as the optimizer
        return {"model": fp32, "optimizer": fp32 * 2, "gradients": fp32 + fp16, "step": fp32 * 2}
    return {"model": -1, "optimizer": -1, "gradients": -1, "step": -1}


def accelerate_own(hf: dict, mixed: str) -> dict:
    """accelerate's own functions on the model `accelerate estimate-memory` builds for a transformers config: its
    `create_empty_model` without the hub (`AutoModel.from_config` in fp32 under `init_empty_weights`)."""
    import torch
    import transformers
    from accelerate import init_empty_weights
    from accelerate.commands.estimate import estimate_training_usage
    from accelerate.utils import calculate_maximum_sizes

    from ..models.traced.model import hf_config

    with init_empty_weights():
        model = transformers.AutoModel.from_config(hf_config(hf), dtype=torch.float32)
    total, (largest, largest_names) = calculate_maximum_sizes(model)
    usage = estimate_training_usage(total, mixed)
    return {"total_size": total, "largest_layer": largest, "largest_layer_names": list(largest_names),
            "model_class": type(model).__name__, "training": usage}


def accelerate_estimate(hf: dict | None, n_params: int, precision, config_from: str = "its config",
                        no_hf: str = "the model has no transformers config for accelerate to build") -> dict:
    """`accelerate estimate-memory`'s "Training using Adam" for the model (the largest of its training terms, bytes)
    at the setup's precision (`precision`: models.precision.Precision; mixed precision by the compute dtype), from
    accelerate's own functions where it imports and the model has a transformers config (`hf`), else accelerate
    1.16.0's formula over fp32 bytes of peakledger's `n_params` (the LM head included; `no_hf` says why there is no
    config; `config_from` where the config comes from, for the source line). `estimate`, `source`, `version`,
    `own`, `detail`."""
    mixed = MIXED_PRECISION[precision.compute]
    estimate, version, why = installed("accelerate.commands.estimate", "accelerate")
    own = None
    if estimate is not None and hf is None:
        why = no_hf
    elif estimate is not None:
        try:
            with quiet():
                own = accelerate_own(hf, mixed)
        except Exception as e:  # noqa: BLE001 - transformers or accelerate refusing the model
            why = f"accelerate {version} could not build or size it: {first_line(e)}"
    if own is not None:
        source = (f"accelerate {version}, its own {ACCELERATE_FUNCTIONS} (`accelerate estimate-memory`'s \"Training "
                  f"using Adam\", {mixed}) on {own['model_class']} built from {config_from} with empty weights")
        detail = {**own, "mixed_precision": mixed}
    else:
        version = ACCELERATE_VERSION
        source = f"accelerate {version}'s formulas ({why}): estimate_training_usage over 4 B x peakledger's parameters"
        detail = {"total_size": 4 * n_params, "training": accelerate_training_usage(4 * n_params, mixed),
                  "mixed_precision": mixed}
    best = max(detail["training"].values())
    return {"estimate": None if best < 0 else best, "source": source, "version": version, "own": own is not None,
            "detail": detail}


__all__ = ["PeerFunction", "installed", "quiet", "llm_analysis_peer", "llm_analysis_own", "llm_analysis_gpu",
           "accelerate_training_usage", "accelerate_own", "accelerate_estimate", "LLM_ANALYSIS_VERSION",
           "ACCELERATE_VERSION", "MIXED_PRECISION"]
