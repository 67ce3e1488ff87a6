"""Mixture of experts (HF transformers 5.24's Mixtral): parameters, routing, and the sparse MoE block's tape.

The block (`MixtralSparseMoeBlock`, modeling_mixtral.py) is a router and `num_local_experts` SwiGLU experts
stored as two 3-D parameters, `experts.gate_up_proj` (E, 2F, D) and `experts.down_proj` (E, D, F). How many
tokens each expert sees is decided by the router at run time, so routing is an input
(`TrainingSetup.moe_routing`, `routing_counts`):

  balanced      tokens x top-k / experts per expert (the remainder to the first experts);
  worst         every token of the micro-batch to the same top-k experts (experts 0..k-1);
  counts:PATH   measured tokens per expert per layer, a "peakledger-moe-counts" JSON file
                (`traces/moe_counts.py` records one from a real run: `peakledger capture --moe-counts`).

What runs (`TransformerConfig.experts_implementation`): `MixtralExperts` is decorated with
`use_experts_implementation`, and a model built from a config takes `get_correct_experts_implementation(None)`
= "grouped_mm" wherever torch has `grouped_mm` (torch >= 2.10 on a CPU, SM80+ on CUDA):
`grouped_mm_experts_forward` (transformers/integrations/moe.py). It sorts the tokens x top-k (token, expert)
pairs by expert, gathers their hidden states, and runs the experts as two grouped matmuls over all E experts
with per-expert row offsets. Every tensor it allocates is sized by tokens x top-k rows, whatever the split
between experts: on this path the routing changes FLOPs per expert and nothing in memory (measured:
tests/test_moe.py runs a real model under its own and under worst routing and sees the same peaks).
"eager" (`experts_implementation="eager"`, and what a subclass defined outside transformers gets: its module's
source lacks the decorator) loops over the experts that got tokens (`_eager_experts`): there the routing sets
the per-expert tensors and how many full-size weight-gradient pieces are summed. The router's load-balancing
loss is computed only with `output_router_logits` (False in MixtralConfig); such configs are refused.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

from ..simulator import strict_json
from .config import ConfigError, TrainingSetup, TransformerConfig, read_config_file
from .parallel.expert import expert_combine, expert_dispatch
from .tape import ParamSpec, TensorSpec

COUNTS_FORMAT = "peakledger-moe-counts"
COUNTS_VERSION = 1


def moe_params(cfg: TransformerConfig, h: str) -> list[ParamSpec]:
    """`{h}.mlp.gate.weight` (the router, E x D), then the experts' 3-D weights (MixtralExperts.__init__)."""
    E, D, F = cfg.num_local_experts, cfg.d_model, cfg.ffn
    return [ParamSpec(f"{h}.mlp.gate.weight", (E, D)), ParamSpec(f"{h}.mlp.experts.gate_up_proj", (E, 2 * F, D)),
            ParamSpec(f"{h}.mlp.experts.down_proj", (E, D, F))]


def active_params(cfg: TransformerConfig, n_params: int) -> int:
    """Parameters one token runs through: all but the (E - top-k) experts it is not routed to, per layer."""
    per_expert = 3 * cfg.d_model * cfg.ffn
    return n_params - cfg.n_layer * (cfg.num_local_experts - cfg.num_experts_per_tok) * per_expert


# -- routing --------------------------------------------------------------------------------------

def check_routing(cfg: TransformerConfig, setup: TrainingSetup) -> None:
    """A counts file must fit the model and the micro-batch (the mixtral family's check)."""
    if setup.moe.routing is not None:
        routing_counts(cfg, setup, 0)


def no_routing(cfg, setup: TrainingSetup) -> None:
    """`moe_routing` is for models with experts (every other family's check)."""
    if setup.moe.routing is not None:
        raise ConfigError("moe_routing", f"the model {getattr(cfg, 'name', cfg)!r} has no experts; moe_routing "
                                         "applies to mixture-of-experts models only (num_local_experts)")


def routing_counts(cfg: TransformerConfig, setup: TrainingSetup, layer: int) -> tuple[int, ...]:
    """Tokens each expert of `layer` receives in one micro-batch (they sum to tokens x top-k)."""
    E, k = cfg.num_local_experts, cfg.num_experts_per_tok
    pairs = setup.batch.micro_batch * setup.batch.seq_len * k
    mode = setup.moe.routing or "balanced"
    if mode == "balanced":
        base, extra = divmod(pairs, E)
        return tuple(base + (1 if e < extra else 0) for e in range(E))
    if mode == "worst":
        tokens = setup.batch.micro_batch * setup.batch.seq_len
        return tuple(tokens if e < k else 0 for e in range(E))
    return read_counts(mode[len("counts:"):], cfg, setup)[layer]


@functools.lru_cache(maxsize=16)
def _read_counts_once(path: str, mtime_ns: int, cfg: TransformerConfig, setup: TrainingSetup):
    return _read_counts(path, cfg, setup)


def read_counts(path: str | Path, cfg: TransformerConfig, setup: TrainingSetup) -> tuple[tuple[int, ...], ...]:
    """`_read_counts`, read once per file version (the tape asks once per layer)."""
    try:
        mtime = Path(path).stat().st_mtime_ns
    except OSError:
        mtime = -1  # read_config_file says what is wrong with the path
    return _read_counts_once(str(path), mtime, cfg, setup)


def _read_counts(path: str, cfg: TransformerConfig, setup: TrainingSetup) -> tuple[tuple[int, ...], ...]:
    """A "peakledger-moe-counts" file, checked strictly against the model and the micro-batch: a ConfigError
    naming the field ("moe_routing.layers[3]", ...) for anything that does not fit."""
    data = read_config_file(path, "moe_routing", strict_json.loads, json.JSONDecodeError, "JSON")

    def bad(field: str, what: str) -> ConfigError:
        return ConfigError(f"moe_routing.{field}", f"{path}: {what}")

    if not isinstance(data, dict):
        raise ConfigError("moe_routing", f"{path} must hold a JSON object")
    extra = sorted(set(data) - {"format", "version", "layers", "micro_batch", "seq_len", "num_experts_per_tok",
                                "model", "source"})
    if extra:
        raise bad(extra[0], "unknown key; allowed: format, version, layers, micro_batch, seq_len, "
                            "num_experts_per_tok, model, source")
    if data.get("format") != COUNTS_FORMAT:
        raise bad("format", f"must be {COUNTS_FORMAT!r}, got {data.get('format')!r}")
    if data.get("version") != COUNTS_VERSION or isinstance(data.get("version"), bool):
        raise bad("version", f"must be {COUNTS_VERSION}, got {data.get('version')!r}")
    for key, want in (("micro_batch", setup.batch.micro_batch), ("seq_len", setup.batch.seq_len),
                      ("num_experts_per_tok", cfg.num_experts_per_tok)):
        value = data.get(key, want if key == "num_experts_per_tok" else None)
        if isinstance(value, bool) or not isinstance(value, int):
            raise bad(key, f"must be an integer, got {value!r}")
        if value != want:
            raise bad(key, f"the counts were recorded with {key} {value}, the run has {want}")
    layers = data.get("layers")
    if not isinstance(layers, list) or len(layers) != cfg.n_layer:
        got = f"{len(layers)} layers" if isinstance(layers, list) else repr(type(layers).__name__)
        raise bad("layers", f"must be a list of {cfg.n_layer} layers (one per decoder layer), got {got}")
    pairs = setup.batch.micro_batch * setup.batch.seq_len * cfg.num_experts_per_tok
    out = []
    for i, row in enumerate(layers):
        if not isinstance(row, list) or len(row) != cfg.num_local_experts:
            got = f"{len(row)} experts" if isinstance(row, list) else type(row).__name__
            raise bad(f"layers[{i}]", f"must list tokens for each of the {cfg.num_local_experts} experts, got {got}")
        for e, n in enumerate(row):
            if isinstance(n, bool) or not isinstance(n, int) or n < 0:
                raise bad(f"layers[{i}][{e}]", f"must be an integer >= 0, got {n!r}")
            if n > setup.batch.micro_batch * setup.batch.seq_len:
                raise bad(
                    f"layers[{i}][{e}]",
                    f"{n} is more than the micro-batch's {setup.batch.micro_batch * setup.batch.seq_len}"
                    " tokens (an expert sees a token at most once)",
                )
        if sum(row) != pairs:
            raise bad(f"layers[{i}]", f"sums to {sum(row)}, not tokens x top-k = {pairs}")
        out.append(tuple(row))
    return tuple(out)


def counts_document(layers, micro_batch: int, seq_len: int, top_k: int, model: str = "", source: str = "") -> dict:
    return {"format": COUNTS_FORMAT, "version": COUNTS_VERSION, "micro_batch": micro_batch, "seq_len": seq_len,
            "num_experts_per_tok": top_k, "layers": [list(map(int, row)) for row in layers], "model": model,
            "source": source}


# -- the block's tape -----------------------------------------------------------------------------

def moe_block(w, cfg: TransformerConfig, h: str, m: TensorSpec, layer: int, residual: TensorSpec) -> TensorSpec:
    """`MixtralSparseMoeBlock.forward` on the post-attention norm's output `m`, as the grouped_mm or eager path runs
    it (transformers/models/mixtral/modeling_mixtral.py, transformers/integrations/moe.py), and the residual add
    after it. `w` is the HF writer (`models.hf_mixtral._MixtralWriter`): ops, tensors, `release`. Returns (B, T, D)."""
    B, T, D = m.shape
    E, k, F = cfg.num_local_experts, cfg.num_experts_per_tok, cfg.ffn
    N, S = B * T, B * T * k
    p = f"{h}.mlp"
    counts = routing_counts(cfg, w.setup, layer)
    # router (MixtralTopKRouter): F.linear, softmax(logits.float()), topk, top values /= their sum (in place:
    # DivBackward keeps a clone of the values; modelled as the values saved and the quotient a new tensor)
    logits = w.linear(f"{p}.gate", m, E, False)
    logits32 = logits
    if logits.dtype != "fp32":
        (logits32,) = w.op(f"{p}.gate.float", "to_copy", [logits], [w.t(f"{p}.gate.logits_fp32", (B, T, E), "fp32")])
    (probs,) = w.op(f"{p}.gate.softmax", "softmax", [logits32], [w.t(f"{p}.gate.probs", (N, E), "fp32")],
                    saves=(f"{p}.gate.probs",), flops=5 * N * E)
    top, idx = w.op(f"{p}.gate.topk", "topk", [probs], [w.t(f"{p}.gate.top_values", (N, k), "fp32"),
                                                        w.t(f"{p}.gate.top_index", (N, k), "int64", False)],
                    saves=(f"{p}.gate.top_index",), bwd_workspace=(w.t(f"{p}.gate.topk.zeros", (N, E), "fp32", False),))
    (total,) = w.op(f"{p}.gate.sum", "sum", [top], [w.t(f"{p}.gate.top_sum", (N, 1), "fp32")])
    (scores,) = w.op(f"{p}.gate.normalise", "div", [top, total], [w.t(f"{p}.gate.scores", (N, k), "fp32")],
                     saves=(top.name, total.name),
                     bwd_workspace=tuple(w.t(f"{p}.gate.div.grad_temp{i}", (N, k), "fp32", False) for i in range(3)))
    if cfg.experts_implementation == "eager":
        out, acc = _eager_experts(w, cfg, p, m, scores, idx, counts)
        w.release(f"{p}.return", [m, logits, scores, idx])
        y = w.add(f"{h}.moe_residual", residual, out)
        w.release(f"{p}.output.used", [acc])  # the accumulator is the block's output: alive until the add read it
        return y
    # grouped_mm_experts_forward: sort the (token, expert) pairs by expert, gather, two grouped matmuls
    x = f"{p}.experts"
    ids_g, perm = w.op(f"{x}.sort", "sort", [idx], [w.t(f"{x}.expert_ids_g", (S,), "int64", False),
                                                    w.t(f"{x}.perm", (S,), "int64", False)])
    (rows,) = w.op(f"{x}.token_rows", "floor_divide", [perm], [w.t(f"{x}.token_rows", (S,), "int64", False)])
    (gathered,) = w.op(f"{x}.gather", "index", [m, rows], [w.t(f"{x}.gathered", (S, D), m.dtype)],
                       saves=(rows.name,), bwd_workspace=(w.t(f"{x}.gather.zeros", (N, D), m.dtype, False),))
    (weights_g,) = w.op(f"{x}.weights_g", "index", [scores, perm], [w.t(f"{x}.weights_g", (S,), "fp32")],
                        saves=(perm.name,), bwd_workspace=(w.t(f"{x}.weights_g.zeros", (S,), "fp32", False),))
    (ids_f,) = w.op(f"{x}.histc_input", "to_copy", [ids_g], [w.t(f"{x}.histc_input", (S,), "fp32", False)])
    (hist,) = w.op(f"{x}.histc", "histc", [ids_f], [w.t(f"{x}.tokens_per_expert", (E,), "fp32", False)])
    ep_locals = ()
    if w.setup.mesh.ep > 1:  # torchtitan's token dispatch: this rank's experts get their rows from every rank
        rows, routed, ep_idx, offs, ep_locals = expert_dispatch(w, x, gathered, hist, counts, E)
    else:
        (offs,) = w.op(f"{x}.offsets", "cumsum", [hist], [w.t(f"{x}.offsets", (E,), "int32", False)])
        rows, routed = gathered, S
    pdt = w.setup.precision.param  # grouped_mm is not autocast-enabled: `input.to(weight.dtype)`, in the weights' dtype
    rows = _to(w, f"{x}.gate_up_proj", rows, pdt)
    M = rows.shape[0]
    (proj,) = w.op(f"{x}.gate_up_proj", "grouped_mm", [rows, offs], [w.t(f"{x}.gate_up_out", (M, 2 * F), pdt)],
                   saves=(rows.name, offs.name), params=(f"{x}.gate_up_proj",),
                   saved_params=(f"{x}.gate_up_proj",), flops=2 * routed * D * 2 * F)
    # gate, up = chunk(2): views; silu(gate) saves gate, gate * up saves both (one gradient piece per view)
    (act,) = w.op(f"{x}.act", "silu", [proj], [w.t(f"{x}.act", (M, F), pdt)], saves=(proj.name,), views=(proj.name,))
    (prod,) = w.op(f"{x}.mul", "mul", [act, proj], [w.t(f"{x}.mul", (M, F), pdt)], saves=(act.name, proj.name),
                   views=(proj.name,))
    (down,) = w.op(f"{x}.down_proj", "grouped_mm", [prod, offs], [w.t(f"{x}.down_out", (M, D), pdt)],
                   saves=(prod.name, offs.name), params=(f"{x}.down_proj",), saved_params=(f"{x}.down_proj",),
                   flops=2 * routed * F * D)
    if w.setup.mesh.ep > 1:  # torchtitan's combine: the rows back to the ranks of their tokens
        down = expert_combine(w, x, down, ep_idx, routed, S)
    wdt = "fp32" if "fp32" in (pdt, weights_g.dtype) else pdt
    (weighted,) = w.op(f"{x}.weigh", "mul", [down, weights_g], [w.t(f"{x}.weighted", (S, D), wdt)],
                       saves=(down.name, weights_g.name),
                       bwd_workspace=(w.t(f"{x}.weigh.grad_temp", (S, D), wdt, False),))
    (inv,) = w.op(f"{x}.inv_perm", "index_put", [perm], [w.t(f"{x}.inv_perm", (S,), "int64", False)],
                  workspace=(w.t(f"{x}.arange", (S,), "int64", False),))
    # weighted_out[inv_perm] (a local until the function returns), then .view(N, k, D).sum(1): one op here, as
    # the sum's backward is an expand that ViewBackward copies contiguous (a temporary beside IndexBackward's zeros)
    out, unperm = w.op(f"{x}.unpermute", "index_sum", [weighted, inv],
                       [w.t(f"{x}.out", (B, T, D), wdt), w.t(f"{x}.unpermuted", (S, D), wdt, False)],
                       saves=(inv.name,), bwd_workspace=(w.t(f"{x}.unpermute.view_clone", (S, D), wdt, False),
                                                         w.t(f"{x}.unpermute.zeros", (S, D), wdt, False)))
    w.release(f"{x}.return", [ids_g, ids_f, hist, unperm, *ep_locals])
    out = _to(w, f"{x}.out", out, m.dtype)  # `.to(hidden_states.dtype)`
    w.release(f"{p}.return", [m, logits, scores, idx])  # `_`, the top-k locals and the block's input
    return w.add(f"{h}.moe_residual", residual, out)


def _eager_experts(w, cfg: TransformerConfig, x: str, m: TensorSpec, scores: TensorSpec, idx: TensorSpec, counts):
    """`MixtralExperts.forward` (experts_implementation "eager"): a zero accumulator, a one-hot expert mask, then
    for each expert that got tokens (ascending), its tokens gathered, two linears on slices of the 3-D weights,
    the routing weight, and an in-place `index_add_` into the accumulator. Each slice's gradient is made full
    size by SelectBackward and summed (out of place) into the weight's gradient.

    The in-place accumulator is one tensor: the chain of index_add_ ops writes zero-sized outputs, so that the
    gradient reaches every expert's output without any memory of its own. Returns (output, accumulator)."""
    N, D = m.shape[0] * m.shape[1], m.shape[2]
    E, k, F = cfg.num_local_experts, cfg.num_experts_per_tok, cfg.ffn
    pdt, ddt = w.setup.precision.param, m.dtype
    x = f"{x}.experts"
    (acc,) = w.op(f"{x}.zeros", "zeros_like", [], [w.t(f"{x}.accumulator", m.shape, ddt, False)])
    (mask,) = w.op(f"{x}.one_hot", "one_hot", [idx], [w.t(f"{x}.expert_mask", (N, k, E + 1), "int64", False)])
    hits = [e for e in range(E) if counts[e]]
    (hit,) = w.op(f"{x}.expert_hit", "nonzero", [mask], [w.t(f"{x}.expert_hit", (len(hits), 1), "int64", False)],
                  workspace=(w.t(f"{x}.mask_sum", (E + 1,), "int64", False),
                             w.t(f"{x}.mask_hit", (E + 1,), "bool", False)))
    out, prev_state, prev_weighted = acc, None, None
    for e in hits:
        n, ex = counts[e], f"{x}.{e}"
        (pairs,) = w.op(f"{ex}.where", "nonzero", [mask], [w.t(f"{ex}.where", (n, 2), "int64", False)])
        (state,) = w.op(f"{ex}.gather", "index", [m, pairs], [w.t(f"{ex}.current_state", (n, D), ddt)],
                        saves=(pairs.name,), bwd_workspace=(w.t(f"{ex}.gather.zeros", m.shape, ddt, False),))
        w.release(f"{ex}.current_state.reassigned", [prev_state])  # the loop's local of the previous expert
        (proj,) = w.op(f"{ex}.gate_up_proj", "linear", [state], [w.t(f"{ex}.gate_up_out", (n, 2 * F), pdt)],
                       saves=(state.name,), params=(f"{x}.gate_up_proj",), saved_params=(f"{x}.gate_up_proj",),
                       bwd_workspace=(w.t(f"{ex}.gate_up_proj.slice_grad", (2 * F, D), w.setup.precision.grad, False),),
                       flops=2 * n * D * 2 * F)
        (act,) = w.op(f"{ex}.act", "silu", [proj], [w.t(f"{ex}.act", (n, F), pdt)], saves=(proj.name,),
                      views=(proj.name,))
        (prod,) = w.op(f"{ex}.mul", "mul", [act, proj], [w.t(f"{ex}.mul", (n, F), pdt)], saves=(act.name, proj.name),
                       views=(proj.name,))
        w.release(f"{ex}.current_hidden_states.reassigned", [prev_weighted])
        (down,) = w.op(f"{ex}.down_proj", "linear", [prod], [w.t(f"{ex}.down_out", (n, D), pdt)],
                       saves=(prod.name,), params=(f"{x}.down_proj",), saved_params=(f"{x}.down_proj",),
                       bwd_workspace=(w.t(f"{ex}.down_proj.slice_grad", (D, F), w.setup.precision.grad, False),),
                       flops=2 * n * F * D)
        (wsel,) = w.op(f"{ex}.routing_weight", "index", [scores, pairs], [w.t(f"{ex}.routing_weight", (n, 1), "fp32")],
                       saves=(pairs.name,),
                       bwd_workspace=(w.t(f"{ex}.routing_weight.zeros", (N, k, 1), "fp32", False),))
        wdt = "fp32" if "fp32" in (pdt, "fp32") else pdt
        temps = (w.t(f"{ex}.weigh.grad_temp", (n, D), wdt, False),) + \
            ((w.t(f"{ex}.weigh.grad_uncast", (n, D), wdt, False),) if wdt != pdt else ())
        (weighted,) = w.op(f"{ex}.weigh", "mul", [down, wsel], [w.t(f"{ex}.weighted", (n, D), wdt)],
                           saves=(down.name, wsel.name), bwd_workspace=temps)
        src = _to(w, f"{ex}.weighted", weighted, ddt)  # `.to(final_hidden_states.dtype)`
        # IndexAddBackward keeps the index and the source (its formula expands the gradient as the source)
        (out,) = w.op(f"{ex}.index_add", "index_add", [out, src], [w.t(f"{ex}.accumulated", (0,), ddt)],
                      saves=(pairs.name, src.name), passthrough=True)
        if src is not weighted:
            w.release(f"{ex}.index_add.return", [src])
        prev_state, prev_weighted = state, weighted
    w.release(f"{x}.return", [mask, hit, prev_state, prev_weighted])
    return out, acc


def _to(w, name: str, x: TensorSpec, dtype: str) -> TensorSpec:
    if x.dtype == dtype:
        return x
    (y,) = w.op(f"{name}.to", "to_copy", [x], [w.t(f"{name}.cast", x.shape, dtype)])
    return y
