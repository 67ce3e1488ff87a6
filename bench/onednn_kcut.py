"""Checks models/compile/onednn.py on this machine: a bf16 GEMM probed at its short K (`k_cut`) holds the same
scratchpad as at its own K. Each signature is probed twice (workspace.py `_probe`, one process, one after the other,
one thread): at K as the probes ran before the rule, and at K'. Writes the "oneDNN scratchpad: short K" section of
bench/VALIDATION.md.

    python bench/onednn_kcut.py            # print
    python bench/onednn_kcut.py --write    # and write the section

The signatures: a grid of mm (10 output shapes, each transposition of A and B, K from 511 to 40,000), addmm (a bias of
N, of M x N, alpha 2 / beta 0.5), bmm and baddbmm (batch 3), and the long K of real vocabularies at the probes' cut
shape (Llama-3 128,256, Qwen2 151,936 / 152,064, GPT-2 50,257, Llama-2 32,000), each at full cost.
"""

from __future__ import annotations

import argparse
import platform
import random
import sys
import time

from sections import replace_section  # bench/sections.py, beside this script

from peakledger.models.compile import onednn, workspace

SECTION = "## oneDNN scratchpad: short K"
BF16 = "torch.bfloat16"


def signature(op: str, m: int, n: int, k: int, ta: bool, tb: bool, batch: int | None = None, bias=None,
              kwargs: tuple = ()) -> tuple:
    pre = () if batch is None else (batch,)
    a, b, o = (*pre, m, k), (*pre, k, n), (*pre, m, n)
    ins = [(a, onednn.transposed_strides(a) if ta else onednn.dense_strides(a), BF16),
           (b, onednn.transposed_strides(b) if tb else onednn.dense_strides(b), BF16)]
    if bias is not None:
        ins.insert(0, (bias, onednn.dense_strides(bias), BF16))
    return op, (*ins, (o, onednn.dense_strides(o), BF16)), (), kwargs


def cases() -> list[tuple[str, tuple]]:
    rng = random.Random(12345)
    ks = [511, 512, 513, 1000, 1023, 1024, 1025, 1500, 2047, 2048, 2049, 3072, 4095, 4096, 4097, 6144, 8192, 11008,
          12288, 14336, 16384, 18944, 20000, 24576, 28672, 32768] + sorted(rng.randrange(1026, 40000) for _ in range(8))
    out = []
    for m, n in [(1024, 64), (2048, 64), (1000, 96), (64, 64), (300, 200), (1023, 130), (37, 129), (5, 700),
                 (4096, 48)]:
        out += [("grid", signature("aten::mm.out", m, n, k, ta, tb)) for ta in (False, True) for tb in (False, True)
                for k in ks]
    for m, n in [(1024, 64), (300, 200), (2048, 80)]:
        for ta in (False, True):
            for tb in (False, True):
                for k in [1023, 2049, 4096, 8192, 14336, 16384, 21111, 32768, 39001]:
                    out += [("grid", signature("aten::addmm.out", m, n, k, ta, tb, bias=(n,))),
                            ("grid", signature("aten::addmm.out", m, n, k, ta, tb, bias=(m, n)))]
        out += [("grid", signature("aten::addmm.out", m, n, k, False, False, bias=(n,),
                                   kwargs=(("alpha", 2.0), ("beta", 0.5)))) for k in (4096, 14336, 25000)]
    for m, n in [(1024, 64), (256, 96), (33, 70)]:
        for ta in (False, True):
            for tb in (False, True):
                for k in [1023, 3000, 4096, 8192, 12288, 16384, 30001]:
                    out += [("grid", signature("aten::bmm.out", m, n, k, ta, tb, batch=3)),
                            ("grid", signature("aten::baddbmm.out", m, n, k, ta, tb, batch=3, bias=(3, m, n)))]
    out += [("grid", signature("aten::mm.out", 2048, 2048, k, ta, tb)) for ta in (False, True) for tb in (False, True)
            for k in (4096, 6144, 8192, 14336)]
    big = [signature("aten::mm.out", 2048, 2048, k, False, False) for k in (128256, 152064, 151936, 50257, 32000)]
    big += [signature("aten::mm.out", 2048, 2048, 128256, True, False),
            signature("aten::mm.out", 2048, 2048, 50257, False, True),
            signature("aten::addmm.out", 2048, 2048, 32000, False, False, bias=(2048,)),
            signature("aten::mm.out", 4096, 8192, 65536, False, False)]
    return out + [("vocabulary", s) for s in big]


def probe(key: tuple) -> tuple[int, float]:
    t = time.perf_counter()
    nbytes = workspace._probe(key)
    return nbytes, time.perf_counter() - t


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="write the section of bench/VALIDATION.md")
    args = parser.parse_args()
    if not onednn.applies(1):
        print(f"the rule does not apply here (oneDNN {onednn.onednn_version()}, needs {onednn.ONEDNN}, avx512_bf16 "
              "without AMX, no ONEDNN_MAX_CPU_ISA): nothing to check", file=sys.stderr)
        return 2
    rows, bad, cut = [], [], 0
    at_long = at_cut = 0.0  # seconds probing
    for tag, sig in cases():
        name, layouts, constants, kwargs = sig
        whole = (name, workspace._cut(name, layouts), constants, kwargs, 1)
        short = workspace._key(sig, 1)
        at_k, s_k = probe(whole)
        at_short, s_short = (at_k, 0.0) if short == whole else probe(short)
        cut += short != whole
        at_long += s_k
        at_cut += s_short
        k, k_short = whole[1][-2][0][-2], short[1][-2][0][-2]
        if at_k != at_short:
            bad.append((name, layouts, at_k, at_short))
        if tag == "vocabulary":
            rows.append((name, layouts, k, k_short, at_k, at_short, s_k, s_short))
        print(f"{'ok ' if at_k == at_short else 'BAD'} {name} {[x[0] for x in layouts]} K {k} -> {k_short}: "
              f"{at_k} / {at_short} B", flush=True)
    total = len(cases())
    version = " ".join(onednn.onednn_version())
    text = [SECTION, "",
            f"`python bench/onednn_kcut.py --write` on {platform.machine()}, oneDNN {version} "
            f"(torch's), one thread: each bf16 GEMM signature probed as workspace.py probes it (M and N cut to "
            f"{workspace.CUT}), once at its K and once at the short K of models/compile/onednn.py `k_cut`, in one "
            "process. The bytes must be equal: the rule is read from oneDNN's brgemm configuration, this checks it.",
            "",
            f"**{total - len(bad)} of {total} signatures the same at K and at K'** ({cut} of them cut; mm, addmm with "
            "a bias of N and of M x N and with alpha 2 / beta 0.5, bmm, baddbmm; each transposition of A and B; K "
            f"from 511 to 152,064); probing took {at_long:.1f} s at K, {at_cut:.1f} s at K'.",
            "", "The vocabularies' long K, each at full cost:", "",
            "| GEMM | A, B | K | K' | bytes at K | bytes at K' | s at K | s at K' |",
            "|---|---|---:|---:|---:|---:|---:|---:|"]
    for name, layouts, k, k_short, at_k, at_short, s_k, s_short in rows:
        shapes = " x ".join(f"{tuple(x[0])}{'' if tuple(x[1]) == onednn.dense_strides(x[0]) else ' transposed'}"
                            for x in layouts[-3:-1])
        text.append(f"| `{name}` | {shapes} | {k:,} | {k_short:,} | {at_k:,} | {at_short:,} | {s_k:.2f} | "
                    f"{s_short:.2f} |")
    text += ["", *(f"DIFFERENT: {b}" for b in bad)]
    print("\n".join(text))
    if args.write:
        replace_section(SECTION, "\n".join(text).rstrip() + "\n")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
