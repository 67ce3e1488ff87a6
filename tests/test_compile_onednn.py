"""models/compile/onednn.py: a bf16 GEMM probed at its short K holds the scratchpad it holds at its own K (measured
here, by the probe itself, where the rule applies: this oneDNN, this CPU, one thread), and what the rule does not
cover keeps its K."""

from __future__ import annotations

import pytest

from peakledger.models.compile import onednn, workspace

BF16, FP32 = "torch.bfloat16", "torch.float32"


def _sig(op, m, n, k, ta=False, tb=False, batch=None, bias=None, dtype=BF16):
    pre = () if batch is None else (batch,)
    a, b, o = (*pre, m, k), (*pre, k, n), (*pre, m, n)
    ins = [(a, onednn.transposed_strides(a) if ta else onednn.dense_strides(a), dtype),
           (b, onednn.transposed_strides(b) if tb else onednn.dense_strides(b), BF16)]
    if bias is not None:
        ins.insert(0, (bias, onednn.dense_strides(bias), BF16))
    return op, (*ins, (o, onednn.dense_strides(o), BF16)), (), ()


def _k(key):
    return key[1][-2][0][-2]  # B's rows


@pytest.mark.skipif(not onednn.applies(1), reason="the rule is read from oneDNN v3.12 brgemm on avx512_bf16")
@pytest.mark.parametrize("sig", [
    _sig("aten::mm.out", 2048, 2048, 12288),  # K a multiple of the K block
    _sig("aten::mm.out", 2048, 2048, 8192),  # a power of two: A copied, its own scratchpad
    _sig("aten::mm.out", 2048, 2048, 6000, ta=True),  # A transposed: a K block of 512
    _sig("aten::mm.out", 1023, 130, 5000, tb=True),
    _sig("aten::addmm.out", 300, 200, 9001, bias=(200,)),
    _sig("aten::baddbmm.out", 256, 96, 3000, batch=3, bias=(3, 256, 96)),
], ids=["mm", "mm-pow2", "mm-At", "mm-Bt", "addmm", "baddbmm"])
def test_short_k_probes_the_same_bytes(sig):
    name, layouts, constants, kwargs = sig
    whole = (name, workspace._cut(name, layouts), constants, kwargs, 1)
    short = workspace._key(sig, 1)
    assert _k(short) < _k(whole)
    assert workspace._probe(short) == workspace._probe(whole) > 0


def test_what_the_rule_does_not_cover_keeps_its_k(monkeypatch):
    for sig in (_sig("aten::mm.out", 64, 64, 9000, dtype=FP32),  # not bf16
                _sig("aten::mm.out", 64, 64, 1000),  # K within one K block: nothing shorter
                _sig("aten::mm.out", 1, 64, 9000)):  # a dimension of 1
        assert onednn.k_cut(sig[0], sig[1]) == sig[1]
    name, layouts, _, _ = _sig("aten::mm.out", 64, 64, 9000)
    (asize, _, dtype), *rest = layouts
    strided = ((asize, (9064, 1), dtype), *rest)  # padded rows: not a layout the rule was checked on
    assert onednn.k_cut(name, strided) == strided
    sig = _sig("aten::mm.out", 2048, 2048, 128256)
    assert workspace._key(sig, 2)[1] == workspace._cut(sig[0], sig[1])  # two threads: K kept
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")  # oneDNN steered to another ISA: K kept
    assert not onednn.applies(1)
    assert workspace._key(sig, 1)[1] == workspace._cut(sig[0], sig[1])
