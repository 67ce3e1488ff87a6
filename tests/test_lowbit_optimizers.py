"""Low-bit optimizers (models/lowbit.py): the state bytes each parameter gets, as the libraries' own objects hold them
after one step (the truth: torchao 0.18.0's AdamW8bit / AdamW4bit / AdamWFp8, bitsandbytes 0.50.2's AdamW8bit on its
CPU backend), equal the simulation's optimizer_state rows; the paged states are host rows; bad knobs are refused."""

from __future__ import annotations

import pytest

from peakledger import build_scenario
from peakledger.models.config import ConfigError
from peakledger.models.training import describe
from peakledger.simulator.engine import simulate
from peakledger.simulator.events import Action, Category, Pool

# parameters chosen to hit every rule: quantised (>= 4096, divisible by 256 and 128), too small (512), >= 4096 but
# not divisible by the block size (100 x 41 = 4100: plain in torchao, 8-bit in bitsandbytes, 17 absmax blocks)
SHAPES = [(512, 512), (512,), (100, 41), (64, 128)]


def _library_state_bytes(optimizer, params) -> list[int]:
    """Per parameter, the bytes of every tensor in its state (a subclass's inner codes / scale / qmap), each storage
    once across the optimizer (bitsandbytes' shared qmaps counted with the first parameter holding them)."""
    from peakledger.models.script.record import plain_tensors

    seen, out = set(), []
    for p in params:
        total = 0
        for v in optimizer.state[p].values():
            if not hasattr(v, "untyped_storage"):
                continue  # bitsandbytes' `step` is a Python int
            for t in plain_tensors(v):
                ptr = t.untyped_storage().data_ptr()
                if ptr not in seen:
                    seen.add(ptr)
                    total += t.untyped_storage().nbytes()
        out.append(total)
    return out


def _run(cls, **kwargs):
    import torch

    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s)) for s in SHAPES]
    optimizer = cls(params, lr=1e-3, **kwargs)
    for p in params:
        p.grad = torch.randn_like(p)
    optimizer.step()
    return _library_state_bytes(optimizer, params)


def _simulated_state_bytes(optimizer: str) -> list[int]:
    """The simulation's optimizer_state rows, per parameter of the tiny-mlp whose weights are replaced by SHAPES:
    built through the registry directly (one create per tensor, in order), summed per tensor."""
    from math import prod

    from peakledger.models.config import dtype_bytes
    from peakledger.models.optimizers import OPTIMIZERS, state_specs

    shared = sum(prod(shape) * dtype_bytes(dt) for _, shape, dt in OPTIMIZERS[optimizer].shared_states)
    return [sum(prod(st_shape) * dtype_bytes(dt) for _, st_shape, dt in state_specs(optimizer, prod(shape), "fp32",
                                                                                     shape)) + (shared if k == 0 else 0)
            for k, shape in enumerate(SHAPES)]


def _expected_torchao(kind: str) -> list[int]:
    """torchao 0.18.0's rule, written out (subclass_{8bit,4bit,fp8}.py `zeros`, adam.py `_new_buffer`)."""
    block = {"8bit": 256, "4bit": 128, "fp8": 256}[kind]
    out = []
    for shape in SHAPES:
        n = 1
        for d in shape:
            n *= d
        if n >= 4096 and n % block == 0:
            codes = n // 2 if kind == "4bit" else n
            qmap = {"8bit": 256, "4bit": 16, "fp8": 0}[kind] * 4
            out.append(4 + 2 * (codes + n // block * 4 + qmap))
        else:
            out.append(4 + 2 * n * 4)
    return out


@pytest.mark.parametrize("kind,name,optimizer", [("8bit", "AdamW8bit", "adamw-8bit-torchao"),
                                                 ("4bit", "AdamW4bit", "adamw-4bit"),
                                                 ("fp8", "AdamWFp8", "adamw-fp8")])
def test_torchao_state_bytes_per_parameter(kind, name, optimizer):
    ao = pytest.importorskip("torchao.optim")
    truth = _run(getattr(ao, name))
    assert truth == _expected_torchao(kind)
    assert _simulated_state_bytes(optimizer) == truth


@pytest.mark.parametrize("optimizer", ["adamw-8bit-bnb", "adam-8bit", "paged-adamw-8bit"])
def test_bitsandbytes_state_bytes_per_parameter(optimizer):
    bnb = pytest.importorskip("bitsandbytes")
    truth = _run(bnb.optim.AdamW8bit)  # CPU backend; paged falls back to plain buffers on the CPU: the same bytes
    # bitsandbytes 0.50.2 Optimizer2State.init_state: >= 4096: 2 x (n uint8 + ceil(n / 256) fp32) + the shared qmaps
    assert truth == [2 * (262144 + 1024 * 4) + 2 * 256 * 4, 2 * 512 * 4, 2 * (4100 + 17 * 4), 2 * (8192 + 32 * 4)]
    assert _simulated_state_bytes(optimizer) == truth


def _sim(optimizer: str, device: str = "cpu", preset: str = "tiny-mlp", **extra):
    s = build_scenario({"preset": preset}, dict(micro_batch=2, steps=2, precision="fp32", optimizer=optimizer,
                                                **extra), {"device": device})
    return simulate(describe(s.model, s.setup, device))


def _live_states(log) -> dict[Pool, int]:
    live: dict[int, tuple[Pool, int]] = {}
    for e in log.events:
        if e.block.category is Category.OPTIMIZER_STATE:
            if e.action is Action.ALLOC:
                live[e.block.id] = (e.block.pool, e.block.nbytes)
            else:
                live.pop(e.block.id, None)
    out: dict[Pool, int] = {}
    for pool, n in live.values():
        out[pool] = out.get(pool, 0) + n
    return out


def test_tiny_mlp_states_as_torchao_makes_them():
    # tiny-mlp: 3 x Linear(512, 512): weights quantised, biases plain fp32 (512 < 4096)
    w, b = 512 * 512, 512
    assert sum(_live_states(_sim("adamw-8bit-torchao")).values()) == 3 * (4 + 2 * (w + w // 256 * 4 + 1024)) + \
        3 * (4 + 2 * b * 4)
    assert sum(_live_states(_sim("adamw-4bit")).values()) == 3 * (4 + 2 * (w // 2 + w // 128 * 4 + 64)) + \
        3 * (4 + 2 * b * 4)


def test_torchao_step_is_host_memory_on_a_gpu():
    states = _live_states(_sim("adamw-8bit-torchao", device="H100-80GB"))
    assert states[Pool.HOST] == 6 * 4  # torchao/optim/adam.py: `torch.tensor(0.0)`, on the host, per parameter


def test_paged_states_are_host_rows_on_a_gpu():
    # bitsandbytes 0.50.2 get_state_buffer: state1 / state2 of >= 1e5 elements in managed memory; absmax on the device
    w = 512 * 512
    paged = _live_states(_sim("paged-adamw-8bit", device="H100-80GB"))
    plain = _live_states(_sim("adamw-8bit-bnb", device="H100-80GB"))
    assert paged[Pool.HOST] == 3 * 2 * w
    assert paged[Pool.DEVICE] == plain[Pool.DEVICE] - 3 * 2 * w
    assert Pool.HOST not in plain


@pytest.mark.parametrize("extra,knob", [(dict(optimizer_offload="states"), "optimizer_offload"),
                                        (dict(checkpoint_every=1), "checkpoint_every")])
def test_unmodelled_combinations_are_refused(extra, knob):
    with pytest.raises(ConfigError) as err:
        build_scenario({"preset": "tiny-mlp"}, dict(optimizer="adamw-4bit", **extra), {"device": "cpu"})
    assert err.value.field == knob


def _simulated_rows_per_param(optimizer: str, preset: str) -> dict[str, int]:
    """The simulation's optimizer_state rows alive after step 1, summed per parameter (`<param>.<state>` blocks;
    the shared qmaps under `optimizer`)."""
    log = _sim(optimizer, preset=preset, **({} if preset == "tiny-mlp" else {"seq_len": 32}))
    live = {}
    for e in log.events:
        if e.block.category is Category.OPTIMIZER_STATE and e.step <= 1:
            if e.action is Action.ALLOC:
                live[e.block.id] = e.block
            else:
                live.pop(e.block.id, None)
    out: dict[str, int] = {}
    for b in live.values():
        param = b.name.removesuffix(".managed").rsplit(".", 1)[0]  # `<param>.<state>`, or `optimizer.qmaps`
        out[param] = out.get(param, 0) + b.nbytes
    return out


@pytest.mark.parametrize("optimizer,module,name", [("adamw-8bit-torchao", "torchao.optim", "AdamW8bit"),
                                                   ("adamw-4bit", "torchao.optim", "AdamW4bit"),
                                                   ("adamw-fp8", "torchao.optim", "AdamWFp8"),
                                                   ("adamw-8bit-bnb", "bitsandbytes.optim", "AdamW8bit")])
def test_reference_program_states_match_the_simulated_rows(optimizer, module, name):
    # the tiny preset's real program (GPT-2 family, d_model 64): (64, 64) weights quantised (4096 elements), biases
    # and norms plain; one real step of the library's optimizer over its parameters, each one's state bytes summed
    lib = pytest.importorskip(module)
    import torch

    from peakledger.traces.reference import build_model

    s = build_scenario({"preset": "tiny"}, dict(micro_batch=2, seq_len=32, steps=2, precision="fp32",
                                                optimizer=optimizer), {"device": "cpu"})
    model = build_model(s.model, s.setup)
    named = [(n, p) for n, p in model.named_parameters()]
    opt = getattr(lib, name)([p for _, p in named], lr=1e-3)
    for _, p in named:
        p.grad = torch.randn_like(p)
    opt.step()
    truth = dict(zip((n for n, _ in named), _library_state_bytes(opt, [p for _, p in named])))
    simulated = _simulated_rows_per_param(optimizer, "tiny")
    shared = simulated.pop("optimizer", 0)  # bitsandbytes' qmaps: the library counts them with the first holder
    first = next(n for n in truth if truth[n] and n in simulated and simulated[n] != truth[n]) if shared else None
    if first is not None:
        simulated[first] += shared
    assert simulated == truth


def test_explain_offers_the_low_bit_optimizers_and_no_impl_fix_for_them():
    from peakledger.fixes import optimizer_fixes

    adamw = build_scenario({"preset": "tiny"}, {}, {"device": "cpu"})
    names = {changes.get("optimizer") for _, changes, _, _ in optimizer_fixes(adamw)}
    assert {"adamw-8bit-torchao", "adamw-4bit", "paged-adamw-8bit"} <= names
    lowbit = build_scenario({"preset": "tiny"}, {"optimizer": "adamw-4bit"}, {"device": "cpu"})
    assert not any("optimizer_impl" in changes for _, changes, _, _ in optimizer_fixes(lowbit))


def test_validate_runs_torchaos_compiled_step_and_its_optimizer_phases_match():
    # `peakledger validate --optimizer adamw-fp8`: torchao's real compiled step on the CPU, measured by torch.profiler
    # (traces/lowbit_run.py); every optimizer phase's peak as the simulation's, and the library's state bytes
    pytest.importorskip("torchao.optim")
    from peakledger.validation import validate

    s = build_scenario({"preset": "tiny-mlp"}, dict(micro_batch=2, steps=2, precision="fp32", optimizer="adamw-fp8"),
                       {"device": "cpu"})
    v, measured, _ = validate(s)
    optimizer_phases = [p for p in v.phases if p.label.startswith("optimizer")]
    assert len(optimizer_phases) == 2 and all(p.measured == p.predicted for p in optimizer_phases)
    assert abs(v.overall.error) <= 0.005
