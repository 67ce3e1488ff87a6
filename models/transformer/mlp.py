"""The MLP tape: Linear(+activation) layers under mean-squared error, as traces/reference/nanogpt.py's `MLP` runs.
"""

from __future__ import annotations

from ..config import ConfigError, MLPConfig, TrainingSetup
from ..tape import Tape, TensorSpec, checkpoint_segments
from .params import mlp_params
from .writer import TapeWriter


def mlp_tape(cfg: MLPConfig, setup: TrainingSetup, cpu: bool = False) -> Tape:
    """nn.Sequential(Linear, act, Linear, act, ..., Linear) on (micro_batch, d_in); F.mse_loss, a
    fused kernel that keeps its input and target for backward. (LoRA is refused by the mlp family's check.)"""
    B = setup.batch.micro_batch
    tape = Tape(params=mlp_params(cfg))
    w = TapeWriter(tape, setup, cpu)
    x = TensorSpec("batch.x", (B, 1, cfg.d_in), setup.precision.compute if not w.autocast else "fp32", False)
    y_true = TensorSpec("batch.y", (B, 1, cfg.d_out), x.dtype, False)
    tape.inputs = [x, y_true]
    dims = (cfg.d_in, *cfg.hidden, cfg.d_out)
    h = x
    segments = checkpoint_segments(setup, len(dims) - 1)  # a layer: one Linear and the activation after it
    if any(seg.wrap == "selective" for seg in segments):
        raise ConfigError("checkpointing", "'selective' recomputes the attention core: an MLP has none; allowed for "
                                           "MLPs: none, full, every-k, sqrt, op-policy, offload, layers")
    for segment in segments:
        for i in segment.layers:
            w.begin_layer(segment, i)
            h = w.linear(f"layers.{2 * i}", h, dims[i + 1], cfg.bias)
            if i < len(dims) - 2:
                h = w.pointwise(f"layers.{2 * i + 1}", cfg.activation, h)
    w.end_layers()
    # torch 2.13 aten/src/ATen/native/Loss.cpp mse_loss_out (CPU and CUDA): the reduced loss keeps the storage its
    # structured output was made with, the broadcast shape, then `resize_({})` (models/traced/kernel_outputs.py
    # FULL_STORAGE_LOSSES): a 0-dim tensor of the input's bytes, alive as long as the caller's `loss`; the
    # unreduced `loss` its TensorIterator allocates is freed when it returns. That one is made inside the kernel,
    # where the dispatch tracker does not see it: the cpu profile leaves it out, as the measurement does
    diff = () if w.cpu else (w.t("loss.mse.diff", h.shape, h.dtype, False),)
    w.op("loss.mse", "mse_loss", [h, y_true], [w.t("loss", h.shape, h.dtype)], saves=(h.name, y_true.name),
         workspace=diff)
    tape.held = ((h.name,) if setup.loop.holds_outputs else ()) + ("loss",)  # `loss.backward()`: the caller's
    return tape
