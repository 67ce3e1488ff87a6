"""The torch releases' CUDA rule sets (simulator/torch_rules): the default follows the installed torch, an unmodelled
one picks the nearest and says so, and each rule that differs between torch 2.11 and 2.13 gives the value its cited
source line gives (docs/gpu.md "What changed between torch 2.11 and 2.13")."""

from __future__ import annotations

import subprocess
import sys
from importlib import metadata

import pytest
from cli_run import cli, cli_json

from peakledger.models.compile.convert import zeros_held
from peakledger.models.config import TrainingSetup
from peakledger.models.cuda_context import MEASURED, cuda_context
from peakledger.models.devices import DEVICES
from peakledger.models.presets import preset
from peakledger.models.training import describe
from peakledger.scenario import Scenario
from peakledger.simulator import torch_rules
from peakledger.simulator.allocator import AllocatorConfig, AllocatorConfigError
from peakledger.simulator.torch_rules import v2_6, v2_11, v2_13

MiB = 1 << 20


def test_one_module_per_release_oldest_first():
    assert torch_rules.RULES == (v2_6.RULES, v2_11.RULES, v2_13.RULES)
    assert torch_rules.TORCH_VERSIONS == ("2.6", "2.11", "2.13")


@pytest.mark.parametrize("installed, version, why", [
    ("2.13.0+cpu", "2.13", "torch 2.13.0 installed: its rules"),
    ("2.11.0+cu130", "2.11", "torch 2.11.0 installed: its rules"),
    ("2.12.1", "2.11", "torch 2.12.1 installed, not modelled: torch 2.11's rules, the nearest"),
    ("2.14.0", "2.13", "torch 2.14.0 installed, not modelled: torch 2.13's rules, the nearest"),
    ("2.4.1", "2.6", "torch 2.4.1 installed, not modelled: torch 2.6's rules, the nearest"),
    (None, "2.13", "no torch installed: the newest modelled, torch 2.13's rules"),
])
def test_default_follows_the_installed_torch(monkeypatch, installed, version, why):
    monkeypatch.setattr(torch_rules, "installed_torch", lambda: installed)
    rules, note = torch_rules.default_rules(installed)
    assert (rules.version, note) == (version, why)
    assert Scenario(name="s", model=preset("tiny"), setup=TrainingSetup()).torch_version == version


def test_installed_torch_is_read_from_package_metadata():
    try:
        expected = metadata.version("torch")
    except metadata.PackageNotFoundError:
        expected = None
    assert torch_rules.installed_torch() == expected


def test_the_report_says_which_rules_and_why(monkeypatch):
    monkeypatch.setattr(torch_rules, "installed_torch", lambda: "2.12.0")
    rc, out, err = cli("simulate", "--preset", "tiny", "--seq-len", "32", "--micro-batch", "2")
    assert rc == 0, err
    assert ("GPU rules: torch 2.11's CUDA kernels and caching allocator on H100-80GB (torch 2.12.0 installed, not "
            "modelled: torch 2.11's rules, the nearest)") in out
    d = cli_json("simulate", "--preset", "tiny", "--seq-len", "32", "--micro-batch", "2", "--torch-version", "2.6")
    assert d["gpu_rules"] == {"torch_version": "2.6", "why": "asked for; torch 2.12.0 is installed"}
    d = cli_json("simulate", "--preset", "tiny", "--seq-len", "32", "--micro-batch", "2", "--device", "cpu")
    assert d["gpu_rules"] is None


def test_an_unmodelled_version_is_refused_with_the_allowed_ones():
    rc, out, err = cli("simulate", "--preset", "tiny", "--torch-version", "2.12")
    assert rc == 2
    assert "'2.12' is not modelled; allowed: 2.6, 2.11, 2.13" in err


# -- what changed between 2.11 and 2.13, each from its source line ---------------------------------------------

def test_allocator_keys_new_in_2_13():
    # v2.13.0 c10/cuda/CUDAAllocatorConfig.h:174-175 adds "pinned_free_catch_all", "throw_on_cudamalloc_oom" to
    # v2.11.0's :146-161; c10/core/AllocatorConfig.h:330-336 parses pinned_max_round_threshold_mb and
    # pinned_max_cached_size_mb (host allocator only). None changes the device allocator's blocks.
    for setting in ("pinned_free_catch_all:True", "pinned_max_round_threshold_mb:64", "pinned_max_cached_size_mb:8",
                    "throw_on_cudamalloc_oom:False"):
        assert AllocatorConfig.parse(setting, "2.13") == AllocatorConfig(torch_version="2.13")
        with pytest.raises(AllocatorConfigError, match="unknown allocator setting"):
            AllocatorConfig.parse(setting, "2.11")
    # CUDAAllocatorConfig.h:70-75: True throws an OOM before cudaMalloc, not modelled: refused by name
    with pytest.raises(AllocatorConfigError, match="not modelled: throw_on_cudamalloc_oom:True"):
        AllocatorConfig.parse("throw_on_cudamalloc_oom:True", "2.13")


def test_cublaslt_workspace_unified_in_2_13():
    # 2.11 (CublasHandlePool.cpp getCUDABlasLtWorkspace): a 1 MiB block of its own per (handle, stream) at its first
    # Lt GEMM; the tiny GPT-2's forward has biased F.linear (addmm, 1-D bias: the Lt path), its backward only mm:
    # one block, on the forward's thread. 2.13 (torch/backends/cuda/__init__.py:389-393): the Lt workspace reuses
    # the cuBLAS workspace's allocation: none. The cuBLAS workspaces (32 MiB on sm90, one per thread) stay.
    def workspaces(version):
        graph = describe(preset("tiny"), TrainingSetup(precision="bf16-mixed", seq_len=64, micro_batch=2),
                         "H200-141GB", torch_version=version)
        return sorted((b.name, b.nbytes) for op in graph.ops_in_order() for b in op.allocs if "cublas" in b.name)

    cublas = [("cublas_workspace.autograd_thread", 32 * MiB), ("cublas_workspace.forward_thread", 32 * MiB)]
    assert workspaces("2.11") == sorted(cublas + [("cublaslt_workspace.forward_thread", 1024 * 1024)])
    assert workspaces("2.13") == cublas


def test_compiled_backward_frees_its_gradients_in_2_13():
    # 2.11 runtime_wrappers.py:2673 `def backward(ctx, *flat_args)`: the tuple holds the gradients to the end;
    # 2.13 runtime_wrappers.py:3025-3026: the generated prologue runs `flat_args.clear()`
    assert zeros_held("2.11") and zeros_held("2.12")  # 2.12, not modelled, follows 2.11
    assert not zeros_held("2.13")


def test_cuda_context_measured_only_where_its_release_says():
    for m in MEASURED:
        assert torch_rules.rules_for(m.torch).context_source == m.source
    h200 = DEVICES["H200-141GB"]
    assert cuda_context(h200, "2.11").measured
    ctx = cuda_context(h200, "2.13")  # no measurement under 2.13: the profile's assumption
    assert not ctx.measured and ctx.bytes == h200.context_bytes


@pytest.mark.skipif(not torch_rules.installed_torch() or not torch_rules.installed_torch().startswith("2.13."),
                    reason="needs torch 2.13 installed: its own parser is the reference")
def test_2_13_parser_agrees_with_torch_2_13s_own():
    """torch 2.13.0's c10 parser (AcceleratorAllocatorConfig, in libc10.so of every build, reached through
    torch._C._accelerator_setAllocatorSettings) takes or refuses each setting as the model's 2.13 rules do. Run in
    a process of its own: the setting is process-wide."""
    settings = ["max_split_size_mb:19", "max_split_size_mb:20", "max_non_split_rounding_mb:19",
                "max_non_split_rounding_mb:20", "garbage_collection_threshold:0.5", "garbage_collection_threshold:1.5",
                "roundup_power2_divisions:[256:1,>:4]", "roundup_power2_divisions:3",
                "roundup_power2_divisions:[100:2]", "roundup_power2_divisions:[256:3]", "expandable_segments:True",
                "expandable_segments:yes",
                "pinned_max_round_threshold_mb:64", "pinned_max_round_threshold_mb:abc", "pinned_max_cached_size_mb:8",
                "pinned_use_background_threads:True", "pinned_use_background_threads:1"]
    code = ("import sys, torch\n"
            "for s in sys.argv[1:]:\n"
            "    try:\n"
            "        torch._C._accelerator_setAllocatorSettings(s); print(1)\n"
            "    except Exception:\n"
            "        print(0)\n")
    done = subprocess.run([sys.executable, "-c", code, *settings], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    theirs = [line == "1" for line in done.stdout.split()]

    def ours(s):
        try:
            AllocatorConfig.parse(s, "2.13")
        except AllocatorConfigError:
            return False
        return True

    assert theirs == [ours(s) for s in settings]
    assert theirs.count(True) == 8  # the bounds are torch's: 19 refused, 20 taken (2.6 refused 20 too)


# -- SDPA on sm90: cuDNN attention first under 2.13 (bench/validate_fakecuda_rules.py) -----------------------------

def test_cudnn_attention_rule_fields():
    # PyPI's torch 2.13.0 (+cu130) ships nvidia-cudnn-cu13 9.20.0.48: cudnnGetVersion 92000; 2.6 / 2.11 unchanged
    assert (v2_13.RULES.sdpa_cudnn_version, v2_13.RULES.wheel_cuda_major) == (92000, 13)
    assert v2_11.RULES.sdpa_cudnn_version is None and v2_6.RULES.sdpa_cudnn_version is None


def test_sdpa_choice_follows_check_prefer_cudnn_attention():
    from peakledger.models import gpu
    # tiny-llama's attention: head dim 16, 4 heads, 2 KV heads (GQA), T 64; what torch 2.13.0's own
    # torch._fused_sdp_choice answered on sm 9.0 with cuDNN 9.20 (CUDNN / MATH / EFFICIENT)
    def pick(dtype, cc, cudnn, cuda_major, n_kv=2, version="2.13"):
        return gpu.sdpa_backend(dtype, 16, 0.0, False, True, cc, version, seq_q=64, seq_k=64, n_head=4,
                                n_kv_head=n_kv, enable_gqa=n_kv != 4, cudnn_version=cudnn, cuda_major=cuda_major)
    assert pick("bf16", (9, 0), 92000, 13) == "cudnn" and pick("fp16", (9, 0), 92000, 13, n_kv=4) == "cudnn"
    assert pick("fp32", (9, 0), 92000, 13) == "math"  # cuDNN and flash take 16-bit only; efficient no GQA
    assert pick("fp32", (9, 0), 92000, 13, n_kv=4) == "efficient"
    assert pick("bf16", (9, 0), 91500, 13) == "flash"  # "cudnn_version > 91500"
    # CUDA < 13 wheels: sm90 / sm100 / sm103 only ("!minor || minor == 3"); CUDA 13: any sm10x minor
    assert pick("bf16", (10, 1), 92000, 12) == "flash" and pick("bf16", (10, 1), 92000, 13) == "cudnn"
    assert pick("bf16", (8, 0), 92000, 13) == "flash"  # sm80 is never preferred
    assert pick("bf16", (9, 0), None, 12, version="2.6") == "flash"


def test_tiny_llama_tape_writes_cudnn_under_2_13_and_flash_under_2_11():
    from peakledger.models.transformer.nanogpt import transformer_tape
    cfg = preset("tiny-llama")
    B, T, H, D = 2, 64, 4, 16
    setup = TrainingSetup(micro_batch=B, seq_len=T, precision="bf16")
    for version, lse_shape, bwd in (("2.13", (B, H, T, 1), set()), ("2.11", (B, H, T), {"softmax_d", "dq_accum",
                                                                                     "dk_expanded", "dv_expanded"})):
        tape = transformer_tape(cfg, setup, cpu=False, torch_version=version)
        op = next(o for o in tape.ops if o.kind == "sdpa")
        shapes = {o.name.split(".")[-1]: (o.shape, o.dtype) for o in op.outputs}
        # cuDNN's meta rule: out (B, H, T, D) bf16 (the tape's (B, T, H*D)), logsumexp (B, H, T, 1) fp32
        assert shapes["out"] == ((B, T, H * D), "bf16") and shapes["lse"] == (lse_shape, "fp32")
        assert {w.name.split(".")[-1] for w in op.bwd_workspace} == bwd
