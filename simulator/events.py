"""The event schema: the one contract between describers, simulator, traces and analysis.

A training run, simulated or measured, is a list of `Event`s. Each event allocates or frees one
`Block` of memory: a tensor (or a slice of one) with an exact byte count, a category that says what
the memory is for, and where it lives (rank, pool). Every event also says when it happened (time,
and the phase / step / micro-batch of the training loop) and which stream and operation caused it.

A simulator run and a measured torch trace are the same kind of object (`EventLog`), so the analysis
layer never needs to know which one it is looking at.

Categories live in one enum and are decided in one place per producer (the describer for simulated
runs, the tracker for measured ones), in the spirit of `torch/profiler/_memory_profiler.py`.

What a run records of itself (model, setup, device, steps, ranks, ...) is the log's `RunMetadata`
(simulator/run_metadata.py), one typed field per key.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from .run_metadata import RunMetadata

SCHEMA_VERSION = 1


class Category(str, enum.Enum):
    """What a block of memory is for."""

    PARAMETER = "parameter"
    GRADIENT = "gradient"
    MASTER_PARAMETER = "master_parameter"
    OPTIMIZER_STATE = "optimizer_state"
    ACTIVATION = "activation"  # saved for backward
    TEMPORARY = "temporary"
    INPUT = "input"  # the batch: token ids, labels
    BUFFER = "buffer"  # registered module buffers (masks, rotary tables)
    ALL_GATHER_BUFFER = "all_gather_buffer"
    REDUCE_SCATTER_BUCKET = "reduce_scatter_bucket"
    CHECKPOINT_STAGING = "checkpoint_staging"
    WORKSPACE = "workspace"  # GPU library workspaces held by the caching allocator (cuBLAS, one per handle and stream)
    KV_CACHE = "kv_cache"  # generation's key / value cache: one block per layer, keys and values (transformers' Cache)
    PREDICTIONS = "predictions"  # an evaluation's accumulated outputs on the device (HF Trainer's preds_host)
    UNKNOWN = "unknown"  # measured traces only: a block no rule could label


class OptimizerState(str, enum.Enum):
    """The named optimizer states (Category.OPTIMIZER_STATE blocks carry one)."""

    EXP_AVG = "exp_avg"
    EXP_AVG_SQ = "exp_avg_sq"
    MAX_EXP_AVG_SQ = "max_exp_avg_sq"
    MOMENTUM_BUFFER = "momentum_buffer"
    STEP = "step"
    QUANT_STATE = "quantization_state"  # 8-bit optimizers: per-block absmax scales
    SQUARE_AVG = "square_avg"  # RMSprop
    SUM = "sum"  # Adagrad
    ROW_VAR = "row_var"  # Adafactor: a factored (>= 2-D) parameter's second moment, reduced over its last dim
    COL_VAR = "col_var"  # Adafactor: the same reduced over its second-to-last dim
    VARIANCE = "variance"  # Adafactor: a 1-D parameter's unfactored second moment


class Phase(str, enum.Enum):
    LOAD = "load"
    FORWARD = "forward"
    BACKWARD = "backward"
    OPTIMIZER = "optimizer"
    ZERO_GRAD = "zero_grad"
    CHECKPOINT = "checkpoint"
    EVAL = "eval"  # a script's evaluation: a model called without autograd or in eval mode (peakledger run)
    GENERATE = "generate"  # a generation's own work outside the model's forwards: inputs expanded, the cache made
    PREFILL = "prefill"  # generation's first forward over the prompt, and the first token chosen from its logits
    DECODE = "decode"  # generation's later forwards, one token per sequence each, until generate returns
    # RL post-training, as TRL 1.16.0's trainers run it (models/script/phases.py wraps their methods; docs/rl.md).
    # ROLLOUT: GRPO's _prepare_inputs when it generates (trl/trainer/grpo_trainer.py:1536-1543), less the passes
    # below and generation: padding, rewards, advantages, the buffer split
    ROLLOUT = "rollout"
    # REFERENCE: a frozen reference model's forward under no_grad (grpo_trainer.py:2710-2735, dpo_trainer.py:1327-1338)
    REFERENCE = "reference"
    OLD_LOGPROBS = "old_logprobs"  # the policy's no_grad forward for the old log-probs (grpo_trainer.py:2634-2657)


class Action(str, enum.Enum):
    ALLOC = "alloc"
    FREE = "free"


class Pool(str, enum.Enum):
    DEVICE = "device"
    HOST = "host"


class Stream(str, enum.Enum):
    COMPUTE = "compute"
    COMMUNICATION = "communication"
    HOST = "host"


@dataclass(frozen=True)
class Block:
    """One allocation: exact bytes (a Python int), what it is for and where it lives.

    `name` is the tensor's path (`layers.3.attn.c_attn.weight`, `layers.3.attn.softmax_out`),
    `shard_factor` the number of ranks one full tensor is divided across (1 = not sharded). `pinned`: a
    Pool.HOST block in page-locked memory (cudaHostAlloc: `pin_memory=True`, torch's CachingHostAllocator), which
    the OS cannot page out; False for pageable host memory and for every device block. A flag on the host block,
    not a pool of its own: pinned memory is host RAM, counted in the host's total, and every reader of Pool.HOST
    keeps seeing all of it.
    `outside_allocator`: a Pool.DEVICE block mapped by the process outside torch's caching allocator (vLLM's
    CuMemAllocator pool in sleep mode: cuMemCreate / cuMemMap, vllm 0.32.0 vllm/device_allocator/cumem.py). It is
    device memory (every reader of Pool.DEVICE counts its bytes, and the device total holds it), but torch's
    reserved memory does not: the allocator replay (simulator/device_memory.py) takes no segment for it.
    """

    id: int
    nbytes: int
    category: Category
    name: str
    dtype: str
    shape: tuple[int, ...] = ()
    state: OptimizerState | None = None
    shard_factor: int = 1
    rank: int = 0
    pool: Pool = Pool.DEVICE
    pinned: bool = False
    outside_allocator: bool = False

    @property
    def module(self) -> str:
        """The module path: the tensor name without its last component."""
        return self.name.rpartition(".")[0]


@dataclass(frozen=True)
class Event:
    """One allocate or free of one block, at one moment of the training loop.

    `seq` orders events totally (ties in `time` are broken by it); `step` counts optimizer steps from
    1 (0 = load, before the first step); `micro_batch_index` is the micro-batch's index within gradient
    accumulation (0, 1, ...), or -1 outside forward/backward (the micro-batch's size is the setup's `micro_batch`).
    """

    seq: int
    time: float
    action: Action
    block: Block
    phase: Phase
    step: int
    micro_batch_index: int
    stream: Stream
    op: str

    @property
    def delta(self) -> int:
        return self.block.nbytes if self.action is Action.ALLOC else -self.block.nbytes


_new = object.__new__


def new_block(id: int, nbytes: int, category: Category, name: str, dtype: str, shape: tuple[int, ...] = (),
              state: OptimizerState | None = None, shard_factor: int = 1, rank: int = 0,
              pool: Pool = Pool.DEVICE, pinned: bool = False, outside_allocator: bool = False) -> Block:
    """`Block(...)`, equal to it field for field, made without the frozen dataclass's `__init__` (one
    `object.__setattr__` per field): the describers make hundreds of thousands. `shape` must be a tuple."""
    b = _new(Block)
    d = b.__dict__
    d["id"] = id
    d["nbytes"] = nbytes
    d["category"] = category
    d["name"] = name
    d["dtype"] = dtype
    d["shape"] = shape
    d["state"] = state
    d["shard_factor"] = shard_factor
    d["rank"] = rank
    d["pool"] = pool
    d["pinned"] = pinned
    d["outside_allocator"] = outside_allocator
    return b


def new_event(seq: int, time: float, action: Action, block: Block, phase: Phase, step: int, micro_batch_index: int,
              stream: Stream, op: str) -> Event:
    """`Event(...)`, equal to it field for field, made as `new_block` makes a block (the simulator records
    one per allocation and free)."""
    e = _new(Event)
    d = e.__dict__
    d["seq"] = seq
    d["time"] = time
    d["action"] = action
    d["block"] = block
    d["phase"] = phase
    d["step"] = step
    d["micro_batch_index"] = micro_batch_index
    d["stream"] = stream
    d["op"] = op
    return e


@dataclass(frozen=True)
class OOMRecord:
    """The first allocation that did not fit a pool's capacity, with what was live when it failed."""

    event: Event
    capacity: int
    live_bytes: int  # bytes in that pool before the failing allocation
    live_by_category: dict[Category, int]
    largest_live: tuple[Block, ...]
    message: str = ""  # on a CUDA device: torch's own OutOfMemoryError text for that moment


@dataclass
class EventLog:
    """A whole run: events in order, plus where they came from (simulated or measured)."""

    events: list[Event]
    source: str  # "simulator", "torch-dispatch-tracker", "torch-profiler", "cuda-snapshot"
    metadata: RunMetadata = field(default_factory=RunMetadata)
    ooms: list[OOMRecord] = field(default_factory=list)
    op_names: list[str] = field(default_factory=list)

    def blocks(self) -> dict[int, Block]:
        return {e.block.id: e.block for e in self.events}

    def pools(self) -> list[tuple[int, Pool]]:
        """Every (rank, pool) that appears, in a stable order."""
        return sorted({(e.block.rank, e.block.pool) for e in self.events}, key=lambda rp: (rp[0], rp[1].value))
