"""FSDP2 on one rank with a MixedPrecisionPolicy, as HF users run it (`fully_shard` on each decoder layer and the
root, param_dtype bf16, reduce_dtype fp32 or torch's default): a real forward and backward on this CPU (gloo, world
size 1, measured by the project's tracker) against the simulation of the same setup, allocation for allocation.

What it checks is torch's own program (torch/distributed/fsdp/_fully_shard): at world size 1 no all-gather runs,
each shard is cast to bf16 and copied into its unsharded storage; the reduce-scatter input and output are in
reduce_dtype, the output allocated under the reduce-scatter stream, cast to the fp32 sharded gradient where the
dtypes differ; the previous unit's reduce-scatter input is dropped before the next is made."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from collections import Counter
from pathlib import Path

import pytest

from peakledger import build_scenario
from peakledger.cli import main
from peakledger.models.training import describe
from peakledger.simulator.engine import simulate
from peakledger.simulator.events import Action, Phase, Stream

ROOT = Path(__file__).resolve().parents[1]
LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_hidden_layers": 2, "hidden_size": 128,
         "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "intermediate_size": 352,
         "vocab_size": 256, "max_position_embeddings": 64, "hidden_act": "silu", "attention_bias": True,
         "tie_word_embeddings": True, "rms_norm_eps": 1e-06}

REAL_STEP = textwrap.dedent('''
    import json, os, sys, torch, transformers
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from peakledger.traces.tracker import AllocationTracker
    from peakledger.simulator.events import Action
    path, reduce, port = sys.argv[1:4]
    cfg = json.load(open(path))
    config = CONFIG_MAPPING[cfg["model_type"]](**{k: v for k, v in cfg.items() if k != "model_type"})
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    dist.init_process_group("gloo", rank=0, world_size=1)
    mesh = init_device_mesh("cpu", (1,))
    model = getattr(transformers, cfg["architectures"][0])(config)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32 if reduce == "fp32" else None)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    ids = torch.randint(0, config.vocab_size, (1, 16))
    tracker = AllocationTracker(discover_inputs=False)
    with tracker:
        out = model(input_ids=ids, labels=ids)
        loss = out.loss
        loss.backward()
        del out, loss
    print(json.dumps([["a" if e.action is Action.ALLOC else "f", e.block.nbytes] for e in tracker.log().events]))
''')


@pytest.fixture(scope="module")
def config(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("llama") / "config.json"
    path.write_text(json.dumps(LLAMA))
    return str(path)


def real_step(config: str, reduce: str) -> list[tuple[str, int]]:
    from socket import socket
    with socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    out = subprocess.run([sys.executable, "-c", REAL_STEP, config, reduce, port], capture_output=True, text=True,
                         cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return [tuple(e) for e in json.loads(out.stdout.strip().splitlines()[-1])]


def simulated_step(config: str, reduce: str):
    sc = build_scenario({"hf_config": config}, {"micro_batch": 1, "seq_len": 16, "steps": 1, "build": "device-fp32",
                                                "precision": "bf16-mixed", "dp_engine": "fsdp2", "world_size": 1,
                                                "reduce_dtype": reduce}, {"device": "cpu"})
    log = simulate(describe(sc.model, sc.setup, "cpu"))
    # the batch is made before the measured region
    return [e for e in log.events
            if e.phase in (Phase.FORWARD, Phase.BACKWARD) and not e.block.name.startswith("batch.")]


def peak(events: list[tuple[str, int]]) -> int:
    running = best = 0
    for action, nbytes in events:
        running += nbytes if action == "a" else -nbytes
        best = max(best, running)
    return best


@pytest.mark.parametrize("reduce", ["fp32", "grad"])
def test_one_rank_step_matches_the_real_program(config, reduce):
    real = real_step(config, reduce)
    events = simulated_step(config, reduce)
    sim = [("a" if e.action is Action.ALLOC else "f", e.block.nbytes) for e in events]
    assert Counter(sim) == Counter(real)
    assert peak(sim) == peak(real)
    names = [e.block.name for e in events if e.action is Action.ALLOC]
    assert not any(n.endswith("all_gather_output") for n in names)  # no all-gather at world size 1
    assert any(n.endswith("q_proj.weight.all_gather_input") for n in names)  # each shard cast to bf16
    rs = [e for e in events if e.action is Action.ALLOC and e.block.name == "model.layers.0.reduce_scatter_input"]
    assert [e.block.dtype for e in rs] == ["fp32" if reduce == "fp32" else "bf16"]
    # the reduce-scatter output comes from the reduce-scatter stream's pool; a bf16 one is cast to the fp32 grads
    outs = [e for e in events if e.action is Action.ALLOC and e.block.name.startswith("model.layers.0.")
            and ("reduce_scatter_output" in e.block.name or e.block.name.endswith("sharded_grads"))]
    assert {e.stream for e in outs} == {Stream.COMMUNICATION}
    assert [e.block.dtype for e in outs] == (["fp32"] if reduce == "fp32" else ["bf16", "fp32"])


def test_reduce_dtype_is_checked(capsys):
    assert main(["simulate", "--preset", "tiny", "--reduce-dtype", "fp8"]) == 2
    assert "reduce_dtype" in capsys.readouterr().err
    assert main(["simulate", "--preset", "tiny", "--dp-engine", "ddp", "--world-size", "2",
                 "--reduce-dtype", "fp32"]) == 2
    err = capsys.readouterr().err
    assert "reduce_dtype" in err and "fsdp2" in err
