"""Tensor parallelism (TP) and sequence parallelism (SP) as torch's DTensor runs them: one rank's tape.

`tensor_parallel_tape(tape, tp, sequence_parallel, rank)` rewrites a hand-written GPT-2 (nanoGPT) or Llama tape
(models/transformer/) into what one tensor-parallel rank allocates under `parallelize_module` with the plan of
traces/tensor_run.py `tp_plan` (torchtitan's `apply_tp`, torchtitan/models/llama3/infra/parallelize.py):

- parameters (ParamSpec shapes are the rank's local shards, torch.chunk's split: ceil(n / tp) rows, the last
  ranks fewer):
    ColwiseParallel q/k/v, c_attn, gate/up, c_fc, lm_head: weight and bias Shard(0)
        # torch/distributed/tensor/parallel/style.py ColwiseParallel._partition_linear_fn
    RowwiseParallel o_proj, c_proj, down_proj: weight Shard(1), bias replicated
        # style.py RowwiseParallel._partition_linear_fn
    RowwiseParallel embedding (vocab-parallel): weight Shard(0), rows of the vocabulary
        # style.py RowwiseParallel._partition_embedding_fn
    norms, GPT-2's position table: replicated (SequenceParallel wraps norms in place: style.py
        SequenceParallel._replicate_module_fn)
- activations between a column- and a row-parallel linear: heads / tp (attention), ffn / tp (MLP); with SP,
  everything between the embedding and the head (norms, residual stream) is sequence-sharded, T / tp.
- collectives, each a TapeOp whose output is the collective's result (what `_c10d_functional` allocates, funcol
  is out of place: torch/distributed/_functional_collectives.py `all_reduce` / `all_gather_tensor` /
  `reduce_scatter_tensor`):
    "all_reduce"      Partial -> Replicate (row-parallel output, embedding without SP): a new tensor of the
                      output's shape; the partial goes after it; backward hands the gradient on (the
                      Replicate gradient needs no collective: torch/distributed/tensor/_redistribute.py
                      `Redistribute.backward` turns a Partial source into Replicate)
    "reduce_scatter"  Partial -> Shard(1) (SP row-parallel output and embedding): gathered along dim 1, so funcol
                      first concatenates the dim-1 chunks on dim 0 (a full-size copy, workspace), then the
                      (B, T / tp, D) result; backward: the gradient all-gathered (workspace: the dim-0 gather
                      buffer, then the dim-1 concatenation, the gradient)
    "all_gather"      Shard(1) -> Replicate before the column-parallel linears with SP (PrepareModuleInput,
                      style.py; and lm_head's input_layouts=Shard(1)): a dim-0 gather buffer (tp x B, T / tp, D)
                      then the concatenation (B, T, D); backward: the reduce-scatter of the summed Partial
                      gradient (a full-size concatenation, workspace, then the (B, T / tp, D) gradient)
    "shard"           Replicate -> Shard(0) of GPT-2's (T, D) position rows with SP (PrepareModuleOutput): a
                      contiguous copy of this rank's rows; backward: the gradient all-gathered (T, D)
- the loss under `loss_parallel()` (torch/distributed/tensor/parallel/loss.py `_log_softmax_handler`,
  `_nll_loss_forward_handler`, `_nll_loss_and_log_softmax_backward`) on (B, T, V / tp) logits: max, all-reduce,
  x - max (kept until the log-softmax is made), exp, sum, all-reduce, log, the log-softmax (saved); the nll
  loss gathers the local targets' values (masked) and all-reduces them; its backward writes the gradient of the
  logits from exp(log-softmax) in three (B, T, V / tp) tensors at its highest point.

What no TapeOp can say is kept on the returned `TensorParallelTape` (`grad_hooks`, `grad_shapes`) and done by
engine.py's `TensorParallelEngine`. `tensor_parallel_classes` groups the ranks whose tapes are the same.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from ...rank_ranges import RankRanges
from ...tape import ParamSpec, Tape, TapeOp, TensorSpec
from ..stages import layer_of

COLWISE = ("attn.c_attn", "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.c_fc", "mlp.gate_proj",
           "mlp.up_proj")
ROWWISE = ("attn.c_proj", "self_attn.o_proj", "mlp.c_proj", "mlp.down_proj")
EMBEDDINGS = ("transformer.wte", "model.embed_tokens")
FINAL_NORMS = ("transformer.ln_f", "model.norm")
NORM_KINDS = ("layernorm", "rmsnorm")
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "shard")


@dataclass
class TensorParallelTape(Tape):
    """A rank's tape under tensor parallelism, plus what the replay's engine hooks do for it (see engine.py's
    docstring): `grad_hooks` op name -> (("sum" | "all_reduce", tensor name), ...) after that op's backward node;
    `grad_shapes` parameter -> shape of its gradient where that is not its local shard's."""

    tp: int = 1
    sequence_parallel: bool = False
    rank: int = 0
    grad_hooks: dict[str, tuple[tuple[str, str], ...]] = field(default_factory=dict)
    grad_shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    chunked: tuple[int, ...] = ()  # the sizes of the dimensions split over the ranks (torch.chunk's)


NORM_MODULES = ("ln_1", "ln_2", "input_layernorm", "post_attention_layernorm") + FINAL_NORMS


def is_distributed(param: str, sequence_parallel: bool) -> bool:
    """Whether torchtitan's plan (traces/tensor_run.py `tp_plan`) makes `param` a DTensor: the embedding, lm_head,
    the column- and row-parallel linears (a row-parallel bias too: Replicate), and with sequence parallelism the
    norms (SequenceParallel); GPT-2's position table, and the norms without SP, stay plain tensors."""
    module = param.rpartition(".")[0]
    if module in EMBEDDINGS or module == "lm_head" or module.endswith(COLWISE + ROWWISE):
        return True
    return sequence_parallel and (module in FINAL_NORMS or module.endswith(NORM_MODULES))


def chunk(n: int, tp: int, rank: int) -> int:
    """Elements of a dimension of `n` on `rank` when torch.chunk splits it in `tp` (DTensor's Shard: ceil(n / tp)
    per rank, the last ones fewer or none: torch/distributed/tensor/placement_types.py `Shard._split_tensor`)."""
    size = -(-n // tp)
    return max(0, min(size, n - rank * size))


def _with_dim(spec: TensorSpec, dim: int, size: int, name: str | None = None) -> TensorSpec:
    shape = list(spec.shape)
    shape[dim] = size
    return replace(spec, shape=tuple(shape), name=name or spec.name)


def tensor_parallel_tape(tape: Tape, tp: int, sequence_parallel: bool, rank: int, untied: bool = False) -> Tape:
    """One tensor-parallel rank's tape (see the module docstring); `tape` is a hand-written nanoGPT GPT-2 or Llama
    tape (models/transformer/nanogpt.py `transformer_tape`), without dropout, checkpointed by whole layers if at all.
    `untied`: a tied embedding and head are separate parameters, as on pipeline ranks (the last stage holds its
    own `lm_head.weight`): the embedding's gradient is then the whole Replicate (V, D) table (measured: TP x PP,
    traces/mesh_run.py)."""
    if tp == 1:
        return tape
    return _Transform(tape, tp, sequence_parallel, rank, untied).run()


def _partial_regions(tape: Tape) -> bool:
    """Whether a checkpoint region covers part of a layer (selective: the attention core alone)."""

    regions: dict[int, set] = {}
    for op in tape.ops:
        layer = layer_of(op.name)
        if layer is not None:
            regions.setdefault(layer, set()).add(op.region)
    return any(len(r) > 1 for r in regions.values())


class _Transform:
    def __init__(self, tape: Tape, tp: int, sp: bool, rank: int, untied: bool = False) -> None:
        names = {p.name for p in tape.params}
        if "transformer.wte.weight" in names:
            self.gpt2 = True
        elif "model.embed_tokens.weight" in names:
            self.gpt2 = False
        else:
            raise ValueError("tensor_parallel_tape rewrites the hand-written GPT-2 / Llama tapes only")
        if any(op.offloaded or op.cached for op in tape.ops) or _partial_regions(tape):
            raise NotImplementedError("tensor parallelism with checkpointing other than whole layers (full, every-k, "
                                      "sqrt, layers) is not simulated yet")
        if any(op.kind == "dropout" for op in tape.ops) or tape.backward:
            raise NotImplementedError("tensor parallelism is simulated for hand-written tapes without dropout")
        self.tape, self.tp, self.sp, self.rank = tape, tp, sp, rank
        self.region: int | None = None  # the checkpoint region of the op being rewritten
        idx = tape.inputs[0]
        self.B, self.T = idx.shape
        self.chunked: set[int] = {self.T} if sp else set()
        self.Ts = chunk(self.T, tp, rank)  # this rank's sequence rows with SP
        self.ops: list[TapeOp] = []
        self.rename: dict[str, str] = {}  # tensor -> the name later readers take instead (a collective's result)
        self.hooks: dict[str, list[tuple[str, str]]] = {}
        self.specs: dict[str, TensorSpec] = {t.name: t for t in tape.inputs}
        self.param_shape = {p.name: p.shape for p in tape.params}
        self.readers: dict[str, list[str]] = {}
        for op in tape.ops:
            for n in op.inputs:
                self.readers.setdefault(n, []).append(op.name)
        self.embedding = next(op for op in tape.ops if op.name in EMBEDDINGS)
        self.embedding_weight = self.embedding.params[0]
        self.tied = not untied and any(self.embedding_weight in op.params
                                       for op in tape.ops if op is not self.embedding)
        self.head_index = next(i for i, op in enumerate(tape.ops) if op.name == "lm_head")
        self.final_norm = next(op for op in tape.ops if op.name in FINAL_NORMS)

    # -- shapes ------------------------------------------------------------------------------------------
    def c(self, n: int) -> int:
        self.chunked.add(n)
        return chunk(n, self.tp, self.rank)

    def heads(self, spec: TensorSpec) -> TensorSpec:
        """A tensor between a column- and a row-parallel linear: (B, heads, ...) on dim 1, (B, T, width) on its
        last dim; masks (1, 1, T, T) and tables without the batch stay whole."""
        s = spec.shape
        if len(s) == 4 and s[0] == self.B and s[0] != 1:
            return _with_dim(spec, 1, self.c(s[1]))
        if len(s) == 3 and spec.name.endswith(".lse"):
            return _with_dim(spec, 1, self.c(s[1]))
        if len(s) == 3 and s[:2] == (self.B, self.T):
            return _with_dim(spec, 2, self.c(s[2]))
        return spec

    def seq(self, spec: TensorSpec) -> TensorSpec:
        """With SP, a (B, T, ...) tensor of the residual stream: this rank's T / tp rows."""
        if self.sp and len(spec.shape) >= 2 and spec.shape[:2] == (self.B, self.T):
            return _with_dim(spec, 1, self.Ts)
        return spec

    # -- parameters ----------------------------------------------------------------------------------------
    def params(self) -> list[ParamSpec]:
        out = []
        for p in self.tape.params:
            module, _, leaf = p.name.rpartition(".")
            shape = p.shape
            if p.name == self.embedding_weight or module == "lm_head" or module.endswith(COLWISE):
                shape = (self.c(shape[0]),) + shape[1:]  # Shard(0)
            elif module.endswith(ROWWISE) and leaf == "weight":
                shape = (shape[0], self.c(shape[1]))  # Shard(1); the bias stays replicated
            out.append(ParamSpec(p.name, shape))
        return out

    # -- ops -----------------------------------------------------------------------------------------------
    def emit(self, op: TapeOp) -> None:
        if op.region is None and self.region is not None:  # a collective or scope end the rewrite adds inside a
            op = replace(op, region=self.region)  # checkpointed layer: recomputed with it (Megatron re-runs them too)
        if op.kind == "release":  # a scope end lets go of the Python local: the tensor itself, not a collective's copy
            self.ops.append(op)
            return
        op = replace(op, inputs=tuple(self.rename.get(n, n) for n in op.inputs),
                     saves=tuple(self.rename.get(n, n) for n in op.saves),
                     views=tuple(self.rename.get(n, n) for n in op.views),
                     releases=tuple(self.rename.get(n, n) for n in op.releases))
        for o in op.outputs:
            self.specs[o.name] = o
        self.ops.append(op)

    def hook(self, op_name: str, kind: str, tensor: str) -> None:
        self.hooks.setdefault(op_name, []).append((kind, tensor))

    def run(self) -> TensorParallelTape:
        ops = self.tape.ops
        pending_release: dict[str, str] = {}  # module -> its (SP) input, an argument alive until it returns
        for i, op in enumerate(ops):
            self.region = op.region
            module = self._module(op.name)
            if op is self.embedding:
                self._embedding(op)
            elif self.gpt2 and op.name == "transformer.wpe" and self.sp:
                self._positions(op)
            elif op.name in ("lm_head", "lm_head.autocast_input"):
                self._head(op)
            elif op.name.startswith("loss."):
                if op.name == "loss.log_softmax":
                    self._loss(op, ops[i + 1])
                elif op.name == "loss.autocast_input":  # autocast's fp32 copy of this rank's logits
                    self.emit(replace(op, outputs=tuple(self.heads(o) for o in op.outputs)))
                elif op.name != "loss.nll":
                    raise NotImplementedError(f"{op.name}: not a loss op the parallel loss knows")
            elif module is not None:  # attention / MLP: sharded heads / columns between the linears
                self._region_op(op, module, pending_release)
            else:
                self._plain(op)
        if self.sp:  # the final norm's own (sequence-sharded) output is a local of the model's forward until it
            # returns (not the all-gathered copy lm_head reads: no renaming here)
            self.ops.append(TapeOp("model.return", "release", (self.final_norm.outputs[0].name,), ()))
        return TensorParallelTape(
            params=self.params(), ops=self.ops, inputs=list(self.tape.inputs), buffers=list(self.tape.buffers),
            held=self.tape.held, loss=self.tape.loss, layers=self.tape.layers,
            buffers_follow_params=self.tape.buffers_follow_params, describer=self.tape.describer,
            gradless=self.tape.gradless, param_dtypes=dict(self.tape.param_dtypes), tp=self.tp,
            sequence_parallel=self.sp, rank=self.rank, grad_hooks={k: tuple(v) for k, v in self.hooks.items()},
            grad_shapes=self._grad_shapes(), chunked=tuple(sorted(self.chunked)))

    def _grad_shapes(self) -> dict[str, tuple[int, ...]]:
        if self.tied:  # summed with the head's Shard(0) contribution: the rank's rows
            return {}
        return {self.embedding_weight: self.param_shape[self.embedding_weight]}  # Replicate: the whole table

    @staticmethod
    def _module(name: str) -> str | None:
        """The attention or MLP module an op belongs to ("...h.0.attn", "...layers.0.mlp"), or None."""
        for part in (".attn.", ".self_attn.", ".mlp."):
            if part in name:
                return name[: name.index(part) + len(part) - 1]
        return None

    def _plain(self, op: TapeOp) -> None:
        """Norms, residual adds, the block-return releases: sequence-sharded with SP, else unchanged."""
        if op.kind == "rmsnorm" and not op.bwd_workspace:
            # torch's composite RMSNorm backward (fp32): its highest point is in the pow node, five x-shaped
            # tensors (the x * rstd gradient, MeanBackward1.div, PowBackward0.pow / .mul / .mul; measured) once
            # the output's gradient and the saved normed x are gone. The replay's one node holds those two and
            # the input gradient until its end: two more make the five. transformer.py writes these temporaries
            # for 16-bit CPU inputs only; next to TP's sharded everything else they become the peak
            x = self.specs.get(op.inputs[0]) or op.outputs[0]
            op = replace(op, bwd_workspace=tuple(TensorSpec(f"{op.name}.grad_temp{k}", x.shape, x.dtype, False)
                                                 for k in range(2)))
        op = replace(op, outputs=tuple(self.seq(o) for o in op.outputs),
                     workspace=tuple(self.seq(w) for w in op.workspace),
                     bwd_workspace=tuple(self.seq(w) for w in op.bwd_workspace),
                     flops=op.flops // self.tp if self.sp else op.flops)
        self.emit(op)
        if self.sp and op.kind in NORM_KINDS:  # SequenceParallel's from_local: the residual's gradient sum
            self.hook(op.name, "sum", op.inputs[0])  # is out of place

    def _embedding(self, op: TapeOp) -> None:
        """RowwiseParallel(input_layouts=Replicate()) on the embedding: DTensor's vocab-parallel lookup (the ids
        outside this rank's rows masked: a bool mask and the shifted ids, torch/distributed/tensor/_ops/
        _embedding_ops.py `MaskPartial._partition_value`) gives a Partial (B, T, D), all-reduced (reduce-
        scattered with SP). Its backward makes the whole (V, D) gradient table (embedding_dense_backward on
        Replicate), then this rank's rows where a tied head's Shard(0) gradient is added to it; untied, that table is
        the gradient itself (`grad_shapes`: measured, one (V, D) block, no copy)."""
        B, T = self.B, self.T
        out = op.outputs[0]
        partial = replace(out, name=f"{op.name}.partial")
        V, D = self.param_shape[self.embedding_weight]
        bwd = (TensorSpec(f"{op.name}.grad_dense", (V, D), out.dtype, False),
               TensorSpec(f"{op.name}.grad_rows", (self.c(V), D), out.dtype, False)) if self.tied else ()
        self.emit(replace(op, outputs=(partial,), workspace=(
            TensorSpec(f"{op.name}.mask", (B, T), "bool", False),
            TensorSpec(f"{op.name}.masked_ids", (B, T), "int64", False)), bwd_workspace=bwd))
        self._row_collective(op.name, partial, out)

    def _row_collective(self, name: str, partial: TensorSpec, out: TensorSpec) -> None:
        """The Partial output of a row-parallel op made Replicate (all-reduce) or, with SP, Shard(1)
        (reduce-scatter) under the output's own name."""
        B = self.B
        if not self.sp:
            self.emit(TapeOp(f"{name}.all_reduce", "all_reduce", (partial.name,), (out,), passthrough=True))
            return
        rest = partial.shape[2:]
        cat = TensorSpec(f"{name}.reduce_scatter.cat", (self.tp * B, self.Ts) + rest, partial.dtype, False)
        gather = TensorSpec(f"{name}.reduce_scatter.grad_gather", (self.tp * B, self.Ts) + rest, partial.dtype, False)
        self.emit(TapeOp(f"{name}.reduce_scatter", "reduce_scatter", (partial.name,),
                         (_with_dim(out, 1, self.Ts),), workspace=(cat,), bwd_workspace=(gather,)))

    def _all_gather(self, name: str, source: TensorSpec) -> TensorSpec:
        """SP: Shard(1) -> Replicate of `source` (B, T / tp, D) before column-parallel linears."""
        B, T = self.B, self.T
        rest = source.shape[2:]
        out = TensorSpec(f"{name}.all_gather.out", (B, T) + rest, source.dtype, source.requires_grad)
        buf = TensorSpec(f"{name}.all_gather.buffer", (self.tp * B, self.Ts) + rest, source.dtype, False)
        cat = TensorSpec(f"{name}.all_gather.grad_cat", (self.tp * B, self.Ts) + rest, source.dtype, False)
        self.emit(TapeOp(f"{name}.all_gather", "all_gather", (source.name,), (out,), workspace=(buf,),
                         bwd_workspace=(cat,)))
        return out

    def _positions(self, op: TapeOp) -> None:
        """SP on GPT-2: PrepareModuleOutput(Replicate -> Shard(0)) on wpe: the whole (T, D) rows, then a copy of
        this rank's."""
        out = op.outputs[0]
        full = replace(out, name=f"{op.name}.full")
        self.emit(replace(op, outputs=(full,)))
        self.emit(TapeOp(f"{op.name}.shard", "shard", (full.name,), (_with_dim(out, 0, self.Ts),)))

    def _region_op(self, op: TapeOp, module: str, pending: dict[str, str]) -> None:
        layer = op.name[len(module) + 1:]
        linear = f"{module.rpartition('.')[2]}.{layer}"  # "attn.c_attn", "mlp.down_proj"
        cast = linear.endswith(".autocast_input")  # autocast's 16-bit copy of a linear's fp32 input
        base = linear.removesuffix(".autocast_input")
        if base.endswith(COLWISE) and (cast or op.kind in ("linear", "addmm")):
            x = op.inputs[0]
            if not cast and x.endswith(".in_cast"):  # reads its own cast: the cast op read the module's input
                self.emit(replace(op, outputs=tuple(self.heads(o) for o in op.outputs), flops=op.flops // self.tp))
                return
            if self.sp:
                if module not in pending:  # PrepareModuleInput: one all-gather per module
                    pending[module] = x
                    gathered = self._all_gather(module, self.specs[x])
                    self.rename[x] = gathered.name
                self.hook(op.name, "sum", self.rename[x])
            else:
                self.hook(op.name, "sum", x)
                if module not in pending:  # the module's first reader, the last in backward: the Partial sum of
                    pending[module] = x  # its input gradients is all-reduced after its node
                    self.hook(op.name, "all_reduce", x)
            self.emit(op if cast else replace(op, outputs=tuple(self.heads(o) for o in op.outputs),
                                              flops=op.flops // self.tp))
            return
        if linear.endswith(ROWWISE) and op.kind in ("linear", "addmm"):
            out = op.outputs[0]
            partial = replace(out, name=f"{op.name}.partial")
            bias = f"{op.name}.bias"
            # a replicated bias joins the Partial sum divided by the ranks (Replicate -> Partial, a temporary)
            ws = (TensorSpec(f"{op.name}.bias_share", self.param_shape[bias], out.dtype, False),) \
                if bias in op.params else ()
            self.emit(replace(op, outputs=(partial,), workspace=op.workspace + ws, flops=op.flops // self.tp))
            self._row_collective(op.name, partial, out)
            if module in pending and self.sp:  # the module returns: its SP input argument goes
                self.emit(TapeOp(f"{module}.return", "release", (pending.pop(module),), ()))
            pending.pop(module, None)
            return
        self.emit(replace(op, outputs=tuple(self.heads(o) for o in op.outputs),
                          workspace=tuple(self.heads(w) for w in op.workspace),
                          bwd_workspace=tuple(self.heads(w) for w in op.bwd_workspace), flops=op.flops // self.tp))

    def _head(self, op: TapeOp) -> None:
        """ColwiseParallel(output_layouts=Shard(-1), use_local_output=False) on lm_head: (B, T, V / tp) logits."""
        x = op.inputs[0]
        if op.name == "lm_head" and x.endswith(".in_cast"):  # autocast: its cast op read the final norm's output
            self.emit(replace(op, outputs=tuple(self.heads(o) for o in op.outputs), flops=op.flops // self.tp))
            return
        if self.sp:
            gathered = self._all_gather("lm_head", self.specs[x])
            self.rename[x] = gathered.name
        else:
            self.hook(op.name, "all_reduce", x)
        cast = op.name.endswith(".autocast_input")
        self.emit(op if cast else replace(op, outputs=tuple(self.heads(o) for o in op.outputs),
                                          flops=op.flops // self.tp))

    def _loss(self, lsm_op: TapeOp, nll_op: TapeOp) -> None:
        """`F.cross_entropy` under `loss_parallel()` (module docstring): two ops, the max-shifted logits (kept
        until the log-softmax exists) and the log-softmax with the nll loss, whose backward is one node. 16-bit
        logits are computed on in fp32 (loss.py `_log_softmax`: `x.to(computation_dtype)`, the result cast back):
        the fp32 copy, the shifted logits and the fp32 log-softmax live until its 16-bit copy is made."""
        logits = self.specs[lsm_op.inputs[0]]
        B, T, Vl = logits.shape
        dt = logits.dtype
        t = lambda n, shape, dtype=dt: TensorSpec(f"loss.{n}", shape, dtype, False)  # noqa: E731
        row = (B, T, 1)
        upcast = dt != "fp32"
        cdt = "fp32"
        shifted = t("shifted", logits.shape, cdt)
        copies = (t("logits_fp32", logits.shape, cdt),) if upcast else ()
        self.emit(TapeOp("loss.shift", "log_softmax", (logits.name,), copies + (shifted,),
                         workspace=(t("max_reduced", row, cdt), t("exp", logits.shape, cdt), t("sum", row, cdt)),
                         flops=3 * B * T * Vl))
        lsm = TensorSpec("loss.log_softmax.out", logits.shape, dt, False)
        loss = replace(nll_op.outputs[0], requires_grad=True)
        total = nll_op.outputs[1]
        targets = nll_op.inputs[1]
        result = (t("log_softmax_fp32", logits.shape, cdt),) if upcast else ()
        self.emit(TapeOp("loss.log_softmax", "log_softmax",
                         (logits.name,) + tuple(c.name for c in copies) + (shifted.name, targets),
                         (loss, lsm, total), saves=(lsm.name, targets, total.name),
                         workspace=result + (t("max_reduced_kept", row, cdt), t("sum_reduced", row, cdt),
                                             t("log_sum", row, cdt)),
                         bwd_workspace=(t("grad_zeros", logits.shape), t("grad_sum", logits.shape),
                                        t("grad_targets", row, "int64"), t("grad_local_targets", (B * T,), "int64"),
                                        t("grad_rows", (B * T,)), t("grad_arange", (B * T,), "int64"),
                                        t("grad_weight", row)),
                         flops=2 * B * T * Vl))
        # the nll loss's own temporaries, once the log-softmax's are gone: the local targets (masked to this
        # rank's vocabulary rows), the picked log-probabilities and their all-reduce (its backward is above)
        self.emit(TapeOp("loss.nll", "nll_loss", (logits.name, lsm.name, targets), (),  # the logits: a local until here
                         workspace=(t("local_targets", (B * T,), "int64"), t("masked_targets", row, "int64"),
                                    t("picked", row), t("picked_reduced", row))))


def tensor_parallel_classes(tape: Tape, setup) -> dict:
    """The tensor-parallel ranks grouped by identical local tapes (an uneven vocabulary split makes the last
    rank's differ): {representative rank: RankRanges}. A rank's tape depends on its rank only through the
    chunks of the dimensions the transform splits (`TensorParallelTape.chunked`, recorded on rank 0's)."""

    first = tensor_parallel_tape(tape, setup.mesh.tp, setup.mesh.sequence_parallel, 0)
    groups: dict[tuple, list[int]] = {}
    for r in range(setup.mesh.tp):
        groups.setdefault(tuple(chunk(n, setup.mesh.tp, r) for n in first.chunked), []).append(r)
    return {members[0]: RankRanges.of(members) for members in groups.values()}


__all__ = ["COLLECTIVES", "TensorParallelTape", "chunk", "is_distributed", "tensor_parallel_classes",
           "tensor_parallel_tape"]
