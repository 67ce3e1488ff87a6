"""kkaitlyn111's CS336 TransformerLM, cross-entropy loss and batch, for peakledger's traced describer
(`--module examples/modules/cs336_lm.py:factory`, 2.7B; `:tiny_factory` for a small config with the same ops;
`:small_factory` for the author's "small" config).

This reproduces the program whose real GPU memory snapshots are in shared/gpu-truth/snapshots
(`kkaitlyn111__memory_files--memory_ctx*_{forward,fullstep}_*.pickle`), op for op: the same aten ops in the
same order, with the same temporaries, because the traced describer records every op's allocations.
Written from what the author's code does (not copied):
- model: kkaitlyn111/cs336-assignment1, `cs336_basics/transformer.py`, commit b3ac129 (the stored file
  has an unresolved merge conflict in `Linear.__init__`; the run used the HEAD side, a weight of shape
  [out_features, in_features], the only side the file's own `forward` einsum can run with). The snapshots'
  frames (`/home/c-kaitwang/assignment1/cs336_basics/transformer.py`) confirm each op line by line: e.g.
  Linear.forward at line 22, RMSNorm lines 54-57, SwiGLU 76-80 (w1, w3, silu-by-hand, product, w2), RoPE
  117-127, softmax 135-142, attention 147-154, MultiheadSelfAttention 188-212.
- loss: `cs336_basics/training.py` (b3ac129) `cross_entropy_loss`, lines 21-33 in the snapshots' frames.
- the run: kkaitlyn111/cs336-a2-systems `cs336_systems/benchmark.py` `run_memory_foward_fullstep`
  (recorded at commit ebf6548, which is not in the index; the stored 46eae3f has the same steps, but passes
  dtype=bf16 to the model in its mixed runs, which the snapshots show the recorded one did not): batch 4,
  vocab 10000, RoPE theta 10000, `context_length` = the sequence length (RoPE's table has that many rows),
  `inputs = targets = torch.randint(0, vocab, (batch, context))` (one tensor), `logits = model(inputs)`,
  `loss = cross_entropy_loss(logits, targets)`. Parameters are fp32 (also in the author's bf16-autocast
  runs: the snapshots show every Linear weight cast to bf16 at each call). See bench/notes_cs336.md.

The author imports `einsum` and `rearrange` from einops (not a dependency here). They are written below as
the torch calls einops 0.8 makes for them: `einops.einsum(a, b, "names")` is `torch.einsum` of the same
operands with each axis name replaced by a letter in order of first appearance ("..." kept);
`einops.rearrange` is `reshape` (split a grouped axis), then `permute`, then `reshape` (merge axes), each
step only when the pattern needs it.
"""

import numpy as np
import torch
from torch import nn

# the author's benchmark.py `get_model_config`, plus a tiny config with the same structure for tests
SIZES = {
    "tiny": dict(d_model=64, d_ff=256, num_layers=2, num_heads=4),
    "small": dict(d_model=768, d_ff=3072, num_layers=12, num_heads=12),
    "medium": dict(d_model=1024, d_ff=4096, num_layers=24, num_heads=16),
    "large": dict(d_model=1280, d_ff=5120, num_layers=36, num_heads=20),
    "xl": dict(d_model=1600, d_ff=6400, num_layers=48, num_heads=25),
    "2.7b": dict(d_model=2560, d_ff=10240, num_layers=32, num_heads=32),
}
VOCAB = {"tiny": 512}  # every other size: the author's 10000
DEFAULT_VOCAB = 10000
THETA = 10000
BATCH = 4


# -- einops, as the torch calls it makes -------------------------------------------------------------------

def _einsum(pattern: str, *operands):
    """`einops.einsum(*operands, pattern)`: axis names -> letters in order of first appearance."""
    inputs, output = pattern.split("->")
    letters: dict[str, str] = {}

    def convert(side: str) -> str:
        out = ""
        for name in side.split():
            if name == "...":
                out += "..."
            else:
                out += letters.setdefault(name, "abcdefghijklmnopqrstuvwxyz"[len(letters)])
        return out

    spec = ",".join(convert(part) for part in inputs.split(",")) + "->" + convert(output)
    return torch.einsum(spec, *operands)


def _split_last(x: torch.Tensor, first: int, second: int) -> torch.Tensor:
    """rearrange(x, "... (a b) -> ... a b"): one reshape."""
    return x.reshape(*x.shape[:-1], first, second)


def _heads(x: torch.Tensor, num_heads: int) -> torch.Tensor:
    """rearrange(x, "b s (n_h d_k) -> b n_h s d_k"): reshape, then permute (a view)."""
    b, s, d = x.shape
    return x.reshape(b, s, num_heads, d // num_heads).permute(0, 2, 1, 3)


def _merge_heads(x: torch.Tensor) -> torch.Tensor:
    """rearrange(x, "b n_h s d_k -> b s (n_h d_k)"): permute, then reshape (a copy)."""
    b, h, s, d = x.shape
    return x.permute(0, 2, 1, 3).reshape(b, s, h * d)


def _is_fake(t: torch.Tensor) -> bool:
    """Built under peakledger's FakeTensorMode (shapes, no values): initial values are skipped there; they are
    made before the measured program starts and do not change it."""
    from torch._subclasses.fake_tensor import FakeTensor
    return isinstance(t, FakeTensor)


# -- the author's modules (transformer.py) ------------------------------------------------------------------

class Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, device=None, dtype=None):
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        std = np.sqrt(2 / (in_features + out_features))
        weight = torch.zeros([out_features, in_features], device=device, dtype=dtype)
        if not _is_fake(weight):  # torch 2.13's trunc_normal_ reads values (it redraws those out of range)
            torch.nn.init.trunc_normal_(weight, mean=0, std=std, a=-3 * std, b=3 * std)
        self.weight = nn.Parameter(weight, requires_grad=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _einsum("out_features in_features, ... in_features -> ... out_features", self.weight, x)


class Embedding(nn.Module):
    def __init__(self, num_embeddings: int, embedding_dim: int, device=None, dtype=None):
        super().__init__()
        # the author: always fp32, whatever dtype is asked
        self.weight = nn.Parameter(torch.randn(num_embeddings, embedding_dim, device=device, dtype=torch.float32),
                                   requires_grad=True)

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        return self.weight[token_ids]


class RMSNorm(nn.Module):
    def __init__(self, d_model: int, eps: float = 1e-5, device=None, dtype=None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d_model, device=device, dtype=torch.float32), requires_grad=True)
        self.d_model = d_model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        in_dtype = x.dtype
        x = x.to(torch.float32)
        norm = torch.linalg.vector_norm(x, dim=-1, keepdim=True)
        rms = torch.sqrt(norm ** 2 / self.d_model + self.eps)
        x_normed = x / rms
        result = _einsum("d, b s d -> b s d", self.weight, x_normed)
        return result.to(in_dtype)


class SwiGLUFeedForward(nn.Module):
    def __init__(self, d_model: int, d_ff: int, device=None, dtype=None):
        super().__init__()
        self.w1 = Linear(in_features=d_model, out_features=d_ff, device=device, dtype=dtype)
        self.w2 = Linear(in_features=d_ff, out_features=d_model, device=device, dtype=dtype)
        self.w3 = Linear(in_features=d_model, out_features=d_ff, device=device, dtype=dtype)

    def forward(self, x):
        t1 = self.w1(x)
        t3 = self.w3(x)
        t2 = torch.sigmoid(t1) * t1
        t4 = t2 * t3
        return self.w2(t4)


class RoPE(nn.Module):
    def __init__(self, theta: float, d_k: int, max_seq_len: int, device=None):
        super().__init__()
        self.d_k = d_k
        if d_k % 2 != 0:
            raise ValueError("Input dimension must be even")
        position_indices = torch.arange(max_seq_len, device=device)
        dim_indices = torch.arange(0, d_k, 2, device=device)
        freq = 1.0 / (theta ** (dim_indices.float() / d_k))
        angles = torch.outer(position_indices, freq)
        cos_sin = torch.zeros(max_seq_len, d_k // 2, 2, device=device)
        cos_sin[:, :, 0] = torch.cos(angles)
        cos_sin[:, :, 1] = torch.sin(angles)
        self.register_buffer("cos_sin_matrix", cos_sin, persistent=False)

    def forward(self, x: torch.Tensor, token_positions: torch.Tensor) -> torch.Tensor:
        # x [batch, heads, seq, d_k] (a permuted view of the projection), token_positions [batch, seq]
        x_pairs = _split_last(x, self.d_k // 2, 2)
        cos_vals = self.cos_sin_matrix[token_positions, :, 0]  # [batch, seq, d_k/2], a new tensor
        sin_vals = self.cos_sin_matrix[token_positions, :, 1]
        cos_vals = cos_vals.unsqueeze(1)
        sin_vals = sin_vals.unsqueeze(1)
        rotated = torch.zeros_like(x_pairs)  # keeps x_pairs' (permuted) strides
        rotated[..., 0] = cos_vals * x_pairs[..., 0] - sin_vals * x_pairs[..., 1]
        rotated[..., 1] = sin_vals * x_pairs[..., 0] + cos_vals * x_pairs[..., 1]
        return rotated.reshape(x.shape)  # a view


def softmax(tensor: torch.Tensor, dim: int):
    max_vals = torch.max(tensor, dim=dim, keepdim=True)[0]
    exp_tensor = torch.exp(tensor - max_vals)
    sum_exp = torch.sum(exp_tensor, dim=dim, keepdim=True)
    return exp_tensor / sum_exp


def scaled_dot_product_attention(Q, K, V, mask=None):
    d_k = Q.shape[-1]
    attention_scores = torch.einsum("...qd,...kd->...qk", Q, K)
    attention_scores = attention_scores / np.sqrt(d_k)
    if mask is not None:
        attention_scores = attention_scores.masked_fill(mask == False, -1e9)  # noqa: E712 (as written)
    attention_weights = softmax(attention_scores, dim=-1)
    return torch.einsum("...qk,...kd->...qd", attention_weights, V)


class MultiheadSelfAttention(nn.Module):
    def __init__(self, d_model: int, num_heads: int, max_seq_len: int | None = None, theta: float | None = None,
                 device=None, dtype=None, apply_rope: bool = False):
        super().__init__()
        assert d_model % num_heads == 0
        self.num_heads = num_heads
        self.d_k = d_model // num_heads
        self.q_proj = Linear(d_model, d_model, device=device, dtype=dtype)
        self.k_proj = Linear(d_model, d_model, device=device, dtype=dtype)
        self.v_proj = Linear(d_model, d_model, device=device, dtype=dtype)
        self.output_proj = Linear(d_model, d_model, device=device, dtype=dtype)
        self.rope = RoPE(theta, self.d_k, max_seq_len, device=device) if theta is not None and apply_rope else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch_size, seq_len, _ = x.shape
        Q_x = self.q_proj(x)
        K_x = self.k_proj(x)
        V_x = self.v_proj(x)
        Q = _heads(Q_x, self.num_heads)
        K = _heads(K_x, self.num_heads)
        V = _heads(V_x, self.num_heads)
        if self.rope is not None:
            positions = torch.arange(seq_len, device=x.device).unsqueeze(0).expand(batch_size, -1)
            Q = self.rope(Q, positions)
            K = self.rope(K, positions)
        # the causal mask, rebuilt at every call: fp32 ones, triu, to bool, inverted, expanded (a view)
        mask = torch.triu(torch.ones(seq_len, seq_len, device=x.device), diagonal=1).to(torch.bool)
        mask = ~mask
        mask = mask.unsqueeze(0).unsqueeze(0).expand(batch_size, self.num_heads, -1, -1)
        result = scaled_dot_product_attention(Q, K, V, mask=mask)
        result = _merge_heads(result)
        return self.output_proj(result)


class TransformerBlock(nn.Module):
    def __init__(self, d_model: int, num_heads: int, d_ff: int, max_seq_len: int = None, theta: float = None,
                 device=None, dtype=None):
        super().__init__()
        eps = 1e-5
        self.ln1 = RMSNorm(d_model, eps=eps, device=device, dtype=dtype)
        self.attn = MultiheadSelfAttention(d_model, num_heads, max_seq_len, theta, device=device, dtype=dtype,
                                           apply_rope=True)
        self.ln2 = RMSNorm(d_model, eps=eps, device=device, dtype=dtype)
        self.ffn = SwiGLUFeedForward(d_model, d_ff, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        h = self.attn(h)
        x = x + h
        h = self.ln2(x)
        h = self.ffn(h)
        x = x + h
        return x


class TransformerLM(nn.Module):
    def __init__(self, d_model: int, num_heads: int, d_ff: int, vocab_size: int, context_length: int,
                 num_layers: int, max_seq_len: int = None, theta: float = None, device=None, dtype=None):
        super().__init__()
        self.num_layers = num_layers
        self.max_seq_len = max_seq_len if max_seq_len is not None else context_length
        self.token_embeddings = Embedding(vocab_size, d_model, device, dtype)
        self.layers = nn.ModuleList(TransformerBlock(d_model, num_heads, d_ff, self.max_seq_len, theta, device, dtype)
                                    for _ in range(num_layers))
        self.ln_final = RMSNorm(d_model, eps=1e-5, device=device, dtype=dtype)
        self.lm_head = Linear(in_features=d_model, out_features=vocab_size, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor):
        x = self.token_embeddings(x)
        for i in range(self.num_layers):
            x = self.layers[i](x)
        x = self.ln_final(x)
        return self.lm_head(x)


# -- the author's loss (training.py) ------------------------------------------------------------------------

def cross_entropy_loss(inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    if inputs.dim() > 2:
        inputs = inputs.reshape(-1, inputs.size(-1))
        targets = targets.reshape(-1)
    inputs_max = torch.max(inputs, dim=-1, keepdim=True).values
    inputs = inputs - inputs_max
    exp_inputs = torch.exp(inputs)
    exp_inputs_sum = exp_inputs.sum(dim=-1)
    batch_indices = torch.arange(inputs.shape[0])  # on the host, as written (a CUDA run copies it over)
    target_inputs = inputs[batch_indices, targets]
    losses = torch.log(exp_inputs_sum) - target_inputs
    return losses.mean()


# -- factories ----------------------------------------------------------------------------------------------

def build(size: str = "2.7b", micro_batch: int = BATCH, seq_len: int = 128, dtype=None):
    """(model, batch, loss_fn) as benchmark.py builds them: the model with context_length = seq_len, one
    random token batch that is both the inputs and the targets, and the author's cross-entropy."""
    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}; one of {', '.join(SIZES)}")
    vocab = VOCAB.get(size, DEFAULT_VOCAB)
    model = TransformerLM(vocab_size=vocab, context_length=seq_len, theta=THETA, dtype=dtype, **SIZES[size])
    batch = torch.randint(low=0, high=vocab, size=(micro_batch, seq_len))
    return model, batch, lambda logits: cross_entropy_loss(logits, batch)


def factory(micro_batch: int = BATCH, seq_len: int = 128):
    """The 2.7B configuration of the GPU snapshots (d_model 2560, d_ff 10240, 32 layers, 32 heads, vocab 10000)."""
    return build("2.7b", micro_batch, seq_len)


def small_factory(micro_batch: int = BATCH, seq_len: int = 128):
    """The author's "small" configuration (768 / 3072 / 12 layers / 12 heads, vocab 10000)."""
    return build("small", micro_batch, seq_len)


def tiny_factory(micro_batch: int = BATCH, seq_len: int = 128):
    """The same program at d_model 64, d_ff 256, 2 layers, 4 heads, vocab 512 (for tests)."""
    return build("tiny", micro_batch, seq_len)
