"""Run a user's training script as it is, inside peakledger: its arguments, its folder, no network, no traces left.

`script_context(path, argv)` is the world a script runs in, for the prediction (`record_script`, fake tensors)
and the measurement (traces/script_run.py, real tensors) alike:
- `sys.argv` is `[path, *argv]`, `__name__` is "__main__", the script's folder is first on `sys.path`;
- it runs in a scratch folder that holds a link to every entry of the folder it was started from, so the paths it
  reads resolve as they would, and what it writes (checkpoints, logs, output folders) lands in the scratch folder,
  removed after the run;
- no network: HF_HUB_OFFLINE, TRANSFORMERS_OFFLINE and HF_DATASETS_OFFLINE are set while it runs; a script that
  asks the Hugging Face hub for a model or dataset is refused, naming what it asked for (`hub_error`);
- transformers loads a local checkpoint's tensors in its own thread, sequentially (HF_DEACTIVATE_ASYNC_LOAD): its
  worker threads would make them outside the fake mode, which is thread-local, so a fake run would hold real
  weights that every forward re-converts (a new fake storage per weight read); same bytes loaded either way;
- the boundary of user code (models/traced/boundary.py): a time limit, its prints on stderr, `os._exit` refused; a
  `sys.exit(0)` (or `None`) is a script ending, any other status an error naming the script.

`record_script` is the prediction: the script under `FakeTensorMode` with the recorder (record.py) and the
position tracking (phases.py), stopped after `steps` optimizer steps.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import os
import runpy
import shutil
import sys
import tempfile
import traceback
import weakref
from collections.abc import Iterator
from pathlib import Path

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

from ...simulator.events import Phase
from ..config import ConfigError
from ..traced.boundary import user_code
from ..traced.realpath import cpu_fake_kernels, real_code_paths
from .phases import Position, ScriptPhases, StopScript
from .record import Recorder, ScriptRecording, resize_watch
from .values import Values, numpy_reads
from .weights import header_only_weights

OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
# transformers 5.25.0 core_model_loading.py:1867-1874: a ThreadPoolExecutor loads the weights unless this is set
SEQUENTIAL_LOAD = {"HF_DEACTIVATE_ASYNC_LOAD": "1"}
# libraries a script may use whose save / generate entry points ScriptPhases wraps: imported before the script
# runs (under the offline environment) when the script's text names them
_HF = ("transformers", "transformers.generation.utils", "transformers.cache_utils", "transformers.trainer_pt_utils",
       "safetensors.torch")
LIBRARIES = {"transformers": _HF, "trl": (*_HF, "trl.trainer.grpo_trainer", "trl.trainer.dpo_trainer"),
             "accelerate": ("accelerate", "safetensors.torch"), "peft": ("transformers", "safetensors.torch"),
             "safetensors": ("safetensors.torch",)}


# the libraries whose versions the report names, when the script imported them
VERSIONED = ("torch", "transformers", "accelerate", "peft", "trl", "datasets", "deepspeed", "lightning",
             "pytorch_lightning", "torchtune", "torchtitan", "torchao", "bitsandbytes", "safetensors")


def versions() -> dict[str, str]:
    """The versions of the libraries the script ran (those imported in this process)."""
    out = {}
    for name in VERSIONED:
        version = getattr(sys.modules.get(name), "__version__", None)
        if version:
            out[name] = str(version)
    return out


def check_script(path: str) -> Path:
    p = Path(path)
    if p.suffix != ".py":
        raise ConfigError("script", f"{path!r} is not a Python file (SCRIPT.py)")
    if not p.is_file():
        raise ConfigError("script", f"{path!r} does not exist or is not a file")
    return p.resolve()


def rank_env(rank: int, world_size: int, port: int = 29500) -> dict[str, str]:
    """The environment torchrun gives rank `rank` of `world_size` on one node; none for a world of one (a script
    started with `python`: accelerate, HF Trainer and Lightning read these to decide they are distributed)."""
    if world_size == 1:
        return {}
    return {"RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": str(world_size), "GROUP_RANK": "0", "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port), "TORCHELASTIC_RUN_ID": "peakledger"}


@contextlib.contextmanager
def script_context(path: Path, argv: list[str], env: dict[str, str] | None = None) -> Iterator[None]:
    """The script's world (module docstring): argv, a scratch folder of links, offline, its libraries imported;
    `env` more environment (a rank's, `rank_env`)."""
    start = Path.cwd()
    scratch = Path(tempfile.mkdtemp(prefix="peakledger-run-"))
    extra = {**OFFLINE, **SEQUENTIAL_LOAD, **(env or {})}
    saved_env = {k: os.environ.get(k) for k in extra}
    saved_argv, saved_path = sys.argv, list(sys.path)
    try:
        for entry in start.iterdir():
            try:
                (scratch / entry.name).symlink_to(entry)
            except OSError:
                pass
        os.environ.update(extra)
        text = path.read_text(errors="replace")
        for name, modules in LIBRARIES.items():
            if name in text:
                for module in modules:
                    with contextlib.suppress(ImportError):
                        __import__(module)
        os.chdir(scratch)
        sys.argv = [str(path), *argv]
        sys.path.insert(0, str(path.parent))
        yield
    finally:
        os.chdir(start)
        sys.argv = saved_argv
        sys.path[:] = saved_path
        for k, v in saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        shutil.rmtree(scratch, ignore_errors=True)


def run_path(path: Path, seconds: float | None) -> None:
    """The script's code, run as `__main__` inside the boundary; a clean exit or the step limit ends it."""
    what = f"running {path.name}"
    try:
        with user_code(what, seconds, field="script"):
            try:
                runpy.run_path(str(path), run_name="__main__")
            except StopScript:
                pass
            except SystemExit as e:
                if e.code not in (0, None):
                    raise ConfigError("script", f"{path.name} exited with status {e.code!r}") from None
    except (ConfigError, KeyboardInterrupt):
        raise
    except Exception as e:
        raise script_error(path, e) from None


def script_error(path: Path, e: Exception) -> ConfigError:
    """The script's failure as one line: the hub it asked for, or the error and where in the script it rose."""
    hub = hub_error(e)
    if hub is not None:
        return ConfigError("script", f"{path.name} asks the Hugging Face hub for {hub}; peakledger runs the script "
                                     "offline: point it at local files (a config.json, a local model folder)")
    every = traceback.extract_tb(e.__traceback__)
    frames = [f for f in every if f.filename == str(path)]
    where = f" (line {frames[-1].lineno})" if frames else ""
    if any(f.filename.endswith(os.path.join("nn", "parallel", "distributed.py")) for f in every):
        return ConfigError("script", f"{path.name}{where} wraps its model in DistributedDataParallel, which does not "
                                     "run on fake tensors (its C++ Reducer reads and writes real gradient buckets); "
                                     "FSDP2 (fully_shard) does: peakledger run predicts FSDP2 scripts")
    return ConfigError("script", f"{path.name} failed{where}: {type(e).__name__}: {_first_line(e)}")


def hub_error(e: BaseException) -> str | None:
    """What the script asked the hub for, when `e` is the offline refusal of huggingface_hub / transformers."""
    while e is not None:
        text = str(e)
        if type(e).__name__ in ("OfflineModeIsEnabled", "LocalEntryNotFoundError") or \
                ("offline" in text.lower() and ("hub" in text.lower() or "huggingface" in text.lower())):
            words = [w.strip("'\".,`") for w in text.split() if "/" in w and not w.startswith("http")]
            return repr(words[0]) if words else "a file"
        e = e.__cause__ or e.__context__
    return None


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0][:300] if text else ""


def record_script(path: Path, argv: list[str], steps: int | None, seconds: float | None = None, rank: int = 0,
                  world_size: int = 1) -> ScriptRecording:
    """The script run on fake tensors (module docstring) and recorded, until it ends or `steps` steps have run, as
    rank `rank` of `world_size` (`fake_process_group`)."""
    values = Values()
    rec = Recorder(values, Position(Phase.LOAD, 0, -1))
    phases = ScriptPhases(steps, on_position=lambda p: setattr(rec, "position", p), on_scan=rec.scan,
                          on_inputs=rec.inputs, on_module=lambda name: setattr(rec, "module", name),
                          on_label=rec.label)
    with script_context(path, argv, rank_env(rank, world_size)), fake_process_group(rank, world_size):
        fake = FakeTensorMode(allow_non_fake_inputs=True)
        with fake, fake_gaps(), cpu_fake_kernels(), real_code_paths(), numpy_reads(values), \
                saves_counted(), header_only_weights(), phases, resize_watch(rec), rec, \
                torch.autograd.graph.saved_tensors_hooks(rec.pack, lambda x: x):
            run_path(path, seconds)
        recording = rec.finish(phases.calls, values.lines())
    recording.versions = versions()
    return recording


@contextlib.contextmanager
def fake_process_group(rank: int, world_size: int) -> Iterator[None]:
    """`torch.distributed.init_process_group(...)` in the script makes torch's fake process group instead
    (torch/testing/_internal/distributed/fake_pg.py: every collective returns at once, its outputs' shapes right),
    as rank `rank` of `world_size`, whatever backend the script asks for: one process stands for one rank, with
    no peers, as torch's own memory tracker runs FSDP2 (torch/distributed/_tools/mem_tracker.py)."""
    import torch.distributed as dist

    if not dist.is_available():
        yield
        return
    from torch.testing._internal.distributed.fake_pg import FakeStore

    original = dist.init_process_group

    @functools.wraps(original)
    def init_process_group(*args, **kwargs):
        timeout = kwargs.get("timeout")
        return original("fake", store=FakeStore(), rank=rank, world_size=world_size,
                        **({"timeout": timeout} if timeout is not None else {}))

    dist.init_process_group = init_process_group
    try:
        yield
    finally:
        dist.init_process_group = original
        if dist.is_initialized():
            dist.destroy_process_group()


class fake_gaps:
    """What torch and the libraries do to tensors that fails on fake ones, done as the real run does it:
    - `module.to(...)`: `Module._apply` swaps each fake parameter for its converted one (`torch.utils.swap_tensors`),
      which refuses a tensor the fake mode's converter holds a weak reference to (every fake `nn.Parameter`); the
      swap falls back to `param.data = new`, which gives the parameter the new storage and lets the old one go;
    - `copy.deepcopy(tensor)` (torchmetrics' states, a reference model copied by hand): `Tensor.__deepcopy__`
      copies the storage outside dispatch, a real storage a fake tensor cannot take; a fake leaf is cloned (its
      elements' bytes, allocated by the clone), with its `requires_grad` and a copy of its `.grad`;
    - data pointers: a fake storage has none (every one reads 0, so transformers' and safetensors' shared-storage
      tests see every weight tied to every other); each fake storage gets its own address, 2^40 bytes apart, and a
      tensor's is its storage's plus its offset (`Tensor.data_ptr`, `UntypedStorage.data_ptr`)."""

    def __enter__(self):
        self.swap = swap = torch.utils.swap_tensors
        self.deepcopy = deepcopy = torch.Tensor.__deepcopy__

        def swap_tensors(t1, t2):
            try:
                return swap(t1, t2)
            except RuntimeError as e:
                if "weakref" not in str(e) or not (_is_fake(t1) and _is_fake(t2)):
                    raise
                t1.data = t2.data

        def deepcopy_tensor(t, memo):
            if not _is_fake(t) or not t.is_leaf or type(t) is not FakeTensor:
                return deepcopy(t, memo)
            if id(t) in memo:
                return memo[id(t)]
            with torch.no_grad():
                new = t.clone()
            if t.requires_grad:
                new.requires_grad_()
            if t.grad is not None:
                new.grad = copy.deepcopy(t.grad, memo)
            memo[id(t)] = new
            return new

        bases = weakref.WeakKeyDictionary()
        self.storage_ptr = storage_ptr = torch.UntypedStorage.data_ptr
        self.had_tensor_ptr = "data_ptr" in FakeTensor.__dict__

        def base(st) -> int:
            if st not in bases:
                bases[st] = (len(bases) + 1) << 40
            return bases[st]

        def storage_data_ptr(st):
            return base(st) if st.device.type == "meta" else storage_ptr(st)

        def tensor_data_ptr(t):
            return base(t.untyped_storage()) + t.storage_offset() * t.element_size()

        torch.utils.swap_tensors = swap_tensors
        torch.Tensor.__deepcopy__ = deepcopy_tensor
        torch.UntypedStorage.data_ptr = storage_data_ptr
        FakeTensor.data_ptr = tensor_data_ptr
        return self

    def __exit__(self, *exc):
        torch.utils.swap_tensors = self.swap
        torch.Tensor.__deepcopy__ = self.deepcopy
        torch.UntypedStorage.data_ptr = self.storage_ptr
        if not self.had_tensor_ptr:
            del FakeTensor.data_ptr
        return False


def _is_fake(t) -> bool:
    return isinstance(t, FakeTensor)


class saves_counted:
    """`torch.save` and safetensors' `save_file` / `save_model` on a fake run: nothing written (fake tensors have no
    bytes), wherever the script's libraries hold them (`from safetensors.torch import save_file as safe_save_file`
    in transformers: every module attribute that is one of them is replaced while the script runs); the call still
    runs inside its CHECKPOINT phase (ScriptPhases wraps the libraries' save entry points)."""

    def __enter__(self):
        originals = [torch.save]
        st = sys.modules.get("safetensors.torch")
        if st is not None:
            originals += [st.save_file, st.save_model]
        ids = {id(f) for f in originals}
        self.saved = []
        for module in list(sys.modules.values()):
            attrs = getattr(module, "__dict__", None)
            if not isinstance(attrs, dict):
                continue
            for name, value in list(attrs.items()):
                if id(value) in ids and callable(value):
                    self.saved.append((module, name, value))
                    setattr(module, name, _no_save)
        return self

    def __exit__(self, *exc):
        for owner, name, f in self.saved:
            setattr(owner, name, f)
        return False


def _no_save(*args, **kwargs) -> None:
    return None
