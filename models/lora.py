"""LoRA and QLoRA on the hand-written describers (GPT-2 and Llama families): the tape peft writes.

With `TrainingSetup.lora_r > 0` the model is what `peft.get_peft_model(model, LoraConfig(r, lora_alpha,
lora_dropout, target_modules))` makes of it: every base parameter frozen (embeddings, norms and lm_head too:
no gradients, no optimizer states), and on each targeted linear two adapter weights, named as peft names
them under the model: `<linear>.lora_A.default.weight` (r x in) and `<linear>.lora_B.default.weight`
(out x r); the targeted linear's own weight becomes `<linear>.base_layer.weight`.

A targeted linear runs peft's `Linear.forward` (peft/tuners/lora/layer.py, peft 0.21.2):

    result = base_layer(x)                                  # the frozen linear
    x = x.to(lora_A.weight.dtype)                           # _cast_input_dtype: a copy when the dtypes differ
    result = result + lora_B(lora_A(dropout(x))) * scaling  # out of place; dropout is nn.Identity at p = 0
    result = result.to(torch_result_dtype)                  # a copy when the sum was promoted

so autograd keeps the input of A (or the dropout output, plus the dropout mask when p > 0) and the rank-r
intermediate A(x) for B; the scaled product and the sum are temporaries. `get_peft_model`'s
`autocast_adapter_dtype=True` keeps 16-bit adapters in fp32: under pure bf16 the adapters, their gradients and
their optimizer states are fp32 (`LoraTape.param_dtypes`), every adapter input is copied to fp32 and the sum
cast back.

A frozen linear (the base of a targeted one, every linear not targeted, lm_head) saves only its weight, a
parameter, when its input needs a gradient; under autocast that is the 16-bit copy of the weight, made anew at
every call (autocast caches casts of leaves that require grad only: aten/src/ATen/autocast_mode.cpp
`cached_cast`).

QLoRA (`quantize = "nf4"`, models/qlora.py): every linear of the blocks is a bitsandbytes `Linear4bit`
(transformers' `BitsAndBytesConfig(load_in_4bit=True)` keeps lm_head in its dtype).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from . import qlora
from .config import ConfigError, TrainingSetup, TransformerConfig
from .tape import ParamSpec, Tape, TensorSpec

# the linears of each architecture's blocks, by module path under the block
BLOCK_LINEARS = {"llama": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"),
                 "gpt2": ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")}
# peft/utils/constants.py TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING: target_modules=None means these
DEFAULT_TARGETS = {"llama": ("q_proj", "v_proj"), "gpt2": ("c_attn",)}
ADAPTER_MARKERS = (".lora_A.", ".lora_B.")


def is_adapter(name: str) -> bool:
    return any(m in name for m in ADAPTER_MARKERS)


def _matches(path: str, target: str) -> bool:
    """peft/tuners/tuners_utils.py `check_target_module_exists`: the module path is the target or ends with
    "." + target."""
    return path == target or path.endswith("." + target)


# why a family without LoRA refuses it (its `Family.lora_targets`, models/families/): an MLP; HF's code (HF GPT-2,
# and Mixtral, whose refusal has always named GPT-2's)
NOT_ON_MLP = ("an MLP has no q_proj / c_attn linears to target; LoRA is modelled on transformers: allowed: family "
              "gpt2 or llama (presets tiny, tiny-llama, gpt2, llama-3-8b, ...)")
NOT_ON_HF = ("LoRA on HF's GPT2LMHeadModel (Conv1D, fan_in_fan_out) is not modelled; allowed: implementation nanogpt "
             "(the gpt2 / llama presets)")


def targets(model: TransformerConfig, setup: TrainingSetup) -> tuple[str, ...]:
    """The setup's target_modules for a nanogpt-family transformer (peft's default for its architecture when none
    are given); ConfigError for a name that matches no linear of its blocks (naming the allowed ones). The nanogpt
    family's `lora_targets`; the families LoRA is not modelled on refuse it with their own words."""
    chosen = setup.lora.targets or DEFAULT_TARGETS[model.architecture]
    linears = BLOCK_LINEARS[model.architecture]
    allowed = sorted({p.rpartition(".")[2] for p in linears}) + [p for p in linears
                                                                 if sum(q.endswith(p.rpartition(".")[2])
                                                                        for q in linears) > 1]
    for t in chosen:
        if not any(_matches(f"x.{p}", t) for p in linears):
            raise ConfigError("lora_targets", f"{t!r} matches no linear of a {model.architecture} block; allowed: "
                                              f"{', '.join(allowed)}")
    return tuple(chosen)


def is_target(name: str, chosen: tuple[str, ...]) -> bool:
    return name != "lm_head" and any(_matches(name, t) for t in chosen)


def adapter_dtype(setup: TrainingSetup) -> str:
    """peft get_peft_model(autocast_adapter_dtype=True) upcasts fp16/bf16 adapters to fp32
    (peft/tuners/tuners_utils.py `_cast_adapter_dtype`); under mixed precision the engine casts the module."""
    return "fp32" if setup.precision.uniform and setup.precision.param == "bf16" else setup.precision.param


@dataclass
class LoraTape(Tape):
    """A tape whose parameters do not all have the setup's parameter dtype: name -> dtype (fp32 adapters under
    pure bf16, QLoRA's packed 4-bit weights and quantization state). The others have the setup's."""

    param_dtypes: dict[str, str] = field(default_factory=dict)
    logical_numel: dict[str, int] = field(default_factory=dict)  # 4-bit weights: out x in; quant state: 0

    @property
    def n_params(self) -> int:
        """The model's parameter count as peft's `print_trainable_parameters` gives it (a packed 4-bit weight
        counts its out x in weights; its quantization state is not a parameter of the model)."""
        return sum(self.logical_numel.get(p.name, p.numel) for p in self.params)


def lora_tape(cfg: TransformerConfig, setup: TrainingSetup, params: list[ParamSpec]) -> LoraTape:
    """The tape's parameter list under LoRA: targeted linears' parameters renamed `.base_layer.`, each linear
    followed by its adapters (peft registers base_layer, then lora_A, lora_B); 4-bit weights packed (qlora)."""
    chosen = targets(cfg, setup)
    out: list[ParamSpec] = []
    dtypes: dict[str, str] = {}
    logical: dict[str, int] = {}
    for i, p in enumerate(params):
        module, _, leaf = p.name.rpartition(".")
        if leaf not in ("weight", "bias") or not _is_block_linear(cfg, module):
            out.append(p)
            continue
        target = is_target(module, chosen)
        base = f"{module}.base_layer" if target else module
        if leaf == "weight":
            shape = p.shape
            if setup.lora.quantize != "none":
                packed = qlora.packed_params(f"{base}.weight", p.shape)
                out.append(packed[0][0])
                state = [spec for spec, _ in packed[1:]]  # registered on the module after weight and bias
                dtypes.update({spec.name: dt for spec, dt in packed})
                logical.update({spec.name: p.numel if k == 0 else 0 for k, (spec, _) in enumerate(packed)})
            else:
                out.append(ParamSpec(f"{base}.weight", p.shape))
        else:
            out.append(ParamSpec(f"{base}.bias", p.shape))
        last_of_module = i + 1 == len(params) or params[i + 1].name.rpartition(".")[0] != module
        if last_of_module and setup.lora.quantize != "none":
            out += state
        if target and last_of_module:
            out_f, in_f = shape
            adapters = [ParamSpec(f"{module}.lora_A.default.weight", (setup.lora.r, in_f)),
                        ParamSpec(f"{module}.lora_B.default.weight", (out_f, setup.lora.r))]
            out += adapters
            if adapter_dtype(setup) != setup.precision.param:
                dtypes.update({a.name: adapter_dtype(setup) for a in adapters})
    return LoraTape(params=out, param_dtypes=dtypes, logical_numel=logical)


def _is_block_linear(cfg: TransformerConfig, module: str) -> bool:
    return any(module.endswith("." + p) for p in BLOCK_LINEARS[cfg.architecture])


def adapter_parameters(tape: Tape) -> set[str]:
    """The trainable parameters: peft `_mark_only_adapters_as_trainable` freezes every other one."""
    return {p.name for p in tape.params if is_adapter(p.name)}


# -- the tape ---------------------------------------------------------------------------------------

def write_linear(w, name: str, x: TensorSpec, out_features: int, bias: bool, weight: str | None) -> TensorSpec:
    """`_Writer.linear` under LoRA: a frozen (or 4-bit) linear, with peft's adapter branch when targeted."""
    setup = w.setup
    target = is_target(name, w.lora_targets)
    base = f"{name}.base_layer" if target else name
    weight = weight if (weight and not target) else f"{base}.weight"
    bias_name = f"{base}.bias" if bias else None
    if setup.lora.quantize != "none" and name != "lm_head":
        y = qlora.nf4_linear(w, name, x, out_features, weight, bias_name)
    else:
        y = frozen_linear(w, name, x, out_features, weight, bias_name)
    if not target:
        return y
    return _adapter_branch(w, name, x, y, out_features)


def frozen_linear(w, name: str, x: TensorSpec, out_features: int, weight: str, bias: str | None) -> TensorSpec:
    """F.linear with a frozen weight: saves the weight (a parameter; under autocast its fresh 16-bit copy) for
    the input's gradient, never the input. The bias copy under autocast is a temporary of the op."""
    B, T, in_features = x.shape
    x = w.autocast_input(name, x)
    inputs, saves, workspace = [x], (), ()
    if w.autocast:
        (cast,) = w.op(f"{name}.weight_cast", "to_copy", [],
                       [w.t(f"{weight}.autocast_copy", (out_features, in_features), w.act, False)])
        inputs.append(cast)
        saves = (cast.name,)
        if bias:
            workspace = (w.t(f"{bias}.autocast_copy", (out_features,), w.act, False),)
    params = (weight, bias) if bias else (weight,)
    (y,) = w.op(name, "frozen_linear", inputs, [w.t(f"{name}.out", (B, T, out_features))], saves=saves,
                params=params, saved_params=(weight,), workspace=workspace,
                flops=2 * B * T * in_features * out_features)
    return y


def _adapter_branch(w, name: str, x: TensorSpec, result: TensorSpec, out_features: int) -> TensorSpec:
    """peft/tuners/lora/layer.py Linear.forward (or lora/bnb.py Linear4bit.forward under QLoRA) after the base."""
    setup = w.setup
    adt = adapter_dtype(setup)
    qlora_path = setup.lora.quantize != "none"
    if qlora_path:  # lora/bnb.py: "for 4bit, we need to defensively clone here"
        (result,) = w.op(f"{name}.result_clone", "clone", [result], [w.t(f"{name}.result_clone", result.shape,
                                                                          result.dtype)], passthrough=True)
    convert = not (qlora_path and w.autocast)  # lora/bnb.py: requires_conversion = not torch.is_autocast_enabled()
    copy = None
    if convert and x.dtype != adt:
        (x,) = copy = w.op(f"{name}.lora_input_cast", "to_copy", [x], [w.t(f"{name}.lora_input", x.shape, adt)])
    x = w.dropout(f"{name}.lora_dropout.default", x, setup.lora.dropout)
    a = w.linear(f"{name}.lora_A.default", x, setup.lora.r, False, adapter=True)
    b = w.linear(f"{name}.lora_B.default", a, out_features, False, adapter=True)
    (scaled,) = w.op(f"{name}.lora_scale", "mul", [b], [w.t(f"{name}.lora_scaled", b.shape, b.dtype)],
                     flops=b.shape[0] * b.shape[1] * out_features)
    if qlora_path and convert and scaled.dtype != result.dtype:  # lora/bnb.py: output.to(expected_dtype)
        (scaled,) = w.op(f"{name}.lora_output_cast", "to_copy", [scaled],
                         [w.t(f"{name}.lora_output", scaled.shape, result.dtype)])
    total = w.add(f"{name}.lora_add", result, scaled)
    if not qlora_path and total.dtype != result.dtype:  # result.to(torch_result_dtype)
        (total,) = w.op(f"{name}.lora_result_cast", "to_copy", [total],
                        [w.t(f"{name}.lora_result", total.shape, result.dtype)])
    if copy:  # the cast input is forward's local `x` until it returns
        w.op(f"{name}.lora_return", "release", [copy[0]], [])
    return total


def lazy_recompute(tape: Tape) -> None:
    """torch's non-reentrant checkpoint recomputes a region when its backward first unpacks a saved tensor
    (torch/utils/checkpoint.py `_checkpoint_hook.unpack_hook`). The region's last ops that save nothing (adds,
    the adapters' scaling, bitsandbytes' MatMul4Bit, which keeps its weight in `ctx.tensors`) run their backward
    before that: they are taken out of the region, so the replay recomputes after them, not before."""
    last_saving: dict[int, int] = {}
    for i, op in enumerate(tape.ops):
        if op.region is not None and (op.saves or op.saved_params):
            last_saving[op.region] = i
    for i, op in enumerate(tape.ops):
        if op.region is not None and not op.cached and i > last_saving.get(op.region, len(tape.ops)):
            tape.ops[i] = replace(op, region=None)


def module_return(w, module: str, x: TensorSpec) -> None:
    """Under LoRA a block's attention / MLP input may be saved by nothing (frozen linears; adapters save their
    own cast copy): it is still the module's `forward(x)` argument, alive until the module returns."""
    if w.lora_targets:
        w.op(f"{module}.return", "release", [x], [])


__all__ = ["lora_tape", "write_linear", "frozen_linear", "targets", "NOT_ON_MLP", "NOT_ON_HF", "is_adapter",
           "adapter_dtype", "adapter_parameters", "LoraTape", "BLOCK_LINEARS", "DEFAULT_TARGETS"]
