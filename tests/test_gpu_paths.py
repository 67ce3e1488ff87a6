"""CUDA kernel paths (models/gpu.py, models/traced/gpu_paths.py, the hand-written SDPA in models/transformer/):
which SDPA kernel torch picks on CUDA, what it allocates and saves, and the reduction staging-buffer rule; the
saved bytes of one attention layer on the H100 profile against the CPU's, every expected number worked out
by hand from the shapes and the cited rules."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from peakledger.models.config import TrainingSetup
from peakledger.models.gpu import reduce_staging_bytes, sdpa_backend, sdpa_kernel
from peakledger.models.presets import preset
from peakledger.models.traced import from_hf_dict, traced_tape
from peakledger.models.training import describe
from peakledger.models.transformer import transformer_tape
from peakledger.simulator.engine import simulate
from peakledger.simulator.events import Action

ROOT = Path(__file__).resolve().parents[1]
H100, A100, SM75, SM86, SM100 = (9, 0), (8, 0), (7, 5), (8, 6), (10, 0)

# (dtype, head_dim, dropout, has_mask, is_causal, compute capability, torch, keywords) -> backend
BACKENDS = [
    # flash: 16-bit, no mask, head_dim <= 256, sm80-sm90 (2.6), dropout allowed
    (("fp16", 64, 0.0, False, True, H100, "2.6", {}), "flash"),
    (("bf16", 128, 0.1, False, True, A100, "2.6", {}), "flash"),
    # flash takes any head_dim <= 256 (the caller pads to 8): 24 and 100
    (("bf16", 24, 0.0, False, True, H100, "2.6", {}), "flash"),
    (("bf16", 100, 0.0, False, True, H100, "2.6", {}), "flash"),
    # fp32: flash is fp16/bf16 only; memory-efficient takes fp32 on sm80+ with head_dim % 4 == 0
    (("fp32", 64, 0.0, False, True, H100, "2.6", {}), "efficient"),
    (("fp32", 30, 0.0, False, True, H100, "2.6", {}), "math"),  # 30 % 4 != 0
    # a mask: flash takes none (check_for_attn_mask), memory-efficient does
    (("bf16", 64, 0.0, True, False, H100, "2.6", {}), "efficient"),
    # head_dim > 256: no flash; memory-efficient needs head_dim % 8 for 16-bit (minimum_gemm_alignment)
    (("bf16", 512, 0.0, False, True, H100, "2.6", {}), "efficient"),
    (("bf16", 260, 0.0, False, True, H100, "2.6", {}), "math"),
    # GQA: flash supports it; memory-efficient does not (check_batch_size_and_num_heads_dense<false>; the
    # latest torch's fake backward gives grads at the query's heads)
    (("bf16", 24, 0.0, False, True, H100, "2.6", dict(n_head=4, n_kv_head=2, enable_gqa=True)), "flash"),
    (("fp32", 24, 0.0, False, True, H100, "2.6", dict(n_head=4, n_kv_head=2, enable_gqa=True)), "math"),
    (("fp32", 24, 0.0, False, True, H100, "2.13", dict(n_head=4, n_kv_head=2, enable_gqa=True)), "math"),
    # different heads without enable_gqa: no fused kernel
    (("bf16", 64, 0.0, False, True, H100, "2.6", dict(n_head=4, n_kv_head=2)), "math"),
    # sm75: flash needs sm80; memory-efficient takes fp16/fp32 there, not bf16
    (("fp16", 64, 0.0, False, True, SM75, "2.6", {}), "efficient"),
    (("bf16", 64, 0.0, False, True, SM75, "2.6", {}), "math"),
    # sm100: beyond 2.6's [sm80, sm90] flash and [sm50, sm90] memory-efficient ranges; within 2.13's [.., sm121]
    (("bf16", 64, 0.0, False, True, SM100, "2.6", {}), "math"),
    (("bf16", 64, 0.0, False, True, SM100, "2.13", {}), "flash"),
    # sm86-89, training, head_dim in (192, 224]: flash refused; memory-efficient (200 % 8 == 0)
    (("bf16", 200, 0.0, False, True, SM86, "2.6", {}), "efficient"),
    (("bf16", 200, 0.0, False, True, SM86, "2.6", dict(requires_grad=False)), "flash"),
    # causal with seq_q != seq_k: flash refuses (check_flash_causal_non_square_seqlens)
    (("bf16", 64, 0.0, False, True, H100, "2.6", dict(seq_q=16, seq_k=32)), "efficient"),
    # cuDNN: after math in 2.6's order (never); first in 2.13 with cuDNN > 9.15.0 on sm90
    (("bf16", 128, 0.0, False, True, H100, "2.6", dict(cudnn_version=91600)), "flash"),
    (("bf16", 128, 0.0, False, True, H100, "2.13", dict(cudnn_version=91600)), "cudnn"),
    (("bf16", 128, 0.0, False, True, H100, "2.13", dict(cudnn_version=91500)), "flash"),
    (("bf16", 256, 0.0, False, True, H100, "2.13", dict(cudnn_version=91600)), "flash"),  # cuDNN head_dim <= 128
    (("bf16", 128, 0.1, False, True, H100, "2.13", dict(cudnn_version=91600)), "flash"),  # dropout not k/16
    (("bf16", 128, 0.125, False, True, H100, "2.13", dict(cudnn_version=91600)), "cudnn"),
    (("bf16", 128, 0.0, False, True, A100, "2.13", dict(cudnn_version=91600)), "flash"),  # preferred on sm90/100
]


@pytest.mark.parametrize("args, expected", BACKENDS)
def test_sdpa_backend_follows_select_sdp_backend(args, expected):
    dtype, hd, dropout, mask, causal, cc, version, kw = args
    assert sdpa_backend(dtype, hd, dropout, mask, causal, cc, version, **kw) == expected


def test_unknown_torch_version_is_refused():
    with pytest.raises(ValueError, match="2.6, 2.13"):
        sdpa_backend("bf16", 64, 0.0, False, True, H100, "2.8")


def test_flash_kernel_pieces():
    B, H, Hk, T, D = 2, 4, 2, 40, 24
    k = sdpa_kernel("flash", B, H, T, T, D, "bf16", 0.0, "2.6", n_kv_head=Hk)
    # mha_fwd: out (B, T, H, D) bf16, softmax_lse (B, H, T) fp32; 2.6: seed/offset on the host
    assert [(p.role, p.nbytes) for p in k.outputs] == [("out", B * T * H * D * 2), ("logsumexp", B * H * T * 4)]
    assert k.saved == ("q", "k", "v", "out", "logsumexp")
    # mha_bwd: softmax_d (B, H, round128(T)), dq_accum (B, round128(T), H, round32(D)) fp32; GQA dk/dv at H heads
    assert [(p.role, p.nbytes) for p in k.bwd_workspace] == [
        ("softmax_d", B * H * 128 * 4), ("dq_accum", B * 128 * H * 32 * 4),
        ("dk_expanded", B * T * H * D * 2), ("dv_expanded", B * T * H * D * 2)]
    new = sdpa_kernel("flash", B, H, T, T, D, "bf16", 0.1, "2.13", n_kv_head=Hk)
    assert [(p.role, p.nbytes) for p in new.outputs][2:] == [("rng_state", 16), ("rng_unused", 8)]
    assert new.saved[-2:] == ("rng_state", "rng_unused") and [p.nbytes for p in new.workspace] == [16]
    # head_dim 20: q, k, v padded to 24 (saved instead), the output padded too
    pad = sdpa_kernel("flash", B, H, T, T, 20, "bf16", 0.0, "2.6")
    assert [p.role for p in pad.outputs][:3] == ["q_padded", "k_padded", "v_padded"]
    assert pad.piece("q_padded").shape == (B, H, T, 24) and pad.piece("out").shape == (B, T, H, 24)
    assert pad.saved[:3] == ("q_padded", "k_padded", "v_padded")
    # head_dim 160: dq_accum rounds to 32 in 2.6 (160), to 64 after 2.7 (192)
    assert sdpa_kernel("flash", 1, 1, 8, 8, 160, "bf16").bwd_workspace[1].shape == (1, 128, 1, 160)
    assert sdpa_kernel("flash", 1, 1, 8, 8, 160, "bf16", 0.0, "2.13").bwd_workspace[1].shape == (1, 128, 1, 192)


def test_efficient_kernel_pads_logsumexp_to_32_rows():
    k = sdpa_kernel("efficient", 2, 4, 40, 40, 16, "fp32", has_mask=True)
    assert [(p.role, p.shape) for p in k.outputs] == [("out", (2, 40, 4, 16)), ("logsumexp", (2, 4, 64))]
    assert k.saved == ("q", "k", "v", "mask", "out", "logsumexp") and not k.bwd_workspace
    with pytest.raises(ValueError):
        sdpa_kernel("math", 2, 4, 40, 40, 16, "fp32")


def test_reduction_staging_buffer_reproduces_the_cs336_snapshots():
    # the loss's torch.max over the vocab dim of [B*T, 10000] fp32 logits whose rows are the fastest dim:
    # block (32, 4), output vectors of 4, 157 CTAs per output; (value, int64) pairs of 16 B
    assert reduce_staging_bytes(512, 10000, 16, reduce_on_fastest=False) == (164_626_432, 16)
    assert reduce_staging_bytes(1024, 10000, 16, reduce_on_fastest=False) == (329_252_864, 32)
    # its sum (fp32 accumulator): 41,156,608 B at ctx 128, 82,313,216 B at ctx 256
    assert reduce_staging_bytes(512, 10000, 4, reduce_on_fastest=False) == (41_156_608, 16)
    assert reduce_staging_bytes(1024, 10000, 4, reduce_on_fastest=False) == (82_313_216, 32)
    # contiguous rows (the reduced dim fastest): within blocks, nothing allocated
    assert reduce_staging_bytes(512, 10000, 16, reduce_on_fastest=True) == (0, 0)
    # one output: every SM on it, global reduction
    size, sem = reduce_staging_bytes(1, 1 << 24, 4, reduce_on_fastest=True)
    assert size > 0 and sem == 4


# -- one attention layer, hand-written -----------------------------------------------------------------------

def _saved_bytes(tape, op_name: str) -> int:
    specs = {o.name: o for op in tape.ops for o in op.outputs}
    op = next(op for op in tape.ops if op.name == op_name)
    return sum(specs[n].nbytes for n in dict.fromkeys(op.saves))


def test_hand_written_gpt2_fp32_runs_memory_efficient_on_h100():
    cfg = replace(preset("tiny"), attention="sdpa")  # d_model 64, 4 heads of 16
    setup = TrainingSetup(micro_batch=2, seq_len=40, precision="fp32")
    B, T, H = 2, 40, 4
    qkv, out = B * T * 192 * 4, B * T * 64 * 4  # the c_attn output (q, k, v are its views), the output
    cpu, gpu = (transformer_tape(cfg, setup, cpu=c) for c in (True, False))
    op = "transformer.h.0.attn.sdpa"
    assert _saved_bytes(cpu, op) == qkv + out + B * H * T * 4 == 83_200  # CPU flash: logsumexp (B, H, T)
    assert _saved_bytes(gpu, op) == qkv + out + B * H * 64 * 4 == 83_968  # memory-efficient: (B, H, 64)
    cpu_op = next(o for o in cpu.ops if o.name == op)
    assert [o.shape for o in cpu_op.outputs] == [(B, T, 64), (B, H, T)] and not cpu_op.bwd_workspace


def test_hand_written_llama_bf16_runs_flash_with_its_backward_workspace():
    cfg = preset("tiny-llama")  # 4 heads of 16, 2 kv heads
    setup = TrainingSetup(micro_batch=2, seq_len=40, precision="bf16")
    B, T, H, hd = 2, 40, 4, 16
    saved = B * T * 64 * 2 + 2 * B * T * 32 * 2 + B * T * 64 * 2 + B * H * T * 4  # q, k, v, out, lse
    cpu, gpu = (transformer_tape(cfg, setup, cpu=c) for c in (True, False))
    op = "model.layers.0.self_attn.sdpa"
    assert _saved_bytes(cpu, op) == _saved_bytes(gpu, op) == saved == 32_000  # torch 2.6 flash: rng on the host
    ws = {w.name.rsplit(".", 1)[-1]: w.nbytes for w in next(o for o in gpu.ops if o.name == op).bwd_workspace}
    assert ws == {"softmax_d": B * H * 128 * 4, "dq_accum": B * 128 * H * 32 * 4,
                  "dk_expanded": B * T * H * hd * 2, "dv_expanded": B * T * H * hd * 2}
    log = simulate(describe(cfg, setup.replace(steps=1), "H100-80GB"))
    allocs = {e.block.name: e.block.nbytes for e in log.events if e.action is Action.ALLOC}
    assert allocs[f"{op}.dq_accum"] == 131_072


def test_hand_written_llama_fp32_gqa_falls_back_to_math_on_torch_26():
    cfg = preset("tiny-llama")
    setup = TrainingSetup(micro_batch=2, seq_len=40, precision="fp32")
    gpu = transformer_tape(cfg, setup, cpu=False)
    names = {op.name for op in gpu.ops}
    assert "model.layers.0.self_attn.sdpa" not in names
    softmax = next(op for op in gpu.ops if op.name == "model.layers.0.self_attn.softmax")
    assert softmax.outputs[0].shape == (2, 4, 40, 40)  # the B*H*T*T weights the math backend keeps


# -- one attention layer, traced -----------------------------------------------------------------------------

def _llama(**extra):
    cfg = json.loads((ROOT / "examples" / "hf-llama-tiny" / "config.json").read_text())
    return from_hf_dict({**cfg, "attn_implementation": "sdpa", **extra}, "hf-llama-tiny-sdpa")


def _traced_op(tape, i: int = 0):
    k = next(k for k, op in enumerate(tape.ops) if f"layers.{i}.self_attn._scaled_dot" in op.name)
    return k, tape.ops[k]


def test_traced_llama_bf16_flash_on_h100():
    # hidden 64, 4 heads of 24, 2 kv heads (enable_gqa); micro-batch 2, seq 40: recorded as the CUDA program
    setup = TrainingSetup(micro_batch=2, seq_len=40, precision="bf16")
    B, T, H, Hk, D = 2, 40, 4, 2, 24
    model = _llama()
    cpu = traced_tape(model, setup, cpu=True)
    saved = B * H * T * D * 2 + 2 * B * Hk * T * D * 2 + B * H * T * D * 2 + B * H * T * 4  # q, k, v, out, lse
    k, op = _traced_op(cpu)
    assert op.kind == "_scaled_dot_product_flash_attention_for_cpu"
    assert _saved_bytes(cpu, op.name) == saved == 47_360
    for version, rng in (("2.6", 0), ("2.11", 16 + 8)):  # 2.7+ keeps flash's rng state and offset on the device
        gpu = traced_tape(model, setup, cuda=(H100, version))
        kg, op_g = _traced_op(gpu)
        assert op_g.kind == "_scaled_dot_product_flash_attention" and _saved_bytes(gpu, op_g.name) == 47_360 + rng
        node = next(n for n in gpu.backward if n.op == kg)
        extra = {a.name.split(".")[-2]: a.nbytes for a in node.steps[0].allocs[3:]}
        assert extra == {"softmax_d": B * H * 128 * 4, "dq_accum": B * 128 * H * 32 * 4,
                         "dk_expanded": B * T * H * D * 2, "dv_expanded": B * T * H * D * 2}
        assert set(node.steps[0].frees) >= {a.name for a in node.steps[0].allocs[3:]}
    log = simulate(describe(model, setup.replace(steps=1), "H100-80GB", torch_version="2.11"))
    assert any(e.action is Action.ALLOC and ".dq_accum." in e.block.name for e in log.events)
    # torch 2.13.0+cu130 (cuDNN 9.20.0 > 9.15.0, CUDA 13: sdp_utils.cpp check_prefer_cudnn_attention) puts cuDNN
    # first on sm90: its meta rule's outputs, out (B, H, T, D) and logsumexp (B, H, T, 1) fp32, k and v at their 2
    # heads; no flash temporaries in its backward
    gpu = traced_tape(model, setup, cuda=(H100, "2.13"))
    kg, op_g = _traced_op(gpu)
    assert op_g.kind == "_scaled_dot_product_cudnn_attention"
    # + the meta rule's philox seed and offset, 0-dim int64 each, saved by the backward (derivatives.yaml)
    qkv_out_lse = B * H * T * D * 2 + 2 * B * Hk * T * D * 2 + B * H * T * D * 2 + B * H * T * 4
    assert _saved_bytes(gpu, op_g.name) == qkv_out_lse + 2 * 8


def test_traced_llama_fp32_mha_runs_memory_efficient_and_gqa_math():
    setup = TrainingSetup(micro_batch=2, seq_len=40, precision="fp32")
    B, T, H, D = 2, 40, 4, 24
    mha = _llama(num_key_value_heads=4)
    cpu, gpu = traced_tape(mha, setup, cpu=True), traced_tape(mha, setup)
    qkvo = 4 * B * H * T * D * 4
    assert _saved_bytes(cpu, _traced_op(cpu)[1].name) == qkvo + B * H * T * 4 == 124_160
    _, op_g = _traced_op(gpu)
    assert op_g.kind == "_scaled_dot_product_efficient_attention"
    assert _saved_bytes(gpu, op_g.name) == qkvo + B * H * 64 * 4 == 124_928  # logsumexp padded to 64 rows
    # GQA in fp32: the math composite (its B*H*T*T softmax recorded)
    math = traced_tape(_llama(), setup, cuda=(H100, "2.6"))
    assert not any("_scaled_dot_product" in op.kind for op in math.ops)
    assert any(op.kind == "_safe_softmax" and op.outputs[0].shape == (B, H, T, T) for op in math.ops)


def test_a_mask_whose_last_dim_is_strided_sends_sdpa_to_math_on_cuda():
    # sdp_utils_cpp.h check_last_dim_stride_equals_1_dense: on CUDA the mask's last stride must be 1 too (T5's
    # relative position bias is a permuted view: stride 8); the CPU does not check it
    assert sdpa_backend("fp32", 64, 0.1, True, False, H100, "2.6") == "efficient"
    assert sdpa_backend("fp32", 64, 0.1, True, False, H100, "2.6", last_dims_contiguous=False) == "math"
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from peakledger.models.traced.cuda_program import cuda_program
    with FakeTensorMode(), cuda_program(H100, "2.11") as program:
        q = torch.empty(2, 4, 16, 64, requires_grad=True)
        bias = torch.empty(1, 16, 16, 4).permute(0, 3, 1, 2)  # (1, H, T, T), last stride 4
        torch.nn.functional.scaled_dot_product_attention(q, q, q, attn_mask=bias, dropout_p=0.1)
        torch.nn.functional.scaled_dot_product_attention(q, q, q, attn_mask=bias.contiguous(), dropout_p=0.1)
    assert program.backends == ["math", "efficient"]


def test_a_linear_bias_gradient_on_cuda_holds_the_reduction_staging_buffer():
    # ViT-base's fc2 on the H200 (B=64, 197 tokens, 768 outputs, bf16): grad.sum(0) over 12,608 rows splits the
    # rows over blocks (Reduce.cuh): a 77,463,552 B staging buffer and 24 B of semaphores after the output, as
    # the snapshot shows; the recording of the CUDA program carries them in the node, freed there
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from peakledger.models.gpu import reduce_staging_bytes
    from peakledger.models.traced.cuda_program import reduction_temporaries
    expected = reduce_staging_bytes(768, 12_608, 4, reduce_on_fastest=False, num_sms=132)
    with FakeTensorMode():
        g = torch.empty(12_608, 768, dtype=torch.bfloat16)
        temps = reduction_temporaries(torch.ops.aten.sum.dim_IntList, (g, [0], True), {}, H100)
        assert reduction_temporaries(torch.ops.aten.sum.dim_IntList, (g, [0], True), {}, (7, 5)) == ()
        assert reduction_temporaries(torch.ops.aten.sum.dim_IntList, (g.t(), [0], True), {}, H100) != temps
    rule = (768, 12_608, 4, False, True, 4, 132)  # what scale.py computes them from at another micro-batch
    assert temps == ((expected[0], "reduce_staging", rule), (expected[1], "reduce_semaphores", rule))
    assert expected == (77_463_552, 24)
    model = from_hf_dict({"model_type": "llama", "num_hidden_layers": 1, "hidden_size": 768, "num_attention_heads": 12,
                          "intermediate_size": 3072, "vocab_size": 256, "max_position_embeddings": 256,
                          "mlp_bias": True}, "biased")
    tape = traced_tape(model, TrainingSetup(micro_batch=64, seq_len=197, precision="bf16"), cuda=(H100, "2.11"))
    down = next(n for n in tape.backward if n.name == "model.layers.0.mlp.down_proj.AddmmBackward0")
    allocs = [a for step in down.steps for a in step.allocs]
    frees = {f for step in down.steps for f in step.frees}
    staged = [a for a in allocs if ".reduce_staging." in a.name or ".reduce_semaphores." in a.name]
    assert [a.nbytes for a in staged] == [77_463_552, 24] and {a.name for a in staged} <= frees


def test_autocast_keeps_its_weight_casts_until_the_forward_ends_in_checkpointed_layers():
    # autocast_mode.cpp cached_cast: the bf16 copy of an fp32 parameter that requires grad stays in autocast's
    # cache until the outermost region exits, whether or not a checkpointed layer saves it (the H200's Llama-1B
    # autocast + HF gradient checkpointing run holds every layer's casts through the forward)
    cfg = json.loads((ROOT / "examples" / "hf-llama-tiny" / "config.json").read_text())
    model = from_hf_dict(cfg, "hf-llama-tiny")
    setup = TrainingSetup(micro_batch=2, seq_len=16, precision="bf16-autocast", checkpointing="full", steps=1)
    tape = traced_tape(model, setup, cuda=(H100, "2.11"))
    casts = [o.name for op in tape.ops for o in op.outputs if o.name in op.autocast_cached]
    weights = [op for op in tape.ops if op.kind == "_to_copy" and op.params and op.autocast_cached]
    assert weights and all(op.region is not None for op in weights if ".layers." in op.name)
    log = simulate(describe(model, setup, "H100-80GB", torch_version="2.11"))
    layer_casts = [c for c in casts if ".layers." in c]
    freed_by = {e.block.name: e.op for e in log.events if e.action is Action.FREE and e.phase.value == "forward"}
    assert layer_casts and {freed_by[c] for c in layer_casts} == {"autocast.exit"}
