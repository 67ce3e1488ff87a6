"""Where does a scenario fit: the same training step simulated on every GPU device profile (models/devices.py
DEVICES), each profile's whole device memory against what the step needs there, and the largest micro-batch
that fits each (api.max_micro_batch, the search `peakledger max-batch` runs).

A profile's usable memory is its `memory_bytes`: the total the CUDA driver reports to a process
(cudaMemGetInfo). The step needs its device total: the CUDA context and kernels outside the caching allocator,
NCCL's buffers with data parallelism, and the allocator's reserved segments, x (1 + headroom) (what `simulate`
reports on a GPU profile as `capacity_needed`). It fits when that is within the usable memory, or when the
allocator, freeing its cache and retrying as torch does, serves every request within it (api.fits). One verdict:
the figures printed are the ones judged, so a fit by flush-and-retry shows the run on this card (its allocator
bounded by the card's memory) and says so, with how many requests waited for a flush and what a larger card would
hold. The margin is usable - needed (negative: short by that much); one under THIN_MARGIN of the card is a warning.

Each profile is simulated with its own rules: its compute capability's kernels and workspaces, the CUDA context
measured or assumed for it and the scenario's torch version. What a profile cannot show is said in its row's
notes: bf16 without bf16 tensor cores (T4, V100: torch emulates it, the bytes are the same, the time is not),
and the hand-written describers' attention, written for one GPU target (models/transformer/attention.py
`GPU_TARGET`) where this GPU's torch picks another SDPA kernel.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from . import api
from .analysis.card_fit import THIN_MARGIN
from .analysis.host import HostFit, HostLimits, judge_host
from .analysis.units import format_bytes
from .gpus import GPU_LIMIT, Count, layouts_by_key, min_gpus
from .models.config import ConfigError
from .models.devices import DEVICES, DeviceProfile
from .models.families import family_of
from .models.names import did_you_mean
from .models.transformer.attention import GPU_TARGET, sdpa_choice
from .scenario import Scenario
from .where_rl import REFUSED, RlFit, rl_fit

GPU_PROFILES = tuple(name for name, p in DEVICES.items() if p.is_cuda)


def gpu_profiles(names: Sequence[str] | None = None) -> list[DeviceProfile]:
    """The GPU profiles asked for (every one when `names` is None or empty), smallest memory first (then by
    name); ConfigError naming `devices` for a name that is not a GPU profile, or one given twice."""
    if not names:
        chosen = list(GPU_PROFILES)
    else:
        chosen = []
        for name in names:
            if name not in GPU_PROFILES:
                why = "is not a GPU profile" if name in DEVICES else "is not a device profile"
                raise ConfigError("devices", f"{name!r} {why}; allowed: {', '.join(GPU_PROFILES)}"
                                             f"{did_you_mean(name, GPU_PROFILES)}")
            if name in chosen:
                raise ConfigError("devices", f"{name!r} is given twice")
            chosen.append(name)
    return sorted((DEVICES[n] for n in chosen), key=lambda p: (p.memory_bytes, p.name))


@dataclass(frozen=True)
class Placement:
    """The scenario on one GPU profile."""

    device: str
    usable: int  # bytes: the profile's memory_bytes
    compute_capability: tuple[int, int]
    bf16_native: bool
    # the sizes are None on a row where the run cannot start (`refused`)
    allocated_peak: int | None  # the worst rank's allocated peak (tensors)
    reserved_peak: int | None  # its reserved peak (the caching allocator's segments)
    outside_allocator: int | None  # at the device-total peak: CUDA context and kernels (+ NCCL's buffers)
    device_total_peak: int | None  # outside_allocator + reserved at the device-total peak
    capacity_needed: int | None  # device_total_peak x (1 + headroom)
    fits: bool
    margin: int | None  # usable - capacity_needed
    max_micro_batch: int | None  # -1: not even the fixed state; 0: only it; None: not searched (see `searched`)
    searched: bool  # False: not asked for, or the batch is fixed (a module whose factory takes no micro_batch)
    exact: bool  # False: the describer does not write this GPU's program (`attention_note`); its figures are another's
    search_limit_reached: bool  # max_micro_batch is a lower bound (api.MAX_BATCH_LIMIT)
    notes: tuple[str, ...]
    # a fit that relies on the allocator freeing its whole cache and retrying: the figures above are the run on this
    # card (capacity-bounded), `unbounded_total` what it would hold on a larger one, `alloc_retries` how many
    # requests were served only by that flush (torch's num_alloc_retries)
    alloc_retries: int = 0
    unbounded_total: int | None = None
    # the node's host verdict (analysis/host.py; None: not judged); `fits` is the device's and the host's
    host: HostFit | None = None
    # an RL run (--rl grpo): its rollout batch and vLLM utilization range (peakledger/where_rl.py); max_micro_batch
    # is then its search's (the micro-batches TRL accepts; 0: not the least of them)
    rl: RlFit | None = None
    # why the run cannot start on this card (a colocated vLLM engine's own refusal, models/rl.py); the row then has
    # no sizes and does not fit
    refused: str | None = None

    @classmethod
    def refused_on(cls, profile: DeviceProfile, why: str) -> "Placement":
        """The row of a card where the run stops before its first step (vLLM refuses to start): no sizes, no fit."""
        return cls(device=profile.name, usable=profile.memory_bytes,
                   compute_capability=tuple(profile.compute_capability), bf16_native=profile.bf16_native,
                   allocated_peak=None, reserved_peak=None, outside_allocator=None, device_total_peak=None,
                   capacity_needed=None, fits=False, margin=None, max_micro_batch=None, searched=False, exact=True,
                   search_limit_reached=False, notes=(why,), refused=why)

    @property
    def by_retry(self) -> bool:
        return self.unbounded_total is not None

    @property
    def host_fails(self) -> bool:
        return self.host is not None and not self.host.fits

    def as_json(self) -> dict:
        return {"device": self.device, "usable_bytes": self.usable,
                "compute_capability": list(self.compute_capability), "bf16_native": self.bf16_native,
                "allocated_peak": self.allocated_peak, "reserved_peak": self.reserved_peak,
                "outside_allocator": self.outside_allocator, "device_total_peak": self.device_total_peak,
                "capacity_needed": self.capacity_needed, "fits": self.fits, "margin_bytes": self.margin,
                "max_micro_batch": self.max_micro_batch, "max_micro_batch_searched": self.searched,
                "search_limit_reached": self.search_limit_reached, "exact": self.exact,
                "fits_by_allocator_retry": self.by_retry, "alloc_retries": self.alloc_retries,
                "unbounded_device_total": self.unbounded_total, "notes": list(self.notes),
                **({"host": self.host.as_json()} if self.host is not None and (self.host.asked or self.host_fails)
                   else {}),
                **({"rl": self.rl.as_json()} if self.rl is not None else {}),
                **({"refused": self.refused} if self.refused is not None else {})}


@dataclass(frozen=True)
class Where:
    scenario: str
    micro_batch: int
    precision: str
    headroom: float
    torch_version: str
    world_size: int  # > 1: every row is one GPU of that many (the worst rank's)
    placements: list[Placement]

    @property
    def fits_on(self) -> list[str]:
        return [p.device for p in self.placements if p.fits]

    def as_json(self) -> dict:
        return {"scenario": self.scenario, "micro_batch": self.micro_batch, "precision": self.precision,
                "headroom": self.headroom, "torch_version": self.torch_version, "world_size": self.world_size,
                "unit": "B",
                "fits_on": self.fits_on, "devices": [p.as_json() for p in self.placements]}


def uses_bf16(scenario: Scenario) -> bool:
    """The step computes or keeps tensors in bf16 (its precision, or FSDP2's bf16 gradient reduction)."""
    s = scenario.setup
    return (
        "bf16" in (s.precision.param, s.precision.compute, s.precision.state, s.precision.autocast)
        or s.data_parallel.fsdp2.reduce_dtype == "bf16"
    )


def attention_note(scenario: Scenario, profile: DeviceProfile) -> str | None:
    """Where the hand-written describers' SDPA kernel (written for `GPU_TARGET`'s sm, models/transformer/attention.py
    `sdpa_choice`) is not the one the run's torch picks on this GPU: a note saying so (that row's attention tensors
    are the other kernel's); None where they agree, or the model is traced (its trace follows the GPU) or runs eager
    attention."""
    model = scenario.model
    if not family_of(model).transformer or model.attention != "sdpa":
        return None
    cc = GPU_TARGET[0]
    if tuple(profile.compute_capability) == tuple(cc):
        return None
    s, version = scenario.setup, scenario.torch_version
    n_kv = model.kv_heads

    def pick(capability):
        return sdpa_choice(s.precision.compute, s.batch.seq_len, model.n_head, n_kv, model.head_size, model.dropout,
                           version, capability)

    written, here = pick(None), pick(tuple(profile.compute_capability))
    if written == here:
        return None
    target = "sm{}{}".format(*cc)
    return (f"attention: the hand-written describer writes the {written} SDPA kernel ({target}'s choice under torch "
            f"{version}); torch {version} picks {here} on sm{''.join(map(str, profile.compute_capability))}, whose "
            "saved tensors are not simulated here")


def place(scenario: Scenario, profile: DeviceProfile, search: bool = True, host: HostLimits | None = None
          ) -> Placement:
    """`scenario` on `profile`: its device total against the profile's memory, the node's host against `host`'s
    limits (analysis/host.py `judge_host`: by default the profile's typical node) and (with `search`) the largest
    micro-batch that fits the device."""
    on = dataclasses.replace(scenario, device=profile.name)
    report = api.run(on)
    if report.gpu is None:  # (every profile here is a CUDA one)
        raise ConfigError("devices", f"{profile.name} has no caching allocator to replay")
    usable = profile.memory_bytes
    best, capped, notes = None, False, []
    rl = rl_fit(on, report, profile, search) if on.setup.rl.on else None
    if rl is not None:
        best = rl.max_micro_batch
    elif search:
        try:
            best = api.max_micro_batch(on, usable)
        except ConfigError as e:
            if e.field != "module":
                raise
            notes.append("max micro-batch: the module's batch is fixed (its factory takes no micro_batch)")
        capped = best is not None and best >= api.MAX_BATCH_LIMIT
    if uses_bf16(on) and not profile.bf16_native:
        notes.append(f"bf16: no bf16 tensor cores (sm{''.join(map(str, profile.compute_capability))}); torch "
                     "emulates it, slowly: same bytes, not the same time (fp16 is this GPU's 16-bit type)")
    note = attention_note(on, profile)
    if note:
        notes.append(note)  # (a figure of another program: the row says it is not exact)
    verdict = api.card_fit(report, usable)
    if verdict.by_retry:  # the figures are the run on this card: one verdict
        notes.append(f"fits only because the caching allocator frees its whole cache and retries: "
                     f"{verdict.alloc_retries:,} request(s) served after a flush (torch's num_alloc_retries), each a "
                     "synchronize and cudaFree/cudaMalloc; on a larger card it would hold "
                     f"{format_bytes(verdict.unbounded, 'GiB')}")
    if verdict.thin:
        notes.append(f"thin margin: {format_bytes(verdict.margin, 'GiB')} left, under {THIN_MARGIN:.0%} of the card: "
                     "a longer batch, fragmentation or another process's memory can make it OOM (--headroom adds a "
                     "margin to what is judged)")
    judged = judge_host(report.log, profile.name, host or HostLimits(), report.index)
    if judged is not None and (judged.asked or not judged.fits):
        notes.append(judged.text("GiB"))
    point = verdict.point
    return Placement(device=profile.name, usable=usable, compute_capability=tuple(profile.compute_capability),
                     bf16_native=profile.bf16_native, allocated_peak=report.gpu.at_allocated_peak.allocated,
                     reserved_peak=point.reserved, outside_allocator=point.total - point.reserved,
                     device_total_peak=point.total, capacity_needed=verdict.need,
                     fits=verdict.fits and (judged is None or judged.fits), host=judged,
                     margin=verdict.margin,
                     max_micro_batch=best, searched=best is not None, search_limit_reached=capped,
                     exact=note is None, notes=tuple(notes), alloc_retries=verdict.alloc_retries,
                     unbounded_total=verdict.unbounded if verdict.by_retry else None, rl=rl)


def where(scenario: Scenario, devices: Sequence[str] | None = None, search: bool = True,
          progress: Callable[[int, int, str], None] | None = None, host: HostLimits | None = None) -> Where:
    """`scenario` placed on each GPU profile of `devices` (all by default), smallest memory first. `progress(i,
    n, name)` is called before the i-th of n profiles (0-based) is simulated."""
    profiles = gpu_profiles(devices)
    placements = []
    for i, profile in enumerate(profiles):
        if progress is not None:
            progress(i, len(profiles), profile.name)
        try:
            placements.append(place(scenario, profile, search, host))
        except ConfigError as e:
            if e.field != REFUSED:
                raise
            placements.append(Placement.refused_on(profile, e.message))  # this card only: the others are judged
    s = scenario.setup
    return Where(scenario=scenario.name, micro_batch=s.batch.micro_batch, precision=s.precision.name,
                 headroom=scenario.headroom, torch_version=scenario.torch_version, world_size=s.mesh.world_size,
                 placements=placements)


@dataclass(frozen=True)
class CardCounts:
    """For one GPU profile, the smallest number of those GPUs that fits the scenario in each layout."""

    device: str
    counts: list[Count[Placement]]

    def as_json(self) -> dict:
        def side(n, p: Placement | None):
            return None if p is None else {"gpus": n, "fits": p.fits, "margin_bytes": p.margin,
                                           "capacity_needed": p.capacity_needed,
                                           "fits_by_allocator_retry": p.by_retry}
        return {"device": self.device, "layouts": [
            {"layout": c.layout.key, "min_gpus": c.n, "limit": c.limit, "refused": c.error,
             "at": side(c.n, c.at), "below": side(c.below_n, c.below)} for c in self.counts]}


def min_gpus_per_card(scenario: Scenario, devices: Sequence[str] | None = None, layouts: Sequence[str] | None = None,
                      limit: int = GPU_LIMIT, progress: Callable[[int, int, str], None] | None = None
                      ) -> list[CardCounts]:
    """On each GPU profile of `devices` (all by default), the smallest GPU count at which each layout of `layouts`
    (peakledger/gpus.py; all by default) fits, judged as `where` judges one card (`place`), checked at that count
    and at the one below. `progress(i, n, name)` before the i-th of n profiles."""
    profiles, chosen = gpu_profiles(devices), layouts_by_key(layouts)
    out = []
    for i, profile in enumerate(profiles):
        if progress is not None:
            progress(i, len(profiles), profile.name)
        judge = lambda sc, profile=profile: place(sc, profile, search=False)  # noqa: E731
        out.append(CardCounts(profile.name, [min_gpus(scenario, lay, judge, limit) for lay in chosen]))
    return out
