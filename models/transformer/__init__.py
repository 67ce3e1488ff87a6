"""Analytic describer for decoder-only transformers (GPT-2 and Llama families) and MLPs.

It writes the forward tape of one micro-batch in the order torch runs it, naming parameters as
`named_parameters()` does (nanoGPT names for gpt2, HF names for llama) and listing each saved
activation with its shape and dtype. What each op saves follows torch's autograd formulas:

- Linear saves its input (the weight is a parameter, not new memory); bias adds nothing.
- LayerNorm saves input, mean and rstd (fp32, one per row); RMSNorm (torch's composite, as nn.RMSNorm
  runs on CPU) saves input, rstd and the normalised input.
- GELU / SiLU save their input, ReLU its output; an elementwise product saves both factors; residual adds save nothing.
- Dropout (p > 0) saves a bool mask and its output feeds the next op.
- Eager attention (nanoGPT): q and k are copied contiguous for the batched matmul and saved, the
  B*heads*T*T scores are masked, the softmax output is saved (plus the dropout mask and output), v is
  copied and saved, and the head-merged output is copied contiguous. SDPA/flash saves q, k, v (views
  of the projection), its output and the logsumexp (B*heads*T, fp32) only. On a CUDA profile SDPA is the
  kernel torch picks there (models/gpu.py `sdpa_backend`, for `GPU_TARGET`) with what it allocates and saves
  (`sdpa_kernel`): flash's logsumexp, padded copies and backward workspaces, memory-efficient attention's
  logsumexp padded to 32 rows; where CUDA falls back to the math backend (fp32 with GQA on torch 2.6, head
  dims no fused kernel takes) the nanoGPT/Llama writer writes eager attention, an approximation of torch's
  composite (which also keeps scaled copies of q and k and a (T, T) float mask), and the HF writer the
  composite itself (`_hf_sdpa_math`).
- Cross-entropy: log_softmax output (B*T*vocab, fp32 under autocast) is saved; the caller holds the
  logits until backward ends (`TrainingSetup.logits_held`).

`implementation="hf"` (HF transformers' GPT2LMHeadModel, read from a config.json) has its own tape,
`hf_gpt2_tape`, at the end of the transformer section: same parameters, different allocations (Conv1D,
an additive float mask, CPU dropout masks in the input's dtype, "gelu_new" op by op, HF's loss, and
tensors kept alive by Python locals until their module returns).

Activation checkpointing: the layers are written segment by segment (`models.tape.checkpoint_segments`)
and the writer marks each op with what the segment's policy does to it (`_Writer.begin_layer`): the
checkpoint region it belongs to (whole layers, or only the attention core under "selective"),
whether op-policy's selective checkpointing keeps its outputs (`TapeOp.cached`, matmul and SDPA ops),
or whether what it saves is offloaded to the host (`TapeOp.offloaded`). `models/replay/` replays them.

Under torch.autocast, linears and matmuls run in 16-bit: their weights and biases are cast (autocast
caches the copies until the forward ends; the weight's is saved for backward, and 16-bit gradients are
turned fp32 by a separate node), and an fp32 input is cast to a new 16-bit tensor that the linear saves
instead of the fp32 input (the final norm's fp32 output stays alive until the model returns).
Embeddings, norms and the loss produce fp32 (the loss reads a temporary fp32 copy of the 16-bit
logits); softmax is fp32 under CUDA autocast but keeps its 16-bit input dtype under CPU autocast
(`describe(..., "cpu")`). A residual add of fp32 and 16-bit tensors is fp32, and its backward casts the
gradient for the 16-bit input.

How the modules compose: `writer.py` (the tape writer), `params.py` (parameter names and shapes), `attention.py`
(eager and SDPA attention, CPU and CUDA), `nanogpt.py` (the nanoGPT / Llama tapes), `hf_gpt2.py` (HF's GPT-2),
`mlp.py` (the MLP tape).
"""

from .hf_gpt2 import HF_CHECKPOINTING, HFWriter, hf_causal_lm_loss, hf_gpt2_tape
from .mlp import mlp_tape
from .nanogpt import transformer_tape
from .params import mlp_params, transformer_params

__all__ = ["transformer_tape", "hf_gpt2_tape", "mlp_tape", "transformer_params", "mlp_params", "HF_CHECKPOINTING",
           "HFWriter", "hf_causal_lm_loss"]
