"""CUDA library rules behind bench/validate_gpu.py's H200 matrix (torch 2.11), each worked out from shapes and the
torch source it comes from: the cuBLASLt workspace (aten/src/ATen/cuda/CublasHandlePool.cpp) of the GEMMs that
take the Lt path (aten/src/ATen/native/cuda/Blas.cpp)."""

from __future__ import annotations

from peakledger.models.config import TrainingSetup
from peakledger.models.gpu import (
    addmm_takes_cublaslt,
    cublaslt_workspace_bytes,
    cuda_fused_rms_norm,
    gemm_takes_cublaslt,
)
from peakledger.models.presets import preset
from peakledger.models.training import describe
from peakledger.simulator.engine import simulate
from peakledger.simulator.events import Action, Category, Phase

MiB = 1 << 20
from gpu_snapshots import allocator_replay  # bench/ (pytest's pythonpath)  # noqa: E402


def test_cublaslt_workspace_size_by_torch_version():
    # parseCUDABlasLtWorkspaceSize: CUBLASLT_WORKSPACE_SIZE defaults to 1024 KiB; a block of its own in 2.11; not
    # modelled in 2.6 (one per call) nor after 2.11 (the cuBLAS workspace is used)
    assert cublaslt_workspace_bytes("2.11") == cublaslt_workspace_bytes("2.11.0+cu130") == 1024 * 1024
    assert cublaslt_workspace_bytes("2.6") == cublaslt_workspace_bytes("2.13") == 0


def test_which_addmm_takes_the_lt_path():
    # isInputCompliesAddmmCudaLt: a 1-D bias (or one that squeezes to 1-D) of n, a dtype Lt takes, every dim > 1
    assert addmm_takes_cublaslt(32, 512, 512, (512,), "fp32")
    assert addmm_takes_cublaslt(256, 64, 192, (1, 192), "bf16")
    assert not addmm_takes_cublaslt(32, 512, 512, None, "fp32")  # no bias: mm, beta 0
    assert not addmm_takes_cublaslt(32, 512, 512, (32, 512), "fp32")  # a 2-D bias without an activation
    assert not addmm_takes_cublaslt(1, 512, 512, (512,), "fp32")  # a dim of 1
    assert not addmm_takes_cublaslt(32, 512, 512, (512,), "int64")
    # F.linear of a (B, T, D) input: addmm on its (B*T, D) view (Linear.cpp _flatten_nd_linear)
    assert gemm_takes_cublaslt("linear", [(4, 64, 64), (192, 64), (192,)], (4, 64, 192), "fp32")
    assert not gemm_takes_cublaslt("linear", [(4, 64, 64), (192, 64)], (4, 64, 192), "fp32")
    # a traced aten addmm: bias, mat1, mat2 read off its operands and its (m, n) output
    assert gemm_takes_cublaslt("addmm", [(192,), (256, 64), (64, 192)], (256, 192), "bf16")
    assert not gemm_takes_cublaslt("mm", [(256, 64), (64, 192)], (256, 192), "bf16")
    # F.linear's flattened (B*T, D) view of a (B, T, D) storage: k from the FLOPs (flop_counter addmm_flop: 2 m k n)
    assert gemm_takes_cublaslt("addmm", [(32, 512, 768), (768, 768), (768,)], (16384, 768), "fp32",
                               2 * 16384 * 768 * 768)
    assert not gemm_takes_cublaslt("addmm", [(32, 512, 768), (768, 768)], (16384, 768), "fp32", 2 * 16384 * 768 * 768)


def _workspaces(model: str, torch_version: str, **training) -> list[tuple[str, int, Phase]]:
    setup = TrainingSetup(micro_batch=32, seq_len=1, steps=2, **training)
    log = simulate(describe(preset(model), setup, "H100-80GB", torch_version=torch_version))
    ws = [(e.block.name, e.block.nbytes, e.phase) for e in log.events if e.block.category is Category.WORKSPACE]
    assert all(e.action is Action.ALLOC for e in log.events if e.block.category is Category.WORKSPACE)  # never freed
    return ws


def test_tiny_mlp_holds_one_lt_workspace_per_thread_that_runs_a_biased_linear():
    cublas = ("cublas_workspace.forward_thread", 32 * MiB, Phase.FORWARD)
    lt = ("cublaslt_workspace.forward_thread", MiB, Phase.FORWARD)
    autograd = ("cublas_workspace.autograd_thread", 32 * MiB, Phase.BACKWARD)
    # nn.Linear with a bias on (32, 1, 512): the forward's first addmm takes the Lt path; backward's GEMMs are mm
    assert _workspaces("tiny-mlp", "2.11") == [cublas, lt, autograd]
    # two micro-batches (the second played from the first's recording): still one of each per thread
    assert _workspaces("tiny-mlp", "2.11", grad_accum=2) == [cublas, lt, autograd]
    assert _workspaces("tiny-mlp", "2.6") == [cublas, autograd]
    # checkpointed: the recompute of a region runs its addmm again on autograd's thread, which gets its own
    ws = _workspaces("tiny-mlp", "2.11", checkpointing="full")
    assert ws[:2] == [cublas, lt] and sorted(ws[2:]) == sorted(
        [autograd, ("cublaslt_workspace.autograd_thread", MiB, Phase.BACKWARD)])


def test_a_recompute_that_stops_before_a_gemm_takes_no_workspace():
    # torch/utils/checkpoint.py: the non-reentrant recompute stops (_StopRecomputationError) when the last tensor
    # the first pass saved is packed again; a linear packs its input before its kernel runs (autograd saves inputs
    # before redispatching), so the last layer's recompute runs no addmm. Autograd's first GEMM is that layer's
    # AddmmBackward (an mm: cuBLAS), its first Lt GEMM the next region's recomputed addmm
    setup = TrainingSetup(micro_batch=32, seq_len=1, steps=2, checkpointing="full")
    log = simulate(describe(preset("tiny-mlp"), setup, "H100-80GB", torch_version="2.11"))
    assert [(e.op, e.block.name) for e in log.events if e.block.category is Category.WORKSPACE] == [
        ("layers.0", "cublas_workspace.forward_thread"), ("layers.0", "cublaslt_workspace.forward_thread"),
        ("layers.4.backward", "cublas_workspace.autograd_thread"),
        ("layers.2.recompute", "cublaslt_workspace.autograd_thread")]


def test_rms_norm_on_cuda_is_the_fused_kernel_from_torch_2_11():
    # native_functions.yaml: rms_norm calls _fused_rms_norm (CUDA: _fused_rms_norm_cuda): the output and an fp32 rstd
    # per row; torch 2.6's composite also keeps the normalised input for the weight's product
    assert cuda_fused_rms_norm("2.11") and not cuda_fused_rms_norm("2.6")
    setup = TrainingSetup(micro_batch=4, seq_len=64, steps=1, passes="forward")

    def norm_allocs(version: str) -> list[tuple[str, int]]:
        log = simulate(describe(preset("tiny-llama"), setup, "H100-80GB", torch_version=version))
        return [(e.block.name.rpartition(".")[2], e.block.nbytes) for e in log.events
                if e.op == "model.layers.1.input_layernorm" and e.action is Action.ALLOC]

    # (4, 64, 64) fp32: 65,536 B; rstd (4, 64, 1) fp32: 1,024 B
    assert norm_allocs("2.11") == [("out", 65_536), ("rstd", 1_024)]
    assert norm_allocs("2.6") == [("out", 65_536), ("rstd", 1_024), ("normed", 65_536)]


def _op_allocs(log, op: str) -> list[tuple[str, int]]:
    return [(e.block.name, e.block.nbytes) for e in log.events if e.op == op and e.action is Action.ALLOC]


def _op_frees(log, op: str) -> list[str]:
    return [e.block.name for e in log.events if e.op == op and e.action is Action.FREE]


def test_eager_attention_and_loss_under_cuda_autocast():
    # tiny GPT-2 (d 64, 4 heads, vocab 256), B 4, T 64, bf16 autocast on CUDA; (4, 4, 64, 64) is 65,536 elements
    setup = TrainingSetup(micro_batch=4, seq_len=64, steps=1, precision="bf16-autocast")
    log = simulate(describe(preset("tiny"), setup, "H100-80GB", torch_version="2.11"))
    a = "transformer.h.0.attn"
    # SoftMax.cpp softmax(x, dim, dtype=float): a bf16 input is converted first (fp32, gone with the call)
    assert _op_allocs(log, f"{a}.softmax_upcast") == [(f"{a}.softmax_upcast", 262_144)]
    assert _op_allocs(log, f"{a}.softmax") == [(f"{a}.softmax", 262_144)]
    assert _op_frees(log, f"{a}.softmax") == [f"{a}.softmax_upcast", f"{a}.masked"]
    # SoftMax.cu softmax_backward_cuda_out: tmp = grad * output (fp32) besides the fp32 gradient of the upcast
    assert sorted(_op_allocs(log, f"{a}.softmax.backward")) == [(f"{a}.softmax.grad_times_output", 262_144),
                                                                (f"{a}.softmax_upcast.grad", 262_144)]
    # the @ v matmul casts the fp32 probabilities to bf16 (autocast's lower-precision list)
    assert _op_allocs(log, f"{a}.pv.autocast_input") == [(f"{a}.pv.in_cast", 131_072)]
    # LossNLL.cpp cross_entropy_loss: log_softmax in the logits' dtype (bf16), nll_loss's fp32 copy of it saved
    assert _op_allocs(log, "loss.log_softmax") == [("loss.log_softmax.out", 4 * 64 * 256 * 2)]
    assert _op_allocs(log, "loss.autocast_input") == [("loss.log_softmax_fp32", 4 * 64 * 256 * 4)]
    # CausalSelfAttention.forward's argument (ln_1's fp32 output) and the q, k, v views of c_attn's output live
    # until it returns: the linears saved their bf16 casts
    assert _op_frees(log, f"{a}.return") == ["transformer.h.0.ln_1.out", f"{a}.c_attn.out"]
    assert _op_frees(log, "transformer.h.0.mlp.return") == ["transformer.h.0.ln_2.out"]


def test_allocator_replay_tells_segment_placement_from_the_allocator_rules():
    # two 2 MiB small-pool segments, the second one cudaMalloc'd at the lower address. Best fit breaks ties between
    # free blocks of one size by address (CUDACachingAllocator.cpp BlockComparatorSize): the 512 KiB request after
    # A and D are freed takes D's slot at the recorded addresses (A's at the model's ascending ones), so freeing B
    # merges A and B into 1 MiB there and the 1 MiB request fits; at the model's addresses it needs a third segment
    K = 1024
    hi, lo = 0x7F0000400000, 0x7F0000000000

    def ev(action, addr, size):
        return {"action": action, "addr": addr, "size": size, "stream": 0}

    trace = [ev("segment_alloc", hi, 2 * MiB), ev("alloc", hi, 512 * K), ev("alloc", hi + 512 * K, 512 * K),
             ev("alloc", hi + MiB, MiB), ev("segment_alloc", lo, 2 * MiB), ev("alloc", lo, 512 * K),
             ev("alloc", lo + 512 * K, 512 * K), ev("alloc", lo + MiB, MiB),
             ev("free_completed", hi, 512 * K), ev("free_completed", lo, 512 * K), ev("alloc", lo, 512 * K),
             ev("free_completed", hi + 512 * K, 512 * K), ev("alloc", hi, MiB)]
    assert allocator_replay({"device_traces": [trace], "segments": []}, "2.11") == {
        "allocs": 8, "reserved": 6 * MiB, "reserved_at_recorded_addresses": 4 * MiB, "blocks_where_recorded": True}
    # a trace that starts with live blocks (a free of a block it never allocated) is not replayed
    assert allocator_replay({"device_traces": [[ev("alloc", lo, 512), ev("free_completed", hi, 512)]]}, "2.11") is None
