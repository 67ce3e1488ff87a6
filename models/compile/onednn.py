"""Which bf16 GEMMs oneDNN gives the same scratchpad, so that a probe (workspace.py) runs a short K for a long one.

A probe costs the GEMM it measures, 2 M N K multiply-adds of its cut shape: a Llama-3 lm_head's backward (K = 128256,
the vocabulary) ~8.5 s on one core, most of a cold prediction's probing. oneDNN sizes its scratchpad when it builds
the primitive, from a configuration in which K counts only through four things (oneDNN v3.12,
src/cpu/x64/matmul/brgemm_matmul_utils.cpp `init_brgemm_matmul_conf`, brgemm on avx512_core_bf16, one thread):
- the K block, K_blk = min(K, D), D (`default_k_blk`) 1024 where K > 1024 and A is not transposed, else 512;
- whether K > K_blk (`init_aux_values`: the C buffer is then scaled by the N chunk);
- `prefer_copy_a` (brgemm_matmul_utils.hpp `brgemm_matmul_conf_utils_t`): A not transposed and K a power of two
  of at least 4096 (with M >= 1024), which turns on the A copy buffer (1,721,472 B for K = 4096, 8192, ...
  32768 against 197,632 B for the K between them, M = N = 2048);
- K mod K_blk, a constant of the blocking score (`disbalance_nthr_k`, a tie-break only);
and at one thread every branch that splits K between threads is skipped. So for K > D the GEMM with K' = 4096 (A
not transposed, K a power of two >= 4096), else D + (K mod D) (2 D where D divides K), has every one of the four,
hence the same scratchpad; K <= D is kept. Measured (bench/onednn_kcut.py, bench/VALIDATION.md "oneDNN
scratchpad: short K"): the bytes at K and at K' equal on every signature tried, mm / addmm / bmm / baddbmm, each
transposition, K up to 152,064.

Where the rule is taken to hold (`applies`): torch hands oneDNN the inputs as they are (mkldnn/Matmul.cpp
`mkldnn_matmul`: contiguous or transposed-contiguous, else it copies them first, bytes growing with K: not cut),
everything bf16, one thread, oneDNN v3.12.0 itself (the hash torch reports), a CPU with avx512_bf16 and no AMX, and
no ONEDNN_MAX_CPU_ISA / ONEDNN_DEFAULT_FPMATH_MODE steering oneDNN elsewhere; any other GEMM keeps its K.
"""

from __future__ import annotations

import functools
import os
import re

ONEDNN = "v3.12.0", "80afa71049cd69a3df32adcccb623b12cd7baa22"  # the oneDNN the rule was read from and checked on
BF16 = "torch.bfloat16"
K_MAX = 1_048_575  # brgemm's int32 stride checks (init_brgemm_matmul_conf): a K past this may leave brgemm
MKLDNN_MIN = 16 * 16 * 16  # aten/src/ATen/native/mkldnn/Matmul.cpp `checksize`: M N K (batch) above it for oneDNN
STEERING = ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA", "ONEDNN_DEFAULT_FPMATH_MODE", "DNNL_DEFAULT_FPMATH_MODE")


@functools.cache
def onednn_version() -> tuple[str, str]:
    """(version, git hash) of the oneDNN this torch bundles, as `torch.__config__.show()` reports it, or ("", "")."""
    import torch

    found = re.search(r"DNN (v[\d.]+) \(Git Hash ([0-9a-f]+)\)", torch.__config__.show())
    return (found.group(1), found.group(2)) if found else ("", "")


@functools.cache
def cpuinfo() -> tuple[str, ...] | None:
    """The CPU's model name and flags lines of /proc/cpuinfo (each once), or None where it cannot be read; read once
    per process (this rule's ISA check, and workspace.py's disk-cache key)."""
    try:
        with open("/proc/cpuinfo") as f:
            return tuple(dict.fromkeys(x for x in f.read().splitlines() if x.startswith(("model name", "flags"))))
    except OSError:
        return None


def _cpu_flags() -> frozenset[str]:
    line = next((x for x in cpuinfo() or () if x.startswith("flags")), "")
    return frozenset(line.split(":", 1)[-1].split())


def applies(threads: int) -> bool:
    """Whether the rule holds on this machine for GEMMs run at `threads` (module docstring)."""
    flags = _cpu_flags()
    return (threads == 1 and onednn_version() == ONEDNN and "avx512_bf16" in flags
            and not any(f.startswith("amx") for f in flags) and not any(os.environ.get(v) for v in STEERING))


def k_prime(k: int, transposed_a: bool) -> int:
    """The short K with the scratchpad of `k` (module docstring); `k` itself where none is shorter."""
    d = 512 if transposed_a or k <= 1024 else 1024
    if k <= d:
        return k
    if not transposed_a and k >= 4096 and k & (k - 1) == 0:
        return 4096
    return d + k % d if k % d else 2 * d


def dense_strides(size) -> tuple:
    """The strides of a contiguous tensor of `size`."""
    stride, acc = [], 1
    for s in reversed(size):
        stride.append(acc)
        acc *= s
    return tuple(reversed(stride))


def transposed_strides(size) -> tuple:
    """Strides of the last two dimensions swapped in memory (A stored as K x M), a batch outermost."""
    t = dense_strides([*size[:-2], size[-1], size[-2]])
    return (*t[:-2], t[-1], t[-2])


def k_cut(name: str, layouts: tuple) -> tuple:
    """`layouts` ((size, stride, dtype) of each input, last the output: workspace.py's) with K at `k_prime`, where
    the module's rule holds for the GEMM `name`; else `layouts` themselves. The caller checks `applies`."""
    *ins, out = layouts
    batched = name in ("aten::bmm.out", "aten::baddbmm.out")
    if name not in ("aten::mm.out", "aten::addmm.out") and not batched or len(ins) < 2:
        return layouts
    if any(dtype != BF16 for _, _, dtype in layouts):  # a bias too: a bf16 GEMM only
        return layouts
    (asize, astride, _), (bsize, bstride, _) = ins[-2], ins[-1]
    asize, astride, bsize, bstride, osize = map(tuple, (asize, astride, bsize, bstride, out[0]))
    rank = 3 if batched else 2
    if not len(asize) == len(bsize) == len(osize) == rank or tuple(out[1]) != dense_strides(osize):
        return layouts
    (m, k), (k2, n) = asize[-2:], bsize[-2:]
    if k != k2 or osize[-2:] != (m, n) or batched and not asize[0] == bsize[0] == osize[0] >= 1:
        return layouts
    if min(m, n, k) < 2 or k > K_MAX:  # a dimension of 1 makes oneDNN's layout tags ambiguous
        return layouts
    layout = {dense_strides(asize): False, transposed_strides(asize): True}
    if astride not in layout or bstride not in (dense_strides(bsize), transposed_strides(bsize)):
        return layouts  # torch copies such an input before oneDNN sees it
    transposed_a = layout[astride]
    short = k_prime(k, transposed_a)
    if short >= k or (asize[0] if batched else 1) * m * n * short <= MKLDNN_MIN:
        return layouts
    a = (*asize[:-1], short)
    b = (*bsize[:-2], short, n)
    new_a = (a, transposed_strides(a) if transposed_a else dense_strides(a), BF16)
    new_b = (b, transposed_strides(b) if bstride != dense_strides(bsize) else dense_strides(b), BF16)
    return (*ins[:-2], new_a, new_b, out)


__all__ = ["applies", "k_cut", "k_prime", "onednn_version", "cpuinfo", "dense_strides", "transposed_strides",
           "ONEDNN", "STEERING"]
