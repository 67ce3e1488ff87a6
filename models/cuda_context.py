"""What a torch process holds on a CUDA device outside the caching allocator: measured, per GPU and torch version.

`torch.cuda.mem_get_info()` counts as used what the driver gave the process; `torch.cuda.memory_reserved()`
only the caching allocator's segments. The difference is the CUDA context (the driver's per-process state and
per-SM local memory), the modules of the kernels loaded so far (CUDA loads a module lazily, at a kernel's first
launch), and the handles of torch's CUDA libraries (cuBLAS, NCCL's communicators); none of it is a tensor. The
device total a report prints is these + reserved (+ NCCL's buffers with data parallelism, models/gpu.py).

`MEASURED` holds one `ContextMeasurement` per GPU, torch and CUDA version; each figure is `total - free -
reserved`, read where the measurement says (relative to the repository root):

- H200 (NVIDIA H200, sm90, driver 580.159.04), torch 2.11.0+cu130, CUDA 13.0 (../shared/gpu-truth/h200: its
  README.md and hf-runs/measured.json, written by hf-runs/run_cases.py): 552,402,944 B after `torch.cuda.init()`
  and one allocation (`context_used`), 623,706,112 B after the first bf16 matmul (`context_used_after_matmul`:
  + cuBLAS's handle and kernels). After the first training step of a fresh process's first run (GPT-2 124M, bf16
  autocast: `device_used - reserved_after` of step 1) 804,061,184 B: the step's kernels (forward, autograd's
  thread with its own cuBLAS handle, AdamW's foreach kernels) add 180,355,072 B (172 MiB); step 2 adds nothing.
  A fresh process whose first run is FSDP2 on one rank (Qwen2-0.5B, NCCL, world size 1) holds 877,461,504 B
  after its first step: 73,400,320 B (70 MiB) more, NCCL's communicator and FSDP2's copy kernels.

  The 20 runs of measured.json check `device_used = after_first_gemm + step kernels (+ FSDP2's) + reserved_after`
  (tests/test_cuda_context.py): 0 B off for the first run of each process; later runs of the same process carry
  the kernels of every run before them (one process ran the 12 runs of set A, another the 8 of set A2), so the
  residual only grows, 0 to 10,485,760 B (10 MiB) over set A and 0 to 8,388,608 B over set A2 past its FSDP2
  run; both steps of a run equal. ResNet-50 (cuDNN's convolutions) adds nothing over the run before it (cuDNN's
  workspaces are allocator blocks); torch.compile's Triton kernels at most 2 MiB.
- H100-class, torch 2.6 (../shared/gpu-truth/snapshots): allocator snapshots only (segments and alloc/free
  traces, no device-wide free or total): nothing there measures the context.

`cuda_context(profile, torch_version, setup)` picks, for a device profile and the scenario's torch version:
measured, when a measurement of that profile's GPU with that torch major.minor exists; else assumed from a
measurement of the same compute capability and torch version (another GPU of the same architecture: its
figures, labelled as borrowed); else assumed: the profile's `context_bytes` (models/devices.py), one figure for
the context and the kernels. The result says which, and from where, in every line it prints.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Protocol

from .config import TrainingSetup

MiB = 1 << 20


class Device(Protocol):
    """What this module reads of a device profile (models/devices.py `DeviceProfile`, which imports this module)."""

    name: str
    compute_capability: tuple[int, int]
    is_cuda: bool
    context_bytes: int


@dataclass(frozen=True)
class ContextMeasurement:
    """One GPU, torch and CUDA version: what `total - free - reserved` read, in bytes (module docstring)."""

    gpu: str  # torch.cuda.get_device_name()
    profile: str  # the device profile (models/devices.py DEVICES) of that GPU
    compute_capability: tuple[int, int]
    torch: str  # torch.__version__
    cuda: str
    driver: str
    after_init: int  # after torch.cuda.init() and one allocation
    after_first_gemm: int  # after the first bf16 matmul: + cuBLAS's handle and its kernels
    after_first_step: int  # after the first training step of a fresh process's first run (`first_step_run`)
    first_step_run: str
    fsdp2_after_first_step: int | None  # the same, the first run being FSDP2 on one rank (NCCL, world size 1)
    fsdp2_run: str | None
    source: str  # the measurement's folder, relative to the repository root
    files: tuple[str, ...]  # where each figure is written, relative to `source`

    @property
    def torch_minor(self) -> str:
        return torch_minor(self.torch)

    @property
    def step_kernels(self) -> int:
        """What the first training step loads outside the allocator: its kernels and autograd's handles."""
        return self.after_first_step - self.after_first_gemm

    @property
    def fsdp2_extra(self) -> int | None:
        """FSDP2 on one rank over a plain run: NCCL's communicator and FSDP2's kernels."""
        return None if self.fsdp2_after_first_step is None else self.fsdp2_after_first_step - self.after_first_step

    def short(self) -> str:
        """"H200, torch 2.11+cu130"."""
        gpu = self.gpu.removeprefix("NVIDIA ")
        local = self.torch.partition("+")[2]
        return f"{gpu}, torch {self.torch_minor}{'+' + local if local else ''}"

    def as_json(self) -> dict:
        return {"gpu": self.gpu, "profile": self.profile, "compute_capability": list(self.compute_capability),
                "torch": self.torch, "cuda": self.cuda, "driver": self.driver, "after_init": self.after_init,
                "after_first_gemm": self.after_first_gemm, "after_first_step": self.after_first_step,
                "first_step_run": self.first_step_run, "fsdp2_after_first_step": self.fsdp2_after_first_step,
                "fsdp2_run": self.fsdp2_run, "source": self.source, "files": list(self.files)}


MEASURED: tuple[ContextMeasurement, ...] = (
    ContextMeasurement(gpu="NVIDIA H200", profile="H200-141GB", compute_capability=(9, 0), torch="2.11.0+cu130",
                       cuda="13.0", driver="580.159.04", after_init=552_402_944, after_first_gemm=623_706_112,
                       after_first_step=804_061_184, first_step_run="gpt2-124m-autocast-b8-t1024",
                       fsdp2_after_first_step=877_461_504, fsdp2_run="a2-qwen2-0.5b-fsdp2-1gpu-b8-t1024",
                       source="../shared/gpu-truth/h200", files=("README.md", "hf-runs/measured.json")),
)

# the rows of the device total outside the allocator (JSON `ledger_at_device_total_peak`)
CONTEXT_ROW = "CUDA context + cuBLAS"
KERNELS_ROW = "kernels loaded by the training step"
FSDP2_ROW = "NCCL communicator + FSDP2 kernels (world size 1)"
ASSUMED_ROW = "CUDA context and kernels"


def torch_minor(version: str | None) -> str | None:
    """"2.11.0+cu130" / "2.11" -> "2.11"; None when it is not a version."""
    m = re.match(r"\s*(\d+)\.(\d+)", str(version or ""))
    return f"{m.group(1)}.{m.group(2)}" if m else None


@dataclass(frozen=True)
class CudaContext:
    """What a profile's process holds outside the allocator, row by row, and whether it is measured."""

    parts: tuple[tuple[str, int], ...]  # (row, bytes)
    measured: bool
    label: str  # "measured: H200, torch 2.11+cu130, ../shared/gpu-truth/h200" or "assumed: ..."
    measurement: ContextMeasurement | None  # the one its figures come from (measured or borrowed)
    note: str = ""  # the assumption line's detail

    @property
    def bytes(self) -> int:
        return sum(n for _, n in self.parts)

    @property
    def source(self) -> str | None:
        return self.measurement.source if self.measurement else None

    def text(self) -> str:
        """"CUDA context + cuBLAS 594.8 MiB (measured: ...) + kernels loaded by the training step 172.0 MiB (...)"."""
        (first, n), *rest = self.parts
        same = f"({'measured' if self.measured else 'assumed'}, same source)"
        return " + ".join([f"{first} {n / MiB:.1f} MiB ({self.label})"] + [f"{r} {b / MiB:.1f} MiB {same}"
                                                                              for r, b in rest])

    def assumption(self) -> str:
        """The report's line under "assumptions": what is measured and where, or what is assumed and why."""
        rows = ", ".join(f"{r} {n / MiB:.1f} MiB" for r, n in self.parts)
        return f"outside the caching allocator: {rows} ({self.label}){'; ' + self.note if self.note else ''}"

    def as_json(self) -> dict:
        return {"bytes": self.bytes, "unit": "B", "measured": self.measured, "label": self.label,
                "source": self.source, "rows": [{"row": r, "bytes": n} for r, n in self.parts],
                "measurement": self.measurement.as_json() if self.measurement else None}


def find_measurement(profile: str, compute_capability: tuple[int, int] | None,
                     torch_version: str | None) -> tuple[ContextMeasurement | None, bool]:
    """(the measurement, whether it is of this profile's GPU): the profile's own for the torch version, else one
    of the same compute capability and torch version, else (None, False)."""
    version = torch_minor(torch_version)
    same = [m for m in MEASURED if m.torch_minor == version]
    own = next((m for m in same if m.profile == profile), None)
    if own is not None:
        return own, True
    return next((m for m in same if m.compute_capability == compute_capability), None), False


def cuda_context(profile: Device, torch_version: str | None, setup: TrainingSetup | None = None) -> CudaContext | None:
    """What `profile` holds outside the caching allocator with torch `torch_version` ("2.6", "2.11", or a full
    version); `setup` (the log's) adds FSDP2's communicator on one rank. None: not a CUDA device."""
    if not profile.is_cuda:
        return None
    m, own = find_measurement(profile.name, profile.compute_capability, torch_version)
    cc = "sm{}{}".format(*profile.compute_capability)
    asked = f"{profile.name} with torch {torch_minor(torch_version) or torch_version}"
    if m is None:
        known = "; ".join(f"{x.short()} ({x.profile})" for x in MEASURED)
        return CudaContext(parts=((ASSUMED_ROW, profile.context_bytes),), measured=False,
                           label=f"assumed: not measured for {asked}", measurement=None,
                           note=f"{cc}; measured only: {known}")
    parts = [(CONTEXT_ROW, m.after_first_gemm), (KERNELS_ROW, m.step_kernels)]
    if (
        m.fsdp2_extra is not None
        and setup is not None
        and setup.data_parallel.engine == "fsdp2"
        and setup.mesh.world_size == 1
    ):
        parts.append((FSDP2_ROW, m.fsdp2_extra))
    where = f"{m.short()}, {m.source}"
    detail = (f"{m.gpu} ({cc}, driver {m.driver}), torch {m.torch}, CUDA {m.cuda}: after torch.cuda.init() "
              f"{m.after_init / MiB:.1f} MiB, after the first GEMM {m.after_first_gemm / MiB:.1f} MiB, after a "
              f"fresh process's first training step {m.after_first_step / MiB:.1f} MiB "
              f"({m.source}/{m.files[-1]})")
    if own:
        return CudaContext(parts=tuple(parts), measured=True, label=f"measured: {where}", measurement=m,
                           note=detail)
    return CudaContext(parts=tuple(parts), measured=False,
                       label=f"assumed: not measured for {asked}; the {m.short()} measurement ({cc}), {m.source}",
                       measurement=m, note=detail)
