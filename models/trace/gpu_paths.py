"""CUDA kernel paths on a traced tape: the recording runs the CPU program's kernels (models/trace/record.py);
on a GPU device profile some recorded ops run other kernels on CUDA, which allocate and save other tensors.
`cuda_tape` rewrites those ops, and their recorded backward nodes, on the tape the replay runs: no second
recording, no second path around the replay.

SDPA. A recorded `_scaled_dot_product_flash_attention_for_cpu` (the CPU flash kernel; the CPU takes it only
without dropout, models/trace/record.py records its outputs `out` (B, H, T, D) and `logsumexp` (B, H, T) fp32)
becomes the kernel torch picks on CUDA (models/gpu.py `sdpa_backend`), with what that kernel allocates, keeps
for backward and uses as temporaries (`sdpa_kernel`):
- flash (16-bit): the same output and logsumexp; head dims not a multiple of 8 are padded (copies of q, k, v
  saved instead of q, k, v, a padded output, padded dq/dk/dv); torch 2.7+ (rules "2.13") adds the rng state
  (16 B) and an unused offset (8 B) on the device, saved; the backward node gets flash's temporaries
  (softmax_d, dq_accum, and dk/dv at the query heads for GQA);
- memory-efficient (fp32, a mask, or what flash refuses): logsumexp (B, H, ceil(T/32)*32) fp32;
- math (e.g. fp32 with GQA under torch 2.6's rules): not rewritten. The CUDA math backend is torch's composite
  of ordinary ops, with its own autograd nodes; the recording has the fused CPU op in its place, which a tape
  rewrite cannot turn into those nodes with certainty. Such ops keep the CPU kernel's tensors (an underestimate
  of the CUDA run: the composite keeps B*H*T*T scores); `math_ops` lists them.
The op's arguments are not recorded; they are read back from the tape: B, H, T_q, D and the dtype from the
output, the key/value heads and length from the backward node's first allocations (the CPU backward allocates
grad_q, grad_k, grad_v in the inputs' shapes; without a node: those of q), and a mask from the op's last
input when it has a mask's shape ((T_q, T_k), or 4-D (1|B, 1|H, >=T_q, >=T_k)) and is none of q, k, v. A mask
that is a buffer or a batch tensor is not a forward tensor of the tape and is not seen (flash is then chosen
where the CUDA run takes memory-efficient attention); is_causal is taken as square (T_q == T_k).

SDPA recorded as its math decomposition on the CPU (dropout > 0, which the CPU flash kernel refuses) stays
as recorded: on CUDA a fused kernel with dropout would run instead (see above for why no rewrite).
"""

from __future__ import annotations

import dataclasses

from ..gpu import sdpa_backend, sdpa_kernel
from ..tape import GradNode, GradStep, Tape, TapeOp, TensorSpec

CPU_FLASH = "_scaled_dot_product_flash_attention_for_cpu"
CUDA_OPS = {"flash": "_scaled_dot_product_flash_attention", "efficient": "_scaled_dot_product_efficient_attention",
            "cudnn": "_scaled_dot_product_cudnn_attention"}


def cuda_tape(tape: Tape, compute_capability: tuple[int, int] = (9, 0), torch_version: str = "2.6") -> Tape:
    """`tape` with its recorded CPU SDPA ops run as the CUDA kernels torch picks (module docstring)."""
    ops, backward = list(tape.ops), list(tape.backward)
    node_of = {n.op: k for k, n in enumerate(backward) if n.op is not None}
    specs = {t.name: t for t in (*tape.inputs, *tape.buffers)}
    for op in ops:
        specs.update((o.name, o) for o in op.outputs)
    for i, op in enumerate(ops):
        if op.kind != CPU_FLASH:
            continue
        k = node_of.get(i)
        done = _rewrite(op, backward[k] if k is not None else None, specs, tuple(compute_capability), torch_version)
        if done is not None:
            ops[i] = done[0]
            if k is not None:
                backward[k] = done[1]
    return dataclasses.replace(tape, ops=ops, backward=tuple(backward))


def math_ops(tape: Tape, compute_capability: tuple[int, int] = (9, 0), torch_version: str = "2.6") -> list[str]:
    """Names of the recorded CPU SDPA ops that CUDA runs on its math backend (left as recorded)."""
    node_of = {n.op: n for n in tape.backward if n.op is not None}
    specs = {t.name: t for t in (*tape.inputs, *tape.buffers)}
    for op in tape.ops:
        specs.update((o.name, o) for o in op.outputs)
    return [op.name for i, op in enumerate(tape.ops) if op.kind == CPU_FLASH
            and (args := _arguments(op, node_of.get(i), specs)) is not None
            and _backend(args, tuple(compute_capability), torch_version) == "math"]


def _arguments(op: TapeOp, node: GradNode | None, specs: dict) -> dict | None:
    """The CPU flash op's shapes, dtype and mask, read back from the tape (module docstring)."""
    if len(op.outputs) != 2 or len(op.outputs[0].shape) != 4 or op.outputs[1].dtype != "fp32":
        return None  # not the (output, logsumexp) pair a recording makes
    out = op.outputs[0]
    B, H, Tq, D = out.shape
    q, k, v = (B, H, Tq, D), (B, H, Tq, D), (B, H, Tq, D)
    grads = node.steps[0].allocs[:3] if node is not None and node.steps else ()
    if len(grads) == 3 and all(len(g.shape) == 4 and g.shape[0] == B for g in grads) and grads[0].shape == q:
        k, v = grads[1].shape, grads[2].shape
    else:  # no backward run: k and v from their own storages where they have one
        own = [specs[n].shape for n in op.inputs[1:3] if n in specs and len(specs[n].shape) == 4
               and specs[n].shape[0] == B and specs[n].shape[3] == D]
        k = v = own[0] if own else k
    mask = None
    last = specs.get(op.inputs[-1]) if len(op.inputs) > 1 else None
    if last is not None and last.shape not in (q, k, v):
        s = last.shape
        if (len(s) == 2 and s == (Tq, k[2])) or (len(s) == 4 and s[0] in (1, B) and s[1] in (1, H)
                                                and s[2] >= Tq and s[3] >= k[2]):
            mask = last.name
    return dict(B=B, H=H, Tq=Tq, D=D, Hk=k[1], Tk=k[2], Dv=v[3], dtype=out.dtype, mask=mask)


def _backend(a: dict, cc: tuple[int, int], version: str) -> str:
    return sdpa_backend(a["dtype"], a["D"], 0.0, a["mask"] is not None, False, cc, version, head_dim_v=a["Dv"],
                        seq_q=a["Tq"], seq_k=a["Tk"], n_head=a["H"], n_kv_head=a["Hk"], enable_gqa=a["Hk"] != a["H"])


def _rewrite(op: TapeOp, node: GradNode | None, specs: dict, cc: tuple[int, int], version: str):
    a = _arguments(op, node, specs)
    if a is None:
        return None
    backend = _backend(a, cc, version)
    if backend == "math":
        return None
    kernel = sdpa_kernel(backend, a["B"], a["H"], a["Tq"], a["Tk"], a["D"], a["dtype"], 0.0, version,
                         n_kv_head=a["Hk"], head_dim_v=a["Dv"], has_mask=a["mask"] is not None)
    out, lse = op.outputs
    name = {"out": out.name, "logsumexp": lse.name}
    outputs = []
    tag = out.name.rsplit(".", 1)[-1]  # the output's storage id: names stay unique per call
    for piece in kernel.outputs:
        name.setdefault(piece.role, f"{op.name}.{piece.role}.{tag}")
        grad = piece.role == "out" and out.requires_grad
        shape = out.shape[:3] + (piece.shape[-1],) if piece.role == "out" else piece.shape  # (B, H, T, D) as recorded
        outputs.append(TensorSpec(name[piece.role], shape, piece.dtype, grad))
    inputs_saved = [s for s in op.saves if s not in (out.name, lse.name)]
    if "q" not in kernel.saved:  # flash saves its padded copies instead of q, k, v (the mask stays out)
        inputs_saved = [s for s in inputs_saved if s == a["mask"]]
    saves = tuple(inputs_saved) + tuple(name[r] for r in kernel.saved if r not in ("q", "k", "v", "mask"))

    def temps(pieces, at: str) -> tuple[TensorSpec, ...]:
        return tuple(TensorSpec(f"{at}.{p.role}.{tag}", p.shape, p.dtype, False) for p in pieces)

    new_op = dataclasses.replace(op, kind=CUDA_OPS[backend], outputs=tuple(outputs), saves=saves,
                                 workspace=op.workspace + temps(kernel.workspace, op.name))
    if node is None or not node.steps:
        return new_op, node
    first, padded = node.steps[0], kernel.piece("q_padded")
    allocs = list(first.allocs)
    if padded is not None and len(allocs) >= 3:  # dq, dk, dv: empty_like the padded inputs (sliced afterwards)
        allocs[:3] = [dataclasses.replace(g, shape=g.shape[:3] + (padded.shape[-1],)) for g in allocs[:3]]
    ws = temps(kernel.bwd_workspace, node.name)
    step = GradStep(tuple(allocs) + ws, first.frees + tuple(w.name for w in ws), first.grads, first.release_saved)
    return new_op, dataclasses.replace(node, steps=(step,) + node.steps[1:])
