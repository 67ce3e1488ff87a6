"""`peakledger ledger EVENTS`: a user's own alloc / free events, made the project's event log (analysis/user_events.py).

Peaks are computed by hand for small lists: a shared storage counted once, events at the same time applied in file
order, frees; bad input exits 2 with one line naming the file, the row and the column; reruns give the same bytes."""

import json
from pathlib import Path

import pytest

from peakledger.analysis import user_events
from peakledger.analysis.user_events import read_user_events
from peakledger.analysis.user_ledger import pool_ledgers
from peakledger.cli import main
from peakledger.simulator.events import EventLog
from peakledger.simulator.timeline import timeline
from peakledger.traces.store import check_consistency

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "events" / "shared-storage.csv"
MiB = 1 << 20

SHARED = """time,object,bytes,action,storage
0,a,100,alloc,s
1,b,100,alloc,s
2,c,50,alloc,
3,a,,free,
4,d,10,alloc,
5,b,,free,s
6,c,,free,
6,d,,free,
"""


def run_cli(capsys, *argv):
    code = main([str(a) for a in argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def write(tmp_path, text: str, name: str = "events.csv") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def ledger_json(capsys, path, *flags) -> dict:
    code, out, err = run_cli(capsys, "ledger", path, "--json", *flags)
    assert code == 0, err
    return json.loads(out)


def test_shared_storage_counts_once_while_any_reference_lives(tmp_path, capsys):
    # by hand: a (storage s) 100; b (s) +0 = 100; c 150; free a: s still held by b = 150; d 160 (the peak);
    # free b, the last reference: 60; free c, d: 0
    data = ledger_json(capsys, write(tmp_path, SHARED))
    assert data["events"] == 8 and data["objects"] == 4 and data["blocks"] == 3
    (pool,) = data["pools"]
    peak = pool["peak"]
    assert (peak["bytes"], peak["time"], peak["event"], peak["object"]) == (160, 4.0, 5, "d")
    assert peak["where"].endswith("events.csv line 6")
    assert pool["live"] == [
        {"storage": "s", "objects": ["b"], "bytes": 100, "category": "unknown", "state": None},
        {"storage": None, "objects": ["c"], "bytes": 50, "category": "unknown", "state": None},
        {"storage": None, "objects": ["d"], "bytes": 10, "category": "unknown", "state": None}]
    assert [(r["event"], r["action"], r["object"], r["bytes"]) for r in pool["timeline"]] == [
        (1, "alloc", "a", 100), (3, "alloc", "c", 150), (5, "alloc", "d", 160), (6, "free", "b", 60),
        (7, "free", "c", 10), (8, "free", "d", 0)]  # b's alloc and a's free change nothing: s is held
    assert pool["ledger"] == [{"row": "unknown", "category": "unknown", "bytes": 160, "blocks": 3, "share": 1.0,
                               "max_bytes": 160}]


def test_same_instant_events_apply_in_file_order(tmp_path, capsys):
    alloc_first = "time,object,bytes,action\n0,y,100,alloc\n1,x,100,alloc\n1,y,,free\n"
    free_first = "time,object,bytes,action\n0,y,100,alloc\n1,y,,free\n1,x,100,alloc\n"
    peak = ledger_json(capsys, write(tmp_path, alloc_first, "a.csv"))["pools"][0]["peak"]
    assert (peak["bytes"], peak["time"], peak["event"], peak["object"]) == (200, 1.0, 2, "x")
    peak = ledger_json(capsys, write(tmp_path, free_first, "b.csv"))["pools"][0]["peak"]
    assert (peak["bytes"], peak["time"], peak["event"], peak["object"]) == (100, 0.0, 1, "y")  # ties: the first


def test_ledger_by_category_at_the_peak(tmp_path, capsys):
    # by hand: w 1000; h1 1300; h2 1500; free h1 1200; g 2200 (the peak); free h2 2000
    text = ("time,object,bytes,action,category\n0,w,1000,alloc,parameter\n1,h1,300,alloc,activation\n"
            "2,h2,200,alloc,activation\n3,h1,,free,\n4,w.grad,1000,alloc,gradient\n5,h2,,free,activation\n")
    pool = ledger_json(capsys, write(tmp_path, text))["pools"][0]
    assert pool["peak"]["bytes"] == 2200 and pool["peak"]["object"] == "w.grad"
    assert pool["peak"]["live_by_category"] == {"parameter": 1000, "gradient": 1000, "activation": 200}
    rows = {r["row"]: (r["bytes"], r["blocks"], r["max_bytes"]) for r in pool["ledger"]}
    assert rows == {"parameter": (1000, 1, 1000), "gradient": (1000, 1, 1000), "activation": (200, 1, 500)}
    assert [r["row"] for r in pool["ledger"]] == ["parameter", "gradient", "activation"]  # the ledger's row order


def test_the_example_file(capsys):
    """examples/events/shared-storage.csv: tied weights in one storage (4 MiB once, not twice), logits.grad listed
    before the free of logits at time 4; the peak is the optimizer step's: 6 + 6 + 6 MiB."""
    data = ledger_json(capsys, EXAMPLE)
    (pool,) = data["pools"]
    assert pool["peak"]["bytes"] == 18 * MiB and pool["peak"]["time"] == 6.0
    assert pool["peak"]["object"] == "mlp.weight.exp_avg"
    assert {r["row"]: r["bytes"] for r in pool["ledger"] if r["bytes"]} == {
        "parameter": 6 * MiB, "gradient": 6 * MiB, "optimizer_state.exp_avg": 6 * MiB}
    assert pool["live"][0] == {"storage": "wte", "objects": ["wte.weight", "lm_head.weight"], "bytes": 4 * MiB,
                               "category": "parameter", "state": None}
    at_4 = [r["bytes"] for r in pool["timeline"] if r["time"] == 4.0]
    assert at_4 == [13 * MiB + 64 * 1024, 10 * MiB + 64 * 1024]  # logits.grad and logits live together first
    code, out, _ = run_cli(capsys, "ledger", EXAMPLE)
    assert code == 0 and "peak 18 MiB at time 6" in out and "storage wte: wte.weight, lm_head.weight" in out


def test_one_schema_the_projects_event_log(tmp_path):
    """The events become an EventLog of the simulator's schema: a life story check_consistency accepts, whose
    timeline (simulator/timeline.py) gives the peak the command reports."""
    u = read_user_events(write(tmp_path, SHARED))
    assert isinstance(u.log, EventLog) and u.log.source == "user-events"
    check_consistency(u.log)
    assert timeline(u.log).peak().bytes == 160 == pool_ledgers(u)[0].peak.bytes
    assert [e.seq for e in u.log.events] == list(range(len(u.log.events)))


def test_json_input_reads_as_the_csv_does(tmp_path, capsys):
    events = [{"time": 0, "object": "a", "bytes": 100, "action": "alloc", "storage": "s"},
              {"time": 1, "object": "b", "bytes": "100", "action": "alloc", "storage": "s"},
              {"time": 2, "object": "c", "bytes": 50, "action": "alloc"},
              {"time": 3, "object": "a", "action": "free"},
              {"time": 4, "object": "d", "bytes": 10, "action": "alloc"},
              {"time": 5, "object": "b", "action": "free", "storage": "s"},
              {"time": 6, "object": "c", "action": "free"},
              {"time": 6, "object": "d", "action": "free"}]
    from_json = ledger_json(capsys, write(tmp_path, json.dumps({"events": events}), "e.json"))
    from_csv = ledger_json(capsys, write(tmp_path, SHARED))
    assert from_json["format"] == "json" and from_json["pools"][0]["peak"]["where"].endswith("e.json events[4]")
    strip = lambda pools: json.loads(json.dumps(pools).replace('"where"', '"_"'))  # noqa: E731
    for a, b in zip(from_json["pools"], from_csv["pools"]):
        assert {k: v for k, v in a.items() if k not in ("peak", "timeline")} == \
            {k: v for k, v in b.items() if k not in ("peak", "timeline")}
        assert [(r["time"], r["bytes"]) for r in a["timeline"]] == [(r["time"], r["bytes"]) for r in b["timeline"]]
        assert strip(a["peak"])["bytes"] == strip(b["peak"])["bytes"]
    listed = ledger_json(capsys, write(tmp_path, json.dumps(events), "list.json"))  # a plain list too
    assert listed["pools"][0]["peak"]["bytes"] == 160


def test_format_told_by_content_without_an_extension(tmp_path, capsys):
    as_json = write(tmp_path, '[{"time": 0, "object": "a", "bytes": 7, "action": "alloc"}]', "events.txt")
    assert ledger_json(capsys, as_json)["format"] == "json"
    as_csv = write(tmp_path, "time,object,bytes,action\n0,a,7,alloc\n", "events")
    assert ledger_json(capsys, as_csv)["format"] == "csv"


def test_units_comments_optimizer_states(tmp_path, capsys):
    text = ("# a comment line\n\ntime,object,bytes,action,category\n# another\n"
            "0,m,1.5KiB,alloc,optimizer_state.exp_avg\n0,v,2 KB,alloc,optimizer_state.exp_avg_sq\n"
            "1,w,4MiB,alloc,parameter\n")
    pool = ledger_json(capsys, write(tmp_path, text))["pools"][0]
    assert pool["peak"]["bytes"] == 1536 + 2000 + 4 * MiB
    assert {r["row"]: r["bytes"] for r in pool["ledger"]} == {
        "parameter": 4 * MiB, "optimizer_state.exp_avg": 1536, "optimizer_state.exp_avg_sq": 2000}
    assert pool["live"][-1]["state"] == "exp_avg"


def test_pools_and_ranks_are_timelines_of_their_own(tmp_path, capsys):
    text = ("time,object,bytes,action,pool,rank\n0,a,100,alloc,device,0\n1,b,30,alloc,host,0\n"
            "2,c,70,alloc,device,1\n3,a,,free,,\n4,d,50,alloc,host,0\n")
    path = write(tmp_path, text)
    data = ledger_json(capsys, path)
    peaks = {(p["rank"], p["pool"]): (p["peak"]["bytes"], p["peak"]["object"]) for p in data["pools"]}
    assert peaks == {(0, "device"): (100, "a"), (0, "host"): (80, "d"), (1, "device"): (70, "c")}
    only = ledger_json(capsys, path, "--pool", "host")["pools"]
    assert [(p["rank"], p["pool"]) for p in only] == [(0, "host")]
    code, out, err = run_cli(capsys, "ledger", path, "--rank", "2")
    assert code == 2 and out == "" and "has no events in --rank 2" in err and err.count("\n") == 1
    code, _, err = run_cli(capsys, "ledger", path, "--plot", tmp_path / "p.png")
    assert code == 2 and "choose it with --rank and --pool" in err and not (tmp_path / "p.png").exists()
    code, _, err = run_cli(capsys, "ledger", path, "--rank", "0", "--pool", "host", "--plot", tmp_path / "p.png")
    assert code == 0 and (tmp_path / "p.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


H = "time,object,bytes,action"
BAD = [  # (file name, content, what the one line says, beyond the file name)
    ("e.csv", "", ["is empty", "time,object,bytes,action"]),
    ("e.csv", f"{H}\n", ["holds no events"]),
    ("e.csv", "time,object,action\n0,a,alloc\n", ["line 1 (the header)", "missing column bytes"]),
    ("e.csv", f"{H},colour\n0,a,1,alloc,red\n", ["unknown column 'colour'", "allowed: time, object, bytes"]),
    ("e.csv", f"{H},bytes\n0,a,1,alloc,1\n", ["'bytes' is given twice"]),
    ("e.csv", f"{H}\n0,a,1,malloc\n", ["line 2, column 'action'", "'malloc'", "alloc, free"]),
    ("e.csv", f"{H}\n0,a,-4,alloc\n", ["line 2, column 'bytes'", "negative"]),
    ("e.csv", f"{H}\n0,a,4.5,alloc\n", ["line 2, column 'bytes'", "not a whole number of bytes"]),
    ("e.csv", f"{H}\n0,a,0.3KiB,alloc\n", ["line 2, column 'bytes'", "not a whole number of bytes"]),
    ("e.csv", f"{H}\n0,a,4 bananas,alloc\n", ["column 'bytes'", "cannot read", "MiB"]),
    ("e.csv", f"{H}\n0,a,nan,alloc\n", ["column 'bytes'", "NaN"]),
    ("e.csv", f"{H}\n0,a,,alloc\n", ["column 'bytes'", "empty on an alloc"]),
    ("e.csv", f"{H}\n0,a,99999999TiB,alloc\n", ["column 'bytes'", "2^63 - 1"]),
    ("e.csv", f"{H}\nnan,a,1,alloc\n", ["line 2, column 'time'", "NaN"]),
    ("e.csv", f"{H}\ninf,a,1,alloc\n", ["column 'time'", "not finite"]),
    ("e.csv", f"{H}\nsoon,a,1,alloc\n", ["column 'time'", "not a number"]),
    ("e.csv", f"{H}\n2,a,1,alloc\n1,b,1,alloc\n", ["line 3, column 'time'", "earlier than 2", "line 2"]),
    ("e.csv", f"{H}\n0,a,1,free\n", ["line 2, column 'object'", "not live (never allocated)"]),
    ("e.csv", f"{H}\n0,a,1,alloc\n1,a,,free\n2,a,,free\n", ["line 4, column 'object'", "freed already at",
                                                         "line 3"]),
    ("e.csv", f"{H}\n0,a,1,alloc\n1,a,1,alloc\n", ["line 3, column 'object'", "allocated again while live"]),
    ("e.csv", f"{H},storage\n0,a,10,alloc,s\n1,b,20,alloc,s\n", ["line 3, column 'bytes'", "storage 's'",
                                                                "10 at", "20 here"]),
    ("e.csv", f"{H},storage,category\n0,a,10,alloc,s,parameter\n1,b,10,alloc,s,\n",
     ["line 3, column 'category'", "parameter", "unknown"]),
    ("e.csv", f"{H}\n0,a,1,alloc\n1,a,2,free\n", ["line 3, column 'bytes'", "its alloc", "gave 1"]),
    ("e.csv", f"{H},category\n0,a,1,alloc,weights\n", ["column 'category'", "'weights'", "optimizer_state"]),
    ("e.csv", f"{H},pool\n0,a,1,alloc,gpu\n", ["column 'pool'", "device, host"]),
    ("e.csv", f"{H},rank\n0,a,1,alloc,-1\n", ["column 'rank'", "integer in [0"]),
    ("e.csv", f"{H},phase\n0,a,1,alloc,train\n", ["column 'phase'", "forward, backward"]),
    ("e.csv", f"{H}\n0,a,1,alloc,extra\n", ["line 2 has 5 cells", "4 columns"]),
    ("e.csv", f"{H}\n0,a\x00,1,alloc\n", ["line 2, column 'object'", "control characters"]),
    ("e.csv", f"{H}\n0,\"a\nb\",1,alloc\n", ["line 3, column 'object'", "control characters"]),
    ("e.csv", f"{H}\n0,{'x' * 1001},1,alloc\n", ["column 'object'", "at most 1000"]),
    ("e.csv", f"{H}\n0,\"a,1,alloc\n", ["line 2", "not readable as CSV", "unexpected end of data"]),
    ("e.csv", f"{H}\n0,\"a\"b,1,alloc\n", ["line 2", "not readable as CSV"]),
    ("e.json", "[{\"time\": 0, \"object\": \"a\", \"bytes\": NaN, \"action\": \"alloc\"}]",
     ["events[0], key 'bytes'", "NaN"]),
    ("e.json", "[{\"time\": Infinity, \"object\": \"a\", \"bytes\": 1, \"action\": \"alloc\"}]",
     ["events[0], key 'time'", "not finite"]),
    ("e.json", "[{\"time\": 0, \"object\": \"a\", \"bytes\": 1.5, \"action\": \"alloc\"}]",
     ["key 'bytes'", "not a whole number"]),
    ("e.json", "[{\"time\": 0, \"object\": \"a\", \"action\": \"alloc\", \"colour\": 1}]",
     ["events[0]", "unknown key 'colour'"]),
    ("e.json", "[{\"time\": 0, \"object\": \"a\"}]", ["events[0]", "missing keys bytes, action"]),
    ("e.json", "[{\"time\": 0, \"object\": true, \"bytes\": 1, \"action\": \"alloc\"}]", ["key 'object'"]),
    ("e.json", "[3]", ["events[0] is 3"]),
    ("e.json", "{\"evts\": []}", ["one key, \"events\""]),
    ("e.json", "[]", ["holds no events"]),
    ("e.json", "[{", ["is not JSON"]),
    ("e.json", "[" * 100000, ["nested too deeply"]),
    ("e.json", "[{\"time\": 0, \"object\": \"a\", \"bytes\": " + "9" * 5000 + ", \"action\": \"alloc\"}]",
     ["digits"]),
]


@pytest.mark.parametrize("name,text,says", BAD, ids=[f"{i}-{says[0][:30]}" for i, (_, _, says) in enumerate(BAD)])
def test_bad_input_exits_2_with_one_line_naming_the_place(tmp_path, capsys, name, text, says):
    path = write(tmp_path, text, name)
    code, out, err = run_cli(capsys, "ledger", path)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("peakledger: error: EVENTS: ")
    assert str(path) in err
    for words in says:
        assert words in err, err


def test_files_over_the_cap_and_not_files(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(user_events, "EVENTS_FILE_LIMIT", 100)
    path = write(tmp_path, H + "\n" + "0,a,1,alloc\n" * 20)
    code, _, err = run_cli(capsys, "ledger", path)
    assert code == 2 and "over the 100 B cap" in err and err.count("\n") == 1
    for bad, says in ((tmp_path, "is a folder"), (tmp_path / "missing.csv", "file not found"),
                      ("/dev/zero", "character device")):
        code, _, err = run_cli(capsys, "ledger", bad)
        assert code == 2 and says in err and err.count("\n") == 1


def test_outputs_checked_before_any_work(tmp_path, capsys):
    path = write(tmp_path, SHARED)
    code, _, err = run_cli(capsys, "ledger", path, "--plot", tmp_path / "nowhere" / "p.png")
    assert code == 2 and "--plot: folder" in err and "does not exist" in err
    code, _, err = run_cli(capsys, "ledger", path, "--export-timeline", path)
    assert code == 2 and "is the input of EVENTS" in err
    code, _, err = run_cli(capsys, "ledger", path, "--plot", tmp_path / "x", "--export-timeline", tmp_path / "x")
    assert code == 2 and "give two different files" in err
    code, _, err = run_cli(capsys, "ledger", path, "--json", "--unit", "MiB")
    assert code == 2 and "--json always gives bytes" in err


def test_export_timeline_csv(tmp_path, capsys):
    text = ("time,object,bytes,action,storage,category\n0,w,100,alloc,s,parameter\n0.5,w_t,100,alloc,s,parameter\n"
            "1,h,40,alloc,,activation\n2,w,,free,,\n2,h,,free,,\n3,w_t,,free,,\n")
    out = tmp_path / "t.csv"
    code, stdout, _ = run_cli(capsys, "ledger", write(tmp_path, text), "--export-timeline", out)
    assert code == 0 and f"written: {out}" in stdout
    lines = out.read_text().splitlines()
    assert lines[0] == ("time,event,where,action,object,storage,category,delta_bytes,live_bytes,parameter_bytes,"
                        "activation_bytes")  # every size column names its unit
    assert [line.split(",", 3)[3] for line in lines[1:]] == [
        "alloc,w,s,parameter,100,100,100,0", "alloc,h,,activation,40,140,100,40",
        "free,h,,activation,-40,100,100,0", "free,w_t,s,parameter,-100,0,0,0"]
    assert [line.split(",")[0] for line in lines[1:]] == ["0", "1", "2", "3"]


def test_reruns_give_the_same_bytes_and_the_plot_is_written(tmp_path, capsys):
    outputs = []
    for i in range(2):
        plot, csv_out = tmp_path / f"p{i}.png", tmp_path / f"t{i}.csv"
        code, text, _ = run_cli(capsys, "ledger", EXAMPLE, "--plot", plot, "--export-timeline", csv_out)
        assert code == 0
        code, as_json, _ = run_cli(capsys, "ledger", EXAMPLE, "--json")
        assert code == 0
        outputs.append((text.replace(str(plot), "P").replace(str(csv_out), "T"), as_json, plot.read_bytes(),
                        csv_out.read_bytes()))
    assert outputs[0] == outputs[1]
    assert outputs[0][2][:8] == b"\x89PNG\r\n\x1a\n" and len(outputs[0][2]) > 1000


def test_help_states_the_order_rule(capsys):
    code, out, _ = run_cli(capsys, "ledger", "--help")
    assert code == 0 and "ORDER: file order" in out and "storage" in out and "4MiB" in out
