"""What the model-parallel degrees are checked against, and what is not simulated yet: each refusal a ConfigError
naming the field (checked when the model is described, so a scenario with these degrees can still be compared with
the formulas of `compare --peers`). `check_model_parallel` is the entry: the degrees against the model, then each
dimension's own check (tensor/, context.py, pipeline.py simulate what passes). What a model supports is its
family's (models/families/: `Family.parallel`, `transformer`, `experts`, `kind`), passed in by the caller."""

from __future__ import annotations

from ..config import ConfigError, TrainingSetup

SIMULATED_SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b")


def check_model_parallel(family, model, setup: TrainingSetup) -> None:
    """The model-parallel degrees against the model (ConfigError naming the field): tp divides the query and
    key/value heads, sequence parallelism and context parallelism divide the sequence (torchtitan's
    ParallelDims.seq_len_divisor: tp, 2 x cp with load balancing), ep needs a mixture-of-experts model whose
    experts it divides; then each dimension's check (what it is not simulated with yet). pp needs a family that
    runs it (the nanogpt family's GPT-2 / Llama) with at most n_layer + 2 stages. `family` is `model`'s
    (models/families/)."""
    s = setup
    if s.mesh.tp > 1:
        if not family.transformer:
            raise ConfigError("tp", f"tensor parallelism splits attention heads and MLP columns: modelled for "
                                    f"transformers, not {type(model).__name__}")
        for what, heads in (("n_head", model.n_head), ("n_kv_head", model.kv_heads)):
            if heads % s.mesh.tp:
                raise ConfigError(
                    "tp",
                    f"tp={s.mesh.tp} does not divide the model's {what}={heads}: each tensor-parallel "
                    f"rank holds whole heads",
                )
    if s.mesh.sequence_parallel and s.batch.seq_len % s.mesh.tp:
        raise ConfigError(
            "sequence_parallel",
            f"seq_len={s.batch.seq_len} is not a multiple of tp={s.mesh.tp}: sequence "
            "parallelism splits the sequence over the tensor-parallel ranks",
        )
    if s.mesh.cp > 1 and s.batch.seq_len % (2 * s.mesh.cp):
        raise ConfigError(
            "cp",
            f"seq_len={s.batch.seq_len} is not a multiple of 2 x cp = {2 * s.mesh.cp} (load-balanced "
            "context parallelism splits it into 2 x cp chunks)",
        )
    if s.mesh.ep > 1:
        experts = model.num_local_experts if family.experts else None
        if not experts:
            raise ConfigError("ep", f"expert parallelism splits the experts of a mixture-of-experts model; "
                                    f"{getattr(model, 'name', 'this model')!r} has none: drop ep")
        if experts % s.mesh.ep:
            raise ConfigError("ep", f"ep={s.mesh.ep} does not divide num_local_experts={experts}")
    if s.mesh.tp > 1:
        check_tensor_parallel_supported(family, model, s)
    if s.mesh.cp > 1:
        check_context_parallel_supported(family, model, s)
    if s.mesh.ep > 1:
        check_expert_parallel_supported(model, s)
    if s.mesh.pp == 1:
        return
    check_pipeline_supported(s)
    if "pp" not in family.parallel:
        raise ConfigError("pp", f"pipeline parallelism is simulated for the hand-written GPT-2 and Llama "
                                f"(implementation nanogpt, dense), not {family.kind} yet")
    if s.mesh.pp_schedule not in SIMULATED_SCHEDULES:
        raise ConfigError("pp_schedule", f"{s.mesh.pp_schedule}: its order is derived (models/parallel/stages.py "
                                         "rank_actions) but its split backward (input gradients, then weight "
                                         "gradients) is not simulated yet; allowed: " + ", ".join(SIMULATED_SCHEDULES))
    stages = s.mesh.pp * s.mesh.virtual_stages
    if stages > model.n_layer + 2:
        raise ConfigError(
            "pp",
            f"pp x virtual_stages = {s.mesh.pp} x {s.mesh.virtual_stages} = {stages} stages is more than "
            f"the model's n_layer + 2 = {model.n_layer + 2} (its blocks, the embeddings and the "
            "output each count as one layer, as torchtitan splits a model): use fewer stages",
        )


def _refuse(not_yet: list[tuple[str, bool, str]]) -> None:
    """The first (field, allowed?, why) that is not allowed, as a ConfigError naming the field."""
    for name, ok, why in not_yet:
        if not ok:
            raise ConfigError(name, why)


def _training_only(dim: str, s: TrainingSetup, model) -> list[tuple[str, bool, str]]:
    """What a model-parallel dimension is not simulated with yet, alike for cp, tp and ep: LoRA, dropout (`model`
    None: not asked), optimizer offload, checkpoint saves or loads, and passes other than training steps."""
    rows = [("lora_r", s.lora.r == 0, f"{dim} with LoRA is not simulated yet")]
    if model is not None:
        rows.append(("dropout", getattr(model, "dropout", 0) == 0, f"{dim} with dropout is not simulated yet"))
    return rows + [
        ("optimizer_offload", s.offload.mode == "none", f"{dim} with optimizer offload is not simulated yet"),
        ("checkpoint_every", s.checkpoint_io.every == 0 and s.checkpoint_io.load_mode == "none",
         f"{dim} with checkpoint saves or loads is not simulated yet"),
        ("passes", s.batch.passes == "train", f"{dim} runs training steps: passes train")]


def check_pipeline_supported(setup: TrainingSetup) -> None:
    """What pipeline parallelism is not simulated with yet (checked when the model is described, so a scenario
    with these degrees can still be compared with the formulas of `compare --peers`)."""
    if setup.mesh.pp == 1:
        return
    fsdp = setup.mesh.dp > 1 and setup.data_parallel.engine == "fsdp2"
    not_yet = [
        (
            "dp_engine",
            setup.mesh.dp == 1 or setup.data_parallel.engine in ("deepspeed", "fsdp2"),
            f"pp with data parallelism runs FSDP2, DeepSpeed's replicas or ZeRO-1 (dp_engine fsdp2, or deepspeed "
            f"with zero_stage 0 or 1) for now; {setup.data_parallel.engine} under a pipeline schedule is not "
            "simulated yet",
        ),
        (
            "pp_schedule",
            not fsdp or setup.mesh.pp_schedule in ("gpipe", "1f1b"),
            f"pp with FSDP2 runs gpipe or 1f1b for now; {setup.mesh.pp_schedule} (its runtime's unshard and reshard "
            "actions) is not simulated yet",
        ),
        (
            "zero_stage",
            setup.data_parallel.deepspeed.zero_stage in (0, 1),
            f"pp with ZeRO-{setup.data_parallel.deepspeed.zero_stage}: DeepSpeed's PipelineEngine refuses ZeRO-2 "
            "and ZeRO-3 (\"ZeRO-2 and "
            'ZeRO-3 are incompatible with pipeline parallelism", deepspeed/runtime/pipe/engine.py); allowed: '
            "zero_stage 0 or 1, or dp_engine fsdp2 (torchtitan's FSDP2 x PP)",
        ),
        (
            "checkpointing",
            setup.checkpointing.policy != "offload",
            "pp with activations offloaded to the host "
            "(save_on_cpu) is not simulated yet; allowed: "
            "none, full, every-k, selective, sqrt, "
            "op-policy, layers",
        ),
        (
            "optimizer_offload",
            setup.offload.mode == "none",
            "pp with optimizer-state offload is not simulated yet: optimizer_offload none",
        ),
        (
            "checkpoint_every",
            setup.checkpoint_io.every == 0 and setup.checkpoint_io.load_mode == "none",
            "pp with checkpoint saves or loads is not simulated yet: checkpoint_every 0, load_mode none",
        ),
        ("lora_r", setup.lora.r == 0, "pp with LoRA is not simulated yet: lora_r 0"),
        ("passes", setup.batch.passes == "train", "pp runs training steps: passes train"),
    ]
    _refuse(not_yet)


def check_context_parallel_supported(family, model, setup: TrainingSetup) -> None:
    """What context parallelism is simulated with (models/parallel/context.py, checked against real runs of torch's
    ring attention, traces/context_run.py): the hand-written dense GPT-2 / Llama with SDPA attention, alone on its
    ranks (world_size = cp) or with FSDP2 over dp x cp (torchtitan's dp_shard_cp), fp32 or bf16, no activation
    checkpointing, LoRA or dropout."""
    s = setup
    kind = None
    if "cp" not in family.parallel:
        kind = "the model: context parallelism is simulated for the hand-written dense GPT-2 and Llama"
    not_yet = [
        ("cp", kind is None, kind or ""),
        (
            "attention",
            getattr(model, "attention", "sdpa") == "sdpa",
            "context parallelism replaces SDPA calls (torch's context_parallel): attention must be sdpa",
        ),
        (
            "world_size",
            s.mesh.pp == 1 and (s.mesh.tp == 1 or s.mesh.world_size == s.mesh.cp * s.mesh.tp),
            "cp with pipeline parallelism, or with tensor and data parallelism together, is not simulated yet: pp "
            "1, and world_size = cp x tp with tp > 1",
        ),
        ("sequence_parallel", not s.mesh.sequence_parallel, "cp with sequence parallelism is not simulated yet"),
        (
            "dp_engine",
            s.mesh.dp == 1 or s.data_parallel.engine == "fsdp2",
            f"cp with data parallelism runs FSDP2 over dp x cp (torchtitan's dp_shard_cp): dp_engine fsdp2; "
            f"{s.data_parallel.engine} with cp is not simulated yet (or give world_size = cp x tp = "
            f"{s.mesh.cp * s.mesh.tp})",
        ),
        (
            "precision",
            s.precision.uniform,
            f"cp with precision {s.precision.name} is not simulated yet; allowed: fp32, bf16",
        ),
        ("checkpointing", s.checkpointing.policy == "none", "cp with activation checkpointing is not simulated yet"),
        *_training_only("cp", s, model),
    ]
    _refuse(not_yet)


def check_expert_parallel_supported(model, setup: TrainingSetup) -> None:
    """What expert parallelism is simulated with (models/parallel/expert.py, checked against real runs of HF Mixtral
    under torchtitan's token dispatch, traces/expert_run.py): the experts of HF Mixtral on their grouped_mm path,
    data parallelism only besides (world_size = dp, a multiple of ep) with DDP for the dense parameters."""
    s = setup
    not_yet = [
        (
            "experts_implementation",
            getattr(model, "experts_implementation", None) in (None, "grouped_mm"),
            "expert parallelism replaces the grouped_mm experts path (torchtitan's dispatch); allowed: grouped_mm",
        ),
        (
            "world_size",
            s.mesh.world_size == s.mesh.dp,
            f"ep with tensor, pipeline or context parallelism is not simulated yet: world_size must be dp (a "
            f"multiple of ep = {s.mesh.ep}), tp, pp and cp 1",
        ),
        (
            "dp_engine",
            s.data_parallel.engine == "ddp",
            f"ep runs the dense parameters under DDP for now (dp_engine ddp, "
            f"the experts ignored by it); {s.data_parallel.engine} with ep is not "
            "simulated yet",
        ),
        *_training_only("ep", s, None),
    ]
    _refuse(not_yet)


def check_tensor_parallel_supported(family, model, setup: TrainingSetup) -> None:
    """What tensor parallelism is simulated with (models/parallel/tensor/, checked against real DTensor runs):
    the hand-written dense GPT-2 / Llama, alone on its ranks (world_size = tp), fp32, bf16 or bf16 autocast,
    without activation checkpointing, LoRA or dropout."""
    s = setup
    kind = None
    if "tp" not in family.parallel:
        kind = "the model: tensor parallelism is simulated for the hand-written dense GPT-2 and Llama"
    not_yet = [
        ("tp", kind is None, kind or ""),
        (
            "precision",
            not (s.precision.mixed and s.precision.param == "fp16"),
            "tp with precision fp16-mixed is not simulated yet (its loss scaler under DTensor); allowed: fp32, "
            "bf16, bf16-autocast, bf16-mixed",
        ),
        (
            "checkpointing",
            s.checkpointing.policy in ("none", "full", "every-k", "sqrt", "layers"),
            f"tp with checkpointing {s.checkpointing.policy} is not simulated yet (a region inside a layer); allowed: "
            "none, full, every-k, sqrt, layers",
        ),
        *_training_only("tp", s, model),
    ]
    _refuse(not_yet)


__all__ = ["SIMULATED_SCHEDULES", "check_model_parallel", "check_pipeline_supported", "check_tensor_parallel_supported",
           "check_context_parallel_supported", "check_expert_parallel_supported"]
