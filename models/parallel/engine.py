"""`Engine`: the data-parallel hooks the describer (training.py) and the autograd replay call, and the
single-rank behaviour every engine starts from."""

from __future__ import annotations

from math import prod

from ...simulator.events import Block, Category, Phase, Stream
from ..config import dtype_bytes
from .layout import OptimTensor, own_dtype


class Engine:
    """Full replicas: one device, or DDP-style data parallelism without sharding.

    Subclasses override the layout and the hooks; this class is also the exact single-device case.
    """

    shards_optimizer = False
    symmetric = True  # every rank's layout is the same by construction (padded equal partitions)

    def __init__(self, b) -> None:
        self.b = b
        self.setup = b.setup
        self.n = b.setup.dp  # the rank's data-parallel group (world_size without tp, pp, cp)
        self.rank = b.dp_rank
        self.params = {p.name: p for p in b.tape.params}
        self.trainable = [p for p in b.tape.params if p.name in b.trainable]
        self.grad_dtype = b.setup.grad_dtype
        self.contribution_dtype = "fp32" if b.setup.param_dtype == "fp32" else b.setup.param_dtype

    # layout ------------------------------------------------------------------------------------------
    def param_numel(self, name: str) -> tuple[int, int]:
        """(elements of parameter `name` this rank stores at rest, shard factor)."""
        return self.params[name].numel, 1

    def optim_tensors(self) -> list[OptimTensor]:
        return [OptimTensor(p.name, p.numel, p.shape) for p in self.trainable]

    def optim_groups(self) -> list[list[OptimTensor]]:
        """The optimizer's parameter groups, each made (states) and stepped before the next: one here."""
        return [self.optim_tensors()]

    def master_dtype(self) -> str | None:
        return self.setup.master_dtype

    def state_shard(self) -> int:
        return 1

    def signature(self) -> tuple:
        """What makes this rank's bytes differ from another's: ranks with equal signatures are identical."""
        return (tuple(self.param_numel(p.name) for p in self.b.tape.params),
                tuple((t.name, t.numel) for t in self.optim_tensors()))

    def rank_segments(self) -> list[tuple[int, tuple]]:
        """Every rank's `signature()`, by ranges: (first rank, signature) of consecutive ranges of ranks,
        ascending from rank 0, each running to the next one's first rank (the last to N - 1). Within a range
        every rank has the same signature and the same training state (what models/checkpoint_io.rank_state
        reads from the engine); two ranges may be equal. A symmetric engine is one range; an engine that is
        not overrides this from its layout functions, or is asked rank by rank here (O(world) engines)."""
        if self.symmetric:
            return [(0, self.signature())]
        b = self.b
        return [(r, self.signature() if r == self.rank else type(b)(b.tape, self.setup, b.device, r).engine.signature())
                for r in range(self.n)]

    # load --------------------------------------------------------------------------------------------
    def load(self, grads) -> None:
        b = self.b
        params = []
        for p in b.tape.params:
            numel, shard = self.param_numel(p.name)
            dt = own_dtype(b.tape, p.name) or self.param_storage_dtype()
            params.append(b.block(p.name, numel * dtype_bytes(dt), Category.PARAMETER, dt, p.shape, shard=shard))
        params += self.extra_param_blocks()
        # the describers' buffers are floating point: `module.to(dtype)` casts them with the parameters
        buffers = []
        for t in b.tape.buffers:  # a traced tape's buffers keep the dtype they were traced in
            # `module.to(dtype)` casts floating-point buffers only (an int64 position buffer stays int64)
            floating = t.dtype in ("fp32", "bf16", "fp16")
            dtype = self.param_storage_dtype() if b.tape.buffers_follow_params and floating else t.dtype
            buffers.append(b.block(t.name, prod(t.shape) * dtype_bytes(dtype), Category.BUFFER, dtype, t.shape))
        b.op("load.parameters", Phase.LOAD, 0, -1, params + buffers, [], bytes_moved=sum(x.nbytes for x in params))
        master_dtype = self.master_dtype()
        if master_dtype:
            master = [b.block(f"{t.name}.master", t.numel * 4, Category.MASTER_PARAMETER, "fp32", t.shape,
                              shard=self.state_shard()) for t in self.optim_tensors()]
            b.op("load.master_weights", Phase.LOAD, 0, -1, master, [], bytes_moved=sum(x.nbytes for x in master))
        if grads.persistent:
            main = [b.block(f"{p.name}.main_grad", p.numel * 4, Category.GRADIENT, "fp32", p.shape)
                    for p in self.trainable]
            grads.blocks.update({p.name: blk for p, blk in zip(self.trainable, main)})
            b.op("load.main_grads", Phase.LOAD, 0, -1, main, [], bytes_moved=sum(x.nbytes for x in main))
        self.after_load()

    def param_storage_dtype(self) -> str:
        return self.setup.param_dtype

    def extra_param_blocks(self) -> list[Block]:
        return []

    def after_load(self) -> None:
        pass

    # forward / backward hooks ------------------------------------------------------------------------
    def before_op(self, replay, i: int, phase: Phase, recompute: bool = False) -> None:
        pass

    def after_op(self, replay, i: int, phase: Phase, recompute: bool = False) -> None:
        pass

    def pure_replay_hooks(self, replay) -> bool:
        """Whether the replay's hooks act on nothing but the op, the replay and its GradState (models/
        replay_template.py `pure_hooks`, asked of each class itself): these do nothing, and `param_grad` reads and
        writes nothing else."""
        return True

    def param_grad(self, replay, p: str, allocs: list, frees: list) -> None:
        """A gradient contribution for parameter `p` in backward: the first in the step becomes `.grad`;
        later ones (more micro-batches, kept gradients) are temporaries summed in place.

        A parameter read by several ops of one micro-batch (a tied embedding) has one AccumulateGrad
        node, whose input buffer sums the contributions before it runs: the first waits in the buffer
        (from its own backward node on), each later one is added OUT of place once the node that made
        it is done (a new sum, then the old sum and the contribution are freed: measured with the
        tracker, torch 2.13 CPU, fp32 and bf16-autocast), and after the last one AccumulateGrad steals
        the sum as `.grad`, or adds it in place to the `.grad` already there and frees it."""
        b = self.b
        numel, shape = self.params[p].numel, self.params[p].shape
        own = own_dtype(b.tape, p)  # a LoRA adapter kept fp32 under pure bf16: its gradient is fp32 too
        grad_dtype, contribution_dtype = (own, own) if own else (self.grad_dtype, self.contribution_dtype)
        has_grad = replay.grads.persistent or p in replay.grads.blocks or p in replay.contributed
        uses = replay.grad_uses.get(p, 1)
        if uses > 1:
            seen = replay.grad_seen[p] = replay.grad_seen.get(p, 0) + 1
            cdt = contribution_dtype
            new = b.block(f"{p}.grad_contribution", numel * dtype_bytes(cdt), Category.TEMPORARY, cdt, shape)
            allocs.append(new)
            if seen == 1:
                replay.grad_buffer[p] = new  # waits in AccumulateGrad's input buffer
                replay.grad_had[p] = has_grad
                if not has_grad:  # keeps `.grad`'s place in the order gradients are freed (zero_grad)
                    replay.grads.blocks[p] = new
                return
            last = seen == uses
            stolen = last and not replay.grad_had[p]
            total = b.block(f"{p}.grad" if stolen else f"{p}.grad_sum", numel * dtype_bytes(cdt),
                            Category.GRADIENT if stolen else Category.TEMPORARY, cdt, shape)
            # the engine adds a node's outputs to the next input buffers once the node is done (its
            # grad_output and saved tensors gone): the sum is an op of its own, right after
            sum_frees = [replay.grad_buffer.pop(p).id, new.id]
            if not last:
                replay.grad_buffer[p] = total
            elif stolen:
                replay.grads.blocks[p] = total
            else:
                sum_frees.append(total.id)  # summed in place into the `.grad` already there
            replay.after_node.append((f"{p}.grad_accumulate", [total], sum_frees))
            replay.contributed.add(p)
            return
        if has_grad:
            tmp = b.block(f"{p}.grad_contribution", numel * dtype_bytes(contribution_dtype),
                          Category.TEMPORARY, contribution_dtype, shape)
            allocs.append(tmp)
            frees.append(tmp.id)
        else:
            blk = b.block(f"{p}.grad", numel * dtype_bytes(grad_dtype), Category.GRADIENT,
                          grad_dtype, shape)
            replay.grads.blocks[p] = blk
            allocs.append(blk)
        replay.contributed.add(p)

    def end_backward(self, step: int, mb: int) -> None:
        pass

    # optimizer ---------------------------------------------------------------------------------------
    def before_step(self, step: int, grads) -> list[Block]:
        """Before the update: fp32 copies of 16-bit gradients where mixed precision needs them (freed after)."""
        s, b = self.setup, self.b
        if not (s.master_dtype and not s.fp32_grads):
            return []
        fp32 = [b.block(f"{t.name}.grad_fp32", t.numel * 4, Category.TEMPORARY, "fp32", t.shape,
                        shard=self.state_shard()) for t in self.optim_tensors()]
        b.op("optimizer.grads_to_fp32", Phase.OPTIMIZER, step, -1, fp32, [],
             bytes_moved=3 * sum(x.nbytes for x in fp32))
        return fp32

    def after_step(self, step: int) -> None:
        pass

    def zero_grad_frees(self, grads) -> list[int]:
        """`zero_grad(set_to_none=True)` drops the gradients in parameter order (torch/optim/optimizer.py
        `zero_grad`: its param_groups in `model.parameters()` order)."""
        if self.setup.set_to_none and not grads.persistent:
            order = {p.name: i for i, p in enumerate(self.b.tape.params)}
            frees = [blk.id for _, blk in sorted(grads.blocks.items(), key=lambda kv: order.get(kv[0], len(order)))]
            grads.blocks.clear()
            return frees
        return []

    # collectives -------------------------------------------------------------------------------------
    def collective(self, name: str, kind: str, nbytes: int, phase: Phase, step: int, mb: int,
                   allocs=(), frees=(), after=()):
        """One collective: its buffers are allocated (and its scratch freed) when the host issues it, in
        program order on the compute stream, as the caching allocator sees them; the transfer itself runs
        on the rank's communication stream for the ring model's duration, overlapping later compute."""
        issue = self.b.op(f"{name}.issue", phase, step, mb, allocs, frees, duration=0.0, after=after)
        duration = self.b.device.collective_duration(kind, nbytes, self.n)
        return self.b.op(name, phase, step, mb, [], [], stream=Stream.COMMUNICATION, duration=duration,
                         after=(issue.id,))
