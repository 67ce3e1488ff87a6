"""What a run records of itself: the event log's metadata (`EventLog.metadata`, and `OpGraph.metadata`, which the
simulator hands on to the log), one typed field per key any run writes.

A simulated run (models/training.py `describe`, peakledger/script.py) and a measured one (traces/: the tracker, the
distributed, mesh, pipeline, tensor-, context- and expert-parallel runs, CUDA captures and snapshots) fill different
fields; every field is optional. A field is written when it is given, None included: `RunMetadata(batch=None)` is
stored as `"batch": null`, `RunMetadata()` stores no "batch" (a run that says "none" and a run that never had the
key stay apart, as they were in the JSON). Either way the field reads as None. `updated` gives a copy with more
fields given, as `dict.update` did.

The training setup is the setup object itself (models/config's `TrainingSetup`): the simulator, the lowest layer,
does not import it, and types it by the one thing the log needs of it, `knob_values()`, its serialised form.
Reading a stored log back, the layer that knows the class rebuilds it (`from_json_dict`'s `read_setup`; the trace
store passes `TrainingSetup`'s).

`to_json_dict` / `from_json_dict` are the one serialisation: the JSON object a trace file stores as "metadata",
exactly as the dict this replaces was written (same keys, same values, keys sorted as the store sorts them), so
files written before it read back, and files written after it are the same bytes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol


class Setup(Protocol):
    """A run's training setup, as far as the event log needs it: models/config's `TrainingSetup`."""

    def knob_values(self) -> dict[str, object]:
        """The setup's one serialised form (every knob by name)."""


class _Unset:
    __slots__ = ()

    def __repr__(self) -> str:
        return "UNSET"


UNSET: Any = _Unset()  # every field's default: not given, so not written; it reads as None


@dataclass(frozen=True, kw_only=True, repr=False)
class RunMetadata:
    """A run's metadata: what ran, on what, and what the run found out about itself (see the module docstring)."""

    # -- what ran, on what (every kind of run) -------------------------------------------------------------------
    model: str | dict | None = UNSET  # simulated: the model's name. measured: its config's fields (dataclasses.asdict
    # of the class `model_kind` names, one of several: peakledger/inputs.py `recorded_scenario` reads it back)
    model_kind: str | None = UNSET  # the model config's class: "TransformerConfig", "MLPConfig", "TracedModel"
    setup: Setup | None = UNSET  # the TrainingSetup run
    scenario: str | None = UNSET  # the scenario's name
    device: str | int | None = UNSET  # the device profile's name ("H100-80GB", "cpu"); a CUDA capture: the GPU's
    # name; a CUDA snapshot: the device's index
    torch_version: str | None = UNSET  # the torch whose rules apply (simulated) or that ran (measured)
    torch_rules: str | None = UNSET  # simulated: why those rules (simulator/torch_rules `rules_note`)
    alloc_conf: str | None = UNSET  # PYTORCH_CUDA_ALLOC_CONF
    empty_cache_before_save: bool | None = UNSET  # torch.cuda.empty_cache() before a checkpoint save
    device_capacity: int | None = UNSET  # bytes: the budget the run was given (None: the device's own memory)
    steps: int | None = UNSET  # optimizer steps asked for (models/training.py `StepPlan`)
    steps_simulated: int | None = UNSET  # of which simulated; later ones repeat them
    repeat_period: int | None = UNSET  # the repeating steps' period
    stopped_at_oom: bool | None = UNSET  # the log ends at the first allocation that did not fit

    # -- a simulation: models/training.py `describe`, peakledger/script.py `script_metadata` ---------------------
    describer: str | None = UNSET  # what turned the model into ops: "hand-written", "traced ...", "script ..."
    batch: str | None = UNSET  # a traced model's own batch, described (None: the setup's micro-batch)
    describer_note: str | None = UNSET  # what the report adds about the describer on a GPU profile
    counted_flops_per_step: int | None = UNSET  # a traced model: torch's FLOP formulas over its recorded aten ops
    n_params: int | None = UNSET
    n_trainable: int | None = UNSET
    n_active_params: int | None = UNSET  # mixture of experts: parameters one token runs through
    experts: str | None = UNSET  # mixture of experts: "top-2 of 8 experts"
    forward_flops_per_microbatch: int | None = UNSET
    effective_batch: int | None = UNSET
    tokens_per_step: int | None = UNSET
    rank_classes: dict[str, list[int] | None] | None = UNSET  # class (its lowest rank) -> its ranks (None: too many)
    rank_class_ranges: dict[str, list[list[int]]] | None = UNSET  # class -> its ranks as [first, last] ranges
    assumptions: list[str] | None = UNSET  # the device profile's timing assumptions
    pipeline: dict | None = UNSET  # models/parallel/pipeline.py `pipeline_metadata`, with "timing"
    expert_parallel: dict | None = UNSET  # models/parallel/expert.py `expert_metadata`
    script: dict | str | None = UNSET  # peakledger run: the script's run (peakledger/script.py `script_metadata`);
    # its real run, measured (traces/script_run.py): the script's file name

    # -- a measured run: the tracker (traces/tracker/) and what runs it --------------------------------------------
    torch: str | None = UNSET  # torch.__version__ of the tracking process
    live_at_end: list[int] | None = UNSET  # ids of the blocks never freed
    grad_accum: int | None = UNSET
    set_to_none: bool | None = UNSET
    optimizer: str | None = UNSET  # the torch optimizer's class name
    autocast: str | None = UNSET  # the autocast dtype (None: no autocast)
    time: str | None = UNSET  # "event index": wall-clock times replaced (traces/store.py `with_event_index_times`)
    compile: dict | None = UNSET  # a torch.compile run: mode, how the optimizer step ran, what measured it
    phases: str | None = UNSET  # torch.profiler's timeline: which phases it tells apart
    source: str | None = UNSET  # a script's real run: what measured it
    script_calls: dict | None = UNSET  # a script's real run: what it called (traces/script_run.py)
    mode: str | None = UNSET  # bench/validate_checkpoint_io.py: the checkpoint save or load mode measured

    # -- a CUDA capture (traces/cuda_capture.py) and a CUDA snapshot (traces/cuda_snapshot/) -----------------------
    device_kind: str | None = UNSET  # "cuda"
    cuda_device: int | None = UNSET
    gpu: str | None = UNSET  # torch.cuda.get_device_name
    compute_capability: list[int] | None = UNSET
    gpu_total_memory: int | None = UNSET
    gpu_profile: str | None = UNSET  # the device profile that matches the GPU (None: none does)
    device_profile: str | None = UNSET  # likewise, the one validate --trace simulates on
    allocator_rules: str | None = UNSET  # the torch minor version whose allocator rules apply
    source_pickle: str | None = UNSET  # the snapshot the trace was read from
    reserved_peak: int | None = UNSET  # bytes the caching allocator held at most
    step_labels: dict | None = UNSET  # how the snapshot's events were given steps and phases
    loop_marks: list | None = UNSET  # the training loop's marks: [time, phase, step, micro-batch]
    entries: int | None = UNSET  # the snapshot's trace entries
    streams: list[int] | None = UNSET
    preexisting_blocks: int | None = UNSET  # blocks live when recording started
    preexisting_segments: int | None = UNSET
    devices: list[int] | None = UNSET  # a snapshot of several devices, merged

    # -- a measured rank of a distributed run (traces/harness.py `run_metadata` and each run's own) ---------------
    world_size: int | None = UNSET
    rank: int | None = UNSET
    backend: str | None = UNSET  # the process group's: "gloo", "fake"
    engine: str | None = UNSET  # "fsdp2", "ddp", "mesh", "pipeline", "dtensor-tp", ...
    engines: list[str] | None = UNSET  # the engines a mesh or expert-parallel run combines
    dp_engine: str | None = UNSET  # "fsdp2" where FSDP2 is applied on a sub-mesh
    reshard_after_forward: bool | None = UNSET  # FSDP2's, on the blocks (None: not an FSDP2 run)
    root_reshard_after_forward: bool | None = UNSET  # FSDP2's, on the root (None: fully_shard's default)
    fsdp_units: dict[str, list[str]] | None = UNSET  # each FSDP2 unit's module path -> the parameters it shards
    fsdp_mesh: str | None = UNSET  # the mesh dimension FSDP2 shards over
    backend_release: dict[str, int] | None = UNSET  # how the collectives' tensors were released (harness.ReleaseCount)
    backend_copies: str | None = UNSET  # "removed": the process group's own copies taken out (traces/distributed.py)
    ddp_bucket_cap_bytes: int | None = UNSET
    ddp_ignored: list[str] | None = UNSET  # parameters DDP leaves alone (the experts)
    zero_owner: dict[str, int] | None = UNSET  # ZeroRedundancyOptimizer: parameter -> the rank that owns its state
    mesh: dict[str, int] | None = UNSET  # the rank's coordinates on the device mesh
    mesh_shape: dict[str, int] | None = UNSET
    mesh_dim_names: list[str] | None = UNSET
    placements: dict[str, str] | None = UNSET  # parameter -> its DTensor placements and local shape
    dp: int | None = UNSET
    tp: int | None = UNSET
    pp: int | None = UNSET
    cp: int | None = UNSET
    ep: int | None = UNSET
    dp_rank: int | None = UNSET
    cp_rank: int | None = UNSET
    ep_rank: int | None = UNSET
    sequence_parallel: bool | None = UNSET
    loss_parallel: bool | None = UNSET
    pp_schedule: str | None = UNSET
    virtual_stages: int | None = UNSET
    stages: list[dict] | None = UNSET  # the rank's pipeline stages: index, layers, first, last
    expert_grad_sync: str | None = UNSET  # how the experts' replicas sync their gradients (None: no replicas)
    routing: str | None = UNSET  # the experts' routing: "measured", "worst", ...
    routing_counts: dict | None = UNSET  # tokens per expert, the document `--moe-routing counts:FILE` reads
    cp_options: dict | None = UNSET  # torch's context-parallel options as the run had them
    load_balancer: str | None = UNSET  # context parallelism's load balancer (None: none)
    grad_reduce: str | None = UNSET
    attention: str | None = UNSET  # the attention run
    attention_requested: str | None = UNSET  # the attention the model config asked for
    local_seq_len: int | None = UNSET
    losses: list[list] | None = UNSET  # [step, micro-batch, loss]

    # -- user events (analysis/user_events.py) --------------------------------------------------------------------
    events_file: str | None = UNSET
    order: str | None = UNSET  # how events at one time are ordered

    # -- bookkeeping ---------------------------------------------------------------------------------------------
    # Keys this peakledger does not know, as a stored trace had them (a file of another version or tool): kept, so
    # such a file still reads and is written again the same. Nothing here writes one; it stays a mapping because
    # its keys are not known.
    foreign: Mapping[str, object] = field(default_factory=dict)
    # The None fields written, as null: those given as None when made (`RunMetadata(batch=None)`; leave this out) or
    # to `updated`. A None field not in it was never given and is left out. `dataclasses.replace` keeps it as it is.
    written_none: frozenset[str] | None = None

    def __post_init__(self) -> None:
        nones = set()
        for name in FIELDS:
            value = getattr(self, name)
            if value is UNSET:
                object.__setattr__(self, name, None)
            elif value is None:
                nones.add(name)
        kept = nones if self.written_none is None else nones & self.written_none
        object.__setattr__(self, "written_none", frozenset(kept))

    def written(self) -> dict[str, object]:
        """The fields written, by name (the setup as the object it is), in declaration order."""
        return {name: getattr(self, name) for name in FIELDS
                if getattr(self, name) is not None or name in self.written_none}

    def updated(self, other: RunMetadata | None = None, /, **fields: object) -> RunMetadata:
        """A copy with `other`'s written fields, then `fields`, written over this one's (`dict.update`): a field
        given as None is written, as null."""
        foreign = self.foreign
        if other is not None:
            fields = {**other.written(), **fields}
            foreign = {**foreign, **other.foreign}
        nones = {name for name, value in fields.items() if value is None}
        return dataclasses.replace(self, **fields, foreign=foreign,
                                   written_none=(self.written_none - fields.keys()) | nones)

    def to_json_dict(self) -> dict[str, object]:
        """The JSON object a trace file stores: the written fields and the foreign keys, the setup as
        `knob_values()`, keys sorted."""
        out = {**self.written(), **self.foreign}
        if self.setup is not None:
            out["setup"] = self.setup.knob_values()
        return dict(sorted(out.items()))

    @classmethod
    def from_json_dict(cls, data: Mapping[str, object], read_setup: Callable[[Any], Setup]) -> RunMetadata:
        """`to_json_dict`'s object read back: each known key to its field, the setup through `read_setup` (a null
        setup stays None), any other key into `foreign`."""
        given = {k: v for k, v in data.items() if k in _FIELD_SET}
        if given.get("setup") is not None:
            given["setup"] = read_setup(given["setup"])
        return cls(**given, foreign={k: v for k, v in data.items() if k not in _FIELD_SET})

    def __repr__(self) -> str:
        """The fields written only (of a hundred)."""
        shown = [f"{k}={v!r}" for k, v in self.written().items()]
        if self.foreign:
            shown.append(f"foreign={self.foreign!r}")
        return f"RunMetadata({', '.join(shown)})"


FIELDS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(RunMetadata)
                                if f.name not in ("foreign", "written_none"))
_FIELD_SET = frozenset(FIELDS)

__all__ = ["RunMetadata", "Setup", "FIELDS", "UNSET"]
