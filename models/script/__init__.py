"""The user's own training script as the describer: run as it is on fake tensors (record.py), its step structure
discovered from what it calls (phases.py), its reads answered (values.py), and the recording turned into the op
graph the simulator runs (graph.py). run.py is the world the script runs in, for the prediction and for the
measurement (traces/script_run.py) alike."""

from .graph import script_graph
from .phases import Calls, Position, ScriptPhases, StopScript
from .record import ScriptRecording
from .run import check_script, record_script, script_context

__all__ = ["Calls", "Position", "ScriptPhases", "ScriptRecording", "StopScript", "check_script", "record_script",
           "script_context", "script_graph"]
