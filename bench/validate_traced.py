"""The traced describer (models/traced/) against real CPU runs: 17 HF model types from tiny config dicts and
nn.Modules of our own (examples/modules/), each 2 training steps in fp32 and bf16 autocast, with AdamW
and with SGD with momentum, under the project's exact allocation tracker (`peakledger.validation.validate`).

    python bench/validate_traced.py            # print the table
    python bench/validate_traced.py --write    # and write its section of bench/VALIDATION.md
    python bench/validate_traced.py --only t5  # one model type (its 4 rows), printed only

"before" is what the hand-written describers give for the same model: `from_hf_config` (gpt2, llama,
mistral, qwen2, mixtral; LoRA through the setup's lora_* fields), its simulated peak against the same
measured peak, or the reason they refuse it. Static rows = parameter, gradient and optimizer-state bytes
when step 1's optimizer phase ends.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
import warnings

from sections import replace_section  # bench/sections.py, beside this script

from peakledger import validation
from peakledger.analysis.validate import static_rows
from peakledger.models.config import ConfigError, TrainingSetup
from peakledger.models.traced import from_hf_dict, from_module_spec
from peakledger.models.training import describe
from peakledger.models.transformer.hf_config import from_hf_config
from peakledger.scenario import Scenario
from peakledger.simulator.engine import simulate
from peakledger.simulator.timeline import timeline

SECTION = "## Traced describer: any HF model type and your own modules (real CPU runs)"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODULES = os.path.join(ROOT, "examples", "modules")

H, INTER, L, NH, KV, V = 64, 128, 2, 4, 2, 256
DEC = dict(hidden_size=H, intermediate_size=INTER, num_hidden_layers=L, num_attention_heads=NH, num_key_value_heads=KV,
           vocab_size=V, max_position_embeddings=128)
HF = {
    "gpt2": dict(model_type="gpt2", n_embd=H, n_layer=L, n_head=NH, vocab_size=V, n_positions=128),
    "llama": dict(model_type="llama", **DEC),
    "mistral": dict(model_type="mistral", **DEC),
    "qwen2": dict(model_type="qwen2", **DEC),
    "gemma": dict(model_type="gemma", head_dim=16, **DEC),
    "gemma2": dict(model_type="gemma2", head_dim=16, **DEC),
    "phi3": dict(model_type="phi3", pad_token_id=0, **DEC),
    "gpt_neox": dict(model_type="gpt_neox", hidden_size=H, intermediate_size=INTER, num_hidden_layers=L,
                     num_attention_heads=NH, vocab_size=V, max_position_embeddings=128),
    "opt": dict(model_type="opt", hidden_size=H, ffn_dim=INTER, num_hidden_layers=L, num_attention_heads=NH,
                vocab_size=V, max_position_embeddings=128, word_embed_proj_dim=H),
    "falcon": dict(model_type="falcon", hidden_size=H, num_hidden_layers=L, num_attention_heads=NH, vocab_size=V),
    "starcoder2": dict(model_type="starcoder2", **DEC),
    "olmo": dict(model_type="olmo", **DEC),
    "bert": dict(model_type="bert", hidden_size=H, intermediate_size=INTER, num_hidden_layers=L, num_attention_heads=NH,
                 vocab_size=V, max_position_embeddings=128),
    "t5": dict(model_type="t5", d_model=H, d_ff=INTER, num_layers=L, num_heads=NH, d_kv=16, vocab_size=V,
               decoder_start_token_id=0, pad_token_id=0),
    "vit": dict(model_type="vit", hidden_size=H, intermediate_size=INTER, num_hidden_layers=L, num_attention_heads=NH,
                image_size=64, patch_size=8, num_labels=10),
    "whisper": dict(model_type="whisper", d_model=H, encoder_layers=L, decoder_layers=L, encoder_attention_heads=NH,
                    decoder_attention_heads=NH, encoder_ffn_dim=INTER, decoder_ffn_dim=INTER, vocab_size=V,
                    pad_token_id=0, decoder_start_token_id=1, num_mel_bins=16, max_source_positions=64,
                    max_target_positions=64),
    "mixtral": dict(model_type="mixtral", num_local_experts=4, num_experts_per_tok=2, **DEC),
    "qwen2_moe": dict(model_type="qwen2_moe", moe_intermediate_size=32, shared_expert_intermediate_size=64,
                      num_experts=4, num_experts_per_tok=2, **DEC),
    "deepseek_v3": dict(model_type="deepseek_v3", hidden_size=H, intermediate_size=INTER, moe_intermediate_size=32,
                        n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2, n_group=1, topk_group=1,
                        num_hidden_layers=L, first_k_dense_replace=1, num_attention_heads=NH, num_key_value_heads=NH,
                        q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
                        vocab_size=V, max_position_embeddings=128),
}
# own modules: row label -> (factory spec under examples/modules, hand-written "before": None = refused, or
# (HF config, LoRA setup fields) for the peft factories)
LORA_LLAMA = dict(model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=256, max_position_embeddings=128)
LORA_GPT2 = dict(model_type="gpt2", n_embd=64, n_layer=2, n_head=4, vocab_size=256, n_positions=128)
MODULE_ROWS = {
    "cnn (BatchNorm)": ("cnn.py:factory", None),
    "nn.TransformerEncoder": ("transformer_encoder.py:factory", None),
    "nn.TransformerEncoder, layers not cloned": ("transformer_encoder.py:fresh_layers", None),
    "tied weights": ("tied.py:factory", None),
    "tied weights, loss closes over targets": ("tied.py:closure_loss", None),
    "peft LoRA llama": ("lora.py:llama", (LORA_LLAMA, dict(lora_r=8, lora_alpha=16.0, lora_dropout=0.0,
                                                            lora_targets=("q_proj", "k_proj", "v_proj", "o_proj")))),
    "peft LoRA gpt2": ("lora.py:gpt2", (LORA_GPT2, dict(lora_r=8, lora_alpha=16.0, lora_dropout=0.0,
                                                         lora_targets=("c_attn", "c_fc")))),
}
PRECISIONS = ("fp32", "bf16-autocast")
OPTIMIZERS = ("adamw", "sgd-momentum")
SHAPE = dict(micro_batch=4, seq_len=64)
SHAPE_NOTE = {"vit": "B=4, 64x64 images (64 patches)", "whisper": "B=4, 128 mel frames, 64 label tokens",
              "cnn (BatchNorm)": "B=4, 3x32x32 images"}
TOLERANCE = 0.005


@dataclasses.dataclass
class Row:
    label: str
    precision: str
    optimizer: str
    measured: int = 0
    predicted: int = 0
    error: float = 0.0
    worst: tuple[str, float] = ("", 0.0)
    other: tuple[str, float] = ("", 0.0)  # the worst other phase (optimizer, zero_grad)
    static_exact: bool = False
    before: str = ""
    seconds: float = 0.0
    failed: str = ""

    @property
    def ok(self) -> bool:
        return not self.failed and abs(self.error) <= TOLERANCE and self.static_exact


def short(e: Exception) -> str:
    text = str(e).split(";")[0]
    if isinstance(e, ConfigError) and ": " in text:
        text = text.split(": ", 1)[1]
    return text.replace("|", "/")[:80]


def before_of(hf: dict | None, setup: TrainingSetup, measured: int, refusal: str) -> str:
    if hf is None:
        return f"refused: {refusal}"
    try:
        config = from_hf_config(dict(hf), "before")
        peak = timeline(simulate(describe(config, setup, "cpu"))).peak().bytes
    except ConfigError as e:
        return f"refused: {short(e)}"
    return f"{(peak - measured) / measured:+.2%}"


def run_row(label: str, model, setup: TrainingSetup, before) -> Row:
    row = Row(label, setup.precision.name, setup.optimizer.name)
    t0 = time.perf_counter()
    try:
        v, measured, simulated = validation.validate(Scenario(name=label, model=model, setup=setup, device="cpu"))
    except Exception as e:  # a row that cannot run is a row of the table, named
        row.failed = f"{type(e).__name__}: {short(e)}"
        row.seconds = time.perf_counter() - t0
        return row
    phases = [p for p in v.phases if p.label.startswith(("forward", "backward"))]
    worst = max(phases, key=lambda p: abs(p.error))
    row.measured, row.predicted, row.error = v.overall.measured, v.overall.predicted, v.overall.error
    row.worst = (worst.label, worst.error)
    others = [p for p in v.phases if p not in phases]
    if others:
        other = max(others, key=lambda p: abs(p.error))
        row.other = (other.label, other.error)
    row.static_exact = static_rows(measured) == static_rows(simulated)
    row.before = before(row.measured)
    row.seconds = time.perf_counter() - t0
    return row


def rows_for(label: str, precisions=PRECISIONS, optimizers=OPTIMIZERS):
    for precision in precisions:
        for optimizer in optimizers:
            setup = TrainingSetup(steps=2, precision=precision, optimizer=optimizer, **SHAPE)
            if label in HF:
                model = from_hf_dict(HF[label], f"tiny-{label}")
                yield run_row(label, model, setup, lambda m, s=setup: before_of(
                    HF[label], s, m, ""))
            else:
                spec, hand = MODULE_ROWS[label]
                model = from_module_spec(os.path.relpath(os.path.join(MODULES, spec), os.getcwd()))
                if hand is None:
                    yield run_row(label, model, setup, lambda m: "refused: an nn.Module (no hand-written describer)")
                else:
                    hf, lora = hand
                    yield run_row(label, model, setup, lambda m, s=setup.replace(**lora): before_of(
                        hf, s, m, ""))


def table(rows: list[Row]) -> list[str]:
    lines = ["| model | precision | optimizer | measured peak B | predicted peak B | error | worst fwd/bwd phase "
             "| static rows exact | before (hand-written) |", "|---|---|---|---:|---:|---:|---|---|---|"]
    for r in rows:
        if r.failed:
            lines.append(f"| {r.label} | {r.precision} | {r.optimizer} | FAILED: {r.failed} | | | | | |")
            continue
        lines.append(f"| {r.label} | {r.precision} | {r.optimizer} | {r.measured:,} | {r.predicted:,} | "
                     f"{r.error:+.3%} | {r.worst[0]} {r.worst[1]:+.3%} | {'yes' if r.static_exact else 'NO'} | "
                     f"{r.before} |")
    return lines


WHATIF_MODEL = dict(model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, vocab_size=256, max_position_embeddings=128)
WHATIFS = [("plain", {}), ("checkpointing full (every decoder layer)", dict(checkpointing="full")),
           ("checkpointing every-k 2", dict(checkpointing="every-k", checkpoint_every_k=2)),
           ("checkpointing op-policy (torch SAC)", dict(checkpointing="op-policy")),
           ("gradient accumulation 2", dict(grad_accum=2)),
           ("LoRA r 8, dropout 0.1 (peft)", dict(lora_r=8, lora_dropout=0.1)),
           ("FSDP2, 2 gloo ranks", dict(world_size=2, dp_engine="fsdp2")),
           ("DDP, 2 gloo ranks", dict(world_size=2, dp_engine="ddp"))]


def run_whatifs() -> list[tuple[str, str, int, int, float, float]]:
    """(what, rank, measured, predicted, error, worst forward/backward phase error) per real run of a traced HF
    Llama (describer traced) under each what-if."""
    from peakledger.validation import validate_ranks
    model = from_hf_dict(WHATIF_MODEL, "llama")
    out = []
    for what, changes in WHATIFS:
        setup = TrainingSetup(**{**dict(SHAPE, steps=2, precision="fp32"), **changes})
        sc = Scenario(name=what, model=model, setup=setup, device="cpu")
        runs = validate_ranks(sc)[0] if setup.mesh.world_size > 1 else [validation.validate(sc)[:2]]
        for k, (v, _) in enumerate(runs):
            worst = max((abs(p.error) for p in v.phases if p.label.startswith(("forward", "backward"))), default=0.0)
            out.append((what, str(k) if setup.mesh.world_size > 1 else "-", v.overall.measured, v.overall.predicted,
                        v.overall.error, worst))
        print(f"what-if {what}: {[f'{r[4]:+.4%}' for r in out if r[0] == what]}", flush=True)
    return out


def whatif_lines(whatifs) -> list[str]:
    if not whatifs:
        return []
    lines = ["### What-ifs on a traced model (real CPU runs)", "",
             "A tiny HF Llama (2 layers, hidden 64) given as a config and traced (`from_hf_dict`), micro-batch 4 x 64 "
             "tokens, fp32, AdamW, 2 steps; each what-if applied by the replay to the one traced tape and run for "
             "real the same way (checkpointing: each decoder layer's forward under `torch.utils.checkpoint`, "
             "`use_reentrant=False`, or torch's selective checkpoint contexts; LoRA: `peft.get_peft_model`; FSDP2: "
             "`fully_shard` per decoder layer then the root, and DDP, on 2 gloo processes, every rank measured).", "",
             "| what-if | rank | measured | predicted | error | worst forward/backward phase |",
             "|---|---|---:|---:|---:|---:|"]
    for what, rank, measured, predicted, error, worst in whatifs:
        lines.append(f"| {what} | {rank} | {measured:,} | {predicted:,} | {error:+.3%} | {worst:.3%} |")
    return lines + [""]


def render(rows: list[Row], seconds: float, command: str, whatifs=()) -> str:
    hf = [r for r in rows if r.label in HF]
    mods = [r for r in rows if r.label not in HF]
    exact = sum(r.measured == r.predicted and r.static_exact and not r.failed for r in rows)
    ok = sum(r.ok for r in rows)
    worst = max((r for r in rows if not r.failed), key=lambda r: abs(r.error))
    zero = [r for r in rows if not r.failed and r.other[0].startswith("zero_grad") and r.other[1]]
    zworst = max(zero, key=lambda r: abs(r.other[1]), default=None)
    refused = sorted({r.label for r in hf if r.before.startswith("refused")})
    return "\n".join([
        SECTION, "",
        "The traced describer (models/traced/: the model run once on fake tensors, its aten ops, storages, saves "
        "and autograd nodes recorded into the tape) against the same program run for real on the CPU (random "
        "weights, 2 training steps, exact allocation tracker, `peakledger.validation.validate`). HF rows: "
        f"`from_hf_dict` on tiny configs of {len(HF)} model types (2 layers, hidden 64, 4 heads, vocab 256; "
        "transformers' own classes, nothing downloaded), micro-batch 4 x 64 tokens "
        f"(vit: {SHAPE_NOTE['vit']}; whisper: {SHAPE_NOTE['whisper']}). Module rows: `from_module_spec` on the "
        "factories in examples/modules/ (cnn: "
        f"{SHAPE_NOTE['cnn (BatchNorm)']}; the others micro-batch 4 x 64 tokens). fp32 and bf16 autocast, AdamW "
        f"and SGD with momentum; {len(rows)} real CPU runs in {seconds:.0f} s on {os.cpu_count()} cores. "
        f"Regenerate with `{command}`.", "",
        f"**Summary: {ok}/{len(rows)} rows within {TOLERANCE:.1%} of the measured peak with static rows exact "
        f"({exact} exact to the byte; HF types {sum(r.ok for r in hf)}/{len(hf)}, modules "
        f"{sum(r.ok for r in mods)}/{len(mods)}); worst {worst.error:+.3%} ({worst.label}, {worst.precision}, "
        f"{worst.optimizer}). Before, the hand-written describers refused {len(refused)} of the {len(HF)} HF "
        "types.**", "",
        *table(rows), "",
        "- Open (the describer), within tolerance. mixtral (-0.05%): the measured run keeps "
        "`model.layers.N.mlp.gate.clone` (2,048 B per layer, the router's top-k values: 256 tokens x 2 x fp32) "
        "alive through the forward, the recording frees it right after it is made. Most likely the copy autograd "
        "makes of the top-k values before `router_top_value /= router_top_value.sum(...)` "
        "(`MixtralTopKRouter.forward`) overwrites them in place; the real run keeps it to backward.",
        "- Open (the describer), within tolerance. bf16 autocast with a BatchNorm (cnn, -0.016%): the measured "
        "run's `native_batch_norm` statistics (save_mean, save_invstd) of the 64-channel BatchNorm are 256 B "
        "each (fp32), the recording has 64 B each; bert under bf16 autocast (-0.019%) is a difference of "
        "the same size, not traced further.",
        "- Closed: a tensor the loss closes over (`tied.py:closure_loss`: targets captured by `loss_fn`, not in "
        "the batch) lives for the whole run in the real run; the recording now keeps every forward storage that "
        "outlives the caller's output as a buffer (was -0.12% to -0.15%). `nn.TransformerEncoder`'s deep-copied "
        "layers (parameters of another fake mode) are adopted by the tracing mode (was +4.1% / +4.4%).",
        f"- Open (the replay's zero_grad). In {len(zero)}/{len(rows)} rows the zero_grad phase's own peak "
        f"differs{f' (worst {zworst.other[1]:+.1%}, {zworst.label})' if zworst else ''}: torch's "
        "`zero_grad(set_to_none=True)` drops the gradients in parameter order (`named_parameters`), the "
        "simulation in another order (tied weights: the reverse), and a phase's peak is the level after each of its "
        "events, so it "
        "depends on which gradient goes first. Overall and forward/backward peaks are not affected (zero_grad "
        "only frees).",
        "- peft under FakeTensorMode: `get_peft_model` moves each adapter with `Module.to(device, dtype)`, which "
        "cannot swap fake parameters; the describer runs factories and peft with such moves done by hand "
        "(models/traced/model.py `fake_module_moves`).", "",
        *whatif_lines(whatifs)])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--write", action="store_true", help="write the section of bench/VALIDATION.md")
    ap.add_argument("--only", metavar="TYPE", help=f"one model: {', '.join(list(HF) + list(MODULE_ROWS))}")
    ap.add_argument("--precision", choices=PRECISIONS)
    ap.add_argument("--optimizer", choices=OPTIMIZERS)
    args = ap.parse_args()
    labels = list(HF) + list(MODULE_ROWS)
    if args.only is not None:
        if args.only not in labels:
            ap.error(f"--only: unknown {args.only!r}; one of {', '.join(labels)}")
        labels = [args.only]
    if (args.only or args.precision or args.optimizer) and args.write:
        ap.error("--write needs the whole table (no --only / --precision / --optimizer)")
    warnings.filterwarnings("ignore")
    precisions = (args.precision,) if args.precision else PRECISIONS
    optimizers = (args.optimizer,) if args.optimizer else OPTIMIZERS
    t0 = time.perf_counter()
    rows = []
    for label in labels:
        for r in rows_for(label, precisions, optimizers):
            rows.append(r)
            state = f"FAILED {r.failed}" if r.failed else (
                f"{r.error:+8.4%}  worst {r.worst[0]} {r.worst[1]:+.4%}  static {'ok ' if r.static_exact else 'BAD'}  "
                f"before {r.before}")
            print(f"{'ok ' if r.ok else 'OFF'} {r.label:40} {r.precision:13} {r.optimizer:12} "
                  f"{state}  {r.seconds:.1f}s", flush=True)
    whatifs = run_whatifs() if args.only is None and not (args.precision or args.optimizer) else []
    seconds = time.perf_counter() - t0
    section = render(rows, seconds, "python bench/validate_traced.py --write", whatifs)
    print()
    print(section)
    if args.write:
        replace_section(SECTION, section)
        print(f"wrote {SECTION[3:]!r} into bench/VALIDATION.md")
    return 0 if all(r.ok for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
