"""Low-bit optimizers: their states and their step's buffers, as the libraries make them (registered in
models/optimizers.py `OPTIMIZERS`; this module holds their rules, each cited from the library's source).

torchao 0.18.0, torchao/optim/adam.py (`_AdamBase`, `AdamW8bit`, `AdamW4bit`, `AdamWFp8`):
- `step()` loops over the parameters one by one; a parameter with no state gets it there, just before its own update
  (`state["step"] = torch.tensor(0.0)`: a 4-byte fp32 scalar made on the host whatever the parameter's device, then
  `exp_avg`, `exp_avg_sq`), so states are made parameter by parameter, interleaved with the updates
  (`OptimizerSpec.per_param`). `state["step"] += 1` makes two host scalars (8 and 4 B, measured), freed at once.
- `_new_buffer`: a quantised state only where the (local) parameter has `numel() >= 4096` and `numel() % block_size
  == 0` ("follow bitsandbytes"); otherwise `torch.zeros_like(p)`: the parameter's dtype and shape.
- subclass_8bit.py `OptimState8bit.zeros` (block_size 256): `codes` uint8 of the parameter's shape, `scale` fp32
  (numel // 256,), `qmap` fp32 (256,) (bitsandbytes' dynamic map, signed for exp_avg, unsigned for exp_avg_sq): each
  state has its own qmap tensor (1 KiB per state per parameter).
- subclass_4bit.py `OptimState4bit.zeros` (block_size 128): `codes` uint8 (numel // 2,) (two 4-bit codes a byte),
  `scale` fp32 (numel // 128,), `qmap` fp32 (16,) (signed: `create_dynamic_map(True, 3, 4)`; unsigned:
  `linspace(0, 1, 17)[1:]`).
- subclass_fp8.py `OptimStateFp8.zeros` (block_size 256): `codes` float8_e4m3fn of the parameter's shape, `scale`
  fp32 (numel // 256,); no qmap.
- The update is `torch.compile(single_param_adam, fullgraph=True, dynamic=False)` per parameter: the buffers its
  compiled graph allocates, measured with torch.profiler on the CPU (inductor's C++ backend, torch 2.13.0, fp32
  and bf16 parameters; bench/validate_lowbit.py), per quantised parameter of n elements: 8-bit: two new `scale`s
  (n // 256 fp32) and the two dequantised fp32 moments (`exp_avg_f32`, `exp_avg_sq_f32`, n fp32 each), all freed when
  the parameter's update ends; fp8: the two new `scale`s (the moments stay in registers), and where the parameter's last
  dim is no multiple of 256 (the (-1, 256) blocks span rows) the two new fp8 code arrays (n bytes each); 4-bit: the
  two unpacked code arrays (n uint8, made from two nibble halves of n // 2 uint8 each, freed first), then two `scale`s
  (n // 128 fp32), the two fp32 moments and two int64 code indices (n int64, the nearest-qmap search).
  A parameter that keeps plain states makes none (one fused kernel); the plan: models/optimizers.py `_torchao_temps`.
  On CUDA (Triton) inductor may keep fewer (the int64 indices above all): this plan is the CPU's, assumed for a GPU.

bitsandbytes 0.50.2, bitsandbytes/optim/optimizer.py `Optimizer2State.init_state` (AdamW8bit, optim_bits 8, defaults):
`state["step"]` a Python int (no tensor); `numel < min_8bit_size` (4096): `state1`, `state2` fp32 `zeros_like`;
else `state1`, `state2` uint8 of the parameter's shape, `absmax1`, `absmax2` fp32 ((n // 256) + bool(n % 256),)
(blocksize 256), and `qmap1` / `qmap2`: the optimizer's two shared 256-entry fp32 maps (`name2qmap`, one copy for all
parameters); `max_unorm` 0: no `unorm_vec`. The CUDA update is one fused kernel (`optimizer_update_8bit_blockwise`):
no temporaries. `adam-8bit`, the entry stored scenarios name, is this entry under its old name: the same states,
made as it always made them (every state at once, the qmaps with them).

Paged (bnb.optim.PagedAdamW8bit, `is_paged=True`): `get_state_buffer` on CUDA puts `state1` / `state2` of a
parameter of >= 1e5 elements in CUDA unified memory (bitsandbytes/functional.py `get_paged`: `cget_managed_ptr`,
cudaMallocManaged, wrapped by `torch.frombuffer`; `GlobalPageManager` lists them and prefetches them to the device
before each update, `prefetch_state`), not in torch's caching allocator; smaller ones and the `absmax`es are plain
device tensors; on the CPU it falls back to plain buffers. The simulation shows the managed buffers as host-backed
memory (Pool.HOST blocks named `<param>.<state>.managed`): the device's allocated bytes exclude them, as
torch.cuda.memory_allocated does; the driver migrates their pages to the device during the update and evicts them
under pressure, which the simulation does not model (their residency is the driver's).
"""

from __future__ import annotations

from math import prod

from ..simulator.events import OptimizerState

Shape = tuple[int, ...]
StateSpecs = list[tuple[OptimizerState, Shape, str]]  # as models/optimizers.py's (which imports this module)

TORCHAO_MIN_SIZE = 4096  # torchao/optim/adam.py `_new_buffer`: `numel() >= 4096 and numel() % block_size == 0`
TORCHAO_BLOCKS = {"8bit": 256, "4bit": 128, "fp8": 256}  # AdamW8bit / AdamW4bit / AdamWFp8 `block_size` defaults
TORCHAO_QMAP = {"8bit": 256, "4bit": 16, "fp8": 0}  # qmap entries per state (fp32)
BNB_PAGED_MIN = 100_000  # bitsandbytes/optim/optimizer.py `get_state_buffer`: paged when `p.numel() >= 1e5`
MOMENTS = (OptimizerState.EXP_AVG, OptimizerState.EXP_AVG_SQ)


def torchao_quantised(kind: str, numel: int) -> bool:
    """Whether torchao's `_new_buffer` makes a quantised state for a (local) parameter of `numel` elements."""
    return numel >= TORCHAO_MIN_SIZE and numel % TORCHAO_BLOCKS[kind] == 0


def _codes(kind: str, numel: int) -> tuple[Shape, str]:
    return {"8bit": ((numel,), "int8"), "4bit": ((numel // 2,), "int8"), "fp8": ((numel,), "fp8_e4m3")}[kind]


def torchao_states(kind: str):
    """The states of torchao's AdamW{8bit,4bit,Fp8} for one parameter: `step` (host fp32 scalar), then exp_avg and
    exp_avg_sq, each its codes, scale (and qmap), or a plain tensor of the parameter's dtype."""

    def states(shape: Shape, dtype: str) -> StateSpecs:
        numel = prod(shape)
        out: StateSpecs = [(OptimizerState.STEP, (), "fp32")]
        for state in MOMENTS:
            if not torchao_quantised(kind, numel):
                out.append((state, shape, dtype))
                continue
            codes_shape, codes_dtype = _codes(kind, numel)
            out += [(state, codes_shape, codes_dtype), (state, (numel // TORCHAO_BLOCKS[kind],), "fp32")]
            if TORCHAO_QMAP[kind]:
                out.append((state, (TORCHAO_QMAP[kind],), "fp32"))
        return out

    return states


def paged(optimizer_name: str, state: OptimizerState, numel: int) -> bool:
    """Whether this state of a parameter of `numel` elements lives in CUDA unified memory (bnb's paged buffers)."""
    return optimizer_name == "paged-adamw-8bit" and state in MOMENTS and numel >= BNB_PAGED_MIN


# the library classes the real programs build (traces/reference/build.py `optimizer_class`): direct references,
# imported when a real program asks for them (peakledger needs neither library to simulate)
def torchao_adamw8bit():
    from torchao.optim import AdamW8bit  # torchao==0.18.0

    return AdamW8bit


def torchao_adamw4bit():
    from torchao.optim import AdamW4bit  # torchao==0.18.0

    return AdamW4bit


def torchao_adamwfp8():
    from torchao.optim import AdamWFp8  # torchao==0.18.0

    return AdamWFp8


def bnb_adamw8bit():
    from bitsandbytes.optim import AdamW8bit  # bitsandbytes==0.50.2

    return AdamW8bit


def bnb_paged_adamw8bit():
    from bitsandbytes.optim import PagedAdamW8bit  # bitsandbytes==0.50.2

    return PagedAdamW8bit
