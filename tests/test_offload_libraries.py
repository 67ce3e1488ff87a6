"""Optimizer and gradient offload as the libraries do it: torchao 0.18.0's CPUOffloadOptimizer
(`optimizer_offload cpu`, `offload_gradients`), its own code run on the CPU (traces/reference/torchao_offload.py
stands in for its stream, pin_memory and record_stream), against the simulation."""

import inspect

import pytest
import torch

from peakledger import validation
from peakledger.api import op_graph, run
from peakledger.cli import main
from peakledger.models.config import ConfigError, TrainingSetup
from peakledger.models.offload_libraries import MINIMAL_SIZE, is_pinned
from peakledger.scenario import build_scenario
from peakledger.simulator.events import Category, Phase, Pool, Stream
from peakledger.traces.reference import autocast_context, build_model, make_batch, optimizer_class
from peakledger.traces.reference.torchao_offload import TorchaoOffload

cpu_offload = pytest.importorskip("torchao.optim.cpu_offload")


def scenario(preset: str, **training):
    base = dict(precision="fp32", micro_batch=2, steps=2, optimizer="adamw", optimizer_impl="fused",
                optimizer_offload="cpu", **({} if preset == "tiny-mlp" else {"seq_len": 32}))
    return build_scenario({"preset": preset}, {**base, **training}, {"device": "cpu"})


def library_step(sc):
    """One real step of torchao's optimizer; what its own objects hold after backward and after the step."""
    setup = sc.setup
    model = build_model(sc.model, setup)
    cls, kwargs = optimizer_class(setup)
    opt = TorchaoOffload([p for p in model.parameters() if p.requires_grad], setup, cls, kwargs).optimizer
    names = {id(p): n for n, p in model.named_parameters()}
    with autocast_context(setup):
        _, loss = model(*make_batch(sc.model, setup)[0])
    loss.backward()
    grads_left = sorted(names[id(p)] for p in model.parameters() if p.grad is not None)
    opt.step()
    return {
        "pinned": sum(h.untyped_storage().nbytes() + h.grad.untyped_storage().nbytes()
                      for h in opt.param_d2h_map.values()),
        "host_states": sum(v.untyped_storage().nbytes() for p, o in opt.optim_dict.items()
                           for v in o.state[opt.param_d2h_map[p]].values()),
        "on_device": sorted(names[id(p)] for g in opt.d_param_groups for p in g["params"]),
        "grads_left": grads_left,
    }


def simulated_step(sc):
    """The simulated blocks: device gradients live when step 1's optimizer phase begins; what lives after step 1."""
    live, grads_left = {}, None
    for op in (op for op in op_graph(sc).ops_in_order() if op.step <= 1):
        if grads_left is None and op.phase is Phase.OPTIMIZER:
            grads_left = sorted(b.name.removesuffix(".grad") for b in live.values()
                                if b.category is Category.GRADIENT and b.pool is Pool.DEVICE)
        live.update({b.id: b for b in op.allocs})
        for f in op.frees:
            live.pop(f, None)
    host = [b for b in live.values() if b.pool is Pool.HOST]
    return {
        "pinned": sum(b.nbytes for b in host if is_pinned(b)),
        "host_states": sum(b.nbytes for b in host if b.category is Category.OPTIMIZER_STATE),
        "on_device": sorted({b.name.rsplit(".", 1)[0] for b in live.values()
                             if b.category is Category.OPTIMIZER_STATE and b.pool is Pool.DEVICE}),
        "grads_left": grads_left,
    }


def test_minimal_size_is_the_librarys_default():
    assert inspect.signature(cpu_offload.CPUOffloadOptimizer).parameters["minimal_size"].default == MINIMAL_SIZE


@pytest.mark.parametrize("preset, training", [
    ("tiny-mlp", dict(offload_gradients=True)),
    ("tiny", dict(precision="bf16")),  # tied embedding: its hook runs after the last use's sum
    ("tiny", dict(precision="bf16-autocast", optimizer="amsgrad", offload_gradients=True)),
])
def test_torchaos_own_objects_are_the_simulated_blocks(preset, training):
    """Pinned host copies (p_host, p_host.grad), the host optimizers' states, the parameters torchao keeps on the
    device (fewer than minimal_size elements) and which device gradients offload_gradients leaves: the library's
    objects after a real step, the simulation's blocks."""
    sc = scenario(preset, **training)
    lib = library_step(sc)
    assert lib["pinned"] > 0 and lib["host_states"] > 0
    assert simulated_step(sc) == lib
    if training.get("offload_gradients"):
        assert lib["grads_left"] == lib["on_device"]  # only d_opt's parameters keep a device gradient


def test_a_real_run_under_the_tracker_matches_the_simulation():
    """tiny-mlp, offload_gradients: the host peak and the optimizer / zero_grad phases exact; the forward and
    backward phases off by exactly what the same run without the offload is off (its 4-byte loss scalars);
    dropping the gradients in backward lowers the backward peak by the same bytes on both sides."""
    v, _, _ = validation.validate(scenario("tiny-mlp", steps=3, offload_gradients=True))
    kept, _, _ = validation.validate(scenario("tiny-mlp", steps=3))
    plain, _, _ = validation.validate(scenario("tiny-mlp", steps=3, optimizer_offload="none"))
    gaps = {p.label: p.predicted - p.measured for p in v.phases}
    plain_gaps = {p.label: p.predicted - p.measured for p in plain.phases}
    assert v.host.measured == v.host.predicted > 0
    assert all(gaps[k] == 0 for k in gaps if k.startswith(("optimizer", "zero_grad")))
    assert all(gaps[k] == plain_gaps[k] for k in gaps if k.startswith(("load", "forward", "backward")))
    back = {p.label: p for p in v.phases}["backward step 2"]
    back_kept = {p.label: p for p in kept.phases}["backward step 2"]
    assert back_kept.measured - back.measured == back_kept.predicted - back.predicted > 0


def test_llama_3_8b_host_bytes_follow_torchaos_rules():
    """Llama-3-8B, pure bf16: every parameter tensor has >= 4096 elements, so all 8,030,261,248 parameters get a
    pinned bf16 p_host and p_host.grad (4 bytes each) and bf16 exp_avg / exp_avg_sq on the host, plus a 4-byte
    fp32 `step` per tensor (fused: `_get_scalar_dtype(is_fused=True)`); 32 layers x 9 tensors + embedding, final
    norm and lm_head = 291 tensors; one copy of each gradient to the host and of each parameter back."""
    n, tensors = 8_030_261_248, 32 * 9 + 3
    sc = build_scenario({"preset": "llama-3-8b"}, dict(precision="bf16", seq_len=1024, micro_batch=1, steps=1,
                                                       optimizer="adamw", optimizer_impl="fused",
                                                       optimizer_offload="cpu", offload_gradients=True),
                        {"device": "H100-80GB"})
    graph = op_graph(sc)
    host = [b for op in graph.ops_in_order() for b in op.allocs if b.pool is Pool.HOST]
    assert sum(b.nbytes for b in host if is_pinned(b)) == 2 * 2 * n
    assert sum(b.nbytes for b in host if b.category is Category.OPTIMIZER_STATE) == 2 * 2 * n + 4 * tensors
    copies = [op for op in graph.ops_in_order() if op.stream is Stream.HOST]
    assert len(copies) == 2 * tensors  # each gradient to the host, each parameter back
    report = run(sc, graph=graph)
    assert report.host.overall.bytes == 4 * 2 * n + 4 * tensors


@pytest.mark.parametrize("changes, field", [
    (dict(optimizer_offload="cpu", optimizer_impl="foreach"), "optimizer_offload"),
    (dict(optimizer_offload="cpu", optimizer_impl="fused", optimizer="sgd-momentum"), "optimizer_offload"),
    (dict(optimizer_offload="cpu", optimizer_impl="fused", world_size=2, dp_engine="ddp"), "optimizer_offload"),
    (dict(optimizer_offload="cpu", optimizer_impl="fused", precision="bf16-mixed"), "optimizer_offload"),
    (dict(optimizer_offload="cpu", optimizer_impl="fused", precision="fp32", offload_gradients=True, grad_accum=2),
     "offload_gradients"),
])
def test_bad_settings_name_the_knob(changes, field):
    with pytest.raises(ConfigError) as e:
        TrainingSetup(**changes)
    assert e.value.field == field


def test_cli_flags_and_their_refusals(capsys):
    assert main(["simulate", "--preset", "tiny", "--precision", "fp32", "--optimizer-impl", "fused",
                 "--optimizer-offload", "cpu", "--offload-gradients", "--steps", "1"]) == 0
    assert main(["simulate", "--preset", "tiny", "--offload-gradients"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "offload_gradients" in err[0] and "optimizer_offload cpu" in err[0]


def test_the_shims_leave_other_streams_to_torch():
    """The stand-in `record_stream` takes only the offload's own host stream; anything else is torch's (which
    refuses a non-stream on the CPU as before)."""
    from peakledger.traces.reference.torchao_offload import HostStream, install_cpu_shims

    install_cpu_shims()
    t = torch.zeros(2)
    t.record_stream(HostStream())
    with pytest.raises((RuntimeError, TypeError)):
        t.record_stream(object())


# FSDP2's CPUOffloadPolicy (torch 2.13 torch/distributed/fsdp/_fully_shard/_fsdp_param.py, _fsdp_collectives.py)

LLAMA_8B = 8_030_261_248  # every dim 0 divisible by 8: the shards are unpadded
LLAMA_TENSORS = 32 * 9 + 3


def fsdp_graph(**extra):
    sc = build_scenario({"preset": "llama-3-8b"}, dict(precision="bf16-mixed", seq_len=1024, micro_batch=1, steps=1,
                                                       optimizer="adamw", optimizer_impl="fused", dp_engine="fsdp2",
                                                       world_size=8, **extra), {"device": "H100-80GB"})
    return sc, op_graph(sc)


def test_fsdp_cpu_offload_keeps_shards_grads_and_states_on_the_host():
    """`_init_sharded_param`: each padded fp32 shard `.cpu().pin_memory()`; `foreach_reduce`: each sharded gradient
    `.to("cpu")` (fp32, the sharded parameter's dtype); the optimizer over CPU parameters makes its states there
    (fused: the `step` scalars too). Per rank of 8: 8,030,261,248 / 8 elements x 4 bytes for each of parameters,
    gradients, exp_avg and exp_avg_sq, and 4 bytes of `step` per tensor."""
    sc, graph = fsdp_graph(fsdp_cpu_offload=True)
    blocks = [b for op in graph.ops_in_order() for b in op.allocs if b.rank == 0]
    host = [b for b in blocks if b.pool is Pool.HOST]
    shard = LLAMA_8B // 8 * 4
    by = {c: sum(b.nbytes for b in host if b.category is c) for c in (Category.PARAMETER, Category.GRADIENT,
                                                                       Category.OPTIMIZER_STATE)}
    assert by == {Category.PARAMETER: shard, Category.GRADIENT: shard,
                  Category.OPTIMIZER_STATE: 2 * shard + 4 * LLAMA_TENSORS}
    device = [b for b in blocks if b.pool is Pool.DEVICE]
    assert not any(b.category is Category.OPTIMIZER_STATE for b in device)
    assert all(b.name.endswith(".unsharded") for b in device if b.category is Category.PARAMETER)
    assert all(b.name.endswith(".unsharded.grad") for b in device if b.category is Category.GRADIENT)
    assert run(sc, graph=graph).host.overall.bytes == 4 * shard + 4 * LLAMA_TENSORS
    assert sum(b.nbytes for b in host if is_pinned(b)) == 2 * shard  # pin_memory=True: parameters and gradients


def test_fsdp_cpu_offload_copies_each_shard_in_and_each_gradient_out():
    """`all_gather_inputs` under offload: each fp32 host shard copied to the device, then cast to bf16 (the copy
    dropped); one copy to the host per unit's reduce-scatter output. Forward and backward all-gather every unit
    (reshard_after_forward), the root too."""
    _, graph = fsdp_graph(fsdp_cpu_offload=True)
    ops = [op for op in graph.ops_in_order() if op.rank == 0]
    to_device = [b for op in ops for b in op.allocs if b.name.endswith(".all_gather_input.to_device")]
    casts = [b for op in ops for b in op.allocs if b.name.endswith(".all_gather_input")]
    assert {b.dtype for b in to_device} == {"fp32"} and {b.dtype for b in casts} == {"bf16"}
    assert len(to_device) == len(casts)
    assert sum(b.nbytes for b in to_device) == 2 * sum(b.nbytes for b in casts)
    gathers = [op for op in ops if op.name.startswith("fsdp.all_gather.") and not op.name.endswith(".issue")]
    host_link = 50e9  # models/devices.py, H100-80GB: PCIe 5 (assumed)
    assert sum(b.nbytes for b in to_device) == pytest.approx(host_link * sum(
        op.duration for op in ops if op.stream is Stream.HOST and ".all_gather_input." in op.name))
    assert len(gathers) >= 2 * 32
    d2h = [op for op in ops if op.stream is Stream.HOST and op.name.startswith("fsdp.reduce_scatter_output.to_host")]
    assert len(d2h) == 33  # 32 layers and the root


def test_fsdp_cpu_offload_lowers_the_device_peak_by_what_moved_to_the_host():
    sc_off, g_off = fsdp_graph(fsdp_cpu_offload=True)
    sc_on, g_on = fsdp_graph()
    off, on = run(sc_off, graph=g_off), run(sc_on, graph=g_on)
    assert on.host is None or on.host.overall.bytes == 0
    shard = LLAMA_8B // 8 * 4
    assert on.peaks.overall.bytes > 4 * shard > off.peaks.overall.bytes  # parameters, gradients, 2 states


@pytest.mark.parametrize("changes, field", [
    (dict(dp_engine="fsdp2", world_size=2, fsdp_cpu_offload=True), "fsdp_cpu_offload"),  # foreach
    (dict(dp_engine="fsdp2", world_size=2, fsdp_cpu_offload=True, optimizer_impl="fused", checkpoint_every=1),
     "checkpoint_every"),
])
def test_fsdp_cpu_offload_refusals_name_the_knob(changes, field):
    with pytest.raises(ConfigError) as e:
        TrainingSetup(**changes)
    assert e.value.field == field


@pytest.mark.parametrize("changes", [dict(dp_engine="fsdp2", world_size=1), dict(dp_engine="ddp", world_size=2)])
def test_fsdp_cpu_offload_is_refused_where_fsdp2_does_not_shard(changes):
    with pytest.raises(ConfigError) as e:
        build_scenario({"preset": "tiny"}, dict(changes, fsdp_cpu_offload=True, optimizer_impl="fused"))
    assert e.value.field == "fsdp_cpu_offload" and "dp_engine fsdp2 on > 1 rank" in str(e.value)


def test_a_real_cpu_run_of_fsdp_cpu_offload_is_refused():
    sc = build_scenario({"preset": "tiny-mlp"}, dict(precision="fp32", optimizer_impl="fused", dp_engine="fsdp2",
                                                     world_size=2, fsdp_cpu_offload=True), {"device": "cpu"})
    with pytest.raises(ConfigError) as e:
        validation.validate_ranks(sc, backend="fake")
    assert e.value.field == "fsdp_cpu_offload"


# DeepSpeed ZeRO-Offload (deepspeed 0.19.8 runtime/zero/stage_1_and_2.py, `cpu_offload`, pin_memory true)

def zero_graph(**extra):
    sc = build_scenario({"preset": "llama-3-8b"}, dict(precision="bf16-mixed", seq_len=1024, micro_batch=1, steps=1,
                                                       optimizer="adamw", optimizer_impl="fused", zero_stage=2,
                                                       world_size=8, **extra), {"device": "H100-80GB"})
    return sc, op_graph(sc)


def test_zero_offload_host_buffers_follow_deepspeeds_init():
    """stage_1_and_2.py under cpu_offload, per rank of 8 (partition = 8,030,261,248 / 8 elements): the fp32
    partition and its fp32 `.grad` (pinned), the pinned bit16 buffer of the partition's size, and
    `temp_grad_buffer_for_cpu_offload` of the largest parameter (the 128256 x 4096 embedding) in bf16 on the host;
    DeepSpeedCPUAdam's exp_avg and exp_avg_sq, fp32, on the host (its `step` is a Python int). On the device:
    `temp_grad_buffer_for_gpu_offload` (the same size), and no fp32 master, gradient partition or state."""
    sc, graph = zero_graph(zero_offload_optimizer="cpu")
    partition, largest = LLAMA_8B // 8, 128256 * 4096
    blocks = [b for op in graph.ops_in_order() for b in op.allocs if b.rank == 0]
    host = {b.name: b.nbytes for b in blocks if b.pool is Pool.HOST}
    assert host == {"flat_group0.partition.fp32": 4 * partition, "flat_group0.partition.fp32.grad": 4 * partition,
                    "flat_group0.partition.bit16_buffer": 2 * partition,
                    "deepspeed.temp_grad_buffer_for_cpu_offload": 2 * largest,
                    "flat_group0.partition.exp_avg": 4 * partition, "flat_group0.partition.exp_avg_sq": 4 * partition}
    device = [b for b in blocks if b.pool is Pool.DEVICE]
    assert [b.nbytes for b in device if b.name == "deepspeed.temp_grad_buffer_for_gpu_offload"] == [2 * largest]
    assert not any(b.category in (Category.MASTER_PARAMETER, Category.OPTIMIZER_STATE) for b in device)
    assert not any(b.name == "deepspeed.grad_partition" for b in device)
    assert run(sc, graph=graph).host.overall.bytes == sum(host.values())


def test_zero_offload_copies_each_buckets_share_of_gradients_to_the_host():
    """After each bucket's reduce, this rank's ~1/8 of it cast to fp32 and copied to the host: the copies add up to
    the fp32 gradient partition (the last bucket's share rounded up)."""
    _, graph = zero_graph(zero_offload_optimizer="cpu")
    ops = [op for op in graph.ops_in_order() if op.rank == 0]
    casts = [b for op in ops for b in op.allocs if b.name.startswith("deepspeed.grad_to_fp32.bucket")]
    reduces = [op for op in ops if op.name.startswith("deepspeed.reduce_scatter.bucket") and op.stream is
               Stream.COMMUNICATION]
    assert len(casts) == len(reduces) > 1
    assert 0 <= sum(b.nbytes for b in casts) - 4 * (LLAMA_8B // 8) < 4 * len(casts)


def test_zero_offload_knob_refusals():
    with pytest.raises(ConfigError) as e:
        build_scenario({"preset": "tiny"}, dict(zero_stage=1, world_size=2, zero_offload_optimizer="cpu"))
    assert e.value.field == "zero_offload_optimizer" and "zero_stage 2" in str(e.value)
    with pytest.raises(ConfigError) as e:
        TrainingSetup(zero_stage=2, world_size=2, zero_offload_optimizer="cpu")  # foreach
    assert e.value.field == "zero_offload_optimizer"
    with pytest.raises(ConfigError) as e:
        TrainingSetup(zero_stage=2, world_size=2, zero_offload_optimizer="nvme")
    assert e.value.field == "zero_offload_optimizer"


def test_the_hook_copies_each_gradient_once_per_micro_batch():
    """torchao's hook runs after every accumulation (`register_post_accumulate_grad_hook`), each time copying the
    gradient to the host; the queue keeps each parameter once, so the host steps are one per offloaded parameter."""
    sc = scenario("tiny-mlp", grad_accum=2, steps=1)
    ops = op_graph(sc).ops_in_order()
    lib = library_step(sc)
    n_offloaded = len({op.name for op in ops if op.name.endswith(".host_step")})
    assert len([op for op in ops if op.name.endswith("grad_to_host.copy")]) == 2 * n_offloaded
    assert n_offloaded == 6 - len(lib["on_device"])  # tiny-mlp: 3 weights, 3 biases (the biases stay)


def test_on_a_gpu_the_blocks_the_library_pins_are_pinned_memory():
    """The host memory report counts `Block.pinned`: on a GPU profile exactly the blocks the library asks to pin."""
    for changes in ({"optimizer_offload": "cpu", "optimizer_impl": "fused", "precision": "bf16"},
                    {"dp_engine": "fsdp2", "world_size": 2, "fsdp_cpu_offload": True, "optimizer_impl": "fused"}):
        sc = build_scenario({"preset": "tiny"}, changes, {"device": "H100-80GB"})
        host = [b for op in op_graph(sc).ops_in_order() for b in op.allocs if b.pool is Pool.HOST]
        assert any(b.pinned for b in host)
        assert all(b.pinned == is_pinned(b) for b in host), changes
