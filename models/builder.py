"""`GraphBuilder`: one rank's maker of blocks and ops. It gives each block a fresh id and each op its place on
its stream and its duration from the cost model (models/devices.py), adds the cuBLAS / cuBLASLt workspaces a GPU
thread's first GEMM allocates (models/gpu.py), and holds the rank's data-parallel engine (models/parallel) that
the replay (models/replay/) calls around every op. models/training.py `describe` makes one per simulated
rank; models/parallel/mesh.py `rank_builder` makes a model-parallel rank's.
"""

from __future__ import annotations

import fnmatch
import itertools

from ..simulator.events import Block, Category, Phase, Pool, Stream, new_block
from ..simulator.ops import Op, OpGraph, new_op
from .config import ConfigError, TrainingSetup
from .devices import DeviceProfile
from .gpu import cublas_workspace_bytes, cublaslt_workspace_bytes
from .lora import LoraTape, adapter_parameters
from .parallel import make_engine
from .parallel.pipeline import PipelineEngine
from .tape import Tape

_new = object.__new__


def trainable_params(tape: Tape, frozen: tuple[str, ...]) -> set[str]:
    if isinstance(tape, LoraTape):  # peft freezes the whole base model: only the adapters train
        return adapter_parameters(tape)
    names = [p.name for p in tape.params]
    for pattern in frozen:
        if not any(fnmatch.fnmatchcase(n, pattern) for n in names) and not getattr(tape, "stages", ()):
            # (a pipeline rank's tape holds its stages' parameters only: the whole tape is checked in describe)
            raise ConfigError("frozen", f"pattern {pattern!r} matches no parameter (names look like {names[0]!r})")
    return {n for n in names if not any(fnmatch.fnmatchcase(n, pat) for pat in frozen)}


class GraphBuilder:
    """Creates blocks and ops with fresh ids and durations from the cost model, for one rank; several
    builders (one per rank) can share one graph and one block counter."""

    def __init__(self, tape: Tape, setup: TrainingSetup, device: DeviceProfile, rank: int = 0,
                 graph: OpGraph | None = None, block_ids: itertools.count | None = None, *,
                 dp_rank: int | None = None, pipeline_group: int = 0, torch_version: str | None = None) -> None:
        """`tape` is the rank's own (models/parallel/mesh.py `rank_builder` makes it for a model-parallel rank,
        with the local setup); `rank` is global (blocks and ops carry it), `dp_rank` the rank's place in its
        data-parallel group (default: `rank`), `pipeline_group` names the pipeline its stages' sends link.
        `torch_version`: whose CUDA library rules apply (the cuBLASLt workspace); default: the one `describe`
        puts in the graph's metadata while it builds, else "2.6"."""
        self.tape = tape
        self.setup = setup
        self.device = device
        self.rank = rank
        self.dp_rank = rank if dp_rank is None else dp_rank
        self.pipeline_group = pipeline_group
        self.graph = graph if graph is not None else OpGraph()
        self._block_ids = block_ids if block_ids is not None else itertools.count(1)
        self._last_on_stream: dict[Stream, int] = {}
        self._workspaces: set[str] = set()  # threads whose cuBLAS handle holds its workspace ("<thread>.lt": Lt's)
        if torch_version is None:
            torch_version = self.graph.metadata.torch_version
            torch_version = "2.6" if torch_version is None else torch_version
        self.torch_version = torch_version
        self._lt_workspace = cublaslt_workspace_bytes(torch_version) if device.is_cuda else 0
        self.trainable = trainable_params(tape, setup.optimizer.frozen) - set(tape.gradless)
        self.param_numel = {p.name: p.numel for p in tape.params}
        self.param_shape = {p.name: p.shape for p in tape.params}
        self.replay_plans: dict = {}  # models/replay/plan.py: each tape's replay plan, made once for this rank
        self.replay_templates: dict = {}  # models/replay/template.py: each plan's recorded passes
        # the cost model's rates (models/devices.py DeviceProfile.duration), taken once: every op reads them
        self._flop_rate = device.flops.get(setup.precision.compute, device.flops["fp32"]) * device.flops_efficiency
        self._byte_rate = device.bandwidth * device.bandwidth_efficiency
        self._cuda = device.is_cuda
        self.cpu_offload = None  # torchao's CPUOffloadOptimizer (models/offload_libraries.py), set by the describer
        self.engine = make_engine(self)
        if setup.mesh.pp > 1:  # a pipeline rank: its stages in the schedule's order (models/parallel/pipeline.py)
            self.engine = PipelineEngine(self, self.engine)

    def close(self) -> None:
        """Done describing: the builder lets go of what it holds. Its engine and their helpers point back at it (a
        reference cycle), so without this the graph, the tape and every block it made would wait for the cyclic
        collector (simulator/gcpause.py) after their users drop them, instead of being freed then."""
        vars(self).clear()

    def block(self, name: str, nbytes: int, category: Category, dtype: str, shape=(), state=None,
              shard: int = 1, pool: Pool = Pool.DEVICE, pinned: bool = False,
              outside_allocator: bool = False) -> Block:
        """A new block of this rank; `pinned`: page-locked host memory, `outside_allocator`: device memory torch's
        caching allocator does not hold (simulator/events.py `Block`)."""
        return new_block(next(self._block_ids), nbytes, category, name, dtype,
                         shape if type(shape) is tuple else tuple(shape), state, shard, self.rank, pool, pinned,
                         outside_allocator)

    def op(self, name: str, phase: Phase, step: int, micro_batch_index: int, allocs, frees, flops: int = 0,
           bytes_moved: int = 0, recompute: bool = False, stream: Stream = Stream.COMPUTE,
           duration: float | None = None, after=(), gemm: str | None = "cublas", pool: Stream | None = None) -> Op:
        """Add an op after the previous op of its stream (streams run in order) and after `after`. `gemm`: the library
        its FLOPs run through on CUDA, "cublas", or "cublaslt" (models/gpu.py `gemm_takes_cublaslt`); None when its
        kernel never runs although its time is counted (a recompute stopping before it: replay/checkpoint.py)."""
        if duration is None:  # self.device.duration(flops, bytes_moved, self.setup.precision.compute), inline
            duration = max(flops / self._flop_rate, bytes_moved / self._byte_rate) + self.device.launch_latency
        if self._cuda and flops and gemm and stream is Stream.COMPUTE and (phase is Phase.FORWARD
                                                                          or phase is Phase.BACKWARD):
            allocs = self._cublas_workspace(phase, recompute, gemm == "cublaslt") + tuple(allocs)
        op_id = len(self.graph)
        op = new_op(op_id, name, stream, phase, step, micro_batch_index, duration, self.rank, tuple(allocs),
                    tuple(frees), flops, recompute, pool)
        previous = self._last_on_stream.get(stream)
        self._last_on_stream[stream] = op_id
        if after:
            deps = tuple(dict.fromkeys(d for d in ((previous,) if previous is not None else ()) + tuple(after)
                                       if d is not None))
        else:
            deps = (previous,) if previous is not None else ()
        return self.graph.add(op, after=deps)

    def recorded(self, actions: list) -> tuple[list, list]:
        """A pass as `play` makes it again, from what models/replay/template.py recorded of it in order: each
        `Block` made, and for each op emitted (the `Op` as `op` made it, the places in the pass's block table of
        the blocks it was given to allocate and free, the places among the pass's ops of the ops it was to follow).
        Each op keeps its fields but the id, step, micro-batch and blocks (a dict in `Op`'s order), the place of
        the op before it on its stream in the pass (None: the rank's op before the pass), its `after`, and the
        workspaces `op` would give it at its thread's first GEMM (and first cuBLASLt GEMM): their keys and its
        `gemm`, or None; with the last op of each stream in the pass."""
        out: list = []
        last: dict[Stream, int] = {}
        k = 0
        for act in actions:
            if type(act) is Block:
                out.append(act)
                continue
            op, allocs, frees, after, gemm = act
            workspaces = None
            runs = op.flops and gemm and op.stream is Stream.COMPUTE and op.phase in (Phase.FORWARD, Phase.BACKWARD)
            if self._cuda and runs:
                thread = self._thread(op.phase, op.recompute)
                lt = gemm == "cublaslt" and self._lt_workspace
                workspaces = ((thread, f"{thread}.lt") if lt else (thread,)), gemm == "cublaslt"
            out.append((dict(op.__dict__), op.stream, allocs, frees, last.get(op.stream), after, workspaces))
            last[op.stream] = k
            k += 1
        return out, list(last.items())

    def play(self, recorded: tuple[list, list], tab: list[Block], step: int, micro_batch_index: int) -> None:
        """A recorded pass (`recorded`) made again, as its own code would make it: each `Block` anew with the next
        id (appended to `tab`), each op as `op` would add it, its blocks taken from `tab` by place."""
        actions, ends = recorded
        ids, last, workspaces = self._block_ids, self._last_on_stream, self._workspaces
        base = len(self.graph)
        added: list[tuple[Op, list[int]]] = []
        for act in actions:
            if type(act) is Block:
                blk = _new(Block)
                d = blk.__dict__
                d.update(act.__dict__)
                d["id"] = next(ids)
                tab.append(blk)
                continue
            fields, stream, a, f, prev, after, blas = act
            allocs = tuple([tab[j] for j in a])
            if blas is not None and not workspaces.issuperset(blas[0]):
                allocs = self._cublas_workspace(fields["phase"], fields["recompute"], blas[1]) + allocs
            op_id = base + len(added)
            op = _new(Op)
            d = op.__dict__
            d.update(fields)
            d["id"] = op_id
            d["step"] = step
            d["micro_batch_index"] = micro_batch_index
            d["allocs"] = allocs
            d["frees"] = tuple([tab[j].id for j in f])
            previous = last.get(stream) if prev is None else base + prev
            if after:
                deps = list(dict.fromkeys(([previous] if previous is not None else []) + [base + k for k in after]))
            else:
                deps = [previous] if previous is not None else []
            added.append((op, deps))
        for stream, k in ends:
            last[stream] = base + k
        self.graph.extend(added)

    @staticmethod
    def _thread(phase: Phase, recompute: bool) -> str:
        """The thread an op runs on: the forward on the Python thread; backward and its recomputation on autograd's
        device thread (each has its own cuBLAS handle)."""
        return "forward" if phase is Phase.FORWARD and not recompute else "autograd"

    def _cublas_workspace(self, phase: Phase, recompute: bool, lt: bool = False) -> tuple[Block, ...]:
        """The workspaces of the handle of the thread running this op's GEMM (models/gpu.py), each at its first use
        and kept for good: cuBLAS's at the thread's first GEMM; then, when the GEMM takes the cuBLASLt path (`lt`)
        and the torch version keeps one (`cublaslt_workspace_bytes`), cuBLASLt's, at its first Lt GEMM
        (CublasHandlePool.cpp: getCUDABlasLtWorkspace fetches the handle, which sets the cuBLAS workspace, then
        allocates its own)."""
        thread = self._thread(phase, recompute)
        out: tuple[Block, ...] = ()
        if thread not in self._workspaces:
            self._workspaces.add(thread)
            size = cublas_workspace_bytes(self.device.compute_capability)
            out = (self.block(f"cublas_workspace.{thread}_thread", size, Category.WORKSPACE, "uint8", (size,)),)
        key = f"{thread}.lt"
        if lt and self._lt_workspace and key not in self._workspaces:
            self._workspaces.add(key)
            size = self._lt_workspace
            out += (self.block(f"cublaslt_workspace.{thread}_thread", size, Category.WORKSPACE, "uint8", (size,)),)
        return out

    def last(self, stream: Stream) -> int | None:
        """The id of the latest op on `stream` of this rank (None before the first)."""
        return self._last_on_stream.get(stream)
