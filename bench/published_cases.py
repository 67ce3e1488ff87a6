"""Published GPU memory measurements (issue 38's scoreboard), as data: each figure with where it was published
(repository, file, commit, or the issue / pull request), the setup as the source states it, what the figure
measures, and the peakledger scenario it maps to (model table + training knobs, as `build_scenario` takes them).

Rules kept here:
- `setup` is the source's own wording; what the source leaves out is listed in `unstated` together with the value
  the scenario takes for it and where that value comes from (the recipe's config file, a library default). A case
  with anything in `unstated` is "not fully stated" on the scoreboard. No value was chosen to move a prediction.
- `pending` names the techniques peakledger does not simulate yet (issue 38's other helpers are adding them); the
  case keeps the knob values it will use (issue 38's flag scheme: fp8, optimizer adamw-8bit-bnb / adamw-8bit-torchao
  / adamw-4bit / paged-adamw-8bit, optimizer_in_backward, activation_offload, chunked_loss) and gets no prediction
  until then: bench/published.py skips it.
- `mapping` says where the scenario differs from what the library does, so a reader can weigh the error.

bench/published.py runs the cases and writes the "Published measurements (scoreboard)" section of
bench/VALIDATION.md; tests/test_published.py checks this data is well formed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

MEASURES = ("allocated", "reserved", "active", "nvidia-smi")  # max_memory_allocated / _reserved / active_bytes peak
UNITS = {"GiB": 2**30, "GB": 10**9}
MOMENTS = ("training", "model init")  # the whole run's peak, or the peak up to the end of model setup (Phase.LOAD)


@dataclass(frozen=True)
class Source:
    repo: str  # owner/name on GitHub
    path: str  # the file, or "pull/N" / "issues/N" for a thread
    commit: str = ""  # the file's commit the figure was read at (40 hex digits)
    issue: str = ""  # or the issue / pull request thread (URL) holding it
    where: str = ""  # the table or line inside the file

    @property
    def cite(self) -> str:
        at = f"@{self.commit[:10]}" if self.commit else self.issue
        return f"{self.repo} {self.path}{' ' + at if at else ''}{' (' + self.where + ')' if self.where else ''}"


@dataclass(frozen=True)
class Case:
    name: str
    source: Source
    setup: str  # the setup as the source states it
    measures: str  # one of MEASURES
    measured_by: str  # how the source got the figure (the function its logger calls)
    figure: float
    unit: str  # "GiB" or "GB" as the source prints it
    model: dict  # build_scenario's model table
    training: dict  # build_scenario's training table (knob values)
    device: str  # peakledger device profile
    budget_gib: float | None = None  # the card's capacity where no profile has it (H100 96 GB HBM2e)
    moment: str = "training"
    unstated: tuple[str, ...] = ()  # what the source leaves out: "what -> the value taken (from where)"
    pending: tuple[str, ...] = ()  # techniques not yet modelled, by the knob that will carry them
    mapping: str = ""  # where the scenario differs from the library's run
    notes: str = field(default="", compare=False)

    @property
    def published_bytes(self) -> float:
        return self.figure * UNITS[self.unit]

    @property
    def fully_stated(self) -> bool:
        return not self.unstated

    @property
    def modelled(self) -> bool:
        return not self.pending


# -- the models ----------------------------------------------------------------------------------------------
LLAMA3_8B = {"preset": "llama-3-8b"}  # Llama 3.1 8B has Llama 3 8B's shapes (rope scaling only differs)
LLAMA3_70B = {"preset": "llama-3-70b"}
# Llama-2-7b (meta-llama/Llama-2-7b-hf config.json): 32 layers, d 4096, 32 heads (no GQA), d_ff 11008, vocab 32000
LLAMA2_7B = {"preset": "llama-3-8b", "name": "llama-2-7b", "n_kv_head": 32, "d_ff": 11008, "vocab_size": 32000,
             "max_seq_len": 4096}

# -- the sources ---------------------------------------------------------------------------------------------
TITAN_H100 = "benchmarks/llama3_h100_202412_torchtitan.md"
TITAN_H100_COMMIT = "31a17bfdb70bab6f62a13d21816a5339b911d6e3"
TITAN_MEMORY = "torchtitan metrics.py DeviceMemoryMonitor: the 'memory:' log line is max_memory_reserved in GiB"
TITAN_UNSTATED = (
    "sequence length -> 8192 (torchtitan train_configs/llama3_8b.toml)",
    "selective AC flavour -> op (llama3_8b.toml selective_ac_option = 'op')",
    "precision -> FSDP2 MixedPrecisionPolicy(param bf16, reduce fp32) over fp32 parameters (torchtitan default)",
    "optimizer -> AdamW (llama3_8b.toml), fused (torchtitan's build_optimizers default)",
)
TITAN_MAPPING = ("precision bf16-mixed = bf16 parameter shards + fp32 master shards + fp32 Adam states: the same "
                 "16 bytes per parameter per rank / dp as fp32 shards + fp32 grads + states; the unsharded bf16 "
                 "all-gathers as FSDP2's; op-policy keeps every matmul output while torchtitan's op SAC "
                 "recomputes every second mm; no clip_grad_norm_ (max_norm 1.0) in the plain loop; one rank "
                 "simulated per rank class")
TITAN_8B = {"precision": "bf16-mixed", "optimizer": "adamw", "optimizer_impl": "fused", "micro_batch": 2,
            "seq_len": 8192, "checkpointing": "op-policy", "dp_engine": "fsdp2", "reduce_dtype": "fp32"}

TUNE_LORA_DOC = Source("pytorch/torchtune", "docs/source/tutorials/lora_finetune.rst",
                       "14b59e7a1d0115eb2df8a009f8b7d5c7c41241a4",
                       where="Trading off memory and model performance with LoRA: the peak-memory table")
TUNE_QLORA_DOC = "docs/source/tutorials/qlora_finetune.rst"
TUNE_QLORA_COMMIT = "0e44fed1e1683921cb03f989f6ba3cd0ee6c56f8"
TUNE_MEMORY = "torchtune utils memory stats: torch.cuda.max_memory_reserved(device) / 1e9 (GB)"
TUNE_LORA_SETUP = ("Llama2-7B, lora_finetune_single_device with llama2/7B_lora_single_device (batch size 2), "
                   "bf16, alpaca-cleaned; LoRA layers {layers}, rank {r}, alpha {alpha}")
TUNE_LORA_UNSTATED = (
    "sequence length -> 512 (alpaca_cleaned_dataset max_seq_len default; batches padded to the longest sample, "
    "the peak assumed at a full 512-token batch)",
    "which figure 'Peak Memory' is -> reserved (qlora_finetune.rst prints the same 15.57 GB as 'Peak memory "
    "reserved, training')",
    "activation checkpointing, optimizer -> on, torch.optim.AdamW foreach (7B_lora_single_device.yaml @04dc3801)",
)
TUNE_LORA_TRAINING = {"precision": "bf16", "optimizer": "adamw", "micro_batch": 2, "seq_len": 512,
                      "checkpointing": "full", "grad_accum": 64}
QV = ("q_proj", "v_proj")
ALL_BLOCK = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
LORA_OUTPUT_GAP = ("torchtune's 'all layers' also adapts the output projection (apply_lora_to_output): "
                   "peakledger's hand-written Llama takes LoRA on block linears only, so the lm_head adapter "
                   "(r x (4096 + 32000) parameters, its gradient, states and activations) is left out")
QLORA_MAPPING = ("torchtune quantizes with torchao's NF4Tensor (to_nf4, block 64, scalers double-quantized); "
                 "peakledger's nf4 is bitsandbytes Linear4bit with double quant: the same 4-bit base and "
                 "per-block scale sizes to within the quant-state bookkeeping; the model load is 'direct' (each "
                 "quantized weight allocated once), not torchtune's bf16 state dict quantized on the device")

QLORA_NOTE = ("the source's training figure (9.29 GB) is within 0.16 GB of its model-init figure (9.13 GB): the "
              "reserved peak is set while the model is built, where peakledger holds 4.27 GB; what torchtune's "
              "init held besides the NF4 weights then is not identified here (not tuned)")


def _titan(name, table, figure, world, *, compile_=False, float8=""):
    pending = (("compile with precision bf16-mixed (FSDP2 MixedPrecisionPolicy): compile=True",) if compile_
               else ())
    if float8:
        pending += (f"float8 training: fp8={float8}",)
    training = {**TITAN_8B, "world_size": world, **({"compile": True} if compile_ else {}),
                **({"fp8": float8} if float8 else {})}
    techniques = "FSDP" + (" + torch.compile" if compile_ else "") + (" + Float8" if float8 else "")
    return Case(
        name, Source("pytorch/torchtitan", TITAN_H100, TITAN_H100_COMMIT, where=f"{table}, row {techniques}"),
        f"{table}: 1D parallelism (FSDP), Llama 3.1 8B, {world} GPUs (H100 96 GB HBM2e, 500 W), local batch "
        f"size 2, global batch size {2 * world}, selective activation checkpointing; techniques: {techniques}; "
        "torch 1963fc8, torchao eab345c, torchtitan 9dec370; memory the maximum across GPUs, stable over training",
        "reserved", TITAN_MEMORY, figure, "GiB", LLAMA3_8B, training, "H100-80GB", budget_gib=95.6,
        unstated=TITAN_UNSTATED, pending=pending, mapping=TITAN_MAPPING)


def _lora_doc(name, layers, targets, r, alpha, figure, gap=""):
    return Case(
        name, TUNE_LORA_DOC, TUNE_LORA_SETUP.format(layers=layers, r=r, alpha=alpha), "reserved", TUNE_MEMORY,
        figure, "GB", LLAMA2_7B, {**TUNE_LORA_TRAINING, "lora_r": r, "lora_alpha": float(alpha),
                                  "lora_targets": targets},
        "A100-80GB", unstated=TUNE_LORA_UNSTATED + ("GPU -> A100 80GB (not stated; the GPU does not enter the "
                                                    "allocator's peak below capacity)",),
        mapping=gap)


TUNE_README = Source("pytorch/torchtune", "README.md", "0031bfb080bd35ec533c412df883cf2bf7bf7fe4",
                     where="Memory and training speed table")
TUNE_README_SETUP = ("Llama 3.1 {model}, {method}, runnable on {gpu}; batch size 2 (no gradient accumulation), "
                     "dataset packed to sequence length 2048, torch compile enabled; 'Peak Memory per GPU'")
TUNE_README_UNSTATED = (
    "which memory optimizations each row uses (activation checkpointing / offloading, optimizer, "
    "optimizer_in_bwd, loss) -> the recipe config's defaults at the README's time",
    "which figure 'Peak Memory per GPU' is (torchtune logs active, allocated and reserved) -> reserved",
)
TUNE_README_TRAINING = {"precision": "bf16", "micro_batch": 2, "seq_len": 2048, "compile": True,
                        "checkpointing": "full", "optimizer": "adamw", "optimizer_impl": "fused",
                        "chunked_loss": 8}
CHUNKED = "chunked cross-entropy (torchtune CEWithChunkedOutputLoss, 8 chunks): chunked_loss=8"


def _tune_readme(name, model, method, gpu, figure, device, training, pending, extra=()):
    return Case(
        name, TUNE_README, TUNE_README_SETUP.format(model=model, method=method, gpu=gpu), "reserved",
        "torchtune training/memory.py get_memory_stats (max_memory_reserved)", figure, "GiB",
        LLAMA3_8B if model == "8B" else LLAMA3_70B, {**TUNE_README_TRAINING, **training}, device,
        unstated=TUNE_README_UNSTATED + tuple(extra), pending=(CHUNKED, *pending))


AO_OPTIM = Source("pytorch/ao", "torchao/optim/README.md", "072500abcfbdec15a429eb53160c63fb92534b85",
                  where="Llama2-7B fine-tune table")
AO_OPTIM_SETUP = ("Fine-tune Llama2-7B on Alpaca, PyTorch 2.4, full BF16, 1 epoch, A100, fixed random seed, "
                  "torchtune 52d1b838; AdamW impl: {impl}")
AO_OPTIM_UNSTATED = (
    "batch size, sequence length, activation checkpointing, optimizer_in_bwd -> torchtune's "
    "llama2/7B_full_low_memory.yaml (batch 2, AC on, optimizer_in_bwd True, alpaca unpacked, no max_seq_len: "
    "512 taken)",
    "GB: 1e9 or 2^30 -> 1e9 (torchtune's logger at the time)",
)
AO_OPTIM_TRAINING = {"precision": "bf16", "micro_batch": 2, "seq_len": 512, "checkpointing": "full",
                     "optimizer_in_backward": True}


def _ao_optim(name, impl, figure, optimizer):
    pending = ("optimizer-in-backward: optimizer_in_backward=True",)
    if optimizer != "adamw":
        pending += (f"low-bit optimizer: optimizer={optimizer}",)
    return Case(name, AO_OPTIM, AO_OPTIM_SETUP.format(impl=impl), "allocated",
                "torchtune memory stats: torch.cuda.max_memory_allocated / 1e9", figure, "GB", LLAMA2_7B,
                {**AO_OPTIM_TRAINING, "optimizer": optimizer,
                 **({"optimizer_impl": "fused"} if optimizer == "adamw" else {})},
                "A100-80GB", unstated=AO_OPTIM_UNSTATED, pending=pending)


AO_FLOAT8 = Source("pytorch/ao", "torchao/float8/README.md", "9519bebbc397d60274982a74c084f9dff18e61a6",
                   where="Training benchmarks, NVIDIA H100 table")
AO_FLOAT8_SETUP = ("Single-node training on 8xH100 GPUs, batch size 1, sequence length 8192, steps 100, "
                   "torch.compile, FSDP2, per-op SAC (torchtitan 0.0.2, torch 2.7.0a0+gitb98af95, torchao "
                   "0.10.0+git890e0ac8); Llama3-8b; scaling: {scaling}")


def _ao_float8(name, scaling, figure, fp8=""):
    pending = ("compile with precision bf16-mixed (FSDP2 MixedPrecisionPolicy): compile=True",)
    if fp8:
        pending += (f"float8 training: fp8={fp8}",)
    return Case(name, AO_FLOAT8, AO_FLOAT8_SETUP.format(scaling=scaling), "reserved", TITAN_MEMORY, figure, "GB",
                LLAMA3_8B, {**TITAN_8B, "micro_batch": 1, "world_size": 8, "compile": True,
                            **({"fp8": fp8} if fp8 else {})}, "H100-80GB",
                unstated=("which figure 'Peak Memory (GB)' is -> torchtitan's max_memory_reserved, GiB printed "
                          "(the torchtitan log the benchmark script reads); GB taken as printed",
                          "H100 variant (80 GB or 96 GB) -> 80 GB"),
                pending=pending, mapping=TITAN_MAPPING)


CASES: tuple[Case, ...] = (
    # ---- modelled today ----
    _titan("torchtitan-8b-fsdp8", "Table 1", 82.4, 8),
    _titan("torchtitan-8b-fsdp128", "Table 3", 67.0, 128),
    _lora_doc("torchtune-lora-7b-qv-r8", "Q and V only", QV, 8, 16, 15.57),
    _lora_doc("torchtune-lora-7b-all-r8", "all layers", ALL_BLOCK, 8, 16, 15.87, LORA_OUTPUT_GAP),
    _lora_doc("torchtune-lora-7b-qv-r64", "Q and V only", QV, 64, 128, 15.86),
    _lora_doc("torchtune-lora-7b-all-r64", "all layers", ALL_BLOCK, 64, 128, 17.04, LORA_OUTPUT_GAP),
    Case("torchtune-qlora-7b-train",
         Source("pytorch/torchtune", TUNE_QLORA_DOC, TUNE_QLORA_COMMIT, where="LoRA vs QLoRA table, QLoRA row"),
         "QLoRA finetune of Llama2-7B, lora_finetune_single_device --config llama2/7B_qlora_single_device, "
         "Alpaca, single GPU; 'Peak memory reserved, training'",
         "reserved", TUNE_MEMORY, 9.29, "GB", LLAMA2_7B,
         {**TUNE_LORA_TRAINING, "grad_accum": 16, "optimizer_impl": "fused", "lora_r": 8, "lora_alpha": 16.0,
          "lora_targets": ALL_BLOCK, "quantize": "nf4"}, "A100-80GB",
         unstated=("LoRA targets, rank, batch size, AC, optimizer -> q,k,v,output_proj + MLP, rank 8, alpha 16, "
                   "batch 2, AC on, fused AdamW, grad accumulation 16 (7B_qlora_single_device.yaml @0031bfb0)",
                   TUNE_LORA_UNSTATED[0], "GPU -> A100 80GB (not stated)"),
         mapping=QLORA_MAPPING, notes=QLORA_NOTE),
    Case("torchtune-lora-7b-init-reserved",
         Source("pytorch/torchtune", TUNE_QLORA_DOC, TUNE_QLORA_COMMIT, where="LoRA vs QLoRA table, LoRA row"),
         "LoRA finetune of Llama2-7B, lora_finetune_single_device --config llama2/7B_lora_single_device; "
         "'Peak memory reserved, model init' (logged 'Memory Stats after model init')",
         "reserved", TUNE_MEMORY, 13.98, "GB", LLAMA2_7B,
         {**TUNE_LORA_TRAINING, "lora_r": 8, "lora_alpha": 16.0, "lora_targets": QV}, "A100-80GB",
         moment="model init", unstated=("GPU -> A100 80GB (not stated)",)),
    Case("torchtune-lora-7b-init-allocated",
         Source("pytorch/torchtune", TUNE_QLORA_DOC, TUNE_QLORA_COMMIT, where="example log 'Memory Stats after "
                                                                              "model init'"),
         "LoRA finetune of Llama2-7B, lora_finetune_single_device --config llama2/7B_lora_single_device; "
         "'GPU peak memory allocation' after model init",
         "allocated", "torchtune memory stats: torch.cuda.max_memory_allocated / 1e9", 13.96, "GB", LLAMA2_7B,
         {**TUNE_LORA_TRAINING, "lora_r": 8, "lora_alpha": 16.0, "lora_targets": QV}, "A100-80GB",
         moment="model init", unstated=("GPU -> A100 80GB (not stated)",),
         notes="the same log as the init-reserved case: a second figure of one run"),
    Case("torchtune-qlora-7b-init-reserved",
         Source("pytorch/torchtune", TUNE_QLORA_DOC, TUNE_QLORA_COMMIT, where="LoRA vs QLoRA table, QLoRA row"),
         "QLoRA finetune of Llama2-7B, lora_finetune_single_device --config llama2/7B_qlora_single_device; "
         "'Peak memory reserved, model init'",
         "reserved", TUNE_MEMORY, 9.13, "GB", LLAMA2_7B,
         {**TUNE_LORA_TRAINING, "grad_accum": 16, "optimizer_impl": "fused", "lora_r": 8, "lora_alpha": 16.0,
          "lora_targets": ALL_BLOCK, "quantize": "nf4"}, "A100-80GB", moment="model init",
         unstated=("LoRA targets -> q,k,v,output_proj + MLP (7B_qlora_single_device.yaml @0031bfb0)",
                   "GPU -> A100 80GB (not stated)"),
         mapping=QLORA_MAPPING, notes=QLORA_NOTE),
    # ---- pending: a technique peakledger does not simulate yet ----
    _titan("torchtitan-8b-fsdp8-compile", "Table 1", 77.0, 8, compile_=True),
    _titan("torchtitan-8b-fsdp8-compile-float8", "Table 1", 76.8, 8, compile_=True, float8="tensorwise"),
    _titan("torchtitan-8b-fsdp128-compile", "Table 3", 62.0, 128, compile_=True),
    _titan("torchtitan-8b-fsdp128-compile-float8", "Table 3", 61.8, 128, compile_=True, float8="tensorwise"),
    _ao_float8("torchao-float8-8b-bf16", "none (bfloat16)", 47.65),
    _ao_float8("torchao-float8-8b-tensorwise", "tensorwise with float8 all-gather", 47.77, "tensorwise"),
    _ao_float8("torchao-float8-8b-rowwise", "rowwise with bfloat16 all-gather", 47.79, "rowwise"),
    Case("torchtitan-8b-h200-32gpu-float8",
         Source("pytorch/torchtitan", "benchmarks/llama3_8b_h200_2025-06_torchtitan.md",
                "bcdeaa37c92d1eaceeec3351e7ac81be6a1488af", where="Results, NUM_NODES 4"),
         "Llama 3.1 8B, 4 hosts x 8 H200, torchtitan llama3_8b.toml, local batch size 2, compile, float8 "
         "converters with FSDP float8 all-gather, precomputed float8 dynamic scale, force_recompute_fp8_weight_in_"
         "bwd; Memory(GiB) sampled at iteration 100; torch 2.8.0a0+5228986c39, torchao 0afa4c1, torchtitan "
         "e7c0cae", "reserved", TITAN_MEMORY, 47.96, "GiB", LLAMA3_8B,
         {**TITAN_8B, "world_size": 32, "compile": True, "fp8": "tensorwise"}, "H200-141GB",
         unstated=TITAN_UNSTATED,
         pending=("compile with precision bf16-mixed (FSDP2 MixedPrecisionPolicy): compile=True",
                  "float8 training with float8 all-gather: fp8=tensorwise"), mapping=TITAN_MAPPING),
    _ao_optim("torchao-optim-7b-fused-adamw", "PyTorch (fused)", 51.6, "adamw"),
    _ao_optim("torchao-optim-7b-bnb-8bit", "bnb 8-bit", 39.3, "adamw-8bit-bnb"),
    _ao_optim("torchao-optim-7b-ao-8bit", "ao 8-bit", 39.1, "adamw-8bit-torchao"),
    _ao_optim("torchao-optim-7b-ao-4bit", "ao 4-bit", 33.2, "adamw-4bit"),
    _tune_readme("torchtune-readme-8b-full-4090", "8B", "Full finetune", "1x 4090", 18.9, "RTX-4090-24GB",
                 {"optimizer": "paged-adamw-8bit", "optimizer_impl": "foreach", "optimizer_in_backward": True,
                  "activation_offload": "streams"},
                 ("paged 8-bit AdamW: optimizer=paged-adamw-8bit", "optimizer-in-backward: "
                  "optimizer_in_backward=True", "activation offload: activation_offload=streams")),
    _tune_readme("torchtune-readme-8b-lora-4090", "8B", "LoRA", "1x 4090", 16.2, "RTX-4090-24GB",
                 {"lora_r": 8, "lora_alpha": 16.0, "lora_targets": ("q_proj", "v_proj", "o_proj"),
                  "activation_offload": "streams"},
                 ("activation offload: activation_offload=streams",),
                 ("LoRA targets, rank -> q, v, output_proj, rank 8, alpha 16 (llama3_1/8B_lora_single_device)",)),
    _tune_readme("torchtune-readme-8b-lora-a6000", "8B", "LoRA", "1x A6000", 30.3, "RTX-A6000-48GB",
                 {"lora_r": 8, "lora_alpha": 16.0, "lora_targets": ("q_proj", "v_proj", "o_proj")}, (),
                 ("LoRA targets, rank -> q, v, output_proj, rank 8, alpha 16 (llama3_1/8B_lora_single_device)",)),
    _tune_readme("torchtune-readme-8b-qlora-4090", "8B", "QLoRA", "1x 4090", 7.4, "RTX-4090-24GB",
                 {"lora_r": 8, "lora_alpha": 16.0, "lora_targets": ALL_BLOCK, "quantize": "nf4"}, (),
                 ("LoRA targets, rank -> q, k, v, output_proj + MLP, rank 8, alpha 16 "
                  "(llama3_1/8B_qlora_single_device.yaml @0b3e04ad)",)),
    _tune_readme("torchtune-readme-70b-lora-8xa100", "70B", "LoRA", "8x A100", 27.6, "A100-80GB",
                 {"world_size": 8, "dp_engine": "fsdp2", "lora_r": 16, "lora_alpha": 32.0,
                  "lora_targets": ("q_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")}, (),
                 ("LoRA targets, rank -> q, v, output_proj + MLP, rank 16, alpha 32 (llama3_1/70B_lora.yaml "
                  "@0502cc55)",)),
    Case("torchtune-pr961-7b-full-low-memory",
         Source("pytorch/torchtune", "pull/961", issue="https://github.com/pytorch/torchtune/pull/961",
                where="description"),
         "tune run full_finetune_single_device --config recipes/configs/llama2/7B_full_low_memory.yaml "
         "batch_size=4, every input padded to seq_len=2048; '20.2 peak memory allocated (and similar for "
         "reserved)'", "allocated", "torchtune memory stats: torch.cuda.max_memory_allocated / 1e9", 20.2, "GB",
         LLAMA2_7B, {"precision": "bf16", "micro_batch": 4, "seq_len": 2048, "checkpointing": "full",
                     "optimizer": "paged-adamw-8bit", "optimizer_in_backward": True},
         "A100-80GB",
         unstated=("GPU -> A100 80GB (the thread's other figure, 22.3, is from an A100; this one's GPU unstated)",
                   "optimizer, optimizer_in_bwd at that commit -> bitsandbytes PagedAdamW8bit + optimizer_in_bwd "
                   "(7B_full_low_memory.yaml of the time)"),
         pending=("paged 8-bit AdamW: optimizer=paged-adamw-8bit",
                  "optimizer-in-backward: optimizer_in_backward=True")),
)
