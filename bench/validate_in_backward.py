"""Optimizer-in-backward vs the simulator: real CPU runs of torchtune 0.6.1's scheme (one optimizer per parameter,
`register_optim_in_bwd_hooks`' post-accumulate-grad hook `opt.step(); opt.zero_grad()`: traces/reference/build.py
`InBackwardOptimizers`) against the simulation of the same scenario (`--optimizer-in-backward`).

    python bench/validate_in_backward.py

Each config runs 3 real training steps under the exact allocation tracker, once with the optimizer in backward and
once without. Checked per config: the overall peak within 0.5%; every backward phase off by exactly what the same
config's backward is off without it (the in-backward ops add no error of their own: states, update temporaries and
freed gradients land where torch's hooks put them); the load and forward phases the same as without it; and the
saving, measured and predicted. Also the simulated Llama-3-8B full fine-tune on one H100 with and without it.
Writes the "Optimizer in backward and chunked loss (real CPU runs)" section of bench/VALIDATION.md.
"""

from __future__ import annotations

import platform
import sys
import time

from sections import replace_section  # bench/sections.py, beside this script

from peakledger import build_scenario
from peakledger.api import run
from peakledger.validation import validate

SECTION = "## Optimizer in backward and chunked loss (real CPU runs)"
CASES = [  # (preset, optimizer, impl, precision)
    ("tiny", "adamw", "foreach", "fp32"),
    ("tiny", "adamw", "for-loop", "fp32"),
    ("tiny", "adamw", "for-loop", "bf16-autocast"),
    ("tiny", "amsgrad", "fused", "bf16"),
    ("tiny", "sgd-momentum", "foreach", "fp32"),
    ("tiny-llama", "adamw", "foreach", "fp32"),
    ("tiny-llama", "adamw", "for-loop", "bf16"),
    ("tiny-llama", "adagrad", "foreach", "bf16"),
    ("tiny-mlp", "adamw", "foreach", "fp32"),
    ("tiny-mlp", "rmsprop", "for-loop", "bf16"),
]
GPU = ("llama-3-8b", dict(precision="bf16", seq_len=2048, micro_batch=1, checkpointing="full"))
CHUNKED = [  # (preset, precision, micro_batch, chunks)
    ("tiny", "fp32", 2, 4), ("tiny", "fp32", 2, 8), ("tiny", "bf16", 2, 4), ("tiny", "fp32", 1, 4),
    ("tiny-llama", "fp32", 2, 8), ("tiny-llama", "bf16", 2, 2), ("tiny-llama", "bf16", 1, 4),
]
GPU_CHUNKED = ("llama-3-8b", dict(precision="bf16", seq_len=8192, micro_batch=1, checkpointing="full"))


def training(preset: str, optimizer: str, impl: str, precision: str, in_backward: bool) -> dict:
    out = dict(micro_batch=2, seq_len=32, steps=3, optimizer=optimizer, optimizer_impl=impl, precision=precision,
               optimizer_in_backward=in_backward)
    if preset == "tiny-mlp":
        out.pop("seq_len")
    return out


def gaps(v, prefixes) -> dict[str, int]:
    return {p.label: p.predicted - p.measured for p in v.phases if p.label.startswith(prefixes)}


def run_case(case) -> dict:
    preset = case[0]
    plain, _, _ = validate(build_scenario({"preset": preset}, training(*case, False), {"device": "cpu"}))
    v, _, _ = validate(build_scenario({"preset": preset}, training(*case, True), {"device": "cpu"}))
    return {"label": ", ".join(case), "v": v, "plain": plain,
            "backward_same": gaps(v, ("backward",)) == gaps(plain, ("backward",)),
            "load_forward_same": {k: (p.measured, p.predicted) for k, p in
                                  ((p.label, p) for p in v.phases if p.label.startswith(("load", "forward")))}
            == {k: (p.measured, p.predicted) for k, p in
                ((p.label, p) for p in plain.phases if p.label.startswith(("load", "forward")))},
            "no_optimizer_phase": not any(p.label.startswith(("optimizer", "zero_grad")) for p in v.phases)}


def table(rows: list[dict]) -> list[str]:
    lines = ["| preset, optimizer, impl, precision | steady peak without, measured / predicted B | steady peak in "
             "backward, measured / predicted B | saving measured / predicted | error | backward gaps as without |",
             "|---|---:|---:|---:|---:|---|"]
    for r in rows:
        v, p = r["v"], r["plain"]
        saved_m, saved_p = p.steady.measured - v.steady.measured, p.steady.predicted - v.steady.predicted
        lines.append(f"| {r['label']} | {p.steady.measured:,} / {p.steady.predicted:,} | {v.steady.measured:,} / "
                     f"{v.steady.predicted:,} | {saved_m:,} / {saved_p:,} | {v.overall.error:+.4%} | "
                     f"{'yes' if r['backward_same'] else 'NO'} |")
    return lines


def gpu_lines() -> list[str]:
    model, base = GPU
    gib = 2**30
    lines = ["| scenario (simulated, H100-80GB) | optimizer in backward | steady peak | first-step peak | step time |",
             "|---|---|---:|---:|---:|"]
    for ib in (False, True):
        report = run(build_scenario({"preset": model}, dict(base, optimizer_in_backward=ib)))
        pk = report.peaks
        lines.append(f"| {model}, pure bf16, seq 2048, full ckpt, AdamW foreach | {'yes' if ib else 'no'} | "
                     f"{pk.steady.bytes / gib:.2f} GiB | {pk.first_step.bytes / gib:.2f} GiB | "
                     f"{report.time_per_step_s:.2f} s |")
    return lines


def chunked_case(case) -> dict:
    preset, precision, mb, n = case
    base = dict(micro_batch=mb, seq_len=32, steps=2, precision=precision)
    whole, _, _ = validate(build_scenario({"preset": preset}, base, {"device": "cpu"}))
    v, _, _ = validate(build_scenario({"preset": preset}, dict(base, chunked_loss=n), {"device": "cpu"}))
    return {"label": f"{preset}, {precision}, micro-batch {mb}, {n} chunks", "v": v, "whole": whole,
            "forward": gaps(v, ("forward",)), "backward": gaps(v, ("backward",)),
            "forward_exact": all(g == 0 for g in gaps(v, ("forward",)).values())}


def chunked_table(rows: list[dict]) -> list[str]:
    lines = ["| preset, precision, micro-batch, chunks | forward peak step 2, measured / predicted B | backward peak "
             "step 2, measured / predicted B | overall, measured / predicted B | error | whole-loss overall, "
             "measured / predicted B |", "|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        v, w = r["v"], r["whole"]
        f = next(p for p in v.phases if p.label == "forward step 2")
        b = next(p for p in v.phases if p.label == "backward step 2")
        lines.append(f"| {r['label']} | {f.measured:,} / {f.predicted:,} | {b.measured:,} / {b.predicted:,} | "
                     f"{v.overall.measured:,} / {v.overall.predicted:,} | {v.overall.error:+.4%} | "
                     f"{w.overall.measured:,} / {w.overall.predicted:,} |")
    return lines


def chunked_gpu_lines() -> list[str]:
    model, base = GPU_CHUNKED
    gib = 2**30
    lines = ["| scenario (simulated, H100-80GB) | loss | steady peak | forward peak step 2 | backward peak step 2 |",
             "|---|---|---:|---:|---:|"]
    for n in (0, 8):
        report = run(build_scenario({"preset": model}, dict(base, chunked_loss=n)))
        phases = {(p.step, p.phase.value): p.allocated for p in report.phases}
        fwd, bwd = phases.get((2, "forward")), phases.get((2, "backward"))
        loss = f"{n} chunks" if n else "whole F.cross_entropy"
        lines.append(f"| {model}, pure bf16, seq 8192, full ckpt | {loss} | "
                     f"{report.peaks.steady.bytes / gib:.2f} GiB | {fwd / gib:.2f} GiB | {bwd / gib:.2f} GiB |")
    return lines


def render(rows: list[dict], seconds: float) -> str:
    n = len(rows)
    within = sum(abs(r["v"].overall.error) <= 0.005 for r in rows)
    same = sum(r["backward_same"] for r in rows)
    lf = sum(r["load_forward_same"] for r in rows)
    empty = sum(r["no_optimizer_phase"] for r in rows)
    worst = max(abs(r["v"].overall.error) for r in rows)
    return "\n".join([
        SECTION, "",
        "### Optimizer in backward (`--optimizer-in-backward`)", "",
        "torchtune 0.6.1 (torchtune/training/memory.py `register_optim_in_bwd_hooks`): one optimizer per parameter, "
        "and a post-accumulate-grad hook on each that calls `opt.step(); opt.zero_grad()`; its recipes refuse "
        "gradient accumulation and clipping with it (recipes/full_finetune_distributed.py), and so does peakledger "
        "(`grad_accum`, `loop hf-trainer`: one-line errors, exit 2). The real program is traces/reference/build.py "
        "`InBackwardOptimizers` (the hook as torchtune writes it); the simulation runs each parameter's states "
        "(step 1), update temporaries (one parameter's) and zero_grad in the backward right after the node that "
        "finished its gradient (models/replay/grads.py `grads_ready`, models/optimizer_step.py `InBackward`; a "
        "linear's bias is stepped before its weight, as autograd's ready queue runs them). Real CPU runs, 3 steps, "
        f"micro-batch 2, seq 32, exact allocation tracker, {n} configs each run with and without it, "
        f"{seconds:.1f} s on {platform.machine()}. Regenerate with `python bench/validate_in_backward.py`.", "",
        f"**Summary: overall peak within 0.5% in {within}/{n} (worst {worst:.4%}); every backward phase off by "
        f"exactly what the same config is off without the optimizer in backward in {same}/{n} (the in-backward "
        f"states, temporaries and freed gradients add no error); load and forward phases identical to the runs "
        f"without it in {lf}/{n}; no optimizer or zero_grad phase with memory of its own in {empty}/{n}.**", "",
        *table(rows), "",
        *gpu_lines(), "",
    ])


def chunked_render(rows: list[dict], seconds: float) -> str:
    n = len(rows)
    fwd = sum(r["forward_exact"] for r in rows)
    bwd = [g for r in rows for g in r["backward"].values()]
    within = sum(abs(r["v"].overall.error) <= 0.005 for r in rows)
    return "\n".join([
        "### Chunked cross-entropy (`--chunked-loss N`)", "",
        "torchtune 0.6.1: the model's output projection chunk by chunk (torchtune/modules/transformer.py "
        "`TransformerDecoder.chunked_output`: `[self.output(chunk) for chunk in h.chunk(N, dim=1)]`) and "
        "`CEWithChunkedOutputLoss(num_output_chunks=N)` (torchtune/modules/loss/ce_chunked_output_loss.py: each "
        "chunk's `.float()` and `F.cross_entropy(..., reduction=\"sum\")`, summed, over the count of labels). The "
        "real program is the reference GPT / Llama (traces/reference/nanogpt.py) with its head written as "
        "`chunked_output` and torchtune's own `CEWithChunkedOutputLoss` class, loaded from torchtune 0.6.1's file "
        "(`pip install --no-deps torchtune==0.6.1`; the package's `__init__` wants a torchao older than what torch "
        "2.13 takes, the loss file imports torch alone). The simulation is models/transformer/chunked_loss.py. "
        f"Real CPU runs, 2 steps, seq 32, exact allocation tracker, {n} configs, each beside the same config with "
        f"the whole `F.cross_entropy`, {seconds:.1f} s.", "",
        f"**Summary: every forward phase exact in {fwd}/{n}; backward phases off by {min(bwd)} to {max(bwd)} B "
        f"(the loss scalar and its ones_like seed gradient, which the whole-loss runs miss too: -4 to -8 B); "
        f"overall peak within 0.5% in {within}/{n} (exact or 8 B).** What chunking does and does not save, "
        "measured: every chunk's fp32 log_softmax output is saved until its backward, so all N are alive at the end "
        "of the forward, as one whole one would be; with a micro-batch above 1 each chunk of the hidden state is "
        "copied contiguous for the projection (saved), and each label chunk too; in the backward all N logits "
        "gradients are made (the loss nodes run last chunk first) before the first projection's backward. What it "
        "saves is the fp32 copy of 16-bit logits, one chunk at a time instead of whole (torchtune's unembed "
        "otherwise calls `.float()` on the whole output); against a plain `F.cross_entropy` on 16-bit logits, as "
        "the reference GPT runs it, it costs more (fp32 log_softmax instead of bf16).", "",
        *chunked_table(rows), "",
        *chunked_gpu_lines(), "",
        "Not modelled yet, and not run (it needs triton on a GPU; this project's torch is CPU-only): Liger 0.8.5's "
        "fused linear cross-entropy (liger_kernel/ops/fused_linear_cross_entropy.py "
        "`fused_linear_cross_entropy_forward`). Its rule, from the source: the forward allocates `grad_input` "
        "(BT x H, the input's dtype), `grad_weight` (V x H, the weight's dtype or `accum_dtype`), `loss_1d` (BT, "
        "fp32) and `target != ignore_index` (BT, bool), and one logits buffer of `chunk_size` x V reused for every "
        "chunk (`chunk_size = min(next_power_of_2(cdiv(BT, cdiv(V, chunk_mem_const * H))), BT)`, "
        "`_CHUNK_MEM_CONST = 1`); the triton kernel overwrites each chunk's logits with their gradient in place, "
        "`grad_input[chunk]` and `grad_weight` (addmm, in place) are filled in the forward, and "
        "`ctx.save_for_backward(grad_input, grad_weight, ...)` keeps them until the backward, which only scales them "
        "in place and hands them on as the hidden state's and the weight's gradients. So no whole logits, no "
        "log_softmax saved, but a weight-sized gradient alive from the forward on. Modelling it needs the replay to "
        "hand a saved block on as a gradient (no new allocation), which the tape cannot express yet.", "",
    ])


def main() -> int:
    t0 = time.time()
    rows = [run_case(c) for c in CASES]
    seconds = time.time() - t0
    t0 = time.time()
    chunked = [chunked_case(c) for c in CHUNKED]
    section = render(rows, seconds) + chunked_render(chunked, time.time() - t0)
    replace_section(SECTION, section)
    print(section)
    ok = all(r["backward_same"] and abs(r["v"].overall.error) <= 0.005 for r in rows) and all(
        r["forward_exact"] and abs(r["v"].overall.error) <= 0.005 for r in chunked)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
