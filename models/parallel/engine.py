"""`Engine`: the data-parallel hooks the describer (training.py) and the autograd replay call, and the
single-rank behaviour every engine starts from."""

from __future__ import annotations

from dataclasses import dataclass
from math import prod

from ...simulator.events import Block, Category, Phase, Pool, Stream
from ..config import ConfigError, dtype_bytes
from .layout import OptimTensor, own_dtype

FLOATING = ("fp32", "bf16", "fp16")
# peft's LoraLayer.adapter_layer_names: the modules / parameter dicts that hold an adapter's weights
LORA_ADAPTERS = ("lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B")


def _module(name: str) -> str:
    """The module path of a parameter or buffer: its name without the last component ("" = the root)."""
    return name.rpartition(".")[0]


def _within(module: str, ancestor: str) -> bool:
    return not ancestor or module == ancestor or module.startswith(ancestor + ".")


def is_adapter(name: str) -> bool:
    return any(part in LORA_ADAPTERS for part in name.split("."))


@dataclass(frozen=True)
class BuildEntry:
    """A tensor `cls(config)` makes on the device: a parameter, a buffer, or "tied": the parameter a module made in
    its __init__ for an attribute transformers then ties to another module's parameter (`source`)."""

    kind: str
    name: str
    module: str
    source: str
    shape: tuple[int, ...]
    dtype: str


class DeviceBuild:
    """What `with torch.device("cuda"): model = cls(config)` then `model.to(dtype)` allocate and free, in order, from
    a traced tape (its parameters in `named_parameters()` order, its buffers, and the module each op ran in):

    construction  every parameter in fp32 (torch's default dtype), in the tape's order: `named_parameters()` order,
                  which is the order the modules' __init__ make them for the models traced here; each buffer after
                  the last parameter of the smallest module around it that holds parameters (a module registers
                  its buffers after its parameters and submodules: nn.BatchNorm's running stats, a rotary
                  embedding's inv_freq after the decoder's last norm); floating-point buffers in fp32, others in
                  their own dtype. A module that runs another module's parameter (the op's module is neither the
                  parameter's nor a module around it) holds it as a tied attribute: its own __init__ made that
                  parameter first (nn.Linear / nn.Embedding: the shared one's shape, fp32), placed before the first
                  parameter (tape order) the forward pass uses after that module's first op, and
                  transformers' `tie_weights` drops it at the end of construction (modeling_utils.py
                  PreTrainedModel.tie_weights: `setattr(parent, name, source_param)`);
    model.to      torch/nn/modules/module.py `Module._apply`: children first, then the module's own parameters,
                  then its buffers (a post-order of the module tree); each floating-point tensor's new copy is
                  allocated, then the old one freed (`param.data = param_applied`, `self._buffers[key] =
                  fn(buf)`); a tied parameter is converted once, at the first module that holds it (`param.to`
                  of a tensor already in the dtype returns it, no copy);
    LoRA          peft's adapters (`LORA_ADAPTERS`) are made after the base model, in the tape's order, on the base
                  layer's device and in its dtype (peft/tuners/tuners_utils.py
                  `_move_adapter_to_device_of_base_layer`), then cast to their own dtype one by one (peft's
                  `_cast_adapter_dtype`, autocast_adapter_dtype: 16-bit adapters to fp32).
    `param_post_order` ranks the parameters in the same post-order: the order FSDP2's `_get_managed_modules` lists
    a unit's modules in (models/parallel/fsdp.py)."""

    def __init__(self, tape) -> None:
        self.adapters = [p for p in tape.params if is_adapter(p.name)]
        base = [p for p in tape.params if not is_adapter(p.name)]
        shape = {p.name: p.shape for p in tape.params}
        first_use: dict[str, int] = {}
        ties: dict[tuple[str, str], int] = {}
        for i, op in enumerate(tape.ops):
            suffix = "." + op.kind
            where = op.name[:-len(suffix)] if op.name.endswith(suffix) else op.name
            for p in op.params:
                first_use.setdefault(p, i)
                # a traced tape names the root module "model" (models/traced/record.py), as HF names its decoder:
                # an op there may run any parameter of the model without holding it
                if where != "model" and not _within(_module(p), where) and not is_adapter(p):
                    ties.setdefault((where, p), i)
        last_in: dict[str, int] = {}  # module -> index of the last parameter (tape order) under it
        for i, p in enumerate(base):
            parts = p.name.split(".")[:-1]
            for k in range(len(parts) + 1):
                last_in[".".join(parts[:k])] = i
        keyed = [((i, 0, 0, 0), BuildEntry("param", p.name, _module(p.name), p.name, p.shape, "fp32"))
                 for i, p in enumerate(base)]
        for k, t in enumerate(tape.buffers):
            parts = t.name.split(".")[:-1]
            depth = next((d for d in range(len(parts), -1, -1) if ".".join(parts[:d]) in last_in), None)
            anchor = -1 if depth is None else last_in[".".join(parts[:depth])]
            dtype = "fp32" if t.dtype in FLOATING else t.dtype
            keyed.append(((anchor, 1, -(depth or 0), k), BuildEntry("buffer", t.name, _module(t.name), t.name,
                                                                    t.shape, dtype)))
        for k, ((holder, src), at) in enumerate(ties.items()):
            later = next((i for i, p in enumerate(base) if first_use.get(p.name, -1) > at), len(base))
            leaf = src.rpartition(".")[2]
            keyed.append(((later - 1, 2, 0, k), BuildEntry("tied", f"{holder}.{leaf}", holder, src, shape[src],
                                                           "fp32")))
        for k, (name, src, before) in enumerate(tape.ties):  # a describer that knows them (compiled tapes)
            keyed.append(((before - 1, 2, 0, len(ties) + k), BuildEntry("tied", name, _module(name), src, shape[src],
                                                                        "fp32")))
        keyed.sort(key=lambda kv: kv[0])
        self.construction = [e for _, e in keyed]
        self.ties = [e for e in self.construction if e.kind == "tied"]
        self.apply_order = self._post_order()
        params = [e.source for e in self.apply_order if e.kind != "buffer"]
        self.param_post_order = {name: i for i, name in enumerate(params)}
        self.param_post_order.update({p.name: len(params) + i for i, p in enumerate(self.adapters)})

    def _post_order(self) -> list[BuildEntry]:
        """`Module._apply`'s order over the construction: each parameter once (at the first module holding it, as a
        "param" entry of its own name), then the floating-point buffers, module by module."""
        children: dict[str, list[str]] = {"": []}
        own: dict[str, tuple[list, list]] = {}

        def register(path: str) -> None:
            chain = []
            while path not in children:
                chain.append(path)
                path = _module(path)
            for m in reversed(chain):
                children[_module(m)].append(m)
                children[m] = []

        for e in self.construction:
            register(e.module)
            own.setdefault(e.module, ([], []))[e.kind == "buffer"].append(e)
        out: list[BuildEntry] = []
        seen: set[str] = set()
        stack: list[tuple[str, bool]] = [("", False)]
        while stack:  # post-order without recursion: a module's children, then its own tensors
            path, expanded = stack.pop()
            if not expanded:
                stack.append((path, True))
                stack.extend((c, False) for c in reversed(children[path]))
                continue
            params, buffers = own.get(path, ([], []))
            for e in params:
                if e.source not in seen:
                    seen.add(e.source)
                    out.append(e if e.kind == "param" else BuildEntry("param", e.source, e.module, e.source, e.shape,
                                                                      e.dtype))
            out.extend(e for e in buffers if e.dtype in FLOATING)
        return out


class Engine:
    """Full replicas: one device, or DDP-style data parallelism without sharding.

    Subclasses override the layout and the hooks; this class is also the exact single-device case.
    """

    shards_optimizer = False
    symmetric = True  # every rank's layout is the same by construction (padded equal partitions)

    def __init__(self, builder) -> None:
        self.builder = builder
        self.setup = builder.setup
        self.n = builder.setup.mesh.dp  # the rank's data-parallel group (world_size without tp, pp, cp)
        self.rank = builder.dp_rank
        self.params = {p.name: p for p in builder.tape.params}
        self.trainable = [p for p in builder.tape.params if p.name in builder.trainable]
        self.grad_dtype = builder.setup.precision.grad
        self.contribution_dtype = "fp32" if builder.setup.precision.param == "fp32" else builder.setup.precision.param

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
        return self.setup.precision.master

    def state_shard(self) -> int:
        return 1

    def signature(self) -> tuple:
        """What makes this rank's bytes differ from another's: ranks with equal signatures are identical."""
        return (tuple(self.param_numel(p.name) for p in self.builder.tape.params),
                tuple((t.name, t.numel) for t in self.optim_tensors()))

    def rank_segments(self) -> list[tuple[int, tuple]]:
        """Every rank's `signature()`, by ranges: (first rank, signature) of consecutive ranges of ranks,
        ascending from rank 0, each running to the next one's first rank (the last to N - 1). Within a range
        every rank has the same signature and the same training state (what models/checkpoint_io.rank_state
        reads from the engine); two ranges may be equal. A symmetric engine is one range; an engine that is
        not overrides this from its layout functions, or is asked rank by rank here (O(world) engines)."""
        if self.symmetric:
            return [(0, self.signature())]
        builder = self.builder
        return [
            (
                r,
                self.signature()
                if r == self.rank
                else type(builder)(builder.tape, self.setup, builder.device, r).engine.signature(),
            )
            for r in range(self.n)
        ]

    # load --------------------------------------------------------------------------------------------
    def load(self, grads) -> None:
        builder = self.builder
        if self.setup.checkpoint_io.build == "device-fp32":
            self.build_on_device()
        else:
            self.load_direct()
        master_dtype = self.master_dtype()
        if master_dtype:
            master = [builder.block(f"{t.name}.master", t.numel * 4, Category.MASTER_PARAMETER, "fp32", t.shape,
                              shard=self.state_shard()) for t in self.optim_tensors()]
            builder.op("load.master_weights", Phase.LOAD, 0, -1, master, [], bytes_moved=sum(x.nbytes for x in master))
        if grads.persistent:
            main = [builder.block(f"{p.name}.main_grad", p.numel * 4, Category.GRADIENT, "fp32", p.shape)
                    for p in self.trainable]
            grads.blocks.update({p.name: blk for p, blk in zip(self.trainable, main)})
            builder.op("load.main_grads", Phase.LOAD, 0, -1, main, [], bytes_moved=sum(x.nbytes for x in main))
        self.after_load()

    def load_direct(self) -> None:
        """setup.checkpoint_io.build "direct": every parameter allocated once, in its training dtype and layout, then
        the buffers."""
        builder = self.builder
        params = []
        for p in builder.tape.params:
            numel, shard = self.param_numel(p.name)
            dt = own_dtype(builder.tape, p.name) or self.param_storage_dtype()
            params.append(builder.block(p.name, numel * dtype_bytes(dt), Category.PARAMETER, dt, p.shape, shard=shard,
                                        pool=self.param_pool(), pinned=self.pins_params()))
        params += self.extra_param_blocks()
        # the describers' buffers are floating point: `module.to(dtype)` casts them with the parameters
        buffers = []
        for t in builder.tape.buffers:  # a traced tape's buffers keep the dtype they were traced in
            # `module.to(dtype)` casts floating-point buffers only (an int64 position buffer stays int64)
            floating = t.dtype in ("fp32", "bf16", "fp16")
            dtype = self.param_storage_dtype() if builder.tape.buffers_follow_params and floating else t.dtype
            buffers.append(builder.block(t.name, prod(t.shape) * dtype_bytes(dtype), Category.BUFFER, dtype, t.shape))
        builder.op(
            "load.parameters", Phase.LOAD, 0, -1, params + buffers, [], bytes_moved=sum(x.nbytes for x in params)
        )

    def build_on_device(self) -> None:
        """setup.checkpoint_io.build "device-fp32": the model built on the device in fp32, cast by `model.to(dtype)`
        where this engine stores 16-bit parameters, LoRA's adapters made and cast (`DeviceBuild`), then `shard_built`
        (FSDP2's fully_shard). Traced models only (ConfigError "build" otherwise): a hand-written tape stands for code
        whose construction and tying order it does not record (nanoGPT ties `wte.weight = lm_head.weight`: the tensor
        named first is made last), and a tied parameter is followed in transformers' direction only (the holder's
        own tensor dropped), so a traced `--module` that ties one is refused too."""
        builder = self.builder
        tape = builder.tape
        if not tape.describer.startswith(("traced", "compiled")):
            raise ConfigError("build", "'device-fp32' follows a traced model's construction (--hf-config, --module); "
                                       f"this model is described by hand ({tape.describer}); allowed here: direct")
        plan = DeviceBuild(tape)
        if plan.ties and not tape.describer.startswith("traced (hf:") and "traced hf:" not in tape.describer:
            raise ConfigError("build", f"'device-fp32': {plan.ties[0].module} runs {plan.ties[0].source}, a tied "
                                       "parameter: the order your module's code makes and ties them in is known for "
                                       "HF models only; allowed here: direct")
        after = self.param_storage_dtype()  # the base parameters' dtype once model.to(dtype) ran (fp32: not called)
        for e in plan.construction:
            own = own_dtype(tape, e.name) if e.kind == "param" else None
            if own and own != after:
                how = f"model.to({after}) casts every parameter" if after != "fp32" else "every parameter stays fp32"
                raise ConfigError("build", f"'device-fp32': {how}, but the traced model keeps {e.name} in {own}; "
                                           "allowed here: direct")
        params: dict[str, Block] = {}
        buffers: dict[str, Block] = {}
        made = []
        for e in plan.construction:
            numel = prod(e.shape)
            blk = builder.block(e.name, numel * dtype_bytes(e.dtype), Category.BUFFER if e.kind == "buffer"
                          else Category.PARAMETER, e.dtype, e.shape)
            made.append(blk)
            (buffers if e.kind == "buffer" else params)[e.name] = blk
        builder.op("build.construct", Phase.LOAD, 0, -1, made, [], bytes_moved=sum(x.nbytes for x in made))
        if plan.ties:
            builder.op("build.tie_weights", Phase.LOAD, 0, -1, [], [params.pop(e.name).id for e in plan.ties])
        if after != "fp32":
            for e in plan.apply_order:
                table = buffers if e.kind == "buffer" else params
                old = table[e.name]
                new = builder.block(e.name, prod(e.shape) * dtype_bytes(after), old.category, after, e.shape)
                builder.op(
                    f"build.to.{e.name}", Phase.LOAD, 0, -1, [new], [old.id], bytes_moved=old.nbytes + new.nbytes
                )
                table[e.name] = new
        if plan.adapters:
            made = [builder.block(p.name, p.numel * dtype_bytes(after), Category.PARAMETER, after, p.shape)
                    for p in plan.adapters]
            builder.op("build.lora.adapters", Phase.LOAD, 0, -1, made, [], bytes_moved=sum(x.nbytes for x in made))
            for p, old in zip(plan.adapters, made):
                params[p.name] = old
                own = own_dtype(tape, p.name)
                if own and own != after:
                    new = builder.block(p.name, p.numel * dtype_bytes(own), Category.PARAMETER, own, p.shape)
                    builder.op(f"build.lora.to.{p.name}", Phase.LOAD, 0, -1, [new], [old.id],
                         bytes_moved=old.nbytes + new.nbytes)
                    params[p.name] = new
        extra = self.extra_param_blocks()
        if extra:
            builder.op("build.extra", Phase.LOAD, 0, -1, extra, [], bytes_moved=sum(x.nbytes for x in extra))
        self.shard_built(plan, params)

    def shard_built(self, plan: DeviceBuild, params: dict[str, Block]) -> None:
        """After `build_on_device`: what the data-parallel wrapper does to the built parameters (`params`: name ->
        its live block). One device keeps them as they are."""

    def param_storage_dtype(self) -> str:
        return self.setup.precision.param

    def param_pool(self) -> Pool:
        """Where the rank's stored parameters (and so its optimizer states) live: the device, unless the engine
        offloads them (FSDP2's CPUOffloadPolicy)."""
        return Pool.DEVICE

    def pins_params(self) -> bool:
        """The rank's host-held parameters are pinned memory (FSDP2's CPUOffloadPolicy(pin_memory=True))."""
        return False

    def state_pool(self) -> Pool:
        """Where the optimizer's states live: with the parameters, unless the engine steps on the host
        (ZeRO-Offload)."""
        return self.param_pool()

    host_step_scalar = True  # a host optimizer keeps `step` as a tensor (torch.optim); DeepSpeedCPUAdam: an int

    def extra_param_blocks(self) -> list[Block]:
        return []

    def after_load(self) -> None:
        pass

    # forward / backward hooks ------------------------------------------------------------------------
    # (`replay`: the micro-batch's `ReplayState`, models/replay/state.py: its tape, plan, gradients, builder)
    def before_op(self, replay, i: int, phase: Phase, recompute: bool = False) -> None:
        pass

    def after_op(self, replay, i: int, phase: Phase, recompute: bool = False) -> None:
        pass

    def pure_replay_hooks(self, replay) -> bool:
        """Whether the replay's hooks act on nothing but the op, the replay's state and its GradState (models/
        replay/template.py `pure_hooks`, asked of each class itself): these do nothing, and `param_grad` reads and
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
        builder = self.builder
        numel, shape = self.params[p].numel, self.params[p].shape
        own = own_dtype(builder.tape, p)  # a LoRA adapter kept fp32 under pure bf16: its gradient is fp32 too
        grad_dtype, contribution_dtype = (own, own) if own else (self.grad_dtype, self.contribution_dtype)
        has_grad = replay.grads.persistent or p in replay.grads.blocks or p in replay.contributed
        uses = replay.plan.grad_uses.get(p, 1)
        if uses > 1:
            seen = replay.grad_seen[p] = replay.grad_seen.get(p, 0) + 1
            cdt = contribution_dtype
            new = builder.block(f"{p}.grad_contribution", numel * dtype_bytes(cdt), Category.TEMPORARY, cdt, shape)
            allocs.append(new)
            if seen == 1:
                replay.grad_buffer[p] = new  # waits in AccumulateGrad's input buffer
                replay.grad_had[p] = has_grad
                if not has_grad:  # keeps `.grad`'s place in the order gradients are freed (zero_grad)
                    replay.grads.blocks[p] = new
                return
            last = seen == uses
            stolen = last and not replay.grad_had[p]
            total = builder.block(f"{p}.grad" if stolen else f"{p}.grad_sum", numel * dtype_bytes(cdt),
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
            tmp = builder.block(f"{p}.grad_contribution", numel * dtype_bytes(contribution_dtype),
                          Category.TEMPORARY, contribution_dtype, shape)
            allocs.append(tmp)
            frees.append(tmp.id)
        else:
            blk = builder.block(f"{p}.grad", numel * dtype_bytes(grad_dtype), Category.GRADIENT,
                          grad_dtype, shape)
            replay.grads.blocks[p] = blk
            allocs.append(blk)
        replay.contributed.add(p)

    def end_backward(self, step: int, mb: int) -> None:
        pass

    # optimizer ---------------------------------------------------------------------------------------
    def before_step(self, step: int, grads) -> list[Block]:
        """Before the update: fp32 copies of 16-bit gradients where mixed precision needs them (freed after)."""
        s, builder = self.setup, self.builder
        if not (s.precision.master and not s.precision.fp32_grads):
            return []
        fp32 = [builder.block(f"{t.name}.grad_fp32", t.numel * 4, Category.TEMPORARY, "fp32", t.shape,
                        shard=self.state_shard()) for t in self.optim_tensors()]
        builder.op("optimizer.grads_to_fp32", Phase.OPTIMIZER, step, -1, fp32, [],
             bytes_moved=3 * sum(x.nbytes for x in fp32))
        return fp32

    def after_step(self, step: int) -> None:
        pass

    def zero_grad_frees(self, grads) -> list[int]:
        """`zero_grad(set_to_none=True)` drops the gradients in parameter order (torch/optim/optimizer.py
        `zero_grad`: its param_groups in `model.parameters()` order)."""
        if self.setup.optimizer.set_to_none and not grads.persistent:
            order = {p.name: i for i, p in enumerate(self.builder.tape.params)}
            frees = [blk.id for _, blk in sorted(grads.blocks.items(), key=lambda kv: order.get(kv[0], len(order)))]
            grads.blocks.clear()
            return frees
        return []

    # collectives -------------------------------------------------------------------------------------
    def collective(self, name: str, kind: str, nbytes: int, phase: Phase, step: int, mb: int,
                   allocs=(), frees=(), after=(), pool: Stream | None = None):
        """One collective: its buffers are allocated (and its scratch freed) when the host issues it, in
        program order on the compute stream, as the caching allocator sees them (from `pool`'s pool when the
        program allocates them under that stream); the transfer itself runs on the rank's communication stream
        for the ring model's duration, overlapping later compute."""
        issue = self.builder.op(f"{name}.issue", phase, step, mb, allocs, frees, duration=0.0, after=after, pool=pool)
        duration = self.builder.device.collective_duration(kind, nbytes, self.n)
        return self.builder.op(name, phase, step, mb, [], [], stream=Stream.COMMUNICATION, duration=duration,
                         after=(issue.id,))
