"""The op graph's networkx form (simulator/graph_nx.py): its critical path is when the run ends, as SimPy's own clock
says after running the same graph (simulator/simpy_engine.py), and `simulate --export-graph` writes GraphML that
networkx reads back whole."""

from __future__ import annotations

import networkx as nx
import pytest
from test_engine_simpy import CASES

from peakledger import api, build_scenario
from peakledger.cli import main
from peakledger.models.config import TrainingSetup
from peakledger.models.presets import preset
from peakledger.models.training import describe
from peakledger.simulator.graph_nx import critical_path, to_networkx
from peakledger.simulator.simpy_engine import SimpySimulation


@pytest.mark.parametrize("name", list(CASES))
def test_the_critical_path_is_the_length_simpy_runs(name):
    model, setup = CASES[name]
    graph = describe(preset(model), TrainingSetup(**{"micro_batch": 2, "seq_len": 64, **setup}), "H100-80GB")
    sim = SimpySimulation(graph)
    sim.run()
    path = critical_path(graph)
    assert path.seconds == pytest.approx(sim.env.now, rel=1e-12, abs=1e-15)
    ids = [op.id for op in path.ops]
    g = to_networkx(graph)
    assert all(g.has_edge(a, b) for a, b in zip(ids, ids[1:]))  # a chain of the graph's own edges


def test_export_graph_writes_graphml_networkx_reads_back(capsys, tmp_path):
    out = tmp_path / "step.graphml"
    assert main(["simulate", "--preset", "tiny", "--micro-batch", "2", "--seq-len", "16", "--world-size", "2",
                 "--dp-engine", "ddp", "--export-graph", str(out)]) == 0
    text = capsys.readouterr().out
    assert "critical path:" in text and "communication" in text
    back = nx.read_graphml(out)
    graph = api.op_graph(build_scenario({"preset": "tiny"}, {"micro_batch": 2, "seq_len": 16, "world_size": 2,
                                                             "dp_engine": "ddp"}))
    assert back.number_of_nodes() == len(to_networkx(graph)) and \
        back.number_of_edges() == to_networkx(graph).number_of_edges()
    names = {d["name"] for _, d in back.nodes(data=True) if "name" in d}
    assert names == {op.name for op in graph.ops_in_order()}
