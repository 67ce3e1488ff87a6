"""The cost model: how long an op takes, from its FLOPs and the bytes it moves (a roofline).

duration = max(flops / (peak FLOP/s x efficiency), bytes / (bandwidth x efficiency)) + launch latency.

Collectives run on the communication stream with ring-algorithm costs over the data-parallel
interconnect (bus bandwidth per rank, assumed, and a per-hop latency):
all-gather / reduce-scatter of a full tensor of S bytes on N ranks take (N-1)/N x S / bandwidth +
(N-1) x latency; an all-reduce twice that; a broadcast S / bandwidth + latency.

Device figures are vendor peak numbers (dense, no sparsity) and the efficiencies are assumptions,
labelled as such in every report: durations set the order and overlap of events in time, never the
byte counts, so a wrong assumption here moves a timeline sideways, not a peak up or down.
"""

from __future__ import annotations

from dataclasses import dataclass

from .config import ConfigError
from .cuda_context import CudaContext, cuda_context


@dataclass(frozen=True)
class DeviceProfile:
    name: str
    memory_bytes: int
    flops: dict[str, float]  # peak dense FLOP/s by compute dtype
    bandwidth: float  # memory bytes/s
    host_link: float  # host<->device bytes/s
    is_cpu: bool = False
    flops_efficiency: float = 0.5  # assumption: fraction of peak a training kernel reaches
    bandwidth_efficiency: float = 0.7  # assumption
    launch_latency: float = 5e-6  # assumption, seconds per op
    interconnect: float = 450e9  # data-parallel bus bandwidth per rank, bytes/s (assumption)
    interconnect_latency: float = 10e-6  # seconds per ring hop (assumption)
    compute_capability: tuple[int, int] | None = None  # a CUDA GPU's (major, minor); None: not a CUDA device
    # CUDA context + loaded kernels outside the caching allocator, assumed where models/cuda_context.py has no
    # measurement for the torch version (`context`)
    context_bytes: int = 0

    def context(self, torch_version: str | None, setup: dict | None = None) -> CudaContext | None:
        """What the device holds outside the caching allocator with torch `torch_version`: measured or assumed
        (models/cuda_context.py); None on a device that is not a CUDA GPU."""
        return cuda_context(self, torch_version, setup)

    def assumptions(self, torch_version: str | None = None, setup: dict | None = None) -> list[str]:
        """The timing assumptions; with `torch_version`, on a CUDA GPU, the line of what lies outside the
        allocator too (measured or assumed: it depends on the torch version, which the profile alone does not
        know; the report adds it from the run's `torch_version`)."""
        ctx = self.context(torch_version, setup) if torch_version is not None else None
        peaks = ", ".join(f"{k} {v / 1e12:g} TFLOP/s" for k, v in self.flops.items())
        return [f"{self.name}: vendor peak {peaks}; memory {self.bandwidth / 1e12:g} TB/s; host link "
                f"{self.host_link / 1e9:g} GB/s (assumed, not measured)",
                f"efficiency assumed {self.flops_efficiency:.0%} of peak FLOP/s, {self.bandwidth_efficiency:.0%} "
                f"of bandwidth, {self.launch_latency * 1e6:g} us per op",
                f"collectives: ring over {self.interconnect / 1e9:g} GB/s per rank, "
                f"{self.interconnect_latency * 1e6:g} us per hop (assumed)"] + ([ctx.assumption()] if ctx else [])

    @property
    def is_cuda(self) -> bool:
        """A CUDA GPU: its tensors live in torch's caching allocator (reserved memory, models/gpu.py)."""
        return self.compute_capability is not None

    def collective_duration(self, kind: str, nbytes: int, world_size: int) -> float:
        """Seconds for one ring collective over `nbytes` (the full, unsharded size) on `world_size` ranks; an
        all-to-all's `nbytes` is what the rank sends or receives, the larger, (n - 1) / n of it crossing the link."""
        n = world_size
        if n <= 1:
            return self.launch_latency
        hops = {"all_gather": 1, "reduce_scatter": 1, "all_reduce": 2, "broadcast": 1, "all_to_all": 1}[kind]
        volume = nbytes if kind == "broadcast" else nbytes * (n - 1) / n
        latency = self.interconnect_latency * (1 if kind == "broadcast" else n - 1)
        return hops * (volume / self.interconnect + latency)

    def duration(self, flops: int, bytes_moved: int, dtype: str) -> float:
        peak = self.flops.get(dtype, self.flops["fp32"])
        compute = flops / (peak * self.flops_efficiency)
        memory = bytes_moved / (self.bandwidth * self.bandwidth_efficiency)
        return max(compute, memory) + self.launch_latency


GiB = 2**30
CONTEXT = 512 << 20  # assumption where nothing is measured (models/cuda_context.py): a torch 2.x process's CUDA
# context with lazily loaded kernels, ~0.5 GiB
DEVICES = {
    "A100-80GB": DeviceProfile("A100-80GB", 80 * GiB, {"fp32": 19.5e12, "tf32": 156e12, "bf16": 312e12, "fp16": 312e12},
                               bandwidth=2.039e12, host_link=25e9, interconnect=300e9, compute_capability=(8, 0),
                               context_bytes=CONTEXT),
    "H100-80GB": DeviceProfile("H100-80GB", 80 * GiB, {"fp32": 67e12, "tf32": 494.7e12, "bf16": 989.4e12,
                                                       "fp16": 989.4e12},
                               bandwidth=3.35e12, host_link=50e9, compute_capability=(9, 0), context_bytes=CONTEXT),
    "H200-141GB": DeviceProfile("H200-141GB", 141 * 10**9, {"fp32": 67e12, "tf32": 494.7e12, "bf16": 989.4e12,
                                                           "fp16": 989.4e12}, bandwidth=4.8e12, host_link=50e9,
                                compute_capability=(9, 0), context_bytes=CONTEXT),
    "cpu": DeviceProfile("cpu", 24 * GiB, {"fp32": 0.1e12, "bf16": 0.05e12, "fp16": 0.02e12}, bandwidth=20e9,
                         host_link=20e9, is_cpu=True, flops_efficiency=1.0, bandwidth_efficiency=1.0,
                         launch_latency=2e-6, interconnect=5e9, interconnect_latency=50e-6),
}


def device_profile(name: str) -> DeviceProfile:
    try:
        return DEVICES[name]
    except KeyError:
        raise ConfigError("device", f"unknown device {name!r}; allowed: {', '.join(DEVICES)}") from None
