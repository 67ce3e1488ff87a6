"""Real-run validation: a scenario run for real on this CPU (one process, or every rank of a data-, pipeline-,
tensor-, context-parallel or mesh run on gloo or torch's fake process group) under the allocation tracker, and
held against its simulation, rank by rank (analysis/validate.py `compare_logs`). The simulation API is api.py;
this is the measuring half the `validate` and `capture` commands call.
"""

from __future__ import annotations

from .analysis.validate import compare_logs
from .models.config import ConfigError
from .models.fields import as_keys
from .models.optimizers import OPTIMIZERS
from .models.training import describe
from .scenario import Scenario
from .simulator.engine import simulate
from .simulator.run_metadata import RunMetadata

VALIDATABLE_PRECISIONS = ("fp32", "bf16", "bf16-autocast")


def measure(scenario: Scenario, model_hook=None):
    """Run the scenario for real on CPU: the reference torch model of the same config, real training
    steps under the exact allocation tracker. Returns the measured EventLog (metadata: torch version,
    model config, training setup). `model_hook(model)` is called on the built model before the run (a
    router recorder: traces/reference/mixtral.py)."""
    import torch

    from .traces.reference import TORCH_DTYPES, build_model, make_batch, make_optimizer
    from .traces.tracker import run_training_steps

    setup = scenario.setup
    if setup.precision.name not in VALIDATABLE_PRECISIONS:
        raise ConfigError("precision", f"real CPU runs support {', '.join(VALIDATABLE_PRECISIONS)}; got "
                                       f"{setup.precision.name!r}")
    if (
        setup.mesh.world_size != 1
        or setup.data_parallel.deepspeed.zero_stage != 0
        or setup.data_parallel.engine != "deepspeed"
    ):
        raise ConfigError("world_size", "one real CPU process runs without data parallelism; use validate_ranks "
                                        "(peakledger validate --world-size N --dp-engine fsdp2|ddp|"
                                        "zero-redundancy-optimizer) for real multi-process runs")
    spec = OPTIMIZERS[setup.optimizer.name]
    if spec.torch_class is None and spec.reference is None:
        raise ConfigError("optimizer", f"{setup.optimizer.name} needs bitsandbytes (CUDA); use one of: "
                                       + ", ".join(n for n, sp in OPTIMIZERS.items() if sp.torch_class or sp.reference))
    if spec.compiled_step:  # torchao's compiled optimizer step: torch.profiler, as a compiled model is measured
        from .traces.lowbit_run import measure_lowbit  # torch, torchao

        return measure_lowbit(scenario.model, setup)[0]
    if setup.compile.on:  # a compiled step: inductor's buffers are seen by torch.profiler only
        from .traces.compiled_run import measure_compiled  # torch

        return measure_compiled(scenario.model, setup)
    model = build_model(scenario.model, setup)
    if model_hook is not None:
        model_hook(model)
    optimizer = make_optimizer(model, setup)
    metadata = RunMetadata(torch_version=torch.__version__, model=as_keys(scenario.model),
                           model_kind=type(scenario.model).__name__, setup=setup, device="cpu", scenario=scenario.name)
    return run_training_steps(model, optimizer, make_batch(scenario.model, setup), steps=setup.batch.steps,
                              grad_accum=setup.batch.grad_accum, set_to_none=setup.optimizer.set_to_none,
                              autocast=TORCH_DTYPES[setup.precision.autocast] if setup.precision.autocast else None,
                              metadata=metadata)


DISTRIBUTED_ENGINES = ("fsdp2", "ddp", "zero-redundancy-optimizer")


def validate_ranks(scenario: Scenario, backend: str = "gloo"):
    """Run the scenario for real on `world_size` CPU processes (gloo, 127.0.0.1) with its torch engine,
    measure every rank, and hold each against the simulated rank. Returns [(Validation, measured log)]
    in rank order, and the simulated log. `backend` "fake" runs the same engines on torch's fake process
    group (no transport, same buffers; see traces/distributed.py). gloo's own clone of each
    reduce-scatter input is dropped from the measured logs (its lifetime varies run to run; NCCL has
    none)."""
    from .traces.distributed import measure_distributed, without_backend_copies

    setup = scenario.setup
    if setup.mesh.cp > 1:
        return validate_context_parallel(scenario, backend)
    if sum(d > 1 for d in (setup.mesh.tp, setup.mesh.pp, setup.mesh.dp)) > 1:  # two mesh dimensions or more
        return validate_mesh(scenario, backend)
    if setup.mesh.pp > 1:
        return validate_pipeline(scenario, backend)
    if setup.mesh.tp > 1:
        return validate_tensor_parallel(scenario, backend)
    if setup.offload.mode != "none" and setup.data_parallel.engine == "zero-redundancy-optimizer":
        raise ConfigError("optimizer_offload", "real runs wrap FSDP2's and DDP's optimizers in the offload, not "
                                               "ZeroRedundancyOptimizer's local one; allowed there: none")
    if setup.data_parallel.fsdp2.cpu_offload:
        raise ConfigError("fsdp_cpu_offload", "a CPU run cannot show CPUOffloadPolicy: there its copies to and from "
                                              "the device are the tensors themselves (`.to(cpu)` of a CPU tensor); "
                                              "simulated only; allowed in real runs: off")
    if setup.data_parallel.engine not in DISTRIBUTED_ENGINES:
        raise ConfigError("dp_engine", f"real multi-process runs use torch's engines: {', '.join(DISTRIBUTED_ENGINES)}"
                                       " (DeepSpeed needs CUDA)")
    logs = [
        without_backend_copies(log)
        for log in measure_distributed(
            scenario.model,
            setup,
            setup.mesh.world_size,
            setup.data_parallel.engine,
            reshard_after_forward=setup.data_parallel.fsdp2.reshard_after_forward,
            backend=backend,
        )
    ]
    simulated = simulate(
        describe(scenario.model, setup, "cpu", ranks=list(range(setup.mesh.world_size)), all_steps=True),
        simulator=scenario.simulator,
    )
    return [(compare_logs(log, simulated, name=f"{scenario.name} rank {r}", rank=r), log)
            for r, log in enumerate(logs)], simulated


def validate_pipeline(scenario: Scenario, backend: str = "gloo"):
    """`validate_ranks` for pipeline parallelism (`setup.mesh.pp` > 1): the scenario's stages run for real with
    torch.distributed.pipelining on `pp` CPU processes (gloo, 127.0.0.1; traces/pipeline_run.py), every rank
    measured and held against its simulated rank. Returns [(Validation, measured log)] in rank order, and
    the simulated log."""
    from .traces.pipeline_run import SCHEDULES, measure_pipeline

    setup = scenario.setup
    if backend != "gloo":
        raise ConfigError("pg_backend", "a pipeline runs over gloo (its sends and receives move real activations); "
                                        "drop --pg-backend or give gloo")
    if setup.mesh.pp_schedule not in SCHEDULES:
        raise ConfigError("pp_schedule", f"real pipeline runs use {', '.join(SCHEDULES)}; {setup.mesh.pp_schedule} is "
                                         "not simulated yet")
    if not setup.precision.uniform:
        raise ConfigError("precision", f"real pipeline runs are fp32 or bf16, not {setup.precision.name!r}")
    logs = measure_pipeline(scenario.model, setup)
    simulated = simulate(describe(scenario.model, setup, "cpu", all_steps=True), simulator=scenario.simulator)
    return [(compare_logs(log, simulated, name=f"{scenario.name} rank {r} (pipeline stage"
                                                f"{'s' if setup.mesh.virtual_stages > 1 else ''} "
                                                f"{', '.join(str(st['index']) for st in log.metadata.stages)})",
                          rank=r), log)
            for r, log in enumerate(logs)], simulated


def _validate_model_parallel(scenario: Scenario, backend: str, what: str, measure, label):
    """Run `measure(model, setup)` (real CPU processes over gloo, 127.0.0.1) and hold every rank's log against its
    simulated rank (`label(rank, log)` names it); the simulation's refusals come before any process starts."""
    setup = scenario.setup
    if backend != "gloo":
        raise ConfigError("pg_backend", f"{what} runs over gloo (its collectives move real activations); "
                                        "drop --pg-backend or give gloo")
    describe(scenario.model, setup, "cpu")  # what the simulation refuses, refused before any process starts
    logs = measure(scenario.model, setup)
    simulated = simulate(
        describe(scenario.model, setup, "cpu", ranks=list(range(setup.mesh.world_size)), all_steps=True),
        simulator=scenario.simulator,
    )
    return [(compare_logs(log, simulated, name=f"{scenario.name} rank {r} ({label(r, log)})", rank=r), log)
            for r, log in enumerate(logs)], simulated


def validate_tensor_parallel(scenario: Scenario, backend: str = "gloo"):
    """`validate_ranks` for tensor parallelism (`setup.mesh.tp` > 1): the model parallelized with DTensor
    (`parallelize_module`, torchtitan's plan, loss_parallel) on `tp` CPU processes (traces/tensor_run.py)."""
    from .traces.tensor_run import measure_tensor_parallel

    return _validate_model_parallel(
        scenario, backend, "tensor parallelism",
        lambda model, setup: measure_tensor_parallel(model, setup, setup.mesh.tp, setup.mesh.sequence_parallel),
        lambda r, log: "tensor parallel")


def validate_mesh(scenario: Scenario, backend: str = "gloo"):
    """`validate_ranks` for two mesh dimensions or more (FSDP2 x TP, TP x PP, FSDP2 x PP, FSDP2 x TP x PP): the mesh
    (pp, dp, tp) runs for real on `world_size` CPU processes (traces/mesh_run.py)."""
    from .traces.mesh_run import measure_mesh

    return _validate_model_parallel(scenario, backend, "a device mesh", measure_mesh,
                                    lambda r, log: f"mesh {_coords_text(log)}")


def validate_context_parallel(scenario: Scenario, backend: str = "gloo"):
    """`validate_ranks` for context parallelism: torch's `context_parallel` (ring attention) on `cp` CPU processes
    (traces/context_run.py, with the CPU SDPA kernel routed to torch's own ring attention)."""
    from .traces.context_run import measure_context_parallel

    return _validate_model_parallel(scenario, backend, "context parallelism", measure_context_parallel,
                                    lambda r, log: "context parallel")


def _coords_text(log) -> str:
    mesh = log.metadata.mesh or {}
    return " ".join(f"{k} {v}" for k, v in mesh.items())


def validate(scenario: Scenario, measured=None):
    """Hold the simulation of `scenario` (on the "cpu" device profile) against a measured run: the one
    given, or a fresh real CPU run. A measured log of one rank of a data-parallel run (a saved rank trace)
    is held against that rank. Returns (Validation, measured log, simulated log)."""
    measured = measured if measured is not None else measure(scenario)
    ranks = sorted({e.block.rank for e in measured.events})
    if len(ranks) != 1:
        raise ConfigError("trace", f"the measured log holds ranks {ranks}: validate holds one rank at a time")
    rank = ranks[0]
    if rank >= scenario.setup.mesh.world_size:
        raise ConfigError("world_size", f"the measured log is rank {rank}'s, but the scenario has world_size "
                                        f"{scenario.setup.mesh.world_size}")
    simulated = simulate(describe(scenario.model, scenario.setup, "cpu",  # every step: held against each measured one
                                  ranks=[rank] if scenario.setup.mesh.world_size > 1 else None, all_steps=True),
                         simulator=scenario.simulator)
    return compare_logs(measured, simulated, name=scenario.name, rank=rank), measured, simulated
