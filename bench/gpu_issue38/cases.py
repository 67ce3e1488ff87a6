"""Issue 38's GPU cases: what run_cases.py runs on a CUDA GPU and what compare.py predicts with peakledger.

Data only (no torch import): one Llama-3.2-1B-shaped model (its config.json keys, random weights), pure bf16, built
on the GPU directly in bf16 (`torch.set_default_dtype(torch.bfloat16)` under `torch.device("cuda")`: peakledger's
build "direct"), micro-batch MB x SEQ tokens, STEPS plain training steps (`out = model(input_ids, labels)` held
through backward, `opt.step()`, `opt.zero_grad(set_to_none=True)`), one technique per case.

Each case: `program` (what run_cases.py does), `knobs` (peakledger's TrainingSetup flat knob names, the CLI flags
with `-` for `_`), `describers` (peakledger describers that model it: the hand-written Llama tape models float8 and
streams offload, the traced one does not), `cuda` (why the library needs a GPU), `order` (run order: the cheap and
most wanted first, so a cut-off run still records them), `timeout` (seconds for its subprocess: torchao's low-bit
optimizers compile `single_param_adam` once per parameter shape with inductor in their first step).
"""

LLAMA_3_2_1B = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 2048,
                "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32,
                "num_key_value_heads": 8, "head_dim": 64, "vocab_size": 128256, "max_position_embeddings": 131072,
                "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "tie_word_embeddings": True, "hidden_act": "silu"}
TINY = dict(LLAMA_3_2_1B, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=32, vocab_size=1024)  # --dry-run on a CPU only
MB, SEQ, STEPS, LR = 2, 1024, 3, 1e-4
DEVICE, TORCH_RULES = "H100-80GB", "2.11"  # the profile compare.py predicts on (H200-141GB when it ran there)

ADAMW = {"optimizer": "adamw", "optimizer_impl": "foreach"}  # torch.optim.AdamW's CUDA default
CASES = {
    "baseline-adamw": {
        "order": 1, "timeout": 90, "program": {"optimizer": "torch-adamw"}, "knobs": dict(ADAMW),
        "describers": ("hand-written", "auto"), "cuda": None},
    "fp8-tensorwise": {
        "order": 2, "timeout": 120, "program": {"optimizer": "torch-adamw", "fp8": "tensorwise"},
        "knobs": dict(ADAMW, fp8="tensorwise"), "describers": ("hand-written",),
        "cuda": "torch._scaled_mm float8 kernels (sm >= 8.9)"},
    "fp8-rowwise": {
        "order": 3, "timeout": 120, "program": {"optimizer": "torch-adamw", "fp8": "rowwise"},
        "knobs": dict(ADAMW, fp8="rowwise"), "describers": ("hand-written",),
        "cuda": "torch._scaled_mm float8 kernels (sm >= 8.9)"},
    "paged-adamw-8bit-bnb": {
        "order": 4, "timeout": 90, "program": {"optimizer": "bnb-PagedAdamW8bit"},
        "knobs": {"optimizer": "paged-adamw-8bit"}, "describers": ("hand-written", "auto"),
        "cuda": "bitsandbytes paged state: cudaMallocManaged + prefetch"},
    "adamw-8bit-bnb": {
        "order": 5, "timeout": 90, "program": {"optimizer": "bnb-AdamW8bit"},
        "knobs": {"optimizer": "adamw-8bit-bnb"}, "describers": ("hand-written", "auto"),
        "cuda": "bitsandbytes' CUDA 8-bit blockwise kernels"},
    "cpu-offload-optimizer": {
        "order": 6, "timeout": 120, "program": {"optimizer": "torchao-CPUOffloadOptimizer"},
        "knobs": {"optimizer": "adamw", "optimizer_impl": "fused", "optimizer_offload": "cpu"},
        "describers": ("hand-written", "auto"), "cuda": "pinned host memory, CUDA streams for the H2D/D2H copies"},
    "cpu-offload-optimizer-grads": {
        "order": 7, "timeout": 120,
        "program": {"optimizer": "torchao-CPUOffloadOptimizer", "offload_gradients": True},
        "knobs": {"optimizer": "adamw", "optimizer_impl": "fused", "optimizer_offload": "cpu",
                  "offload_gradients": True},
        "describers": ("hand-written", "auto"), "cuda": "pinned host memory, CUDA streams for the H2D/D2H copies"},
    "activation-offload-streams": {
        "order": 8, "timeout": 120, "program": {"optimizer": "torch-adamw", "activation_offload": "streams"},
        "knobs": dict(ADAMW, activation_offload="streams"), "describers": ("hand-written",),
        "cuda": "pinned host copies on a second CUDA stream"},
    "adamw-8bit-torchao": {
        "order": 10, "timeout": 150, "program": {"optimizer": "torchao-AdamW8bit"},
        "knobs": {"optimizer": "adamw-8bit-torchao"}, "describers": ("hand-written", "auto"),
        "cuda": None},
    "adamw-4bit-torchao": {
        "order": 11, "timeout": 150, "program": {"optimizer": "torchao-AdamW4bit"},
        "knobs": {"optimizer": "adamw-4bit"}, "describers": ("hand-written", "auto"), "cuda": None},
    "adamw-fp8-torchao": {
        "order": 12, "timeout": 150, "program": {"optimizer": "torchao-AdamWFp8"},
        "knobs": {"optimizer": "adamw-fp8"}, "describers": ("hand-written", "auto"),
        "cuda": "float8 state dtypes on sm >= 8.9"},
    "fsdp2-cpu-offload-1gpu": {
        "order": 9, "timeout": 120, "program": {"optimizer": "torch-adamw", "fsdp2_cpu_offload": True},
        "knobs": {"optimizer": "adamw", "dp_engine": "fsdp2", "world_size": 1, "fsdp_cpu_offload": True,
                  "reduce_dtype": "fp32"},
        "precision": "bf16-mixed", "describers": (),
        "cuda": "pinned host shards, H2D all-gather copies; peakledger models CPUOffloadPolicy on > 1 rank only"},
}


def ordered() -> list[str]:
    return sorted(CASES, key=lambda n: CASES[n]["order"])


def training_of(name: str) -> dict:
    """peakledger's training table for a case (build_scenario's `training`)."""
    case = CASES[name]
    return {"precision": case.get("precision", "bf16"), "micro_batch": MB, "seq_len": SEQ, "steps": STEPS,
            **case["knobs"]}


def command_of(name: str, describer: str, config_path: str = "llama-3.2-1b.json", device: str = DEVICE) -> str:
    """The `peakledger simulate` command line that predicts a case."""
    flags = []
    for k, v in training_of(name).items():
        flag = "--" + k.replace("_", "-")
        flags.append(flag if v is True else f"{flag} {v}")
    return (f"peakledger simulate --hf-config {config_path} --describer {describer} {' '.join(flags)} "
            f"--device {device} --torch-version {TORCH_RULES}")
