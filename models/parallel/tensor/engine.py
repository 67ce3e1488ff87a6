"""The engine hooks of tensor parallelism: what a rank's tape (transform.py) cannot say as TapeOps.

What no TapeOp can say is kept on the returned `TensorParallelTape` and done by `TensorParallelEngine`, a thin
wrapper of the rank's data-parallel engine that the replay's hooks reach (models/replay/ calls
`engine.before_op` / `after_op` around every op, `engine.param_grad` for every parameter gradient):
- `grad_hooks`: after an op's backward node, (a) "sum": a gradient contribution that DTensor sums out of place
  (Partial input gradients of the q/k/v and gate/up linears, measured as `ViewBackward0.add`; SP: the residual
  stream's gradient where a SequenceParallel norm's `DTensor.from_local` hands back an alias of its DTensor's
  local tensor, so autograd's input buffer cannot add in place: `_FromTorchTensorBackward.add`), and (b)
  "all_reduce": without SP, the input gradient of the column-parallel linears, Partial, all-reduced by the
  backward of the `DTensor.from_local` that ColwiseParallel / PrepareModuleInput wrapped the replicated input
  in (style.py `_prepare_input_fn`; torch/distributed/tensor/_api.py `_FromTorchTensor.backward`): a new
  tensor, the partial freed. Neither has a forward allocation to hang a TapeOp on (`from_local` makes no
  memory), hence the hook.
- `grad_shapes`: a vocab-parallel embedding's gradient, when nothing else adds into it (an untied embedding),
  is the full (V, D) table on every rank: DTensor's embedding_dense_backward strategy makes it Replicate
  (measured: `model.embed_tokens.weight.grad` (V, D), while the weight and its AdamW states are (V / tp, D)).
- collective TapeOps also get an op on the rank's communication stream (timing only; their buffers are allocated
  in program order on the compute stream, as the CPU run shows them).
"""

from __future__ import annotations

from ....simulator.events import Category, Phase, Stream
from ...replay import replace_grad
from ...replay.template import pure_hooks
from ...tape import ParamSpec
from .transform import COLLECTIVES, TensorParallelTape, is_distributed


class TensorParallelEngine:
    """A rank's data-parallel engine (`inner`) plus what a `TensorParallelTape` needs from the replay's hooks:
    the gradient hooks, the gradient shapes and communication-stream ops for the collective TapeOps. Every
    other attribute is the inner engine's."""

    def __init__(self, inner, tape: TensorParallelTape) -> None:
        self.inner = inner
        self.tape = tape
        self._before: dict[str, object] = {}

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def pure_replay_hooks(self, replay) -> bool:
        """The hooks act on the op and the replay only (`_before` holds a gradient from an op's before_op to its
        after_op), the rest is the inner engine's (models/replay/template.py)."""

        return pure_hooks(self.inner, replay)

    def before_op(self, replay, i: int, phase: Phase, recompute: bool = False) -> None:
        self.inner.before_op(replay, i, phase, recompute)
        if phase is Phase.BACKWARD and not recompute:
            for kind, tensor in self.tape.grad_hooks.get(replay.tape.ops[i].name, ()):
                if kind == "sum":
                    self._before[tensor] = replay.grad_of.get(tensor)

    def after_op(self, replay, i: int, phase: Phase, recompute: bool = False) -> None:
        self.inner.after_op(replay, i, phase, recompute)
        op = replay.tape.ops[i]
        builder = replay.builder
        if phase is Phase.FORWARD and op.kind in COLLECTIVES and op.kind != "shard":
            nbytes = sum(o.nbytes for o in op.outputs)
            kind = op.kind
            builder.op(
                f"{op.name}.transfer",
                phase,
                replay.step,
                replay.mb,
                [],
                [],
                stream=Stream.COMMUNICATION,
                duration=builder.device.collective_duration(kind, nbytes, self.tape.tp),
                after=(builder.last(Stream.COMPUTE),),
            )
        if phase is not Phase.BACKWARD or recompute:
            return
        for kind, tensor in self.tape.grad_hooks.get(op.name, ()):
            if kind == "sum":
                self._sum_out_of_place(replay, tensor)
            elif kind == "all_reduce":
                self._all_reduce(replay, tensor)

    def _sum_out_of_place(self, replay, tensor: str) -> None:
        """The node just added a contribution to `tensor`'s gradient that the replay summed in place; DTensor
        sums it out of place: the contribution (a shadow here, the replay freed it already) and the sum are
        live together, then the old gradient goes."""

        had = self._before.pop(tensor, None)
        storage = replay.grad_of.get(tensor)
        if had is None or storage is not had:
            return
        spec = replay.specs[tensor]
        builder = replay.builder
        shadow = builder.block(f"{tensor}.grad_contribution", spec.nbytes, Category.TEMPORARY, spec.dtype, spec.shape)
        total = builder.block(f"{tensor}.grad_sum", spec.nbytes, Category.TEMPORARY, spec.dtype, spec.shape)
        frees = [shadow.id] + replace_grad(replay, tensor, total)
        builder.op(f"{tensor}.grad_sum", Phase.BACKWARD, replay.step, replay.mb, [shadow, total], frees,
             bytes_moved=3 * spec.nbytes)

    def _all_reduce(self, replay, tensor: str) -> None:
        """`_FromTorchTensor.backward`: the Partial gradient of a replicated input all-reduced into a new tensor."""

        if tensor not in replay.grad_of:
            return
        spec = replay.specs[tensor]
        builder = replay.builder
        reduced = builder.block(f"{tensor}.grad_all_reduce", spec.nbytes, Category.TEMPORARY, spec.dtype, spec.shape)
        frees = replace_grad(replay, tensor, reduced)
        issue = builder.op(f"{tensor}.grad_all_reduce", Phase.BACKWARD, replay.step, replay.mb, [reduced], frees,
                     duration=0.0)
        builder.op(f"{tensor}.grad_all_reduce.transfer", Phase.BACKWARD, replay.step, replay.mb, [], [],
             stream=Stream.COMMUNICATION,
             duration=builder.device.collective_duration("all_reduce", spec.nbytes, self.tape.tp),
             after=(issue.id,))

    def optim_groups(self) -> list:
        """torch.optim parameter groups as the real runs build them (traces/tensor_run.py `optimizer_groups`, one
        per device mesh: foreach kernels refuse to mix DTensors and plain tensors): the DTensors, then the plain
        tensors, each group's states made and stepped before the next's (torch/optim/adam.py `step`)."""
        groups = self.inner.optim_groups()
        if len(groups) != 1 or any(t.name not in self.inner.params for t in groups[0]):
            return groups  # a flat partition (DeepSpeed): one group of its own
        sp = self.tape.sequence_parallel
        split = ([t for t in groups[0] if is_distributed(t.name, sp)],
                 [t for t in groups[0] if not is_distributed(t.name, sp)])
        return [g for g in split if g]

    def param_grad(self, replay, p: str, allocs: list, frees: list) -> None:
        shape = self.tape.grad_shapes.get(p)
        if shape is None:
            return self.inner.param_grad(replay, p, allocs, frees)
        stored = self.inner.params[p]
        self.inner.params[p] = ParamSpec(p, shape)  # the gradient's size, for this call only
        try:
            return self.inner.param_grad(replay, p, allocs, frees)
        finally:
            self.inner.params[p] = stored


__all__ = ["TensorParallelEngine"]
