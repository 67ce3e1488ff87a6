"""CUDA kernels' temporaries on a traced tape of the CUDA program.

A recording for a CUDA device profile is the CUDA program (cuda_program.py): its SDPA ops are the CUDA kernels
torch picks, their outputs and saved tensors from the kernels' fake (meta) functions. What a meta function does
not show is what the kernel allocates and frees inside itself; `cuda_tape` adds those on the tape the replay
runs (no second recording, no second path around the replay), from models/gpu.py `sdpa_kernel`:
- flash backward: softmax_d and dq_accum (fp32), and for GQA dk/dv at the query heads (flash_api.cpp mha_bwd),
  allocated and freed inside the backward node;
- host tensors the meta functions make on the device: memory-efficient attention's philox seed and offset
  (attention.cu _efficient_attention_forward: `at::empty({}, at::dtype(at::kLong))`, on the host unless a CUDA
  graph is captured), and flash's under torch 2.6 (rules "2.6"; 2.7+ keeps them on the device): they leave
  the device tape.
Memory-efficient and cuDNN attention's internal buffers are not modelled (models/gpu.py says why), nor the
16-byte first rng state flash allocates and replaces in its forward with dropout under 2.7+ (the tape does not
carry the op's dropout probability).

A recorded op's shapes are read off the tape: B, H, T_q and the padded head dim from the output, the key/value
heads and length from the backward node's second allocation (grad_k, in the key's shape).
"""

from __future__ import annotations

import dataclasses

from ..gpu import kernel_rules, sdpa_kernel
from ..tape import GradStep, Tape, TensorSpec

FLASH = "_scaled_dot_product_flash_attention"
EFFICIENT = "_scaled_dot_product_efficient_attention"
RNG = ((2,), ())  # the philox seed (flash 2.7+: a (2,) rng state) and offset, in the order the kernels return them


def cuda_tape(tape: Tape, compute_capability: tuple[int, int] = (9, 0), torch_version: str = "2.6") -> Tape:
    """`tape` (a recording of the CUDA program) with its CUDA kernels' temporaries (module docstring)."""
    rules = kernel_rules(torch_version)
    ops, backward = list(tape.ops), list(tape.backward)
    node_of = {n.op: k for k, n in enumerate(backward) if n.op is not None}
    for i, op in enumerate(ops):
        if op.kind not in (FLASH, EFFICIENT) or len(op.outputs) < 2 or len(op.outputs[0].shape) != 4:
            continue
        rng = [o.name for o in op.outputs[2:] if o.dtype == "int64" and o.shape in RNG]
        if rng and (op.kind == EFFICIENT or rules == "2.6"):  # host tensors (module docstring)
            ops[i] = op = dataclasses.replace(op, outputs=tuple(o for o in op.outputs if o.name not in rng),
                                              saves=tuple(s for s in op.saves if s not in rng))
        if op.kind != FLASH:
            continue
        k = node_of.get(i)
        node = backward[k] if k is not None else None
        out = op.outputs[0]
        B, H, Tq, D = out.shape
        grads = node.steps[0].allocs[:3] if node is not None and node.steps else ()
        Hk, Tk = (grads[1].shape[1], grads[1].shape[2]) if len(grads) == 3 and len(grads[1].shape) == 4 else (H, Tq)
        kernel = sdpa_kernel("flash", B, H, Tq, Tk, D, out.dtype, 0.0, rules, n_kv_head=Hk)
        tag = out.name.rsplit(".", 1)[-1]

        def temps(pieces, at: str) -> tuple[TensorSpec, ...]:
            return tuple(TensorSpec(f"{at}.{p.role}.{tag}", p.shape, p.dtype, False) for p in pieces)

        if node is not None and node.steps and kernel.bwd_workspace:
            first = node.steps[0]
            ws = temps(kernel.bwd_workspace, node.name)
            step = GradStep(first.allocs + ws, first.frees + tuple(w.name for w in ws), first.grads,
                            first.release_saved)
            backward[k] = dataclasses.replace(node, steps=(step,) + node.steps[1:])
    return dataclasses.replace(tape, ops=ops, backward=tuple(backward))


__all__ = ["cuda_tape", "FLASH"]
