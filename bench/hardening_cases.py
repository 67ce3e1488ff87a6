"""The hardening cases of issue 11, one per finding: each is a command line with the files it needs, and
what peakledger must do with it now (exit 2 naming the input, or the right number).

Used by tests/test_hardening.py (every case, in process) and bench/hardening.py (every case as a real
command, on this tree and on an older one: the before / after table in bench/HARDENING.md). A case's
argv may hold `{tmp}` (a fresh folder holding the case's files), `{repo}` (the repository root) and
`{gpu}` (../shared/gpu-truth/snapshots).
"""

from __future__ import annotations

import gzip
import json
import pickle
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

REPO = Path(__file__).resolve().parent.parent
GPU_TRUTH = REPO.parent / "shared" / "gpu-truth" / "snapshots"
MLP_TRACE = REPO / "traces" / "data" / "tiny-mlp-fp32-adamw.json"


@dataclass(frozen=True)
class Case:
    id: str
    group: str  # the heading: tracebacks, silent wrong results, files destroyed, unbounded work
    finding: str  # what the issue found
    argv: tuple[str, ...]
    files: dict[str, Callable[[], bytes]] = field(default_factory=dict)  # name in {tmp} -> its bytes
    code: int = 2  # the exit status now
    says: tuple[str, ...] = ()  # each must appear in stdout + stderr (lower case compared)
    check: Callable[[str, str, Path], str | None] | None = None  # (stdout, stderr, tmp) -> problem or None
    umask: int | None = None
    # runs the command itself, with the fault the case needs (a closed stdout, a killed worker, a file-size
    # limit): (command, tmp, timeout, preexec) -> CompletedProcess, or subprocess.TimeoutExpired. Such a case
    # runs as a real command only (bench/hardening.py run_case), in the tests too
    driver: Callable | None = None


def _trace(mutate: Callable[[dict], None] | None = None) -> Callable[[], bytes]:
    def make() -> bytes:
        data = json.loads(MLP_TRACE.read_text())
        if mutate:
            mutate(data)
        return json.dumps(data).encode()
    return make


def _snapshot(entries, segments=None) -> Callable[[], bytes]:
    return lambda: pickle.dumps({"segments": [] if segments is None else segments, "device_traces": [entries]})


def _text(s: str) -> Callable[[], bytes]:
    return lambda: s.encode()


def _wrapped_snapshot() -> bytes:
    """A ring buffer that wrapped: as many entries as the max_entries it records, its first a free of a block the
    trace never allocated (which a segment at record start holds)."""
    return pickle.dumps({"max_entries": 2, "device_traces": [[
        {"action": "free_completed", "addr": 8192, "size": 1024}, {"action": "alloc", "addr": 4096, "size": 512}]],
        "segments": [{"address": 0, "total_size": 2 << 20, "segment_type": "small", "blocks": [
            {"address": 4096, "size": 512, "requested_size": 512, "state": "active_allocated"}]}]})


class _Evil:
    def __reduce__(self):
        import os
        return (os.system, ("touch /tmp/peakledger-pwned",))


def _first_block_negative(d):
    d["blocks"][0][1] = -5


def _free_unknown(d):
    d["events"].insert(0, [0, 0.0, "free", 10**9, "load", 0, -1, "compute", "x"])
    d["blocks"].append([10**9, 4, "temporary", "ghost", "fp32", [1], None, 1, 0, "device"])


def _float_size(d):
    d["blocks"][0][1] = 1.5


def _no_events(d):
    d["events"] = []


def _json_key(key: str, expected) -> Callable[[str, str, Path], str | None]:
    def check(out: str, err: str, tmp: Path) -> str | None:
        value = json.loads(out)
        for part in key.split("."):
            value = value[part]
        return None if value == expected else f"{key} = {value!r}, expected {expected!r}"
    return check


def _unchanged(name: str, content: Callable[[], bytes]) -> Callable[[str, str, Path], str | None]:
    return lambda out, err, tmp: None if (tmp / name).read_bytes() == content() else f"{name} was overwritten"


def _absent(path: str) -> Callable[[str, str, Path], str | None]:
    return lambda out, err, tmp: f"{path} exists" if Path(path.format(tmp=tmp)).exists() else None


def _mode(name: str, mode: int) -> Callable[[str, str, Path], str | None]:
    def check(out, err, tmp):
        got = (tmp / name).stat().st_mode & 0o777
        return None if got == mode else f"{name} has mode {oct(got)}, expected {oct(mode)} (umask 077)"
    return check


def _same_peak_as(*argv: str) -> Callable[[str, str, Path], str | None]:
    def check(out, err, tmp):
        import contextlib
        import io

        from peakledger.cli import main
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            main(list(argv))
        ref, got = json.loads(buf.getvalue()), json.loads(out)
        for key in ("peak", "first_step_peak", "steady_peak"):
            if ref[key]["bytes"] != got[key]["bytes"]:
                return f"{key} {got[key]['bytes']} != {ref[key]['bytes']} with {' '.join(argv)}"
        return None if got["steps_simulated"] < 10 else f"{got['steps_simulated']} steps simulated"
    return check


SIM = ("simulate", "--preset", "tiny", "--steps", "1")
_ALLOC = {"action": "alloc", "addr": 0, "size": 512, "stream": 0, "time_us": 0, "frames": []}


def _evil_module() -> str:
    """A module file whose import writes a marker file (beside it, in the temporary folder): run = wrong."""
    import tempfile
    folder = Path(tempfile.gettempdir())
    path = folder / "peakledger-hardening-evil.py"
    marker = folder / "peakledger-hardening-evil.ran"
    marker.unlink(missing_ok=True)
    path.write_text(f"open({str(marker)!r}, 'w').write('ran')\n"
                    "def factory(micro_batch: int = 2):\n    raise SystemExit('ran')\n")
    return str(path)


def _names_evil_module(data: dict) -> None:
    import hashlib
    path = _evil_module()
    data["metadata"]["model_kind"] = "TracedModel"
    data["metadata"]["model"] = {"name": "evil:factory", "kind": "module", "source": f"{path}:factory",
                                 "digest": hashlib.sha256(Path(path).read_bytes()).hexdigest(),
                                 "varies": ["micro_batch"], "defaults": [["micro_batch", 2]]}


def _evil_did_not_run(out, err, tmp) -> str | None:
    import tempfile
    marker = Path(tempfile.gettempdir()) / "peakledger-hardening-evil.ran"
    return "the module named by the data was imported" if marker.exists() else None


def _factory(first_line: str) -> Callable[[], bytes]:
    """A module whose factory runs `first_line`, then returns a one-Linear model."""
    return _text("import os, sys, time\nimport torch\n\n\ndef factory(micro_batch: int = 2):\n"
                 f"    {first_line}\n    return torch.nn.Linear(8, 8), torch.randn(micro_batch, 8), "
                 "lambda out: out.sum()\n")


def _stdout_is_json(out, err, tmp) -> str | None:
    try:
        json.loads(out)
    except ValueError:
        return f"stdout is not JSON: {out[:80]!r}"
    return None


def _nest(depth: int = 40):
    """A tuple nested `depth` deep whose two halves are one object at every level (pickled in a few bytes)."""
    x = ("x",)
    for _ in range(depth):
        x = (x, x)
    return x
NEMO = {"model_type": "mistral", "hidden_size": 5120, "num_attention_heads": 32, "head_dim": 128,
        "num_key_value_heads": 8, "num_hidden_layers": 40, "intermediate_size": 14336, "vocab_size": 131072,
        "max_position_embeddings": 1024000, "tie_word_embeddings": False}
TINY_LLAMA = {"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
              "num_hidden_layers": 2, "intermediate_size": 176, "vocab_size": 256, "max_position_embeddings": 64}

CASES: list[Case] = [
    # --- tracebacks -------------------------------------------------------------------------------------
    Case("snapshot-explain", "tracebacks", "a CUDA snapshot pickle given to explain --trace died in the JSON reader",
         ("explain", "--trace", "{tmp}/s.pickle", "--budget", "1MiB"),
         {"s.pickle": _snapshot([{"action": "alloc", "addr": 4096, "size": 512, "stream": 0, "time_us": 1}])},
         code=0, says=("cuda snapshot",)),
    Case("own-export-explain", "tracebacks", "peakledger's own --export-snapshot output given to explain --trace",
         ("explain", "--trace", "{tmp}/sim.pickle", "--budget", "1GiB"),
         {"sim.pickle": lambda: _exported_snapshot()}, code=0, says=("fits",)),
    Case("own-export-validate", "tracebacks", "peakledger's own --export-snapshot output given to validate --trace",
         ("validate", "--trace", "{tmp}/sim.pickle"), {"sim.pickle": lambda: _exported_snapshot()},
         says=("records no scenario",)),
    Case("gpu-truth-explain", "tracebacks", "a real snapshot of ../shared/gpu-truth given to explain --trace",
         ("explain", "--trace", "{gpu}/kkaitlyn111__memory_files--memory_ctx128_forward_.pickle", "--budget", "40GiB"),
         code=0, says=("cuda snapshot",)),
    Case("gpu-truth-validate", "tracebacks", "a real snapshot of ../shared/gpu-truth given to validate --trace",
         ("validate", "--trace", "{gpu}/kkaitlyn111__memory_files--memory_ctx128_forward_.pickle"),
         says=("records no scenario",)),
    Case("toml-training-int", "tracebacks", "TOML `training = 5`", ("simulate", "--scenario", "{tmp}/s.toml"),
         {"s.toml": _text("training = 5\n")}, says=("training: must be a table",)),
    Case("toml-model-string", "tracebacks", "TOML `model = \"x\"`", ("simulate", "--scenario", "{tmp}/s.toml"),
         {"s.toml": _text('model = "x"\n')}, says=("model: must be a table",)),
    Case("toml-array-of-tables", "tracebacks", "TOML: an array where a table belongs ([[training]])",
         ("simulate", "--scenario", "{tmp}/s.toml"), {"s.toml": _text("[[training]]\nsteps = 1\n")},
         says=("training: must be a table",)),
    Case("toml-not-utf8", "tracebacks", "a non-UTF-8 scenario file", ("simulate", "--scenario", "{tmp}/s.toml"),
         {"s.toml": lambda: b"\xff\xfe[training]\n"}, says=("scenario:", "not utf-8")),
    Case("toml-headroom-nan", "tracebacks", "TOML `headroom = nan`", ("simulate", "--scenario", "{tmp}/s.toml"),
         {"s.toml": _text("[run]\nheadroom = nan\n")}, says=("headroom: must be a finite number",)),
    Case("toml-headroom-inf", "tracebacks", "TOML `headroom = inf`", ("simulate", "--scenario", "{tmp}/s.toml"),
         {"s.toml": _text("[run]\nheadroom = inf\n")}, says=("headroom: must be a finite number",)),
    Case("toml-frozen-ints", "tracebacks", "TOML `frozen = [1, 2]`", ("simulate", "--scenario", "{tmp}/s.toml"),
         {"s.toml": _text("[training]\nfrozen = [1, 2]\n")}, says=("frozen: must be a list of strings",)),
    Case("flag-headroom-nan", "tracebacks", "--headroom nan (simulate)", SIM + ("--headroom", "nan"),
         says=("headroom: must be a finite number",)),
    Case("flag-headroom-inf-maxbatch", "tracebacks", "--headroom inf (max-batch)",
         ("max-batch", "--preset", "tiny", "--budget", "1GiB", "--headroom", "inf"), says=("headroom",)),
    Case("flag-headroom-nan-compare", "tracebacks", "--headroom nan (compare --json)",
         ("compare", "--preset", "tiny", "--json", "--headroom", "nan"), says=("headroom",)),
    Case("sweep-headroom-nan-point", "tracebacks", "one sweep point with headroom nan killed the whole sweep",
         ("sweep", "--preset", "tiny", "--steps", "1", "--grid", "headroom=0,nan", "--output", "{tmp}/s.csv", "--jobs",
          "1"), code=0, says=("2 points simulated (1 invalid",)),
    Case("compare-case-name", "tracebacks", "compare --case \"a: name=x\"",
         ("compare", "--preset", "tiny", "--case", "a: name=x"), says=("case:",)),
    Case("hf-string-number", "tracebacks", "HF config.json: a string where a number belongs",
         ("simulate", "--hf-config", "{tmp}/config.json"),
         {"config.json": lambda: json.dumps({**TINY_LLAMA, "num_hidden_layers": "2"}).encode()},
         says=("num_hidden_layers",)),
    Case("hf-list-number", "tracebacks", "HF config.json: a list where a number belongs",
         ("simulate", "--hf-config", "{tmp}/config.json"),
         {"config.json": lambda: json.dumps({**TINY_LLAMA, "hidden_size": [64]}).encode()}, says=("hidden_size",)),
    Case("hf-not-utf8", "tracebacks", "a non-UTF-8 HF config.json", ("simulate", "--hf-config", "{tmp}/config.json"),
         {"config.json": lambda: b"\x80\x81{}"}, says=("hf_config:", "not utf-8")),
    Case("hf-deep-nesting", "tracebacks", "deeply nested JSON (RecursionError)",
         ("simulate", "--hf-config", "{tmp}/config.json"), {"config.json": lambda: b"[" * 200000},
         says=("hf_config:", "nested too deeply")),
    Case("trace-free-unknown", "tracebacks", "a trace that frees a block never allocated (explain: KeyError)",
         ("explain", "--trace", "{tmp}/t.json", "--budget", "1GiB"), {"t.json": _trace(_free_unknown)},
         says=("trace:", "not allocated")),
    Case("trace-negative-size", "tracebacks", "a trace with a negative block size",
         ("explain", "--trace", "{tmp}/t.json", "--budget", "1GiB"), {"t.json": _trace(_first_block_negative)},
         says=("trace:", ">= 0")),
    Case("trace-no-events", "tracebacks", "a trace with no events (max() of an empty sequence)",
         ("explain", "--trace", "{tmp}/t.json", "--budget", "1GiB"), {"t.json": _trace(_no_events)},
         says=("trace:", "no events")),
    Case("trace-gzip", "tracebacks", "a gzip'd trace", ("explain", "--trace", "{tmp}/t.json.gz", "--budget", "1GiB"),
         {"t.json.gz": lambda: gzip.compress(MLP_TRACE.read_bytes(), mtime=0)}, code=0, says=("peakledger trace",)),
    Case("trace-directory", "tracebacks", "a directory given as the trace",
         ("explain", "--trace", "{tmp}", "--budget", "1GiB"), says=("trace:", "folder")),
    Case("snapshot-entry-int", "tracebacks", "a snapshot whose trace entry is an int, not a dict",
         ("explain", "--trace", "{tmp}/s.pickle", "--budget", "1GiB"), {"s.pickle": _snapshot([5])},
         says=("trace:", "must be a dict")),
    Case("snapshot-size-string", "tracebacks", "a snapshot entry with size \"big\"",
         ("explain", "--trace", "{tmp}/s.pickle", "--budget", "1GiB"),
         {"s.pickle": _snapshot([{"action": "alloc", "addr": 0, "size": "big"}])}, says=("trace:", "size")),
    Case("snapshot-no-addr", "tracebacks", "a snapshot entry without addr",
         ("explain", "--trace", "{tmp}/s.pickle", "--budget", "1GiB"),
         {"s.pickle": _snapshot([{"action": "alloc", "size": 512}])}, says=("trace:", "addr")),
    Case("out-missing-dir", "tracebacks", "--plot into a missing directory", SIM + ("--plot", "{tmp}/no/x.png"),
         says=("--plot", "does not exist")),
    Case("out-readonly-dir", "tracebacks", "--export-chrome into a directory no file can be made in (/proc)",
         SIM + ("--export-chrome", "/proc/peakledger.json"), says=("--export-chrome", "cannot write")),
    Case("out-onto-dir", "tracebacks", "--export-snapshot onto an existing directory",
         SIM + ("--export-snapshot", "{tmp}"), says=("--export-snapshot", "folder")),
    Case("out-empty", "tracebacks", "--plot '' (the temporary file landed in the parent of the working directory)",
         SIM + ("--plot", ""), says=("--plot", "empty path")),
    Case("out-capture-after-work", "tracebacks", "capture --output into a missing directory: traceback after the run",
         ("capture", "--preset", "tiny-mlp", "--output", "{tmp}/no/t.json"), says=("--output", "does not exist")),
    Case("out-sweep-after-work", "tracebacks", "sweep --json-output into a missing directory, after the work",
         ("sweep", "--preset", "tiny", "--grid", "micro_batch=1,2", "--json-output", "{tmp}/no/s.json"),
         says=("--json-output", "does not exist")),
    Case("out-validate-after-work", "tracebacks", "validate --plot into a missing directory, after the run",
         ("validate", "--trace", str(MLP_TRACE), "--plot", "{tmp}/no/v.png"), says=("--plot", "does not exist")),
    # --- silent wrong results -----------------------------------------------------------------------------
    Case("bool-string-scenario", "silent wrong results", "`fp32_grads = \"false\"` in a scenario counted as true",
         ("simulate", "--scenario", "{tmp}/s.toml"), {"s.toml": _text('[training]\nfp32_grads = "false"\n')},
         says=("fp32_grads: must be true or false",)),
    Case("bool-string-set-to-none", "silent wrong results", "`set_to_none = \"false\"` counted as true",
         ("simulate", "--scenario", "{tmp}/s.toml"), {"s.toml": _text('[training]\nset_to_none = "false"\n')},
         says=("set_to_none: must be true or false",)),
    Case("bool-string-case", "silent wrong results", "--case \"a: fp32_grads=no\" counted as true",
         ("compare", "--preset", "tiny", "--case", "a: fp32_grads=no"), says=("fp32_grads",)),
    Case("hf-head-dim", "silent wrong results", "HF head_dim ignored: Mistral-NeMo 12,772,070,400 parameters (+4.3%)",
         ("simulate", "--hf-config", "{tmp}/config.json", "--json", "--seq-len", "128", "--micro-batch", "1",
          "--steps", "1"), {"config.json": lambda: json.dumps(NEMO).encode()}, code=0,
         check=_json_key("n_params", 12_247_782_400)),
    Case("hf-tie-string", "silent wrong results", "`\"tie_word_embeddings\": \"false\"` read as tied",
         ("simulate", "--hf-config", "{tmp}/config.json"),
         {"config.json": lambda: json.dumps({**TINY_LLAMA, "tie_word_embeddings": "false"}).encode()},
         says=("tie_word_embeddings",)),
    Case("hf-mlp-bias", "silent wrong results", "HF `mlp_bias` ignored",
         ("simulate", "--hf-config", "{tmp}/config.json", "--json", "--steps", "1"),
         {"config.json": lambda: json.dumps({**TINY_LLAMA, "mlp_bias": True}).encode()}, code=0,
         check=_json_key("n_params", 126_080)),  # transformers' LlamaForCausalLM of this config, built on meta
    Case("validate-trace-llama", "silent wrong results", "validate --trace of the repository's tiny-llama trace "
         "compared with the default tiny GPT (-2.4%)",
         ("validate", "--trace", str(REPO / "traces/data/tiny-llama-sdpa-fp32-adamw.json"), "--tolerance", "0.01"),
         code=0, says=("scenario recorded",)),
    Case("validate-trace-mlp", "silent wrong results", "validate --trace of a tiny-mlp trace (-84.5%)",
         ("validate", "--trace", str(MLP_TRACE), "--tolerance", "0.01"), code=0, says=("within tolerance",)),
    Case("validate-trace-world-size", "silent wrong results", "a one-process trace against --world-size 2 (+19.7%)",
         ("validate", "--trace", str(MLP_TRACE), "--world-size", "2", "--dp-engine", "fsdp2"),
         says=("world_size",)),
    Case("explain-trace-flags", "silent wrong results", "explain --trace silently ignored scenario flags",
         ("explain", "--trace", str(MLP_TRACE), "--budget", "1GiB", "--micro-batch", "4"),
         says=("--micro-batch", "ignored")),
    Case("validate-empty-trace", "silent wrong results", "an empty trace passed validate --tolerance 0.01",
         ("validate", "--trace", "{tmp}/t.json", "--tolerance", "0.01"), {"t.json": _trace(_no_events)},
         says=("no events",)),
    Case("validate-negative-trace", "silent wrong results", "a trace of negative size passed validate",
         ("validate", "--trace", "{tmp}/t.json", "--tolerance", "0.01"), {"t.json": _trace(_first_block_negative)},
         says=(">= 0",)),
    # a ring buffer that wrapped: as many entries as the max_entries the file records. Its free of a block the trace
    # never allocated fits the state at record start (a segment holds it): that alone is not truncation
    Case("truncated-snapshot", "silent wrong results", "a wrapped (truncated) CUDA snapshot explained as complete",
         ("explain", "--trace", "{tmp}/s.pickle", "--budget", "1MiB"),
         {"s.pickle": _wrapped_snapshot},
         code=0, says=("truncated", "max_entries", "lower bound")),
    Case("truncated-snapshot-validate", "silent wrong results", "a wrapped (truncated) CUDA snapshot given to validate",
         ("validate", "--trace", "{tmp}/s.pickle", "--preset", "tiny"),
         {"s.pickle": _wrapped_snapshot},
         says=("truncated", "max_entries", "whole run")),
    Case("max-batch-cap", "silent wrong results", "max-batch gave its search cap (1,048,576) as the answer",
         ("max-batch", "--preset", "tiny", "--budget", "1000TiB", "--steps", "1"), code=0,
         says=("at least 1,048,576",)),
    Case("trace-float-size", "silent wrong results", "a float block size in a trace was truncated to an int",
         ("explain", "--trace", "{tmp}/t.json", "--budget", "1GiB"), {"t.json": _trace(_float_size)},
         says=("must be integers",)),
    Case("jobs-zero", "silent wrong results", "--jobs 0 silently replaced",
         ("sweep", "--preset", "tiny", "--grid", "micro_batch=1", "--output", "{tmp}/s.csv", "--jobs", "0"),
         says=("jobs",)),
    Case("jobs-negative", "silent wrong results", "--jobs -3 silently replaced",
         ("sweep", "--preset", "tiny", "--grid", "micro_batch=1", "--output", "{tmp}/s.csv", "--jobs", "-3"),
         says=("jobs",)),
    Case("budget-empty", "silent wrong results", "--budget '' silently ignored", SIM + ("--budget", ""),
         says=("budget",)),
    Case("stop-at-oom-no-budget", "silent wrong results", "--stop-at-oom without a budget silently ignored",
         SIM + ("--stop-at-oom",), says=("stop_at_oom", "--budget")),
    Case("reshard-deepspeed", "silent wrong results", "--no-reshard-after-forward with DeepSpeed silently ignored",
         SIM + ("--no-reshard-after-forward",), says=("reshard_after_forward", "fsdp2")),
    Case("seq-len-mlp", "silent wrong results", "--seq-len on an MLP silently ignored",
         ("simulate", "--preset", "tiny-mlp", "--seq-len", "128"), says=("seq_len",)),
    # --- found on the way: more flags that were silently ignored -------------------------------------------
    Case("unit-with-json", "silent wrong results", "--unit with --json was ignored (JSON is bytes)",
         SIM + ("--json", "--unit", "MB"), says=("unit",)),
    Case("pg-backend-one-process", "silent wrong results", "--pg-backend on a one-process validate was ignored",
         ("validate", "--preset", "tiny-mlp", "--pg-backend", "fake"), says=("pg_backend",)),
    Case("peers-with-case", "silent wrong results", "compare --peers ignored every --case",
         ("compare", "--preset", "tiny", "--peers", "--case", "a: micro_batch=2"), says=("case",)),
    Case("tolerance-nan", "silent wrong results", "validate --tolerance nan passed every run",
         ("validate", "--trace", str(MLP_TRACE), "--tolerance", "nan"), says=("tolerance",)),
    Case("host-budget-no-host", "silent wrong results", "explain --host-budget on a scenario with no host memory "
         "said nothing about it",
         ("explain", "--preset", "tiny", "--steps", "1", "--optimizer", "sgd", "--budget", "1GiB",
          "--host-budget", "1MiB"), code=0, says=("nothing of this scenario lives in host",)),
    Case("ranks-plot", "silent wrong results", "validate --world-size 2 --plot drew nothing",
         ("validate", "--preset", "tiny", "--world-size", "2", "--dp-engine", "fsdp2", "--plot", "{tmp}/v.png"),
         says=("plot",)),
    # --- files destroyed ------------------------------------------------------------------------------------
    Case("plot-onto-trace", "files destroyed", "validate --trace x.json --plot x.json overwrote the trace with a PNG",
         ("validate", "--trace", "{tmp}/x.json", "--plot", "{tmp}/x.json"), {"x.json": lambda: MLP_TRACE.read_bytes()},
         says=("--plot", "input of --trace"), check=_unchanged("x.json", lambda: MLP_TRACE.read_bytes())),
    Case("plot-onto-scenario", "files destroyed", "--scenario S --plot S overwrote the scenario",
         ("simulate", "--scenario", "{tmp}/s.toml", "--plot", "{tmp}/s.toml"),
         {"s.toml": _text('[model]\npreset = "tiny"\n')}, says=("--plot", "input of --scenario"),
         check=_unchanged("s.toml", _text('[model]\npreset = "tiny"\n'))),
    Case("csv-and-json-same", "files destroyed", "--output F --json-output F lost the CSV",
         ("sweep", "--preset", "tiny", "--grid", "micro_batch=1", "--output", "{tmp}/f", "--json-output", "{tmp}/f"),
         says=("--json-output", "also the output")),
    Case("output-char-device", "files destroyed", "a character device given as an output (as root, /dev/null) was "
         "replaced by a regular file", SIM + ("--export-chrome", "{tmp}/null"), says=("character device",)),
    Case("output-fifo", "files destroyed", "a named pipe given as an output was replaced by a file",
         SIM + ("--export-chrome", "{tmp}/fifo"), says=("named pipe",)),
    Case("output-umask", "files destroyed", "outputs ignored the umask (always 0644)",
         SIM + ("--export-chrome", "{tmp}/c.json"), code=0, umask=0o077, check=_mode("c.json", 0o600)),
    Case("stale-temp", "files destroyed", "a kill between write and rename left a hidden .tmp-* beside the target",
         SIM + ("--export-chrome", "{tmp}/c.json"), {".peakledger-tmp-999999999-x": lambda: b"half"}, code=0,
         check=_absent("{tmp}/.peakledger-tmp-999999999-x")),
    # --- unbounded work ---------------------------------------------------------------------------------------
    Case("validate-70b", "unbounded work", "validate --preset llama-3-70b built the real 70B model on the CPU",
         ("validate", "--preset", "llama-3-70b"), says=("--force",)),
    Case("dev-zero-scenario", "unbounded work", "/dev/zero as --scenario read without limit",
         ("simulate", "--scenario", "/dev/zero"), says=("scenario:", "character device")),
    Case("dev-zero-hf", "unbounded work", "/dev/zero as --hf-config read without limit",
         ("simulate", "--hf-config", "/dev/zero"), says=("hf_config:", "character device")),
    Case("dev-zero-trace", "unbounded work", "/dev/zero as --trace read without limit",
         ("explain", "--trace", "/dev/zero", "--budget", "1GiB"), says=("trace:", "character device")),
    Case("steps-20000", "unbounded work", "simulate --steps 20000: 145 s and 7 GB, linear in steps",
         ("simulate", "--preset", "tiny", "--steps", "20000", "--json"), code=0,
         check=_same_peak_as("simulate", "--preset", "tiny", "--steps", "2", "--json")),
    Case("n-layer-huge", "unbounded work", "a huge layer count described layer by layer without end",
         ("simulate", "--preset", "tiny", "--n-layer", "100000000000"), says=("n_layer", "limit")),
    Case("size-over-int64", "unbounded work", "a size no float can hold (10^400) ended in an OverflowError",
         ("simulate", "--preset", "tiny", "--micro-batch", str(10**400)), says=("micro_batch", "int64")),
    Case("grad-accum-huge", "unbounded work", "a huge accumulation simulated micro-batch by micro-batch",
         ("simulate", "--preset", "tiny", "--grad-accum", "100000000"), says=("grad_accum", "limit")),
    # issue 23: data never names code to run (a trace's recorded module, a scenario file's `module`)
    Case("trace-names-module", "code from data", "a JSON trace naming a module file (with its sha256) made "
         "validate --trace import and run it", ("validate", "--trace", "{tmp}/t.json"),
         {"t.json": _trace(_names_evil_module)}, says=("module", "give that file with --module"),
         check=_evil_did_not_run),
    Case("scenario-names-module", "code from data", "a scenario file naming a module file ran it",
         ("simulate", "--scenario", "{tmp}/s.toml"),
         {"s.toml": lambda: f'[model]\nmodule = "{_evil_module()}:factory"\n'.encode()},
         says=("scenario", "never names code"), check=_evil_did_not_run),
    # issue 23: a user's factory ends the process as it likes (or prints into --json, or never returns)
    Case("factory-sys-exit-0", "user code", "a factory calling sys.exit(0): exit 0 and no output",
         ("simulate", "--module", "{tmp}/f.py:factory"), {"f.py": _factory("sys.exit(0)")},
         says=("module", "sys.exit(0)")),
    Case("factory-os-exit", "user code", "a factory calling os._exit(0): exit 0 and no output",
         ("simulate", "--module", "{tmp}/f.py:factory"), {"f.py": _factory("os._exit(0)")},
         says=("module", "os._exit(0)")),
    Case("factory-base-exception", "user code", "a factory raising a BaseException subclass: exit 1, a traceback",
         ("simulate", "--module", "{tmp}/f.py:factory"),
         {"f.py": _factory("raise type('Stop', (BaseException,), {})('stop')")}, says=("module", "stop")),
    Case("factory-print-json", "user code", "a factory's print() corrupted --json",
         ("simulate", "--module", "{tmp}/f.py:factory", "--json"), {"f.py": _factory("print('hello')")}, code=0,
         check=_stdout_is_json),
    Case("factory-sleeps", "user code", "a factory that sleeps blocked forever",
         ("simulate", "--module", "{tmp}/f.py:factory", "--module-timeout", "1"),
         {"f.py": _factory("time.sleep(600)")}, says=("module", "more than 1 s")),
    # issue 23: work a small file can cost (a pickle's memo shares one tuple at every level: 2^40 leaves in
    # 245 bytes; hashing or printing it never ends, and no signal stops it), waits without end, long integers
    Case("snapshot-shared-nest-action", "unbounded work", "a snapshot whose 'action' is a memo-shared nest of "
         "tuples hung explain while it was hashed", ("explain", "--trace", "{tmp}/s.pickle", "--budget", "1GiB"),
         {"s.pickle": lambda: _snapshot([{**_ALLOC, "action": _nest()}])()}, says=("trace:", "unknown action")),
    Case("snapshot-shared-nest-frames", "unbounded work", "a snapshot whose frame names are a memo-shared nest "
         "hung explain while they were turned into text", ("explain", "--trace", "{tmp}/s.pickle", "--budget", "1GiB"),
         {"s.pickle": lambda: _snapshot([{**_ALLOC, "frames": [{"name": _nest(), "filename": "x.py",
                                                                 "line": 1}]}])()},
         says=("trace:", "frames")),
    Case("fifo-no-writer", "unbounded work", "a named pipe nothing writes to, given as --trace, waited forever",
         ("explain", "--trace", "{tmp}/fifo", "--budget", "1GiB"), says=("trace:", "named pipe", "no data")),
    Case("steps-billion", "unbounded work", "simulate --steps 1000000000 ran past 120 s",
         ("simulate", "--preset", "tiny", "--steps", "1000000000", "--json"), code=0,
         check=_same_peak_as("simulate", "--preset", "tiny", "--steps", "2", "--json")),
    Case("validate-steps-billion", "unbounded work", "validate --steps 1000000000 ran every step for real",
         ("validate", "--preset", "tiny", "--steps", "1000000000"), says=("steps", "limit of 100")),
    Case("hf-int-digits", "exit 3 on user input", "an integer of 5,000 digits in an HF config.json",
         ("simulate", "--hf-config", "{tmp}/config.json"),
         {"config.json": lambda: json.dumps(TINY_LLAMA).replace('"num_hidden_layers": 2', '"num_hidden_layers": '
                                                                 + "1" * 5000).encode()},
         says=("hf_config:", "4,300 digits")),
    Case("toml-int-digits", "exit 3 on user input", "an integer of 5,000 digits in a scenario TOML",
         ("simulate", "--scenario", "{tmp}/s.toml"), {"s.toml": _text("[training]\nsteps = " + "1" * 5000 + "\n")},
         says=("scenario:", "4,300 digits")),
    Case("trace-int-digits", "exit 3 on user input", "an integer of 5,000 digits in a JSON trace",
         ("explain", "--trace", "{tmp}/t.json", "--budget", "1GiB"),
         {"t.json": lambda: _trace()().replace(b'"events": [[0', b'"events": [[' + b"1" * 5000, 1)},
         says=("trace:", "4,300 digits")),
    Case("moe-counts-int-digits", "exit 3 on user input", "an integer of 5,000 digits in MoE counts",
         ("simulate", "--preset", "mixtral-8x7b", "--n-layer", "1", "--moe-routing", "counts:{tmp}/c.json"),
         {"c.json": lambda: b'{"format": "peakledger-moe-counts", "counts": [[' + b"1" * 5000 + b"]]}"},
         says=("moe_routing", "4,300 digits")),
    Case("calibration-csv-int-digits", "exit 3 on user input", "an integer of 5,000 digits in a calibration CSV",
         ("calibrate", "fit", "--preset", "tiny", "--csv", "{tmp}/m.csv", "--output", "{tmp}/c.json"),
         {"m.csv": _text("seq_len,measured_allocated\n64," + "1" * 5000 + "\n128,100\n")},
         says=("measured_allocated", "digits")),
    Case("budget-int-digits", "exit 3 on user input", "--budget of 5,000 digits",
         SIM + ("--budget", "1" * 5000), says=("budget", "digits")),
    # issue 23: silent numbers and flags that change nothing
    Case("micro-batch-int64-max", "silent wrong results", "micro-batch 2^63-1 printed a 6.165e+18 GiB peak",
         ("simulate", "--preset", "tiny", "--micro-batch", str(2**63 - 1)), says=("scenario", "int64 limit")),
    Case("vocab-int64-max", "silent wrong results", "vocab 2^63-1 printed as a result",
         ("simulate", "--preset", "tiny", "--vocab-size", str(2**63 - 1)), says=("scenario", "int64 limit")),
    Case("headroom-1e308", "silent wrong results", "--headroom 1e308 was taken",
         SIM + ("--headroom", "1e308"), says=("headroom", "limit")),
    Case("cpu-alloc-conf", "flags ignored", "--alloc-conf with --device cpu was taken and ignored",
         SIM + ("--device", "cpu", "--alloc-conf", "expandable_segments:True"), says=("alloc_conf", "gpu")),
    Case("cpu-torch-version", "flags ignored", "--torch-version with --device cpu was taken and ignored",
         SIM + ("--device", "cpu", "--torch-version", "2.11"), says=("torch_version", "gpu")),
    Case("alloc-conf-23-digits", "flags ignored", "--alloc-conf max_split_size_mb: with a 23-digit value was taken",
         SIM + ("--alloc-conf", "max_split_size_mb:12345678901234567890123"), says=("max_split_size_mb", "2^64")),
    Case("checkpoint-every-huge", "flags ignored", "--checkpoint-every 10^30 was taken (the run never saves)",
         SIM + ("--checkpoint-every", str(10**30)), says=("checkpoint_every", "steps")),
    # issue 23: errors that blamed the wrong input
    Case("pp-over-int64", "misleading errors", "--pp 2^63 was blamed on grad_accum",
         SIM + ("--pp", str(2**63), "--world-size", "4"), says=("error: pp:",)),
    Case("cp-on-gpu", "misleading errors", "--cp on a GPU profile was refused for its precision, then the device",
         SIM + ("--cp", "2", "--world-size", "2"), says=("error: device:", "cpu profile")),
    Case("gpt2-relu-hand-written", "misleading errors", "GPT-2 activation_function relu refused, though "
         "transformers takes it", ("simulate", "--hf-config", "{tmp}/config.json", "--describer", "hand-written"),
         {"config.json": lambda: json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
                                             "n_layer": 2, "n_embd": 64, "n_head": 4, "vocab_size": 100,
                                             "n_positions": 64, "activation_function": "relu"}).encode()},
         says=("activation_function", "traced describer")),
    Case("max-batch-fixed-factory", "silent wrong results", "max-batch on a factory without a micro_batch keyword "
         "printed 'at least 1,048,576'", ("max-batch", "--module", "{tmp}/f.py:factory", "--budget", "1GiB"),
         {"f.py": _text("import torch\n\n\ndef factory():\n    return torch.nn.Linear(8, 8), torch.randn(4, 8), "
                        "lambda out: out.sum()\n")}, says=("module", "no micro_batch keyword")),
    Case("mistral-window-hand-written", "silent wrong results", "a Mistral sliding_window shorter than the sequence "
         "was ignored by the hand-written describer (+2.4% at seq 64)",
         ("simulate", "--hf-config", "{tmp}/config.json", "--seq-len", "64", "--describer", "hand-written"),
         {"config.json": lambda: json.dumps({**TINY_LLAMA, "model_type": "mistral", "architectures":
                                             ["MistralForCausalLM"], "max_position_embeddings": 256,
                                             "sliding_window": 32}).encode()},
         says=("sliding_window", "traced describer")),
    Case("tied-autoencoder-mse", "silent wrong results", "a --module whose forward uses one parameter twice, once "
         "transposed, under mean-squared error: 9% under its real CPU peak",
         ("validate", "--module", str(REPO / "tests/traced_factories.py:autoencoder"), "--micro-batch", "256",
          "--precision", "fp32", "--optimizer", "sgd", "--steps", "1", "--tolerance", "0.005"),
         code=0, says=("within tolerance",)),
    # issue 23: argparse's prefix matching and its usage block
    Case("abbrev-micro", "flags taken as others", "`--micro 3` taken silently as --micro-batch 3",
         ("simulate", "--preset", "tiny", "--micro", "3"), says=("unrecognized arguments: --micro 3",)),
    Case("abbrev-json-output", "flags taken as others", "`sweep --json s.json` became --json-output",
         ("sweep", "--preset", "tiny", "--grid", "micro_batch=1", "--json", "s.json"),
         says=("unrecognized arguments: --json",)),
    Case("argparse-usage-block", "flags taken as others", "argparse's own errors printed a usage block",
         ("simulate", "--preset", "tiny", "--micro-batch", "x"), says=("--micro-batch: invalid int value",)),
]


def assert_outcome(case: Case, code: int, out: str, err: str, tmp: Path) -> None:
    """What tests/test_hardening*.py assert of a case run in process: no traceback, no exit 3, the exit status, each
    phrase said, exit 2 as one line, and the case's own check."""
    text = (out + err).lower()
    assert "traceback" not in text and code != 3, err
    assert code == case.code, (code, err[-2000:])
    for phrase in case.says:
        assert phrase.lower() in text, (phrase, out[-1000:], err[-1000:])
    if case.code == 2:
        assert err.startswith("peakledger: error: ") and err.count("\n") == 1, err
    if case.check is not None:
        problem = case.check(out, err, tmp)
        assert problem is None, problem


def make_special_files(case: Case, tmp: Path) -> None:
    """`{tmp}/fifo`: a named pipe; `{tmp}/loop1`: a symbolic link loop; `{tmp}/null`: a character device like
    /dev/null (made here, so a version that replaces devices by files never touches the real /dev/null)."""
    import os
    import stat

    argv = " ".join(case.argv)
    if "{tmp}/fifo" in argv:
        os.mkfifo(tmp / "fifo")
    if "{tmp}/loop1" in argv:  # a symbolic link loop: loop1 -> loop2 -> loop1
        os.symlink("loop2", tmp / "loop1")
        os.symlink("loop1", tmp / "loop2")
    if "{tmp}/null" in argv:
        try:
            os.mknod(tmp / "null", 0o666 | stat.S_IFCHR, os.makedev(1, 3))
        except PermissionError:  # not root: a link to /dev/null (replacing a link never touches its target)
            os.symlink("/dev/null", tmp / "null")


def _exported_snapshot() -> bytes:
    """peakledger's own --export-snapshot of the tiny GPT (one step)."""
    from peakledger import api
    from peakledger.analysis.export import to_snapshot
    from peakledger.scenario import build_scenario

    report = api.run(build_scenario({"preset": "tiny"}, {"steps": 1}))
    return pickle.dumps(to_snapshot(report.log), protocol=4)


EVIL_PICKLE = pickle.dumps(_Evil())

__all__ = ["CASES", "Case", "EVIL_PICKLE", "REPO", "GPU_TRUTH", "assert_outcome", "make_special_files"]
