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

from .config import ConfigError, TrainingSetup
from .cuda_context import CudaContext, cuda_context
from .names import did_you_mean


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

    def context(self, torch_version: str | None, setup: TrainingSetup | None = None) -> CudaContext | None:
        """What the device holds outside the caching allocator with torch `torch_version`: measured or assumed
        (models/cuda_context.py); None on a device that is not a CUDA GPU."""
        return cuda_context(self, torch_version, setup)

    def assumptions(self, torch_version: str | None = None, setup: TrainingSetup | None = None) -> list[str]:
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
                f"{self.interconnect_latency * 1e6:g} us per hop (assumed)"] + \
            ([f"{self.name}: no bf16 tensor cores (sm{''.join(map(str, self.compute_capability))}): bf16 runs "
              "emulated, timed at the fp32 peak"] if self.is_cuda and not self.bf16_native else []) + \
            ([ctx.assumption()] if ctx else [])

    @property
    def bf16_native(self) -> bool:
        """bf16 has a tensor-core path here (sm80 and later); without one (T4, V100) torch runs bf16 emulated,
        slowly (torch.cuda.is_bf16_supported(including_emulation=False) is False), and its ops are timed at fp32's
        peak. The bytes are the same either way."""
        return "bf16" in self.flops

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

    def peak_dtype(self, dtype: str) -> str:
        """The compute dtype whose peak times `dtype`: itself, or fp32 where the device has no such path (bf16 on a
        T4 or V100 runs emulated)."""
        return dtype if dtype in self.flops else "fp32"

    def sustained_flops(self, dtype: str) -> float:
        """FLOP/s a training kernel reaches in `dtype`: the vendor peak x the assumed efficiency (the cost model's
        rate, not a measurement)."""
        return self.flops[self.peak_dtype(dtype)] * self.flops_efficiency

    def duration(self, flops: int, bytes_moved: int, dtype: str) -> float:
        compute = flops / self.sustained_flops(dtype)
        memory = bytes_moved / (self.bandwidth * self.bandwidth_efficiency)
        return max(compute, memory) + self.launch_latency


GiB = 2**30
MiB = 2**20
CONTEXT = 512 << 20  # assumption where nothing is measured (models/cuda_context.py): a torch 2.x process's CUDA
# context with lazily loaded kernels, ~0.5 GiB
TB = 1e12  # the vendors' decimal unit: TFLOP/s
PCIE3, PCIE4, PCIE5 = 12.5e9, 25e9, 50e9  # host link per direction, assumed: ~80% of PCIe x16 gen 3 / 4 / 5


def _gpu(name: str, memory_bytes: int, cc: tuple[int, int], fp32: float, tf32: float | None, fp16: float,
         bf16: float | None, bandwidth: float, host_link: float, interconnect: float) -> DeviceProfile:
    """A CUDA GPU: peak dense FLOP/s in TFLOP/s (tf32 / bf16 None: no such tensor-core path; bf16 then runs
    emulated and is timed at the fp32 peak), memory bandwidth in bytes/s, the CUDA context assumed (`CONTEXT`)."""
    flops = {k: v * TB for k, v in (("fp32", fp32), ("tf32", tf32), ("bf16", bf16), ("fp16", fp16)) if v is not None}
    return DeviceProfile(name, memory_bytes, flops, bandwidth=bandwidth, host_link=host_link,
                         interconnect=interconnect, compute_capability=cc, context_bytes=CONTEXT)


# Every figure's source: bench/SOURCES.md, "GPU device profiles". `memory_bytes` is the total the CUDA driver
# reports to a process (cudaMemGetInfo's total = cudaDeviceProp.totalGlobalMem = torch.cuda.mem_get_info()[1]):
# what the CUDA context, torch's reserved segments and NCCL's buffers share. It is below the marketing size and
# below nvidia-smi's "Total" (the driver keeps some), and moves by up to ~1% with the driver version; each figure
# is one Linux report, the driver named in SOURCES.md. FLOP/s are the datasheets' dense peaks (no sparsity),
# 16-bit with fp32 accumulation (GeForce cards run that at half their fp16-accumulate rate).
DEVICES = {
    # A100 SXM4 80GB: 81,158 MiB (deviceQuery, driver CUDA 12.5); NVLink 3: 300 GB/s per direction
    "A100-80GB": _gpu("A100-80GB", 85_100_068_864, (8, 0), 19.5, 156, 312, 312, 2.039e12, PCIE4, 300e9),
    # H100 SXM5 80GB HBM3: 81,079 MiB (deviceQuery, driver CUDA 13.0); NVLink 4 (the profile's default 450 GB/s)
    "H100-80GB": _gpu("H100-80GB", 85_017_755_648, (9, 0), 67, 494.7, 989.4, 989.4, 3.35e12, PCIE5, 450e9),
    # H200 SXM 141GB: 143,156 MiB measured (../shared/gpu-truth/h200, driver 580.159.04)
    "H200-141GB": _gpu("H200-141GB", 150_109_880_320, (9, 0), 67, 494.7, 989.4, 989.4, 4.8e12, PCIE5, 450e9),
    # A100 40GB (SXM4 / PCIe, same memory): 40,339 MiB (deviceQuery, A100-PCIE-40GB, driver CUDA 12.2)
    "A100-40GB": _gpu("A100-40GB", 42_298_834_944, (8, 0), 19.5, 156, 312, 312, 1.555e12, PCIE4, 300e9),
    # H100 PCIe 80GB HBM2e: 81,008 MiB (torch's total_memory, in MiB); 114 SMs; PCIe gen 5, no NVLink assumed
    "H100-PCIe-80GB": _gpu("H100-PCIe-80GB", 81_008 * MiB, (9, 0), 51, 378, 756.5, 756.5, 2.0e12, PCIE5, PCIE5),
    # RTX 3090 24GB: 24,268 MiB (deviceQuery, driver CUDA 11.8); GA102: 16-bit tensor 71 TFLOP/s (fp32 accum.)
    "RTX-3090-24GB": _gpu("RTX-3090-24GB", 25_447_170_048, (8, 6), 35.6, 35.6, 71, 71, 936e9, PCIE4, PCIE4),
    # RTX 4090 24GB: 24,210 MiB (deviceQuery, driver CUDA 12.4); AD102: 16-bit tensor 165.2 TFLOP/s (fp32 accum.)
    "RTX-4090-24GB": _gpu("RTX-4090-24GB", 25_386_352_640, (8, 9), 82.6, 82.6, 165.2, 165.2, 1008e9, PCIE4,
                          PCIE4),
    # L4 24GB: 22,518 MiB (deviceQuery, driver CUDA 12.0)
    "L4-24GB": _gpu("L4-24GB", 23_612_293_120, (8, 9), 30.3, 60, 121, 121, 300e9, PCIE4, PCIE4),
    # A10G 24GB (AWS G5): 22,587 MiB (torch's total_memory, in MiB); 80 SMs; no NVIDIA datasheet (SOURCES.md)
    "A10G-24GB": _gpu("A10G-24GB", 22_587 * MiB, (8, 6), 35, 35, 70, 70, 600e9, PCIE4, PCIE4),
    # RTX A6000 48GB: 48,790 MiB (deviceQuery, driver CUDA 12.7); 16-bit tensor 154.8 TFLOP/s (fp32 accum.)
    "RTX-A6000-48GB": _gpu("RTX-A6000-48GB", 51_160_023_040, (8, 6), 38.7, 77.4, 154.8, 154.8, 768e9, PCIE4,
                           PCIE4),
    # L40S 48GB: 45,373 MiB (cuda-device-query, driver CUDA 12.4)
    "L40S-48GB": _gpu("L40S-48GB", 47_576_711_168, (8, 9), 91.6, 183, 362.05, 362.05, 864e9, PCIE4, PCIE4),
    # T4 16GB: 14,918 MiB (deviceQuery, driver CUDA 12.4 and 12.5); Turing: no bf16 or tf32 tensor cores
    "T4-16GB": _gpu("T4-16GB", 15_642_329_088, (7, 5), 8.1, None, 65, None, 320e9, PCIE3, PCIE3),
    # V100 SXM2 16GB: 16,144 MiB (deviceQuery, driver CUDA 12.4); Volta: no bf16 or tf32; NVLink 2: 150 GB/s
    "V100-16GB": _gpu("V100-16GB", 16_928_342_016, (7, 0), 15.7, None, 125, None, 900e9, PCIE3, 150e9),
    # V100 SXM2 32GB: 32,511 MiB (deviceQuery, driver CUDA 13.0 and 11.6)
    "V100-32GB": _gpu("V100-32GB", 34_089_926_656, (7, 0), 15.7, None, 125, None, 900e9, PCIE3, 150e9),
    "cpu": DeviceProfile("cpu", 24 * GiB, {"fp32": 0.1e12, "bf16": 0.05e12, "fp16": 0.02e12}, bandwidth=20e9,
                         host_link=20e9, is_cpu=True, flops_efficiency=1.0, bandwidth_efficiency=1.0,
                         launch_latency=2e-6, interconnect=5e9, interconnect_latency=50e-6),
}


@dataclass(frozen=True)
class NodeHost:
    """The typical node a GPU profile sits in, for judging host memory (analysis/host.py): its RAM and GPUs."""

    system: str
    host_memory: int  # bytes of host RAM per node
    gpus_per_node: int
    source: str


TiB = 2**40
# NVIDIA's DGX datasheets, "System Memory" (2TB = 32 x 64 GiB DIMMs = 2 TiB; 1TB = 1 TiB) and "GPUs" (8): profiles
# without a typical node (PCIe and consumer cards: any host) have none, and their host is judged only when
# --host-memory is given
NODE_HOSTS = {
    "H100-80GB": NodeHost("DGX H100", 2 * TiB, 8, "NVIDIA DGX H100 datasheet: 8x H100 SXM5, 2TB system memory"),
    "H200-141GB": NodeHost("DGX H200", 2 * TiB, 8, "NVIDIA DGX H200 datasheet: 8x H200 SXM, 2TB system memory"),
    "A100-80GB": NodeHost("DGX A100 640GB", 2 * TiB, 8, "NVIDIA DGX A100 datasheet: 640GB system, 2TB memory"),
    "A100-40GB": NodeHost("DGX A100 320GB", 1 * TiB, 8, "NVIDIA DGX A100 datasheet: 320GB system, 1TB memory"),
}


def device_profile(name: str) -> DeviceProfile:
    try:
        return DEVICES[name]
    except KeyError:
        raise ConfigError("device", f"unknown device {name!r}; allowed: {', '.join(DEVICES)}"
                                    f"{did_you_mean(name, DEVICES)}") from None
