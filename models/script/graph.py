"""A recorded script as the op graph the simulator runs.

Each aten call of the script that allocates is one op: it allocates its outputs when it starts, and frees what
the script let go after it, until the next allocating call, when it ends (simulator/ops.py's same-instant rule:
the order of the recording, event for event). A position change (a phase, a step, a micro-batch) starts a new op,
so frees at the start of a zero_grad are the zero_grad's. The ops run in program order on the compute stream; an
op's duration is the cost model's (models/devices.py) from the FLOPs torch's formulas count for its call and the
bytes it allocates.

On a GPU profile the recording is still the CPU program (the script ran on the CPU), with the GPU rules
peakledger applies to any recording: cuBLAS's workspace, one per thread that runs a GEMM (the Python thread's at
its first forward or eval GEMM, autograd's at its first backward GEMM: models/gpu.py
`cublas_workspace_bytes`), and the caching allocator's replay of the events (analysis/device.py). The CUDA
kernels' own paths (SDPA's flash / memory-efficient kernels, CUDA autocast's op lists) are not those of a CPU
recording: the report says so.
"""

from __future__ import annotations

from ...simulator.events import Block, Category, Phase, Stream, new_block
from ...simulator.ops import OpGraph, new_op
from ..devices import DeviceProfile
from ..gpu import cublas_workspace_bytes
from .record import ScriptRecording

_THREAD = {Phase.BACKWARD: "autograd"}


def script_graph(rec: ScriptRecording, device: DeviceProfile, rank: int = 0, graph: OpGraph | None = None,
                 base: int = 0) -> tuple[OpGraph, int]:
    """The op graph of a recorded script on `device`, as rank `rank` (its ops and blocks carry it), added to
    `graph` (a distributed script: one recording per rank class, each its own chain of ops) or a new one; and the
    block ids taken so far. `base`: the block ids already taken by other ranks' recordings (what the call that
    added them returned)."""
    graph = graph if graph is not None else OpGraph()
    blocks: dict[int, Block] = {}
    for s in rec.storages.values():
        blocks[s.id] = new_block(base + s.id, s.nbytes, s.category, s.label_name or s.name, s.dtype, s.shape,
                                 s.state if s.category is Category.OPTIMIZER_STATE else None, 1, rank)
    next_id = [base + max(rec.storages, default=0) + 1]
    first = len(graph)
    workspaces: set[str] = set()
    flop_rate = device.flops["fp32"] * device.flops_efficiency
    byte_rate = device.bandwidth * device.bandwidth_efficiency
    pending: dict | None = None

    def flush() -> None:
        if pending is None:
            return
        allocs, flops = pending["allocs"], pending["flops"]
        position = pending["position"]
        if device.is_cuda and flops:
            thread = _THREAD.get(position.phase, "forward")
            if thread not in workspaces:
                workspaces.add(thread)
                size = cublas_workspace_bytes(device.compute_capability)
                allocs = [new_block(next_id[0], size, Category.WORKSPACE, f"cublas_workspace.{thread}_thread",
                                    "uint8", (size,), None, 1, rank)] + allocs
                next_id[0] += 1
        moved = 2 * sum(b.nbytes for b in allocs)
        duration = max(flops / flop_rate, moved / byte_rate) + device.launch_latency
        op_id = len(graph)
        graph.add(new_op(op_id, pending["name"], Stream.COMPUTE, position.phase, position.step, position.micro_batch,
                         duration, rank, tuple(allocs), tuple(blocks[f].id for f in pending["frees"]), flops, False),
                  after=(op_id - 1,) if op_id > first else ())

    for action, sid, call, position, name in rec.events:
        if action == "alloc":
            if pending is None or pending["call"] != call or pending["position"] != position or pending["frees"]:
                flush()
                pending = {"call": call, "position": position, "name": name, "allocs": [], "frees": [],
                           "flops": rec.flops.get(call, 0)}
            pending["allocs"].append(blocks[sid])
        else:
            if pending is None or pending["position"] != position:
                flush()
                pending = {"call": call, "position": position, "name": name, "allocs": [], "frees": [], "flops": 0}
            pending["frees"].append(sid)
    flush()
    return graph, next_id[0]
