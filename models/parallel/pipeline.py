"""Pipeline parallelism (`TrainingSetup.pp`): one pipeline rank's step, as torch.distributed.pipelining (torch 2.13)
runs it: the rank's stages (stages.py: the layout, each rank's schedule of actions, the stage tapes) replayed micro-
batch by micro-batch in its schedule's order, with the receive buffers, the references the schedule's own code
keeps, and the sends and receives linked across ranks (`PipelineRank`), over the rank's data-parallel engine
(`PipelineEngine`).
"""

from __future__ import annotations

from ...simulator.events import Block, Category, Phase, Stream
from ..config import TrainingSetup
from ..replay import MicroBatchReplay
from ..replay.template import pure_hooks
from ..tape import Tape
from .engine import Engine
from .stages import F, StageTape, rank_actions, stage_tapes

# -- one pipeline rank's step ----------------------------------------------------------------------------------

class _Held:
    """A tensor the schedule's own Python code references (a variable, a list of P2POps or of send Works,
    `bwd_cache`): the stage output or logits a replay owns (one reason in the replay's state per reference), or
    an input gradient the pipeline took from its replay (freed when the last reference goes)."""

    def __init__(self, state=None, name: str | None = None, block: Block | None = None) -> None:
        self.state, self.name, self.block, self.count = state, name, block, 0

    def hold(self) -> None:
        if self.state is not None:
            self.state.hold(self.name)
        else:
            self.count += 1

    def drop(self, frees: list[int]) -> None:
        if self.state is not None:
            self.state.release(self.name, frees)
            return
        self.count -= 1
        if self.count == 0:
            frees.append(self.block.id)


class _Var:
    """A Python name (or list) of the schedule's code: assigning holds the new tensors first, then lets go of
    the old ones (`set`); `extend` adds to a list that lives until the step returns."""

    def __init__(self) -> None:
        self.refs: list[_Held] = []

    def set(self, refs: list[_Held], frees: list[int]) -> None:
        for r in refs:
            r.hold()
        old, self.refs = self.refs, list(refs)
        for r in old:
            r.drop(frees)

    def extend(self, refs: list[_Held]) -> None:
        for r in refs:
            r.hold()
        self.refs += refs


class PipelineEngine:
    """A pipeline rank: its data-parallel engine (`inner`: the stages' parameters, gradients and optimizer
    states; replicas, or ZeRO-1's partitioned states, whose hooks act at load and step only) and the schedule's
    step (`run_step`), which replays the micro-batches of its stages. Every other attribute is the inner
    engine's."""

    def __init__(self, builder, inner: Engine) -> None:
        self.inner = inner
        self.pipeline = PipelineRank(builder)
        self.pipeline.reduce_grads = self.reduce_grads
        if hasattr(inner, "sync_grads"):  # FSDP2: no reduce-scatter, no reshard after the micro-batches' backward
            inner.sync_grads = False
            # the loss is the schedule's loss_fn on the stage module's output, outside the module's hooks
            inner.run_outside({i for i, op in enumerate(builder.tape.ops) if op.name.startswith("loss.")})

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def reduce_grads(self, step: int) -> None:
        """The end of the schedule's `_step_microbatches` (torch/distributed/pipelining/schedules.py
        `perform_reduce_grad`, stage.py): FSDP2's post-backward of every unit, gradient sync and reshard on
        (each backward ran with `set_requires_gradient_sync(False)` and `set_reshard_after_backward(False)`:
        stage.py `backward_maybe_with_nosync`), then its final callback; replicas all-reduce here."""
        sync = hasattr(self.inner, "sync_grads")
        if sync:
            self.inner.sync_grads = True
        self.inner.end_backward(step, self.pipeline.setup.batch.grad_accum - 1)
        if sync:
            self.inner.sync_grads = False

    def pure_replay_hooks(self, replay) -> bool:
        """No code of the schedule's runs inside this replay's forward (`module_end`, by the replay's state), and the
        inner engine's hooks are pure (models/replay/template.py)."""
        return id(replay) not in self.pipeline.module_end and pure_hooks(self.inner, replay)

    def after_op(self, replay, i: int, phase: Phase, recompute: bool = False) -> None:
        self.inner.after_op(replay, i, phase, recompute)
        hook = self.pipeline.module_end.get(id(replay))
        if hook is not None and phase is Phase.FORWARD and i == hook[0]:
            hook[1]()

    def run_step(self, step: int, grads) -> None:
        self.pipeline.run_step(step, grads)


class PipelineRank:
    """One pipeline rank's step, as torch.distributed.pipelining runs it (torch 2.13, `PipelineStage` with
    static shapes, `return_outputs=False` as torchtitan calls `step`):

    - the caller's whole batch (m x B, T) is allocated at the start of the step on the ranks that read it
      (token ids: the first stage's; targets: the last stage's) and dropped when the step returns; the
      schedule splits it into views (micro-batch `tensor_split`, no copy);
    - step 1 only (`_initialize_pp_stages`: `_prepare_forward_infra`, then `_prepare_backward_infra` with
      the stages in reverse): every non-first stage allocates m activation receive buffers, every non-last
      stage m gradient receive buffers (`_make_tensor_from_meta`), kept for good; a micro-batch's forward
      reads its activation buffer as a leaf, its backward starts from its gradient buffer (a gradient
      summed into it is summed out of place: autograd does not own it);
    - a forward (`forward_one_chunk`) replays the stage's ops; its output stays in `fwd_cache` until the
      micro-batch's backward (the last stage: its logits, and the loss after them); a backward
      (`stage_backward`) replays the backward and leaves the gradient of the stage's input in `bwd_cache`;
    - what the schedule's Python code still references keeps a tensor alive past that: the `output`
      variable (the latest forward's output), the P2POps of the latest sends (`fwd_sends`, `bwd_sends` in
      Schedule1F1B), the send Works it keeps (Schedule1F1B's `send_work`; every send of the step in
      ScheduleGPipe's `fwd_sends_to_wait` / `bwd_sends_to_wait` and in the runtime's `send_ops` of the
      multi-stage schedules, all waited on, and dropped, only when the step returns);
    - sends and receives are ops on the communication stream and waits on the compute stream, linked across
      ranks (`_p2p`): the idle time of each rank (the bubble) comes out of the simulation.
    The last stage's losses (4 bytes each) are kept until the step returns (`_internal_losses`). Not modelled:
    the 4-byte int32 tensors of the first step's P2P warm-up vote, the 4-byte `ones_like` of each loss's
    backward."""

    def __init__(self, builder) -> None:
        self.builder = builder
        self.setup = builder.setup
        self.stages: tuple[StageTape, ...] = builder.tape.stages
        self.by_index = {st.spec.index: st for st in self.stages}
        self.recv_act: dict[tuple[int, int], Block] = {}
        self.recv_grad: dict[tuple[int, int], Block] = {}
        self.module_end: dict[int, tuple[int, object]] = {}
        self.links = builder.graph.__dict__.setdefault("pipeline_p2p", {})

    # -- the step --------------------------------------------------------------------------------------
    def run_step(self, step: int, grads) -> None:
        builder, s = self.builder, self.setup
        self.step, self.grads = step, grads
        self.replays: dict[tuple[int, int], MicroBatchReplay] = {}
        self.outputs: dict[tuple[int, int], _Held] = {}
        self.input_grads: dict[tuple[int, int], _Held] = {}
        m = s.batch.grad_accum
        self.batch = {}
        for st in self.stages:
            for t in st.batch:
                if t.name not in self.batch:
                    shape = (t.shape[0] * m,) + tuple(t.shape[1:])
                    self.batch[t.name] = builder.block(t.name, t.nbytes * m, Category.INPUT, t.dtype, shape)
        if self.batch:
            builder.op("batch.load", Phase.FORWARD, step, -1, list(self.batch.values()), [])
        if not self.recv_act and not self.recv_grad:
            self._init_buffers()
        self.vars: list[_Var] = []
        self.losses = self._var()
        if s.mesh.pp_schedule == "gpipe":
            self._gpipe(self.stages[0])
        elif s.mesh.pp_schedule == "1f1b":
            self._one_f_one_b(self.stages[0])
        else:
            self._runtime()
        self.reduce_grads(step)  # perform_reduce_grad: the data-parallel reduction, the schedule's locals alive
        frees: list[int] = []
        for var in self.vars:  # the step returns: its locals and lists go
            var.set([], frees)
        frees += [blk.id for blk in self.batch.values()]
        grad_bytes = sum(blk.nbytes for blk in grads.blocks.values())
        builder.op(
            "pp.step_end", Phase.FORWARD, step, -1, [], frees, bytes_moved=2 * grad_bytes
        )  # scale_grads: in place

    def _var(self) -> _Var:
        var = _Var()
        self.vars.append(var)
        return var

    def _release(self, frees: list[int]) -> None:
        if frees:
            self.builder.op("pp.release", Phase.FORWARD, self.step, -1, [], frees)

    def _init_buffers(self) -> None:
        builder, m = self.builder, self.setup.batch.grad_accum
        acts, grads = [], []
        for st in self.stages:
            if st.input is not None:
                for i in range(m):
                    t = st.input
                    self.recv_act[(st.spec.index, i)] = blk = builder.block(
                        f"pp.stage{st.spec.index}.recv_activation.mb{i}", t.nbytes, Category.ACTIVATION, t.dtype,
                        t.shape)
                    acts.append(blk)
        for st in reversed(self.stages):
            if st.output is not None:
                for i in range(m):
                    t = st.output
                    self.recv_grad[(st.spec.index, i)] = blk = builder.block(
                        f"pp.stage{st.spec.index}.recv_grad.mb{i}", t.nbytes, Category.TEMPORARY, t.dtype, t.shape)
                    grads.append(blk)
        if acts:
            builder.op("pp.init.recv_activations", Phase.FORWARD, self.step, -1, acts, [])
        if grads:
            builder.op("pp.init.recv_grads", Phase.FORWARD, self.step, -1, grads, [])

    # -- compute actions ---------------------------------------------------------------------------------
    def forward(self, st: StageTape, mb: int, after_module=None) -> None:
        """`forward_one_chunk` (after waiting for its activation), with `after_module` run between the
        stage module's last op and the loss (the schedule's code between the two calls)."""
        key = (st.spec.index, mb)
        if st.input is not None:
            self._wait("F", st.spec.index, mb)
        external = {t.name: (t, self.batch[t.name]) for t in st.batch}
        if st.input is not None:
            external[st.input.name] = (st.input, self.recv_act[key])
        replay = MicroBatchReplay(self.builder, st.tape, self.step, mb, self.grads, external=external)
        state = replay.state  # what the engine's hooks get
        self.replays[key] = replay
        out = st.output.name if st.output is not None else st.tape.held[0]
        self.outputs[key] = _Held(state, out)
        if after_module is not None:
            end = max(i for i, op in enumerate(st.tape.ops) if not op.name.startswith("loss."))
            self.module_end[id(state)] = (end, after_module)
        replay.forward()
        self.module_end.pop(id(state), None)
        if st.tape.loss in state.live:  # the schedule keeps every loss (`_internal_losses`) until the step returns
            self.losses.extend([_Held(state, st.tape.loss)])

    def backward(self, st: StageTape, mb: int) -> _Held | None:
        """`backward_one_chunk` (after waiting for its gradient): the input's gradient, in `bwd_cache`."""
        key = (st.spec.index, mb)
        replay = self.replays.pop(key)
        if st.output is not None:
            self._wait("B", st.spec.index, mb)
            replay.receive_grad(st.output.name, self.recv_grad[key])
        replay.backward()
        if st.input is None:
            return None
        blk = replay.take_grad(st.input.name)
        held = self.input_grads[key] = _Held(block=blk)
        held.hold()  # bwd_cache
        return held

    def send_output(self, st: StageTape, mb: int) -> None:
        if st.output is not None:
            self._send("F", st.spec.index + 1, mb, st.output.nbytes)

    def send_grad(self, st: StageTape, mb: int) -> None:
        if st.input is not None:
            self._send("B", st.spec.index - 1, mb, st.input.nbytes)

    # -- point to point ----------------------------------------------------------------------------------
    def _send(self, kind: str, to_stage: int, mb: int, nbytes: int) -> None:
        builder = self.builder
        name = f"pp.send_{'activation' if kind == 'F' else 'grad'}.stage{to_stage}.mb{mb}"
        issue = builder.op(f"{name}.issue", Phase.FORWARD, self.step, -1, [], [], duration=0.0)
        send = builder.op(name, Phase.FORWARD, self.step, -1, [], [], stream=Stream.COMMUNICATION,
                    duration=builder.device.collective_duration("broadcast", nbytes, 2), after=(issue.id,))
        link = self.links.setdefault((self.builder.pipeline_group, kind, to_stage, mb, self.step),
                                     {"send": None, "waits": []})
        link["send"] = send.id
        for w in link["waits"]:
            builder.graph.add_edge(send.id, w)

    def _wait(self, kind: str, stage: int, mb: int) -> None:
        link = self.links.setdefault((self.builder.pipeline_group, kind, stage, mb, self.step),
                                     {"send": None, "waits": []})
        after = (link["send"],) if link["send"] is not None else ()
        wait = self.builder.op(f"pp.recv_{'activation' if kind == 'F' else 'grad'}.stage{stage}.mb{mb}", Phase.FORWARD,
                         self.step, -1, [], [], duration=0.0, after=after)
        if link["send"] is None:
            link["waits"].append(wait.id)

    # -- the schedules -----------------------------------------------------------------------------------
    def _gpipe(self, st: StageTape) -> None:
        """ScheduleGPipe._step_microbatches: the variables `output`, `ops`, `works`, and the lists of every
        send's Works (`fwd_sends_to_wait`, `bwd_sends_to_wait`), all alive until the step returns."""
        m = self.setup.batch.grad_accum
        output, ops, works, fwd_list, bwd_list = (self._var() for _ in range(5))
        for i in range(m):
            frees: list[int] = []
            ops.set([], frees)  # the receive ops: they reference the receive buffers only
            works.set([], frees)
            self._release(frees)

            def after_module(i=i):
                frees: list[int] = []
                output.set([self.outputs[(st.spec.index, i)]], frees)
                if st.output is not None:
                    ops.set([self.outputs[(st.spec.index, i)]], frees)
                    self.send_output(st, i)
                    works.set([self.outputs[(st.spec.index, i)]], frees)
                    fwd_list.extend([self.outputs[(st.spec.index, i)]])
                else:
                    ops.set([], frees)
                    works.set([], frees)
                self._release(frees)
            self.forward(st, i, after_module)
        for i in range(m):
            frees = []
            ops.set([], frees)
            works.set([], frees)
            self._release(frees)
            g = self.backward(st, i)
            frees = []
            if g is not None:
                ops.set([g], frees)
                g.drop(frees)  # out of bwd_cache
                self.send_grad(st, i)
                works.set([g], frees)
                bwd_list.extend([g])
            else:
                ops.set([], frees)
                works.set([], frees)
            self._release(frees)

    def _one_f_one_b(self, st: StageTape) -> None:
        """Schedule1F1B._step_microbatches: warm-up forwards (the last one's send fused with the first
        backward's receive), 1B1F, cool-down; its variables `output`, `fwd_sends`, `bwd_sends` (P2POps) and
        `send_work` (the Works of the latest unfused send) keep their tensors until reassigned."""
        s, m = st.spec.index, self.setup.batch.grad_accum
        warmup = min(m, self.setup.mesh.pp - s)
        output, fwd_sends, bwd_sends, send_work = (self._var() for _ in range(4))
        out = lambda k: [self.outputs[(s, k)]] if st.output is not None else []  # noqa: E731
        fwd = bwd = 0
        for _ in range(warmup):
            def after_module(k=fwd):
                frees: list[int] = []
                output.set([self.outputs[(s, k)]], frees)
                fwd_sends.set(out(k), frees)
                if k != warmup - 1:
                    if st.output is not None:
                        self.send_output(st, k)
                    send_work.set(out(k), frees)
                self._release(frees)
            self.forward(st, fwd, after_module)
            fwd += 1
        while True:
            if st.output is not None:
                self.send_output(st, fwd - 1)  # fwd_sends fused with this backward's receive
            g = self.backward(st, bwd)
            frees: list[int] = []
            bwd_sends.set([g] if g is not None else [], frees)
            if g is not None:
                g.drop(frees)  # out of bwd_cache
            self._release(frees)
            bwd += 1
            if fwd == m:
                break
            if g is not None:
                self.send_grad(st, bwd - 1)  # bwd_sends fused with this forward's receive

            def after_module(k=fwd):
                frees: list[int] = []
                output.set([self.outputs[(s, k)]], frees)
                self._release(frees)
            self.forward(st, fwd, after_module)
            frees = []
            fwd_sends.set(out(fwd), frees)
            self._release(frees)
            fwd += 1
        frees = []
        if st.input is not None:
            self.send_grad(st, bwd - 1)
        send_work.set(bwd_sends.refs, frees)
        self._release(frees)
        while bwd < m:
            g = self.backward(st, bwd)
            frees = []
            bwd_sends.set([g] if g is not None else [], frees)
            if g is not None:
                g.drop(frees)
                self.send_grad(st, bwd)
            send_work.set(bwd_sends.refs, frees)
            self._release(frees)
            bwd += 1

    def _runtime(self) -> None:
        """_PipelineScheduleRuntime._step_microbatches over the rank's actions (interleaved-1f1b): each
        forward's output and each backward's input gradient is sent right after it (`_add_send_recv`), and
        the send Works are kept in `send_ops` until the step returns."""
        s = self.setup
        send_ops = self._var()
        rank = self.stages[0].spec.rank
        for a in rank_actions(s.mesh.pp_schedule, s.mesh.pp, s.batch.grad_accum, rank, s.mesh.virtual_stages):
            st = self.by_index[a.stage]
            if a.kind == F:
                self.forward(st, a.mb)
                if st.output is not None:
                    self.send_output(st, a.mb)
                    send_ops.extend([self.outputs[(a.stage, a.mb)]])
            else:
                g = self.backward(st, a.mb)
                if g is not None:
                    self.send_grad(st, a.mb)
                    send_ops.extend([g])
                    frees: list[int] = []
                    g.drop(frees)  # out of bwd_cache
                    self._release(frees)


def pipeline_metadata(tape: Tape, setup: TrainingSetup) -> dict:
    """The layout and schedule a pipeline graph records (its RunMetadata's `pipeline`)."""
    stages = stage_tapes(tape, setup)
    return {
        "pp": setup.mesh.pp,
        "schedule": setup.mesh.pp_schedule,
        "virtual_stages": setup.mesh.virtual_stages,
        "micro_batches": setup.batch.grad_accum,
        "stages": [
            {
                "index": st.spec.index,
                "rank": st.spec.rank,
                "layers": [st.spec.layers.start, st.spec.layers.stop],
                "embeddings": st.spec.first,
                "output": st.spec.last,
                "parameters": list(st.params),
            }
            for st in stages
        ],
        "actions": {
            r: [
                str(a)
                for a in rank_actions(
                    setup.mesh.pp_schedule, setup.mesh.pp, setup.batch.grad_accum, r, setup.mesh.virtual_stages
                )
            ]
            for r in range(setup.mesh.pp)
        },
    }


def pipeline_timing(graph) -> dict[int, dict]:
    """Each rank's last simulated step in time, from the op graph as the simulator runs it (an op starts when
    the op before it on its stream and every op it depends on have ended): the step's length on that rank
    (its first op's start to its last op's end), the compute stream's busy time in it, and the bubble, the
    idle fraction 1 - busy / length (waiting for activations and gradients from the other stages)."""
    order = graph.ops_in_order()
    preds = graph.predecessor_lists()
    n = len(order)
    if len(preds) == n and [op.id for op in order] == list(range(n)):  # ids are places (a describer's graph)
        duration = [op.duration for op in order]
        end: list[float] | dict[int, float] = [0.0] * n
        start: list[float] | dict[int, float] = [0.0] * n
    else:
        duration = {op.id: op.duration for op in order}
        end, start = {}, {}
    for op_id in graph.topological_order():  # the op before on a stream is a predecessor too
        ps = preds[op_id]
        if not ps:
            t0 = 0.0
        elif len(ps) == 1:
            t0 = end[ps[0]]
        else:
            t0 = max([end[d] for d in ps])
        start[op_id] = t0
        end[op_id] = t0 + duration[op_id]
    last_step = max([op.step for op in order], default=0)
    by_rank: dict[int, list] = {}
    for op in order:
        if op.step == last_step:
            by_rank.setdefault(op.rank, []).append(op)
    out = {}
    compute = Stream.COMPUTE
    for rank, ops in sorted(by_rank.items()):
        length = max([end[op.id] for op in ops]) - min([start[op.id] for op in ops])
        busy = sum([op.duration for op in ops if op.stream is compute and not op.name.startswith("pp.recv")])
        out[rank] = {"step": last_step, "step_time_s": length, "busy_s": busy,
                     "bubble": 1 - busy / length if length > 0 else 0.0}
    return out
