"""Tensor parallelism (TP) and sequence parallelism (SP) as torch's DTensor runs them: one rank's tape.

Modules: transform.py (`tensor_parallel_tape`: a hand-written GPT-2 / Llama tape rewritten into one rank's shards,
activations and collectives, the `TensorParallelTape` it returns, and `tensor_parallel_classes`, the ranks whose
tapes are the same) and engine.py (`TensorParallelEngine`: the rank's data-parallel engine wrapped with the replay
hooks the tape asks for: gradient sums and all-reduces, gradient shapes, communication-stream ops).

Everything here was measured on real DTensor runs (traces/tensor_run.py: gloo, 127.0.0.1, torch 2.13 CPU, the
tracker seeing the plain ops inside DTensor's dispatch), see bench/VALIDATION.md
"Model parallelism (real CPU runs)" for the figures.
"""

from __future__ import annotations

from .engine import TensorParallelEngine
from .transform import TensorParallelTape, chunk, tensor_parallel_classes, tensor_parallel_tape

__all__ = ["tensor_parallel_classes", "tensor_parallel_tape", "TensorParallelTape", "TensorParallelEngine", "chunk"]
