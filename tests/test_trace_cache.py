"""The disk cache of traced recordings (models/traced/store.py): a recording read back equals the trace, a repeat
with a setting that does not change the recording reads it (and imports neither torch nor transformers), one that
does traces anew, a corrupt entry is traced again, the folder stays under its bound, --no-cache writes nothing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zlib
from pathlib import Path

import pytest
from cli_run import cli

import peakledger.models.traced as trace
from peakledger.models.config import ConfigError, TrainingSetup
from peakledger.models.traced import from_hf_dict, recording, store

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "examples" / "hf-llama-tiny" / "config.json"
BASE = TrainingSetup(micro_batch=2, seq_len=16, precision="bf16-mixed")


def _fresh_process() -> None:
    """What a new process starts from: nothing in the per-process cache."""
    trace.forget()


@pytest.fixture(autouse=True)
def _in_this_process(monkeypatch):
    """Every trace in this process, where these tests count them (models/forked.py: no fork)."""
    monkeypatch.setenv("PEAKLEDGER_FORK", "0")


@pytest.fixture
def disk(trace_disk):  # (tests/conftest.py)
    return trace_disk


@pytest.fixture
def traces(traces_run):  # (tests/conftest.py)
    return traces_run


def _tiny(**changes):
    return from_hf_dict({**json.loads(TINY.read_text()), **changes}, "tiny")


def _entries(folder: Path) -> list[Path]:
    return sorted(folder.glob(f"rec-*{store.SUFFIX}"))


@pytest.mark.parametrize("config,setup,target", [
    ("hf-llama-tiny", BASE, None),
    ("hf-llama-tiny", BASE.replace(lora_r=4), None),
    ("hf-llama-tiny", BASE.replace(checkpointing="full"), ((9, 0), "2.6")),
    ("hf-mixtral-tiny", TrainingSetup(micro_batch=2, seq_len=16, precision="fp32"), None),
    ("hf-t5-tiny", TrainingSetup(micro_batch=2, seq_len=16, precision="fp32"), None),
])
def test_a_recording_reads_back_equal_field_for_field(config, setup, target):
    model = from_hf_dict(json.loads((ROOT / "examples" / config / "config.json").read_text()), config)
    rec = recording(model, setup, target)
    back = store.decode(json.loads(json.dumps(store.encode(rec))))
    assert back == rec
    assert [type(getattr(back, f)) for f in rec.__dataclass_fields__] == \
        [type(getattr(rec, f)) for f in rec.__dataclass_fields__]
    shared = [s is rec.storages.get(s.id) for s in rec.buffers + rec.inputs]
    assert [s is back.storages.get(s.id) for s in back.buffers + back.inputs] == shared


def test_a_setting_that_does_not_change_the_recording_reads_it_from_disk(disk, traces):
    model = _tiny()
    first = recording(model, BASE)
    assert len(traces) == 1 and len(_entries(disk)) == 1
    for same in (BASE.replace(grad_accum=4), BASE.replace(steps=5), BASE.replace(optimizer="sgd"),
                 BASE.replace(zero_stage=1), BASE.replace(precision="bf16")):  # (bf16 weights either way)
        _fresh_process()
        assert recording(model, same) == first
    assert len(traces) == 1
    full = BASE.replace(checkpointing="full")
    recording(model, full)
    _fresh_process()
    recording(model, BASE.replace(checkpointing="selective"))  # on either way: the same recording
    assert len(traces) == 2


@pytest.mark.parametrize("change,target", [
    (dict(micro_batch=3), None), (dict(seq_len=8), None), (dict(precision="fp32"), None),
    (dict(precision="bf16-autocast"), None), (dict(frozen=("model.embed_tokens.weight",)), None),
    (dict(checkpointing="full"), None), (dict(lora_r=4), None), (dict(lora_r=4, lora_alpha=16.0), None),
    (dict(passes="forward"), None), ({}, ((9, 0), "2.6")), ({}, ((8, 0), "2.6")),
])
def test_a_setting_that_changes_the_recording_traces_it_and_keeps_it(disk, traces, change, target):
    model = _tiny()
    recording(model, BASE)
    setup = BASE.replace(**change)
    if change.get("lora_alpha"):
        recording(model, BASE.replace(lora_r=4), target)  # another alpha than this one's
    _fresh_process()
    made = len(traces)
    rec = recording(model, setup, target)
    assert len(traces) == made + 1
    _fresh_process()
    assert recording(model, setup, target) == rec and len(traces) == made + 1


def test_another_library_version_or_config_misses(disk, traces, monkeypatch):
    recording(_tiny(), BASE)
    _fresh_process()
    recording(_tiny(rms_norm_eps=1e-5), BASE)  # another config: another digest
    assert len(traces) == 2
    _fresh_process()
    monkeypatch.setattr(store, "salt", lambda lora=False, quantize="none": "torch 9.9; transformers 9.9")
    recording(_tiny(), BASE)
    assert len(traces) == 3


@pytest.mark.parametrize("damage", ["truncated", "garbage", "empty", "other key", "other format"])
def test_a_corrupt_entry_is_ignored_and_rebuilt(disk, traces, damage):
    model = _tiny()
    rec = recording(model, BASE)
    [path] = _entries(disk)
    good = path.read_bytes()
    data = json.loads(zlib.decompress(good))
    path.write_bytes({"truncated": good[:len(good) // 2], "garbage": b"\x00not a cache entry\xff" * 50, "empty": b"",
                      "other key": zlib.compress(json.dumps({**data, "key": data["key"] + "x"}).encode()),
                      "other format": zlib.compress(json.dumps({**data, "format": store.FORMAT + 1}).encode()),
                      }[damage])
    _fresh_process()
    assert recording(model, BASE) == rec
    assert len(traces) == 2
    assert path.read_bytes() == good  # rebuilt: the same entry as the first trace wrote


def test_micro_batch_sizes_traced_in_other_processes_derive_the_others(disk, traces):
    """scale.py's derivation from three traced sizes of one program works from the disk too: a new process asks for
    5 after 2, 4 and 8 were traced (each by a process of its own) and gets the trace's recording without tracing."""
    model = _tiny()
    for b in (2, 4, 8):
        _fresh_process()
        recording(model, BASE.replace(micro_batch=b))
    _fresh_process()
    derived = recording(model, BASE.replace(micro_batch=5))
    assert len(traces) == 3 and trace._key(model, BASE.replace(micro_batch=5)) in trace._DERIVED
    assert len(_entries(disk)) == 3  # a derived recording is not written: it is derived again
    assert derived == trace._trace(model, BASE.replace(micro_batch=5), None)


def test_the_folder_stays_under_its_bound_least_recently_used_first(disk, traces, monkeypatch):
    model = _tiny()
    recording(model, BASE)
    [first] = _entries(disk)
    size = first.stat().st_size
    monkeypatch.setenv(store.MAX_ENV, str(2 * size + size // 2))  # room for two entries of about this size
    recording(model, BASE.replace(seq_len=8))
    os.utime(first, ns=(1, 1))
    [second] = [p for p in _entries(disk) if p != first]
    os.utime(second, ns=(2, 2))
    _fresh_process()
    recording(model, BASE)  # a hit: the first entry is now the most recent
    recording(model, BASE.replace(seq_len=12))  # a third: the least recently used (the second) goes
    assert first in _entries(disk) and second not in _entries(disk) and len(_entries(disk)) == 2
    assert sum(p.stat().st_size for p in disk.iterdir()) <= 2 * size + size // 2


def test_evict_removes_the_oldest_until_under_the_limit(tmp_path):
    for i, n in enumerate((300, 200, 100, 50)):
        p = tmp_path / f"rec-{i}{store.SUFFIX}"
        p.write_bytes(b"x" * n)
        os.utime(p, ns=(10 + i, 10 + i))
    (tmp_path / "other.txt").write_bytes(b"x" * 1000)  # not an entry: never counted nor removed
    store.evict(tmp_path, 360)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["other.txt", f"rec-1{store.SUFFIX}",
                                                          f"rec-2{store.SUFFIX}", f"rec-3{store.SUFFIX}"]
    store.evict(tmp_path, 150)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["other.txt", f"rec-2{store.SUFFIX}", f"rec-3{store.SUFFIX}"]


def test_a_bad_size_bound_is_one_line_and_exit_2(disk, monkeypatch):
    monkeypatch.setenv(store.MAX_ENV, "2GiB")
    with pytest.raises(ConfigError) as e:
        store.entry(_tiny(), trace._key(_tiny(), BASE), 0, "none")
    assert e.value.field == store.MAX_ENV
    rc, out, err = cli("simulate", "--hf-config", str(TINY), "--micro-batch", "2", "--seq-len", "16")
    assert rc == 2 and err.count("\n") == 1 and store.MAX_ENV in err and "whole number" in err


def test_no_cache_neither_reads_nor_writes(disk, traces):
    rc, _, err = cli("simulate", "--hf-config", str(TINY), "--micro-batch", "2", "--seq-len", "16", "--no-cache")
    assert rc == 0, err
    assert not disk.exists() and len(traces) == 1
    _fresh_process()
    recording(_tiny(), BASE.replace(precision="fp32"))
    _fresh_process()
    rc, _, err = cli("simulate", "--hf-config", str(TINY), "--micro-batch", "2", "--seq-len", "16", "--precision",
                     "fp32", "--no-cache")
    assert rc == 0, err
    assert len(traces) == 3  # traced although the disk holds it


def test_off_turns_it_off(monkeypatch):
    monkeypatch.setenv(store.DIR_ENV, "off")
    assert store.cache_dir() is None and store.entry(_tiny(), (), 0, "none") is None
    monkeypatch.delenv(store.DIR_ENV)
    monkeypatch.setenv("XDG_CACHE_HOME", "/somewhere")
    assert store.cache_dir() == Path("/somewhere/peakledger/traces")
    with store.cache_enabled(False):
        assert store.cache_dir() is None


WARM = """
import json, sys
from peakledger.cli import main
rc = main(sys.argv[1:])
print(json.dumps({"rc": rc, "torch": "torch" in sys.modules, "transformers": "transformers" in sys.modules}),
      file=sys.stderr)
"""


def test_a_warm_run_prints_the_same_bytes_and_imports_neither_torch_nor_transformers(tmp_path):
    env = {**os.environ, store.DIR_ENV: str(tmp_path / "traces"), "PYTHONWARNINGS": "ignore"}
    argv = ["simulate", "--hf-config", str(TINY), "--micro-batch", "2", "--seq-len", "16", "--device", "cpu", "--json"]

    def run(*extra):
        p = subprocess.run([sys.executable, "-c", WARM, *argv, *extra], env=env, capture_output=True, text=True,
                           cwd=tmp_path)
        return p.stdout, json.loads(p.stderr.strip().splitlines()[-1])

    cold, cold_state = run()
    assert cold_state == {"rc": 0, "torch": True, "transformers": True}
    warm, warm_state = run()
    assert warm_state == {"rc": 0, "torch": False, "transformers": False}
    assert warm == cold
    other, other_state = run("--grad-accum", "3", "--optimizer", "sgd")  # a setting the recording does not follow
    assert other_state == {"rc": 0, "torch": False, "transformers": False}
    assert json.loads(other)["peak"] != json.loads(cold)["peak"]
