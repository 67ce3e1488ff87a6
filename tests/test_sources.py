"""torch.profiler's memory timeline as a second EventLog agrees with the dispatch tracker on bytes."""

from peakledger.analysis.sources import agreement
from peakledger.models.config import TrainingSetup
from peakledger.models.presets import preset
from peakledger.simulator.events import Category
from peakledger.traces.profiler import profile_training_steps
from peakledger.traces.reference import build_model, make_batch, make_optimizer
from peakledger.traces.tracker import run_training_steps

SCALARS = 16  # 4-byte scalars the arg parser wraps outside dispatch (shared notes)


def test_profiler_and_tracker_agree_on_the_mlp():
    cfg, setup = preset("tiny-mlp"), TrainingSetup(micro_batch=64, seq_len=1)
    logs = []
    for measure in (profile_training_steps, run_training_steps):
        model = build_model(cfg, setup)
        logs.append(measure(model, make_optimizer(model, setup), make_batch(cfg, setup)))
    r = agreement(*logs)
    profiler, tracker = r["peak"]
    assert 0 <= profiler - tracker <= SCALARS
    for c in (Category.PARAMETER, Category.GRADIENT, Category.OPTIMIZER_STATE):
        assert r["by_category"][c.value][0] == r["by_category"][c.value][1]
