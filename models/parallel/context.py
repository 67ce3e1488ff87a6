"""Context parallelism (CP) as torch's `context_parallel` runs it: one cp rank's tape.

`context_parallel_tape(tape, cp, rank)` rewrites a hand-written GPT-2 (nanoGPT, `attention="sdpa"`) or Llama tape
(models/transformer/, the CPU SDPA op) into what one of `cp` ranks allocates when every micro-batch's forward and
backward run inside

    with context_parallel(mesh, buffers=[inputs, labels, positions], buffer_seq_dims=[1, 1, 0],
                          no_restore_buffers={inputs, labels}):

(torch/distributed/tensor/experimental/_context_parallel/_attention.py; torchtitan's `create_context_parallel_ctx`),
as traces/context_run.py runs it for real:

- the sequence: the head-tail load balancer gives each rank 2 of 2 x cp chunks, T / cp positions in all; every
  (B, T, ...) activation, the position rows (GPT-2's `wpe` lookup, Llama's rotary tables) and the attention's
  logsumexp are the rank's T / cp rows; the loss is the mean over the rank's tokens. The inputs and labels are
  resized in place (their storage stays (B, T)); the positions come from an int64 (T,) buffer of the model
  (`cp_positions`), handed to `context_parallel` with the batch (torchtitan hands its `freqs_cis` the same way).
- the context's entry (`_context_parallel_buffers`, `_HeadTailLoadBalancer._generate_indices`): a clone of the
  positions to restore at exit, the load balancer's index tensors, each buffer gathered in the balanced order and
  its shard kept, the shards cloned once more; what it keeps lives until the exit, after the micro-batch's
  backward (`context_entry`).
- attention: torch's ring attention (all-gather of k / v once per call, partial results merged in fp32, the k / v
  gradients rotated by all-to-all): models/parallel/ring.py walks one call and gives its highest point; the
  difference to what the call returns is one workspace block of the op, forward and backward. On every rank but
  the last, a load-balanced partial step merges by `torch.cat` in (B, H, T, hd) order, so the model's
  `transpose(1, 2).contiguous()` copies the output (measured: 8 KiB a layer on rank 0 of tiny GPT-2, cp 2).
- gradients: cp alone, every rank holds whole parameters; after the last micro-batch each gradient is averaged over
  the cp ranks in place (an all-reduce and a division: no new memory). With FSDP2, torchtitan shards over dp x cp
  (its "dp_shard_cp" mesh): the data-parallel engine's group is dp x cp ranks (models/parallel/mesh.py `folds_cp`),
  and its reduce-scatter averages the cp ranks' gradients with the data-parallel ones. Over tensor-parallel ranks
  (cp x tp, models/parallel/mesh.py), this transform rewrites the tp rank's tape (tensor/) on its local heads.

Checked against real runs (traces/context_run.py, torch 2.13 CPU, gloo) in bench/validate_parallel.py.
"""

from __future__ import annotations

from dataclasses import replace

from ..config import dtype_bytes
from ..tape import Tape, TapeOp, TensorSpec
from .ring import Heap, ring_backward, ring_forward

POSITIONS = "cp_positions"  # the model's int64 (T,) position buffer


def _with_dim(spec: TensorSpec, dim: int, size: int) -> TensorSpec:
    shape = list(spec.shape)
    shape[dim] = size
    return replace(spec, shape=tuple(shape))


def context_entry(B: int, T: int, cp: int) -> tuple[int, list[int]]:
    """(highest point, kept blocks) of `context_parallel`'s entry for int64 (B, T) inputs and labels and the (T,)
    positions: the restore clone, the index tensors, each buffer gathered and its shard kept, the shards cloned."""
    h = Heap()
    Tl = T // cp
    h.set("restore", h.new(8 * T))
    for name, n in (("arange", 4 * T), ("head", 8 * cp), ("tail", 8 * cp), ("heads", 2 * T), ("tails", 2 * T)):
        h.set(name, h.new(n))
    h.set("indices", h.new(4 * T))  # torch.stack([chunks[head], chunks[tail]], dim=1)
    for name in ("arange", "head", "tail", "heads", "tails"):
        h.set(name, None)
    shards = []
    for k, (full, local) in enumerate(((8 * B * T, 8 * B * Tl), (8 * B * T, 8 * B * Tl), (8 * T, 8 * Tl))):
        h.set("gathered", h.new(full))  # buffer.index_select / gather in the balanced order
        h.set(f"shard{k}", h.new(local))
        shards.append(local)
        h.set("gathered", None)
    h.set("indices", None)
    for local in shards:  # each shard cloned into the resized buffer's place; the last clone stays
        h.set("clone", h.new(local))
    kept = [8 * T] + shards + [shards[-1]]
    return h.peak, kept


def context_parallel_tape(tape: Tape, cp: int, rank: int) -> Tape:
    """Cp rank `rank`'s tape (see the module docstring)."""
    if cp == 1:
        return tape
    return _Transform(tape, cp, rank).run()


class _Transform:
    def __init__(self, tape: Tape, cp: int, rank: int) -> None:
        names = {p.name for p in tape.params}
        self.gpt2 = "transformer.wte.weight" in names
        if not self.gpt2 and "model.embed_tokens.weight" not in names:
            raise ValueError("context_parallel_tape rewrites the hand-written GPT-2 / Llama tapes only")
        self.tape, self.cp, self.rank = tape, cp, rank
        self.B, self.T = tape.inputs[0].shape
        self.Tl = self.T // cp
        self.produced = {o.name: op for op in tape.ops for o in op.outputs}
        self.rename: dict[str, str] = {}

    def shard(self, spec: TensorSpec, prologue: bool = False) -> TensorSpec:
        s, B, T = spec.shape, self.B, self.T
        if len(s) >= 2 and s[0] == B and s[1] == T:
            return _with_dim(spec, 1, self.Tl)
        if len(s) in (3, 4) and s[0] == B and s[2] == T:  # (B, H, T[, hd]): the logsumexp, attention internals
            return _with_dim(spec, 2, self.Tl)
        if prologue and s and s[0] == T:  # the position rows: wpe's output, the rotary tables
            return _with_dim(spec, 0, self.Tl)
        return spec

    def run(self) -> Tape:
        entry_peak, kept = context_entry(self.B, self.T, self.cp)
        positions = "transformer.pos" if self.gpt2 else "cp.positions"
        held = [TensorSpec("cp.restore.positions", (self.T,), "int64", False),
                TensorSpec("cp.shard.inputs", (self.B, self.Tl), "int64", False),
                TensorSpec("cp.shard.labels", (self.B, self.Tl), "int64", False),
                TensorSpec(positions, (self.Tl,), "int64", False),
                TensorSpec("cp.clone.positions", (self.Tl,), "int64", False)]
        assert [t.nbytes for t in held] == kept
        ops = [TapeOp("context_parallel.enter", "context_parallel", (), tuple(held),
                      workspace=(TensorSpec("cp.enter.workspace", (entry_peak - sum(kept),), "int8", False),))]
        first_block = next(i for i, op in enumerate(self.tape.ops) if ".h." in op.name or ".layers." in op.name)
        for i, op in enumerate(self.tape.ops):
            if op.kind == "arange" and op.name == "transformer.pos":
                continue  # the positions are the buffer's shard (the entry's output)
            if op.kind == "sdpa":
                ops += self._attention(op)
                continue
            prologue = i < first_block
            new = replace(op, inputs=tuple(self.rename.get(n, n) for n in op.inputs),
                          saves=tuple(self.rename.get(n, n) for n in op.saves),
                          views=tuple(self.rename.get(n, n) for n in op.views),
                          releases=tuple(self.rename.get(n, n) for n in op.releases),
                          outputs=tuple(self.shard(o, prologue) for o in op.outputs),
                          workspace=tuple(self.shard(w, prologue) for w in op.workspace),
                          bwd_workspace=tuple(self.shard(w, prologue) for w in op.bwd_workspace),
                          flops=op.flops // self.cp)
            if op.kind == "rotary_tables":
                new = replace(new, inputs=(positions,))
            ops.append(new)
        buffers = list(self.tape.buffers) + [TensorSpec(POSITIONS, (self.T,), "int64", False)]
        return replace(self.tape, ops=ops, buffers=buffers,
                       held=tuple(self.tape.held) + tuple(t.name for t in held))

    def _attention(self, op: TapeOp) -> list[TapeOp]:
        out, lse = (self.shard(o) for o in op.outputs)
        q, k, v = (self.shard(self._spec(n)) for n in op.inputs)
        fused = len(set(op.inputs)) == 1  # GPT-2: q, k, v split from one c_attn output (views, not contiguous)
        eq = out.nbytes
        ek, ev = (q.nbytes // 3, q.nbytes // 3) if fused else (k.nbytes, v.nbytes)
        contiguous = [not fused and self.produced[n].kind == "rotary" for n in op.inputs[1:]]
        L = lse.nbytes // 4
        args = (self.rank, self.cp, eq, ek, ev, L, contiguous[0], contiguous[1], dtype_bytes(out.dtype))
        fwd, bwd = ring_forward(*args), ring_backward(*args)
        if fwd.kept != out.nbytes + lse.nbytes:
            raise AssertionError((fwd, out, lse))
        new = replace(op, outputs=(out, lse), flops=op.flops // self.cp,
                      workspace=(TensorSpec(f"{op.name}.ring.workspace", (fwd.peak - fwd.kept,), "int8", False),),
                      bwd_workspace=(TensorSpec(f"{op.name}.ring.backward_workspace", (bwd.peak - bwd.kept,), "int8",
                                                False),))
        ops = [new]
        if self.rank < self.cp - 1:  # a partial step's cat: the output's transpose(1, 2).contiguous() copies
            copy = replace(out, name=f"{out.name}.contiguous")
            ops.append(TapeOp(f"{op.name}.contiguous", "clone", (out.name,), (copy,), passthrough=True,
                              region=op.region))
            self.rename[out.name] = copy.name
        return ops

    def _spec(self, name: str) -> TensorSpec:
        if name in self.produced:
            return next(o for o in self.produced[name].outputs if o.name == name)
        return next(t for t in self.tape.inputs if t.name == name)


__all__ = ["context_parallel_tape", "context_entry", "POSITIONS"]
