"""torch FSDP2 (`fully_shard`): dim-0 chunked parameters, per-unit all-gather and reduce-scatter buffers."""

from __future__ import annotations

from ...simulator.events import Block, Category, Phase, Pool, Stream
from ..config import dtype_bytes
from ..devices import device_profile
from ..replay.plan import backward_order
from .engine import DeviceBuild
from .gathering import Gathering
from .layout import ROOT, UNIT_PATTERN, OptimTensor, dim0_ranges, dim0_shard, own_dtype, unit_of


class FSDP2(Gathering):
    """torch FSDP2 `fully_shard`: one unit per transformer block / MLP Linear, the rest in the root.

    The order of allocations and frees is the one measured on torch 2.13 (gloo, CPU; see
    bench/DISTRIBUTED_FINDINGS.md):
    forward   unit pre-forward: all-gather output (flat, N x the padded shards), copy-out into each
              parameter's unsharded storage, then the previous unit's all-gather output is freed (FSDP2
              keeps the last one as `all_gather_state`; the root's post-forward frees the last);
              post-forward: the unsharded storages are freed (`reshard_after_forward`, never the root).
    backward  the root's pre-backward all-gathers the first unit in backward order ahead
              (`backward_prefetch` units ahead at every pre-backward); a unit's pre-backward copies out
              and frees its all-gather output at once; its post-backward reshards, frees the previous
              unit's reduce-scatter input, allocates its own (N x padded shards), frees the unsharded
              gradients and reduce-scatters into one flat sharded-gradient buffer (summed into the
              existing one in later micro-batches); the last input is freed by the final callback.
    reduce    input and output in `setup.data_parallel.fsdp2.reduce_dtype` (MixedPrecisionPolicy.reduce_dtype; "grad":
    the
              gradients' dtype), the output allocated under the reduce-scatter stream (its caching-allocator
              pool on a GPU) and cast to the sharded parameters' dtype where the two differ.
    one rank  no all-gather: each shard is cast to the param dtype and copied into its unsharded storage
              (`wait_for_unshard`, world_size == 1); measured on torch 2.13 CPU (tests/test_fsdp_one_rank.py)
              and by the H200 one-GPU run (torch 2.11).
    Not modelled: gloo's reduce-scatter clones its input on its worker threads, freed at a moment that
    varies from run to run (NCCL makes no such copy); measured logs drop it (`without_backend_copies`).

    With setup.checkpoint_io.build "device-fp32" the model is first built whole on every rank (engine.py `DeviceBuild`),
    then `fully_shard` runs on each unit in the order of its first parameter, the root last (run_cases.py: every
    decoder layer, then the model): `shard_built`.
    """

    prefix = "fsdp"
    symmetric = False  # the last ranks' local shards can be shorter (or empty)

    def __init__(self, builder) -> None:
        super().__init__(builder)
        self.units = set(builder.tape.layers) or {
            m.group(1) for p in builder.tape.params if (m := UNIT_PATTERN.match(p.name))
        }
        self.unit_params: dict[str, list] = {}
        for p in builder.tape.params:
            self.unit_params.setdefault(unit_of(p.name, self.units), []).append(p)
        self.op_unit = [unit_of(op.name, self.units) for op in builder.tape.ops]
        self.forward_order = list(dict.fromkeys(u for u in self.op_unit if u != ROOT))
        self.kept_gather: Block | None = None  # all_gather_state: the last forward all-gather output
        self.kept_reduce_input: Block | None = None  # reduce_scatter_state: the last reduce-scatter input
        self.sharded_grads: dict[str, Block] = {}
        self.last_backward: dict[str, int] = {}
        self.backward_started = False
        self.sync_grads = True  # False between a pipeline's micro-batches (models/parallel/pipeline.py)
        self.outside: set[int] = set()  # ops the module does not run (a pipeline's loss: the schedule's loss_fn)
        self.module_last = len(self.op_unit) - 1  # the module's last op: the root's post-forward follows it
        # CPUOffloadPolicy(pin_memory=True), on > 1 rank (one rank: refused by the setup's knob rules)
        self.offload = self.setup.data_parallel.fsdp2.cpu_offload and self.n > 1
        self.host_grads: dict[str, list[Block]] = {}  # offload: unit -> its parameters' sharded gradients, on the host

    def run_outside(self, ops: set[int]) -> None:
        """Ops `ops` run outside the FSDP module (no hook fires for them)."""
        self.outside = set(ops)
        self.module_last = max(i for i in range(len(self.op_unit)) if i not in self.outside)

    # layout ----------------------------------------------------------------------------------------------
    def param_numel(self, name: str) -> tuple[int, int]:
        return dim0_shard(self.params[name].shape, self.n, self.rank)[0], self.n

    def param_storage_dtype(self) -> str:
        return "fp32" if self.setup.precision.master else self.setup.precision.param

    def master_dtype(self) -> str | None:
        return None  # the fp32 sharded parameters are the master weights under mixed precision

    def param_pool(self) -> Pool:
        """CPUOffloadPolicy: `_init_sharded_param` moves each padded shard to the CPU and pins it (_fsdp_param.py:
        `padded_sharded_param.cpu()`, then `.pin_memory()`); the optimizer's states follow its parameters."""
        return Pool.HOST if self.offload else Pool.DEVICE

    def pins_params(self) -> bool:
        """CPUOffloadPolicy(pin_memory=True), its default: the host shards (and first gradients) are page-locked on
        a GPU; a CPU run has nothing to pin (torch pins only where CUDA is available)."""
        return self.offload and not self.builder.device.is_cpu

    def state_shard(self) -> int:
        return self.n

    def optim_tensors(self) -> list[OptimTensor]:
        out = []
        for p in self.trainable:
            local = dim0_shard(p.shape, self.n, self.rank)[1]
            rest = p.numel // p.shape[0] if p.shape else 1
            out.append(OptimTensor(p.name, local, (local // rest, *p.shape[1:]) if p.shape else ()))
        return out

    def rank_segments(self) -> list[tuple[int, tuple]]:
        """From `dim0_ranges`: a parameter's local shard changes only where its full chunks end and after its
        partial one, so the ranks split at those ranks of every parameter (frozen ones too: a checkpoint saves
        their local shards), at most 2 per distinct dim 0 whatever the world size; each range's signature is
        `signature()` of its first rank."""
        ranges = {p.name: dim0_ranges(p.shape, self.n) for p in self.builder.tape.params}
        stored = tuple(self.param_numel(p.name) for p in self.builder.tape.params)
        out = []
        for start in sorted({r for rs in ranges.values() for r, _ in rs}):
            local = [(p.name, next(numel for first, numel in reversed(ranges[p.name]) if first <= start))
                     for p in self.trainable]
            out.append((start, (stored, tuple(local))))
        return out

    def group_params(self, group: str) -> list:
        return self.unit_params.get(group, [])

    # load --------------------------------------------------------------------------------------------------------
    def shard_built(self, plan: DeviceBuild, params: dict[str, Block]) -> None:
        """`fully_shard(unit)` on parameters already on the device, as torch 2.13 does it (torch/distributed/fsdp/
        _fully_shard): `_get_managed_modules` lists the unit's modules in post-order (a module after its children,
        nested units left out) and `_get_managed_states` their parameters, each once (_fsdp_init.py); `FSDPParamGroup.
        __init__` makes an `FSDPParam` of each in that order, whose `_init_sharded_param` allocates the padded shard
        (`param_data.new_zeros(chunks[0].size())`: ceil(dim0 / N) rows, in the parameter's dtype) and copies the
        rank's rows in; the original is "freed normally when its ref count reaches 0 when the `fully_shard` call
        returns" (_fsdp_param.py): its last reference is the `OrderedDict(module.named_parameters())` that
        torch/distributed/_composable/contract.py's wrapper keeps to check the names after the call, so the
        originals go in `named_parameters()` order (a dict drops its values in insertion order) once every shard is
        made. The H200 snapshot of the FSDP2 run (torch 2.11) shows this order unit by unit, allocation for
        allocation. 2.13 gathers the managed states in _fsdp_init.py `_get_modules_and_states` (shared with
        `replicate`) and makes one FSDPParamGroup per process group when a `shard_placement_fn` sends parameters to
        other meshes; without one, a single group, as here."""
        builder = self.builder
        units = [u for u in self.unit_params if u != ROOT] + ([ROOT] if ROOT in self.unit_params else [])
        for unit in units:
            members = self.unit_params[unit]
            shards = []
            for p in sorted(members, key=lambda p: plan.param_post_order[p.name]):
                numel, shard = self.param_numel(p.name)
                dt = own_dtype(builder.tape, p.name) or self.param_storage_dtype()
                shards.append(
                    builder.block(p.name, numel * dtype_bytes(dt), Category.PARAMETER, dt, p.shape, shard=shard)
                )
            builder.op(f"fsdp.fully_shard.{unit}", Phase.LOAD, 0, -1, shards, [params.pop(p.name).id for p in members],
                 bytes_moved=2 * sum(x.nbytes for x in shards))

    # unshard / reshard -----------------------------------------------------------------------------------
    def gather(self, group: str, phase: Phase, step: int, mb: int) -> None:
        if self.n > 1 and self.offload:
            return self.gather_offloaded(group, phase, step, mb)
        if self.n > 1:
            return super().gather(group, phase, step, mb)
        # one rank: `unshard` issues no all-gather (_fsdp_param_group.py: `if world_size == 1`); the copies
        # happen in `wait_for_unshard` (copy_out)
        if group not in self.live and self.group_params(group):
            self.in_flight.setdefault(group, None)

    def copy_out(self, unit: str, gather_op: int | None, phase: Phase, step: int, mb: int) -> None:
        """Copy the unit's gathered parameters into their unsharded storages; the all-gather output is freed
        at once in backward, and kept as `all_gather_state` until the next unit's copy-out in forward.
        One rank (_fsdp_param_group.py `wait_for_unshard`, `world_size == 1`): each parameter's shard, cast to
        the param_dtype (`all_gather_inputs`: a new tensor where the dtypes differ), is copied into its
        unsharded storage; a cast lives until the next parameter's cast replaces it in the loop."""
        builder = self.builder
        if self.n == 1:
            blocks, cast = [], None
            size = dtype_bytes(self.gather_dtype)
            for p in self.group_params(unit):
                numel = self.padded_full(p.name)
                if (own_dtype(builder.tape, p.name) or self.param_storage_dtype()) != self.gather_dtype:
                    previous, cast = cast, builder.block(f"{p.name}.all_gather_input", numel * size, Category.TEMPORARY,
                                                   self.gather_dtype, p.shape)
                    builder.op(f"fsdp.unshard_cast.{p.name}", phase, step, mb, [cast],
                         [previous.id] if previous is not None else [], bytes_moved=3 * numel * size)
                blocks.append(builder.block(f"{p.name}.unsharded", numel * size, Category.PARAMETER, self.gather_dtype,
                                      p.shape))
                builder.op(
                    f"fsdp.unshard_copy.{p.name}", phase, step, mb, blocks[-1:], [], bytes_moved=2 * numel * size
                )
            if cast is not None:
                builder.op(f"fsdp.unshard_done.{unit}", phase, step, mb, [], [cast.id])
            self.live[unit] = blocks
            return
        output = self.buffers.pop(unit)
        size = dtype_bytes(self.gather_dtype)
        blocks = [builder.block(f"{p.name}.unsharded", self.padded_full(p.name) * size, Category.PARAMETER,
                          self.gather_dtype, p.shape) for p in self.group_params(unit)]
        if phase is Phase.FORWARD:
            frees = [self.kept_gather.id] if self.kept_gather is not None else []
            self.kept_gather = output
        else:
            frees = [output.id]
        builder.op(
            f"fsdp.copy_out.{unit}",
            phase,
            step,
            mb,
            blocks,
            frees,
            bytes_moved=2 * sum(x.nbytes for x in blocks),
            after=(gather_op,),
        )
        self.live[unit] = blocks

    def gather_offloaded(self, group: str, phase: Phase, step: int, mb: int) -> None:
        """CPUOffloadPolicy's all-gather (torch 2.13 _fsdp_collectives.py `_get_param_all_gather_inputs`: no
        foreach fast path under offload; _fsdp_param.py `all_gather_inputs`): each parameter's host shard copied to
        the device (`.to(self.device, non_blocking=True)`, on the host link), cast to the param_dtype where it
        differs (the copy then dropped), the all-gather output allocated and the inputs copied in, the inputs
        dropped once the all-gather is issued."""
        if group in self.live or group in self.in_flight or not self.group_params(group):
            return
        builder, gd = self.builder, self.gather_dtype
        inputs, copies = [], []
        for p in self.group_params(group):
            numel = self.padded_full(p.name) // self.n
            sdt = own_dtype(builder.tape, p.name) or self.param_storage_dtype()
            copy = builder.block(f"{p.name}.all_gather_input.to_device", numel * dtype_bytes(sdt), Category.TEMPORARY,
                                 sdt, (numel,))
            keep = copy if sdt == gd else builder.block(f"{p.name}.all_gather_input", numel * dtype_bytes(gd),
                                                        Category.TEMPORARY, gd, (numel,))
            issue = builder.op(f"fsdp.all_gather_input.to_device.{p.name}", phase, step, mb,
                               [copy] if keep is copy else [copy, keep], [] if keep is copy else [copy.id],
                               duration=0.0)
            copies.append(builder.op(f"fsdp.all_gather_input.to_device.{p.name}.copy", phase, step, mb, [], [],
                                     stream=Stream.HOST, duration=copy.nbytes / builder.device.host_link,
                                     after=(issue.id,)).id)
            inputs.append(keep)
        numel = sum(self.padded_full(p.name) for p in self.group_params(group))
        buf = builder.block(f"{group}.all_gather_output", numel * dtype_bytes(gd), Category.ALL_GATHER_BUFFER, gd,
                            (numel,))
        op = self.collective(f"{self.prefix}.all_gather.{group}", "all_gather", numel * dtype_bytes(gd), phase, step,
                             mb, allocs=[buf], after=(copies[-1],))
        builder.op(f"fsdp.all_gather_inputs.free.{group}", phase, step, mb, [], [x.id for x in inputs], duration=0.0)
        self.in_flight[group] = op.id
        self.buffers[group] = buf

    def prefetch_backward(self, unit: str | None, step: int, mb: int) -> None:
        """Issue the all-gathers of the next `backward_prefetch` units in backward order after `unit`."""
        order = list(reversed(self.forward_order))
        k = 0 if unit is None else order.index(unit) + 1
        for ahead in order[k:k + self.setup.data_parallel.fsdp2.backward_prefetch]:
            if ahead not in self.live:
                self.gather(ahead, Phase.BACKWARD, step, mb)

    # hooks -----------------------------------------------------------------------------------------------
    def before_op(self, replay, i: int, phase: Phase, recompute: bool = False) -> None:
        if i in self.outside:  # no hook of the module's fires: its pre-backward waits for the output's gradient
            return
        step, mb = replay.step, replay.mb
        unit = self.op_unit[i]
        if phase is Phase.FORWARD:
            if i == 0:
                self.backward_started = False
                self.wait(ROOT, phase, step, mb)
            if unit != ROOT:
                self.wait(unit, phase, step, mb)
                k = self.forward_order.index(unit)
                for ahead in self.forward_order[k + 1:k + 1 + self.setup.data_parallel.fsdp2.forward_prefetch]:
                    self.gather(ahead, phase, step, mb)
            return
        if not self.backward_started:  # the root's pre-backward
            self.backward_started = True
            self.last_backward = {}
            for j in backward_order(replay.tape, replay.plan):
                if self.op_unit[j] != ROOT:
                    self.last_backward[self.op_unit[j]] = j
            self.wait(ROOT, phase, step, mb)
            self.prefetch_backward(None, step, mb)
        if unit != ROOT and unit not in self.live:
            self.wait(unit, phase, step, mb)
            self.prefetch_backward(unit, step, mb)

    def after_op(self, replay, i: int, phase: Phase, recompute: bool = False) -> None:
        unit = self.op_unit[i]
        if recompute or i in self.outside:
            return
        if phase is Phase.FORWARD:
            last = i == self.module_last
            if (
                unit != ROOT
                and (last or self.op_unit[i + 1] != unit)
                and self.setup.data_parallel.fsdp2.reshard_after_forward
            ):
                self.release(unit, phase, replay.step, replay.mb)
            if last and self.kept_gather is not None:  # the root's post-forward drops all_gather_state
                self.builder.op("fsdp.root_post_forward", phase, replay.step, replay.mb, [], [self.kept_gather.id])
                self.kept_gather = None
        elif unit != ROOT and self.last_backward.get(unit) == i:
            self.post_backward(unit, replay.step, replay.mb)

    def param_grad(self, replay, p: str, allocs: list, frees: list) -> None:
        builder, spec = self.builder, self.params[p]
        if p in self.unsharded_grads:  # a tied weight's second use: summed into the first
            tmp = builder.block(
                f"{p}.grad_contribution",
                spec.numel * dtype_bytes(self.gather_dtype),
                Category.TEMPORARY,
                self.gather_dtype,
                spec.shape,
            )
            allocs.append(tmp)
            frees.append(tmp.id)
            return
        blk = builder.block(f"{p}.unsharded.grad", spec.numel * dtype_bytes(self.gather_dtype), Category.GRADIENT,
                      self.gather_dtype, spec.shape)
        self.unsharded_grads[p] = blk
        allocs.append(blk)

    def post_backward(self, unit: str, step: int, mb: int) -> None:
        """Reshard the unit, then reduce-scatter its gradients into the flat sharded-gradient buffer; under a
        pipeline schedule (`sync_grads` off) neither, until the schedule's reduction: the unsharded gradients
        accumulate (torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py `post_backward`)."""
        if not self.sync_grads:
            return
        builder = self.builder
        self.release(unit, Phase.BACKWARD, step, mb)
        params = [p for p in self.group_params(unit) if p.name in self.unsharded_grads]
        if not params:
            return
        # _fsdp_collectives.py foreach_reduce: the reduce-scatter input (current stream) and output (allocated
        # under the reduce-scatter stream: its pool) in reduce_dtype (None: the gradients' dtype), the output
        # cast to the sharded parameter's dtype where they differ
        dt = (
            self.gather_dtype
            if self.setup.data_parallel.fsdp2.reduce_dtype == "grad"
            else self.setup.data_parallel.fsdp2.reduce_dtype
        )
        full = sum(self.padded_full(p.name) for p in self.group_params(unit))
        rs_input = builder.block(f"{unit}.reduce_scatter_input", full * dtype_bytes(dt), Category.REDUCE_SCATTER_BUCKET,
                           dt, (full,))
        # _fsdp_param_group.py post_backward: the oldest of `reduce_scatter_states` (at most 1 by default) is
        # dropped before this reduce allocates its input
        if self.kept_reduce_input is not None:
            builder.op(f"fsdp.post_backward_rs_wait.{unit}", Phase.BACKWARD, step, mb, [], [self.kept_reduce_input.id])
        self.kept_reduce_input = rs_input
        builder.op(f"fsdp.reduce_scatter_copy_in.{unit}", Phase.BACKWARD, step, mb, [rs_input],
             [self.unsharded_grads.pop(p.name).id for p in params], bytes_moved=2 * rs_input.nbytes)
        shard = full // self.n
        grad_dt = self.param_storage_dtype()
        first = unit not in self.sharded_grads
        allocs, out_frees = [], []
        if dt != grad_dt:  # `_to_dtype_if_needed(reduce_output, orig_dtype)`: the reduce-dtype output is dropped
            reduced = builder.block(f"{unit}.reduce_scatter_output", shard * dtype_bytes(dt), Category.TEMPORARY, dt,
                              (shard,), shard=self.n)
            allocs, out_frees = [reduced], [reduced.id]
        name = f"{unit}.reduce_scatter_output" + (f".{grad_dt}" if dt != grad_dt else "")
        if self.offload:
            first = unit not in self.host_grads
        out = builder.block(f"{unit}.sharded_grads" if first and not self.offload else name,
                      shard * dtype_bytes(grad_dt), Category.GRADIENT if first and not self.offload
                      else Category.TEMPORARY, grad_dt, (shard,), shard=self.n)
        allocs.append(out)
        if self.offload:
            pass  # copied to the host below, then dropped
        elif first:
            self.sharded_grads[unit] = out
        else:
            out_frees.append(out.id)
        reduce = self.collective(
            f"fsdp.reduce_scatter.{unit}",
            "reduce_scatter",
            rs_input.nbytes,
            Phase.BACKWARD,
            step,
            mb,
            allocs=allocs,
            frees=out_frees,
            after=(builder.last(Stream.COMPUTE),),
            pool=Stream.COMMUNICATION,
        )
        if self.offload:
            self.grads_to_host(unit, out, reduce.id, first, step, mb)

    def grads_to_host(self, unit: str, out: Block, reduce: int, first: bool, step: int, mb: int) -> None:
        """CPUOffloadPolicy (_fsdp_collectives.py `foreach_reduce`): each parameter's view of the reduce-scatter
        output copied to the host, `.to("cpu", non_blocking=pin_memory and not accumulating)`: a pinned host
        gradient the first time, a pageable one summed into it and dropped in later micro-batches; the device
        output dropped once copied ("we can free it here by not keeping a ref")."""
        builder = self.builder
        grads = []
        for p in self.group_params(unit):
            numel = self.padded_full(p.name) // self.n
            grads.append(builder.block(f"{p.name}.grad" if first else f"{p.name}.grad.to_host",
                                       numel * dtype_bytes(out.dtype), Category.GRADIENT if first else
                                       Category.TEMPORARY, out.dtype, (numel,), shard=self.n, pool=Pool.HOST,
                                       pinned=first and self.pins_params()))
        copy = builder.op(f"fsdp.reduce_scatter_output.to_host.{unit}.copy", Phase.BACKWARD, step, mb, [], [],
                          stream=Stream.HOST, duration=out.nbytes / builder.device.host_link, after=(reduce,))
        builder.op(f"fsdp.reduce_scatter_output.to_host.{unit}", Phase.BACKWARD, step, mb, grads, [out.id],
                   duration=0.0, after=(copy.id,))
        if first:
            self.host_grads[unit] = grads
        else:
            builder.op(f"fsdp.sharded_grad.accumulate.{unit}", Phase.BACKWARD, step, mb, [], [g.id for g in grads],
                       bytes_moved=3 * sum(g.nbytes for g in grads))

    def end_backward(self, step: int, mb: int) -> None:
        for unit in [u for u in self.forward_order if u in self.live]:
            self.post_backward(unit, step, mb)
        self.post_backward(ROOT, step, mb)
        # the final callback: wait for the last reduce-scatter and drop reduce_scatter_state
        frees = [self.kept_reduce_input.id] if self.kept_reduce_input is not None else []
        self.kept_reduce_input = None
        self.builder.op("fsdp.post_backward_final_callback", Phase.BACKWARD, step, mb, [], frees,
                  after=(self.builder.last(Stream.COMMUNICATION),))

    def zero_grad_frees(self, grads) -> list[int]:
        if not self.setup.optimizer.set_to_none:
            return []
        frees = [blk.id for blk in self.sharded_grads.values()]
        frees += [blk.id for blocks in self.host_grads.values() for blk in blocks]
        self.sharded_grads.clear()
        self.host_grads.clear()
        return frees

    def before_step(self, step: int, grads) -> list[Block]:
        """CPUOffloadPolicy: the optimizer steps the host shards on the CPU (a fused Adam step reads and writes 7
        shard-sized tensors, at the cost model's CPU memory bandwidth, assumed)."""
        if self.offload:
            cpu = device_profile("cpu")
            nbytes = sum(t.numel for t in self.optim_tensors()) * dtype_bytes(self.param_storage_dtype())
            self.builder.op("fsdp.cpu_offload.host_step", Phase.OPTIMIZER, step, -1, [], [],
                            duration=7 * nbytes / cpu.bandwidth)
        return []
