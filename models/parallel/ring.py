"""What torch's ring attention allocates in one call, forward and backward, walked step by step.

torch/distributed/tensor/experimental/_context_parallel/_attention.py `_templated_ring_attention` and
`_templated_ring_attention_backward` with `_cp_options`' defaults (the all-gather rotater for k / v, all-to-all
for the k / v gradients, head-tail load balancing under causal masking, `convert_to_f32`): `RingCall` runs their
loops on a tiny reference-counting allocator (`Heap`: each Python variable holds a storage; rebinding it drops
the old one; a storage goes when its last reference does), in the order the code allocates and rebinds, and
returns the call's highest point and what it hands back. models/parallel/context.py turns the difference into
one workspace block of the attention op, forward and backward, so the simulated peak of each call is the
measured one (traces/context_run.py, CPU, gloo) while its inside is not replayed tensor by tensor.

Sizes are bytes of one rank's local tensors: q (Eq), k (Ek), v (Ev) in the model's dtype (`dsize` bytes per
element), the logsumexp (L elements, fp32).
"""

from __future__ import annotations

from dataclasses import dataclass


class Heap:
    def __init__(self) -> None:
        self.size: dict[int, int] = {}
        self.refs: dict[int, int] = {}
        self.vars: dict[str, int | None] = {}
        self.live = self.peak = 0
        self._next = 0

    def new(self, nbytes: int) -> int:
        sid = self._next
        self._next += 1
        self.size[sid], self.refs[sid] = nbytes, 0
        self.live += nbytes
        self.peak = max(self.peak, self.live)
        return sid

    def set(self, var: str, sid: int | None) -> None:
        """`var = <storage sid>`: the new reference first, then the old one dropped (Python's order)."""
        if sid is not None:
            self.refs[sid] += 1
        old = self.vars.get(var)
        self.vars[var] = sid
        if old is not None:
            self.drop(old)

    def drop(self, sid: int) -> None:
        self.refs[sid] -= 1
        if self.refs[sid] == 0:
            self.live -= self.size.pop(sid)
            del self.refs[sid]

    def temp(self, nbytes: int) -> None:
        """A temporary made and dropped inside one expression."""
        self.peak = max(self.peak, self.live + nbytes)


def _contiguous_kv(h: Heap, ek: int, ev: int, k_contiguous: bool, v_contiguous: bool) -> None:
    """`key = key.contiguous(); value = value.contiguous()`, both loops' first lines: a copy of each strided one."""
    if not k_contiguous:
        h.set("key", h.new(ek))
    if not v_contiguous:
        h.set("value", h.new(ev))


@dataclass(frozen=True)
class RingCall:
    """One rank's ring attention call: `peak` bytes above what was live before it, `kept` bytes it returns."""

    peak: int
    kept: int


def _behaviour(rank: int, i: int) -> str:
    """`_is_causal_behavior` with load balancing: the full local q / k / v at step 0, the first half of the
    received k / v while i <= rank, else the second half of q ("partial")."""
    return "full" if i == 0 else "half_kv" if i <= rank else "partial"


def ring_forward(rank: int, cp: int, eq: int, ek: int, ev: int, lse: int, k_contiguous: bool, v_contiguous: bool,
                 dsize: int) -> RingCall:
    h = Heap()
    f32 = lambda n: n * 4 // dsize  # noqa: E731  the fp32 size of n bytes of the model's dtype
    _contiguous_kv(h, ek, ev, k_contiguous, v_contiguous)
    gathered = None
    for i in range(cp):
        if i > 0:
            h.set("next_kv", gathered)  # rotater.next_buffer(): a chunk of the all-gather output
            h.set("key", gathered)
            h.set("value", gathered)
        if i < cp - 1:
            h.set("next_kv", h.new(ek + ev))  # torch.cat([key.flatten(), value.flatten()])
            if gathered is None:  # exchange_buffers: one all-gather of every rank's k / v
                gathered = h.new(cp * (ek + ev))
                h.set("rotater", gathered)
        b = _behaviour(rank, i)
        out_n, lse_n = (eq // 2, lse * 2) if b == "partial" else (eq, lse * 4)
        h.set("out", h.new(out_n))  # the SDPA op's output and logsumexp (fp32)
        h.set("logsumexp", h.new(lse_n))
        block_out = h.vars["out"]
        if dsize != 4:  # convert_to_f32: an fp32 copy of the block's output
            block_out = h.new(f32(out_n))
            h.set("step_out", block_out)
        if i == 0:
            h.set("merged_out", block_out)
            h.set("merged_lse", h.vars["logsumexp"])
        else:
            x, y = f32(out_n), lse_n
            # out = out - sigmoid(block_lse - lse) * (out - block_out); lse = lse - logsigmoid(lse - block_lse)
            t1 = h.new(y)
            t2 = h.new(y)
            h.set("t1", t1), h.set("t1", None)
            h.set("t2", t2)
            t3 = h.new(x)
            t4 = h.new(x)
            h.set("t3", t3), h.set("t4", t4)
            h.set("t2", None), h.set("t3", None)
            h.set("new_out", h.new(x))
            h.set("t4", None)
            t6 = h.new(y)
            t7 = h.new(y)
            h.set("t6", t6), h.set("t6", None)
            h.set("t7", t7)
            h.set("new_lse", h.new(y))
            h.set("t7", None)
            if b == "partial":  # _partial_update: a cat into whole new tensors
                h.set("merged_lse", h.new(lse * 4))
                h.set("merged_out", h.new(f32(eq)))
            else:
                h.set("merged_lse", h.vars["new_lse"])
                h.set("merged_out", h.vars["new_out"])
            h.set("new_out", None), h.set("new_lse", None)
        h.set("step_out", None)
    if dsize != 4:  # results(): the merged output back in the model's dtype
        h.set("result", h.new(eq))
        h.set("merged_out", None)
    for var in ("rotater", "next_kv", "key", "value", "out", "logsumexp"):  # the call returns: its locals go
        h.set(var, None)
    return RingCall(peak=h.peak, kept=h.live)


def ring_backward(rank: int, cp: int, eq: int, ek: int, ev: int, lse: int, k_contiguous: bool, v_contiguous: bool,
                  dsize: int) -> RingCall:
    h = Heap()
    f32 = lambda n: n * 4 // dsize  # noqa: E731
    h.set("grad_query", h.new(f32(eq)))  # zeros_like(..., dtype=float32) accumulators
    h.set("grad_key", h.new(f32(ek)))
    h.set("grad_value", h.new(f32(ev)))
    _contiguous_kv(h, ek, ev, k_contiguous, v_contiguous)
    gathered = None
    for i in range(cp):
        if i > 0:
            h.set("key", gathered)
            h.set("value", gathered)
        if i != cp - 1:
            h.set("next_kv", h.new(ek + ev))
            if gathered is None:
                gathered = h.new(cp * (ek + ev))
                h.set("kv_rotater", gathered)
        b = _behaviour(rank, i)
        if b == "partial":  # logsumexp.chunk(2)[1].contiguous()
            h.set("lse_chunk", h.new(lse * 2))
        h.set("k", h.vars.get("key"))  # q, k, v, out_, dout, lse = (...): the tuple's references
        h.set("v", h.vars.get("value"))
        dq = eq // 2 if b == "partial" else eq
        dkv = (ek // 2, ev // 2) if b == "half_kv" else (ek, ev)
        grads = [h.new(dq), h.new(dkv[0]), h.new(dkv[1])]  # the SDPA backward's dq_, dk_, dv_
        for name, sid in zip(("grad_query_", "grad_key_", "grad_value_"), grads):
            h.set(name, sid)
        if i > 0:
            received = h.vars["dkv_rotater"]
            h.set("next_grad_kv", received)  # dkv_rotater.next_buffer()
            h.set("grad_key", received)
            h.set("grad_value", received)
            if b == "half_kv":  # _partial_update(grad_key / grad_value, ..., idx 0, add): cats
                h.set("grad_key", h.new(f32(ek)))
                h.set("grad_value", h.new(f32(ev)))
        copies = []
        if i == 0 and not k_contiguous:  # zeros_like(key) keeps key's strides: flatten copies
            copies.append(h.new(f32(ek)))
        if i == 0 and not v_contiguous:
            copies.append(h.new(f32(ev)))
        cat = h.new(f32(ek + ev))
        for c in copies:
            h.refs[c] += 1
            h.drop(c)
        h.set("next_grad_kv", cat)
        h.set("dkv_rotater", h.new(f32(ek + ev)))  # all_to_all of the k / v gradients to the next rank
        if b == "partial":
            h.set("grad_query", h.new(f32(eq)))
    if dsize != 4:
        h.set("grad_query", h.new(eq))
    final = h.vars["dkv_rotater"]
    h.set("next_grad_kv", final)
    h.set("grad_key", final)
    h.set("grad_value", final)
    if dsize != 4:
        h.set("next_grad_kv", h.new(ek + ev))
        h.set("grad_key", h.vars["next_grad_kv"])
        h.set("grad_value", h.vars["next_grad_kv"])
    for var in ("kv_rotater", "dkv_rotater", "next_kv", "key", "value", "k", "v", "lse_chunk", "grad_query_",
                "grad_key_", "grad_value_", "next_grad_kv"):
        h.set(var, None)
    return RingCall(peak=h.peak, kept=h.live)


__all__ = ["RingCall", "ring_forward", "ring_backward"]
