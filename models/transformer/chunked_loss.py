"""torchtune's chunked output and chunked cross-entropy (`chunked_loss` N), as torchtune 0.6.1 writes them:

- torchtune/modules/transformer.py `TransformerDecoder.chunked_output`: `[self.output(chunk) for chunk in
  last_hidden_state.chunk(num_output_chunks, dim=1)]`, the model's output a list of N logits chunks (B, T/N, V),
  held by the caller like whole logits;
- torchtune/modules/loss/ce_chunked_output_loss.py `CEWithChunkedOutputLoss.forward`: `total_elements = (labels !=
  ignore_index).sum()`; the labels chunked the same way and each `.reshape(-1)`; then chunk by chunk
  `total_loss += F.cross_entropy(logits_chunk.float(), labels_chunk, reduction="sum")`; `total_loss /
  total_elements`.

What that costs, op by op (measured with the allocation tracker, torch 2.13 CPU, the tiny GPT; tests/
test_in_backward_and_chunked_loss.py): with a micro-batch above 1 a chunk along dim 1 is not contiguous, so each
chunk's projection (aten::matmul's fold) copies it first, and that copy, not the hidden state, is what the matmul
saves; the hidden state lives until the forward returns. With a micro-batch of 1 the chunks are views of it, each
saved. Likewise each labels chunk is reshaped by a copy (saved by its loss) when the micro-batch is above 1. Each
chunk's `.float()` is a copy only for 16-bit logits, gone once log_softmax has run; the log_softmax output of every
chunk (fp32) is saved for the backward, so all N are alive at the end of the forward, as one whole fp32 log_softmax
would be: what chunking saves is the whole fp32 copy of 16-bit logits (one chunk's at a time). In the backward the
chunks' loss nodes run first, last chunk first, then the projections: every chunk's logits gradient is made before
the first projection's backward frees one. The hidden state's gradient is the chunks' pieces concatenated
(SplitBackward0) once all are in; a tied head's weight gradient is summed out of place chunk by chunk.
"""

from __future__ import annotations

from ..tape import TensorSpec


def chunked_cross_entropy(w, x: TensorSpec, targets: TensorSpec, n: int, head_weight: str,
                          vocab: int) -> tuple[str, ...]:
    """The output projection and loss of torchtune's chunked output + CEWithChunkedOutputLoss(n) on the final
    hidden state `x` (B, T, D); the names of the logits chunks (what the caller holds)."""
    B, T, D = x.shape
    c = T // n
    contiguous = B == 1  # chunks along dim 1 of (1, T, D) are contiguous views
    logits = []
    for k in range(n):
        name = f"lm_head.chunk{k}"
        out = w.t(f"{name}.out", (B, c, vocab))
        if contiguous:  # the matmul saves its view of x: x lives until the last chunk's backward
            (y,) = w.op(name, "linear", [x], [out], saves=(x.name,), views=(x.name,), params=(head_weight,),
                        saved_params=(head_weight,), flops=2 * B * c * D * vocab)
        else:  # matmul's reshape copies the strided chunk; the copy is what is saved
            copy = w.t(f"{name}.input_contiguous", (B, c, D), x.dtype, False)
            y, _ = w.op(name, "linear", [x], [out, copy], saves=(copy.name,), views=(x.name,),
                        params=(head_weight,), saved_params=(head_weight,), flops=2 * B * c * D * vocab)
        logits.append(y)
    (ne,) = w.op("loss.ne", "ne", [targets], [w.t("loss.not_ignored", (B, T), "bool", False)])
    (total_elements,) = w.op("loss.total_elements", "sum", [ne], [w.t("loss.total_elements", (), "int64", False)])
    labels = []
    for k in range(n):
        if contiguous:
            labels.append(targets)
        else:
            (lab,) = w.op(f"loss.labels.chunk{k}", "clone", [targets],
                          [w.t(f"loss.labels.chunk{k}", (B * c,), targets.dtype, False)])
            labels.append(lab)
    total = first = None
    for k, (y, lab) in enumerate(zip(logits, labels)):
        pre = f"loss.chunk{k}"
        copied = y.dtype != "fp32"
        if copied:  # logits_chunk.float(): a copy, an argument of F.cross_entropy until it returns
            (y,) = w.op(f"{pre}.float", "to_copy", [y], [w.t(f"{pre}.logits_fp32", y.shape, "fp32")])
        (lsm,) = w.op(f"{pre}.log_softmax", "log_softmax", [y], [w.t(f"{pre}.log_softmax.out", y.shape, "fp32")],
                      saves=(f"{pre}.log_softmax.out",), flops=5 * B * c * vocab)
        loss, _ = w.op(f"{pre}.nll", "nll_loss", [lsm, lab],
                       [w.t(f"{pre}.loss", (), "fp32"), w.t(f"{pre}.total_weight", (), "fp32", False)],
                       saves=(lab.name, f"{pre}.total_weight"), releases=(y.name,) if copied else ())
        # total_loss = 0.0 + loss: a new scalar; then total_loss += loss, in place: no new memory (an empty
        # tensor stands for the same total), the chunk's loss gone after it
        inputs = [loss] if total is None else [total, loss]
        (total,) = w.op(f"{pre}.add", "add", inputs, [w.t(f"loss.total{k}", () if k == 0 else (0,), "fp32")],
                        passthrough=True, releases=(first.name,) if k else ())
        first = total if k == 0 else first
    w.op("loss.div", "div", [total, total_elements], [w.t("loss", (), "fp32")], saves=(total_elements.name,),
         releases=(first.name,))
    if not contiguous:  # the final hidden state is a local of the forward until it returns
        w.op("model.return", "release", [x], [])
    return tuple(y.name for y in logits)
