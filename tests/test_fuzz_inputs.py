"""Fuzzing the input boundary through the CLI entry point, in process: hypothesis builds scenarios, HF
configs, traces, snapshots and output paths, valid and broken (wrong types, NaN / inf, huge ints,
truncated, binary). Whatever it builds: never a traceback and never exit 3 (an internal error is a bug);
an input broken on purpose never exits 0."""

from __future__ import annotations

import json
import math
import os
import pickle

from hardening_cases import MLP_TRACE
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from peakledger import cli

FUZZ = settings(max_examples=int(os.environ.get("PEAKLEDGER_FUZZ_EXAMPLES", "40")), deadline=None,
                suppress_health_check=list(HealthCheck), derandomize=True)

WEIRD = st.one_of(st.none(), st.booleans(), st.integers(-3, 3), st.integers(2**62, 2**80), st.just(-(2**70)),
                  st.just(10**400),
                  st.just(10**5000),  # over Python's 4,300-digit limit for reading an integer back
                  st.floats(allow_nan=True, allow_infinity=True), st.sampled_from([math.nan, math.inf, -0.0]),
                  st.text(max_size=8), st.lists(st.integers(0, 3), max_size=3),
                  st.dictionaries(st.text(max_size=3), st.integers(), max_size=2))
TRAINING_KEYS = ["micro_batch", "seq_len", "grad_accum", "steps", "precision", "optimizer", "fp32_grads", "set_to_none",
                 "frozen", "world_size", "zero_stage", "checkpointing", "dp_engine", "checkpoint_every",
                 "optimizer_offload", "offload_chunk_params", "reshard_after_forward", "not_a_field"]
MODEL_KEYS = ["preset", "n_layer", "d_model", "n_head", "dropout", "attention", "vocab_size", "hf_config", "unknown"]
HF_KEYS = ["model_type", "num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads",
           "intermediate_size", "vocab_size", "max_position_embeddings", "tie_word_embeddings", "head_dim",
           "attention_bias", "mlp_bias", "n_layer", "n_embd", "n_head", "attn_implementation", "resid_pdrop"]
TINY_LLAMA = {"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
              "num_hidden_layers": 2, "intermediate_size": 176, "vocab_size": 256, "max_position_embeddings": 64}


def toml_value(v) -> str:
    if v is None:
        return '"none"'
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float):
        return "nan" if v != v else ("inf" if v == math.inf else "-inf" if v == -math.inf else repr(v))
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, list):
        return "[" + ", ".join(toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{json.dumps(k)} = {toml_value(x)}" for k, x in v.items()) + "}"
    return _digits(v)


BIG = 10**5000
BIG_MARK = "__peakledger_fuzz_big_int__"


def _digits(v: int) -> str:
    """An int as text, BIG too (str() refuses past 4,300 digits: the limit is for reading, the file must hold it)."""
    return "1" + "0" * 5000 if v == BIG else str(v)


def dumps(obj) -> str:
    """json.dumps(obj, allow_nan=True), with BIG written out in full."""
    def mark(x):
        if isinstance(x, dict):
            return {k: mark(v) for k, v in x.items()}
        if isinstance(x, list):
            return [mark(v) for v in x]
        return BIG_MARK if isinstance(x, int) and not isinstance(x, bool) and x == BIG else x
    return json.dumps(mark(obj), allow_nan=True).replace(f'"{BIG_MARK}"', _digits(BIG))


def run(argv, tmp_path, capsys) -> tuple[int, str]:
    code = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    assert code != 3 and "Traceback" not in err, err
    return code, err


@FUZZ
@given(training=st.dictionaries(st.sampled_from(TRAINING_KEYS), WEIRD, max_size=3),
       model=st.dictionaries(st.sampled_from(MODEL_KEYS), WEIRD, max_size=2), junk=st.binary(max_size=20),
       binary=st.booleans())
def test_scenario_files(tmp_path_factory, capsys, training, model, junk, binary):
    tmp = tmp_path_factory.mktemp("s")
    text = "[model]\npreset = \"tiny\"\n" + "".join(f"{k} = {toml_value(v)}\n" for k, v in model.items()) + \
        "[training]\nsteps = 1\n" + "".join(f"{k} = {toml_value(v)}\n" for k, v in training.items() if k != "steps")
    path = tmp / "s.toml"
    path.write_bytes(junk + text.encode() if binary else text.encode())
    run(["simulate", "--scenario", path, "--json"], tmp, capsys)


@FUZZ
@given(broken=st.dictionaries(st.sampled_from(HF_KEYS), WEIRD, min_size=1, max_size=3))
def test_hf_configs(tmp_path_factory, capsys, broken):
    tmp = tmp_path_factory.mktemp("h")
    path = tmp / "config.json"
    path.write_text(dumps({**TINY_LLAMA, **broken}))
    run(["simulate", "--hf-config", path, "--steps", "1", "--seq-len", "8", "--micro-batch", "1"], tmp, capsys)


@FUZZ
@given(where=st.sampled_from(["blocks", "events"]), index=st.integers(0, 50), column=st.integers(0, 9), value=WEIRD,
       cut=st.one_of(st.none(), st.integers(1, 4000)))
def test_traces(tmp_path_factory, capsys, where, index, column, value, cut):
    tmp = tmp_path_factory.mktemp("t")
    data = json.loads(MLP_TRACE.read_text())
    row = data[where][index % len(data[where])]
    original = row[column % len(row)]
    row[column % len(row)] = value
    raw = dumps(data).encode()
    path = tmp / "t.json"
    path.write_bytes(raw[:cut] if cut else raw)
    code, err = run(["explain", "--trace", path, "--budget", "1GiB"], tmp, capsys)
    optional = where == "blocks" and column % len(row) == 6  # a block's optimizer state may be null
    number = isinstance(original, float) and isinstance(value, int) and not isinstance(value, bool)  # 0 for 0.0
    if cut or (type(value) is not type(original) and not (optional and value is None) and not number
               and not (isinstance(value, int) and isinstance(original, int) and not isinstance(value, bool))):
        assert code == 2, (where, column, value, original)


ENTRY_KEYS = ["action", "addr", "size", "stream", "time_us", "frames"]


def _nest(depth: int = 40):
    """2^depth leaves in `depth` objects (a pickle's memo shares each level's two halves): a value whose hash or
    text never ends; only a type check before either keeps a reader bounded."""
    x = ("x",)
    for _ in range(depth):
        x = (x, x)
    return x


SHARED_NEST = st.builds(_nest)


@FUZZ
@given(entries=st.lists(st.one_of(WEIRD, st.fixed_dictionaries(
    {"action": st.one_of(st.sampled_from(["alloc", "free_completed", "segment_alloc", "segment_free", "oom", "x"]),
                         SHARED_NEST),
     "addr": st.one_of(st.integers(0, 8), WEIRD, SHARED_NEST), "size": st.one_of(st.integers(0, 1 << 20), WEIRD),
     "frames": st.lists(st.fixed_dictionaries({"name": st.one_of(st.text(max_size=4), SHARED_NEST),
                                               "filename": st.just("x.py"), "line": st.integers(0, 9)}),
                        max_size=1)})), max_size=6),
       top=st.sampled_from(["ok", "no_segments", "list", "deep"]))
def test_snapshots(tmp_path_factory, capsys, entries, top):
    tmp = tmp_path_factory.mktemp("p")
    obj = {"ok": {"segments": [], "device_traces": [entries]}, "no_segments": {"device_traces": [entries]},
           "list": [entries], "deep": {"segments": [[[[[]]]]], "device_traces": [[{"action": "alloc"}]]}}[top]
    path = tmp / "s.pickle"
    path.write_bytes(pickle.dumps(obj))
    code, _ = run(["explain", "--trace", path, "--budget", "1GiB"], tmp, capsys)
    if top != "ok":
        assert code == 2


@FUZZ
@given(kind=st.sampled_from(["missing-dir", "dir", "empty", "input", "same", "fifo", "ok"]),
       command=st.sampled_from(["simulate", "sweep"]))
def test_output_paths(tmp_path_factory, capsys, kind, command):
    tmp = tmp_path_factory.mktemp("o")
    scenario = tmp / "s.toml"
    scenario.write_text('[model]\npreset = "tiny"\n[training]\nsteps = 1\n')
    target = {"missing-dir": tmp / "no" / "x", "dir": tmp, "empty": "", "input": scenario, "same": tmp / "a",
              "fifo": tmp / "fifo", "ok": tmp / "a"}[kind]
    if kind == "fifo":
        os.mkfifo(target)
    before = scenario.read_bytes()
    if command == "simulate":
        argv = ["simulate", "--scenario", scenario, "--export-chrome", target] + \
            (["--export-snapshot", target] if kind == "same" else [])
    else:
        argv = ["sweep", "--scenario", scenario, "--grid", "micro_batch=1", "--jobs", "1", "--output", target] + \
            (["--json-output", target] if kind == "same" else [])
    code, _ = run(argv, tmp, capsys)
    assert code == (0 if kind == "ok" else 2)
    assert scenario.read_bytes() == before
