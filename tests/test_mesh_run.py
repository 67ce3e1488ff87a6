"""Real multi-dimensional runs (traces/mesh_run.py: gloo over 127.0.0.1, one process per global rank of a
(pp, dp, tp) device mesh, each measured with the tracker): FSDP2 x TP (2D, torchtitan's order), TP x PP, and
FSDP2 x PP and FSDP2 x TP x PP (torchtitan's per-stage FSDP2).

Without a simulator to compare against yet, the real runs check what the layout alone decides: one log per
global rank, every Block carrying that rank, the mesh coordinates in the metadata, each rank's parameter,
gradient and optimizer-state bytes against the local shards worked out here by hand from the config, and
the same event sequence on ranks that must allocate alike (and, for one case, across two runs). The real
4-process runs take 15-25 s each on two cores, the 8-process 3D one about 45 s: they run with PEAKLEDGER_SLOW=1."""

from __future__ import annotations

import math
import os

import pytest

from peakledger.models.config import TrainingSetup
from peakledger.models.presets import preset

slow = pytest.mark.skipif(os.environ.get("PEAKLEDGER_SLOW") != "1",
                          reason="real 4-process mesh runs (15-25 s each on 2 cores): PEAKLEDGER_SLOW=1 runs them")

BASE = dict(micro_batch=2, seq_len=32, steps=2, precision="fp32", optimizer="adamw")
FP32 = 4


# -- the expected local shards, by hand ------------------------------------------------------------------------

def _block_shapes(cfg, tp: int) -> list[tuple[tuple[int, ...], int]]:
    """(tensor-parallel-local shape, rows of dim 0 that FSDP2 shards) of one transformer block's parameters:
    column-parallel weights / biases split their output rows, row-parallel weights their input columns, norms
    and row-parallel biases whole (tensor_run's plan)."""
    d, hd = cfg.d_model, cfg.d_model // cfg.n_head
    if cfg.architecture == "gpt2":
        ffn = cfg.d_ff or 4 * d
        return [((d,), d), ((d,), d),  # ln_1
                ((3 * d // tp, d), 3 * d // tp), ((3 * d // tp,), 3 * d // tp),  # c_attn (q, k, v: n_kv = n_head)
                ((d, d // tp), d), ((d,), d),  # attn.c_proj
                ((d,), d), ((d,), d),  # ln_2
                ((ffn // tp, d), ffn // tp), ((ffn // tp,), ffn // tp),  # c_fc
                ((d, ffn // tp), d), ((d,), d)]  # mlp.c_proj
    kv = cfg.kv_heads * hd
    return [((d // tp, d), d // tp), ((kv // tp, d), kv // tp), ((kv // tp, d), kv // tp),  # q, k, v
            ((d, d // tp), d),  # o_proj
            ((cfg.d_ff // tp, d), cfg.d_ff // tp), ((cfg.d_ff // tp, d), cfg.d_ff // tp),  # gate, up
            ((d, cfg.d_ff // tp), d),  # down
            ((d,), d), ((d,), d)]  # the two norms


def _outer_shapes(cfg, tp: int, first: bool, last: bool, tied_kept: bool):
    """The parameters outside the blocks: the vocabulary-parallel embedding (first), GPT-2's positions (first,
    replicated), the final norm and the head (last); a tied embedding / head is one parameter only when both
    sit on the rank (`tied_kept`)."""
    d, v = cfg.d_model, cfg.vocab_size
    out = []
    if first:
        out.append(((v // tp, d), v // tp))
        if cfg.architecture == "gpt2":
            out.append(((cfg.max_seq_len, d), cfg.max_seq_len))
    if last:
        out += [((d,), d), ((d,), d)] if cfg.architecture == "gpt2" else [((d,), d)]
        if not (cfg.tied and tied_kept):
            out.append(((v // tp, d), v // tp))
    return out


def _bytes(shapes, dp: int) -> int:
    """Bytes of FSDP2's padded shards: ceil(rows / dp) rows of each tensor-parallel-local tensor (dp = 1: whole)."""
    return sum(math.ceil(rows / dp) * math.prod(shape[1:]) * FP32 for shape, rows in shapes)


def _expected_static(cfg, setup: TrainingSetup, n_blocks: int, first: bool, last: bool) -> dict[str, int]:
    """Parameter, gradient and AdamW-state bytes of one rank. Every gradient is its parameter's local shard,
    except a plain-TP embedding that is not tied to the head on the rank: its gradient is a Replicate (V, D)
    DTensor (the vocabulary-parallel lookup's backward is an embedding_dense_backward over the whole table,
    redistributed only when FSDP2 reduce-scatters it: with dp > 1 the stored gradient is the shard again)."""
    dp, tp = setup.mesh.dp, setup.mesh.tp
    shapes = _block_shapes(cfg, tp) * n_blocks + _outer_shapes(cfg, tp, first, last, tied_kept=first and last)
    params = _bytes(shapes, dp)
    grads = params
    if dp == 1 and first and not (cfg.tied and last):
        grads += (cfg.vocab_size - cfg.vocab_size // tp) * cfg.d_model * FP32
    states = 2 * params + FP32 * len(shapes)  # exp_avg, exp_avg_sq, and a 0-d fp32 step per parameter
    return {"parameter": params, "gradient": grads, "optimizer_state": states}


def _event_sequence(log):
    return [(e.action, e.block.name, e.block.nbytes, e.block.category, e.phase, e.step, e.micro_batch_index)
            for e in log.events]


def _check_logs(cfg, setup: TrainingSetup, logs) -> None:
    from peakledger.analysis.validate import static_rows
    from peakledger.models.parallel.stages import rank_stages
    from peakledger.traces.distributed import without_backend_copies
    from peakledger.traces.mesh_run import mesh_coords

    assert len(logs) == setup.mesh.world_size
    for rank, log in enumerate(logs):
        coords = mesh_coords(setup, rank)
        assert log.metadata.rank == rank and log.metadata.mesh == coords
        assert log.metadata.mesh_shape == {"pp": setup.mesh.pp, "dp": setup.mesh.dp, "tp": setup.mesh.tp}
        assert {e.block.rank for e in log.events} == {rank}
        assert any(e.phase.value == "optimizer" for e in log.events)
        if setup.mesh.pp > 1:
            specs = rank_stages(setup, cfg.n_layer, coords["pp"])
            assert [s["index"] for s in log.metadata.stages] == [s.index for s in specs]
            n_blocks = sum(len(s.layers) for s in specs)
            first, last = any(s.first for s in specs), any(s.last for s in specs)
        else:
            n_blocks, first, last = cfg.n_layer, True, True
        assert static_rows(log, rank) == _expected_static(cfg, setup, n_blocks, first, last), (rank, coords)
    # ranks that hold the same shapes on the same stage allocate alike, event for event (gloo's own
    # reduce-scatter copies aside: traces/distributed.py without_backend_copies)
    by_place: dict = {}
    for rank, log in enumerate(logs):
        by_place.setdefault(mesh_coords(setup, rank)["pp"], []).append(_event_sequence(without_backend_copies(log)))
    for sequences in by_place.values():
        assert all(s == sequences[0] for s in sequences[1:])


# -- without processes -----------------------------------------------------------------------------------------

def test_mesh_coordinates_put_tp_innermost():
    from peakledger.traces.mesh_run import mesh_coords, mesh_rank

    setup = TrainingSetup(world_size=8, tp=2, pp=2, grad_accum=2)  # dp = 2
    coords = [mesh_coords(setup, r) for r in range(8)]
    assert coords[:4] == [{"pp": 0, "dp": 0, "tp": 0}, {"pp": 0, "dp": 0, "tp": 1},
                          {"pp": 0, "dp": 1, "tp": 0}, {"pp": 0, "dp": 1, "tp": 1}]
    assert coords[5] == {"pp": 1, "dp": 0, "tp": 1}
    assert [mesh_rank(setup, **c) for c in coords] == list(range(8))


def test_unsupported_layouts_are_refused_before_any_process():
    from peakledger.traces.mesh_run import check_mesh

    gpt, llama = preset("tiny"), preset("tiny-llama")
    with pytest.raises(ValueError, match="measure_tensor_parallel"):
        check_mesh(gpt, TrainingSetup(**BASE, world_size=2, tp=2))
    with pytest.raises(NotImplementedError, match="tp >= 2"):
        check_mesh(gpt, TrainingSetup(**BASE, world_size=2, pp=2, grad_accum=2))
    with pytest.raises(NotImplementedError, match="dp_engine fsdp2"):
        check_mesh(gpt, TrainingSetup(**BASE, world_size=8, tp=2, pp=2, grad_accum=2, dp_engine="ddp"))
    with pytest.raises(NotImplementedError, match="dp_engine fsdp2"):
        check_mesh(gpt, TrainingSetup(**BASE, world_size=4, tp=2, dp_engine="ddp"))
    with pytest.raises(NotImplementedError, match="bf16-mixed"):
        check_mesh(gpt, TrainingSetup(**{**BASE, "precision": "bf16-mixed"}, world_size=4, tp=2, dp_engine="fsdp2"))
    with pytest.raises(NotImplementedError, match="zbv"):
        check_mesh(llama, TrainingSetup(**BASE, world_size=4, tp=2, pp=2, grad_accum=2, pp_schedule="zbv",
                                        virtual_stages=2))
    with pytest.raises(ValueError, match="n_kv_head"):
        check_mesh(llama, TrainingSetup(**BASE, world_size=8, tp=4, dp_engine="fsdp2"))
    with pytest.raises(NotImplementedError, match="checkpointing"):
        check_mesh(gpt, TrainingSetup(**BASE, world_size=4, tp=2, dp_engine="fsdp2", checkpointing="full"))
    with pytest.raises(NotImplementedError, match="nanogpt"):
        check_mesh(preset("tiny-mlp"), TrainingSetup(**BASE, world_size=4, tp=2, dp_engine="fsdp2"))


@pytest.mark.parametrize("name", ["tiny", "tiny-llama"])
@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_stage_plan_is_the_whole_models_plan_on_its_modules(name, sequence_parallel):
    """A pipeline stage is tensor-parallelized with tensor_run's own plan of the stage (its blocks keyed by their
    index in the whole model): the entries naming one of its modules are those of the whole model's plan, same
    styles, same order; its blocks are those the FSDP2 units are made of."""
    from peakledger.models.parallel.stages import rank_stages
    from peakledger.traces.distributed import fsdp_units
    from peakledger.traces.pipeline_run import StageModule
    from peakledger.traces.reference import build_model
    from peakledger.traces.tensor_run import tp_plan

    cfg = preset(name)
    setup = TrainingSetup(**{**BASE, "grad_accum": 4}, world_size=2, pp=2, pp_schedule="1f1b")
    full = build_model(cfg, setup, seed=0)
    whole = tp_plan(full, sequence_parallel)
    for pp_rank in range(setup.mesh.pp):
        for spec in rank_stages(setup, cfg.n_layer, pp_rank):
            stage = StageModule(full, cfg, spec, setup.batch.seq_len)
            names = {n for n, _ in stage.named_modules()}
            own = [(k, repr(v)) for k, v in tp_plan(stage, sequence_parallel).items() if k in names]
            assert own == [(k, repr(v)) for k, v in whole.items() if k in names]
            blocks = cfg.blocks
            assert fsdp_units(stage) == [stage.get_submodule(f"{blocks}.{i}") for i in spec.layers]


def test_expected_shards_by_hand():
    """The hand-written expectations themselves, on the tiny GPT (d 64, ffn 256, V 256, 64 positions, tied)."""
    setup = TrainingSetup(**BASE, world_size=4, tp=2, dp_engine="fsdp2")
    block = 2 * 32 + 48 * 64 + 48 + 32 * 32 + 32 + 2 * 32 + 64 * 64 + 64 + 32 * 128 + 32  # elements, dp 2 x tp 2
    outer = 64 * 64 + 32 * 64 + 2 * 32  # wte rows 256 / 2 / 2 (tied head), wpe 64 / 2 rows, ln_f
    assert _expected_static(preset("tiny"), setup, 2, True, True)["parameter"] == 4 * (2 * block + outer)


# -- real runs -------------------------------------------------------------------------------------------------

@slow
def test_tiny_gpt_fsdp2_x_tp_2x2():
    from peakledger.traces.distributed import without_backend_copies
    from peakledger.traces.mesh_run import measure_mesh

    cfg, setup = preset("tiny"), TrainingSetup(**BASE, world_size=4, tp=2, dp_engine="fsdp2")
    logs = measure_mesh(cfg, setup)
    _check_logs(cfg, setup, logs)
    meta = logs[0].metadata
    assert meta.engines == ["dtensor-tp", "fsdp2"] and meta.backend_release["timeouts"] == 0
    assert set(meta.fsdp_units) == {"model", "transformer.h.0", "transformer.h.1"}
    # FSDP2 shards the tensor-parallel-local rows again (a _StridedShard over dp, Shard over tp)
    assert "_StridedShard(dim=0, sf=2), Shard(dim=0)" in meta.placements["transformer.h.0.mlp.c_fc.weight"]
    assert "(Shard(dim=0), Shard(dim=1))" in meta.placements["transformer.h.0.mlp.c_proj.weight"]
    # the same event sequence run after run
    again = measure_mesh(cfg, setup)
    for a, b in zip(logs, again):
        assert _event_sequence(without_backend_copies(a)) == _event_sequence(without_backend_copies(b))


@slow
def test_tiny_llama_fsdp2_x_tp_sequence_parallel():
    from peakledger.traces.mesh_run import measure_mesh

    cfg = preset("tiny-llama")
    setup = TrainingSetup(**BASE, world_size=4, tp=2, dp_engine="fsdp2", sequence_parallel=True)
    logs = measure_mesh(cfg, setup)
    _check_logs(cfg, setup, logs)
    # the untied embedding's gradient comes out of backward whole (V, D), as under plain TP, before FSDP2
    # reduce-scatters it to its (V / tp / dp, D) shard
    grads = {e.block.name: e.block.shape for e in logs[0].events if e.block.category.value == "gradient"}
    assert grads["model.embed_tokens.weight.unsharded.grad"] == (cfg.vocab_size, cfg.d_model)
    assert grads["lm_head.weight.unsharded.grad"] == (cfg.vocab_size // 2, cfg.d_model)


@slow
def test_tiny_gpt_tp2_x_pp2_1f1b():
    from peakledger.traces.mesh_run import measure_mesh

    cfg = preset("tiny")
    setup = TrainingSetup(**BASE, world_size=4, tp=2, pp=2, grad_accum=4, pp_schedule="1f1b")
    logs = measure_mesh(cfg, setup)
    _check_logs(cfg, setup, logs)
    assert [log.metadata.stages[0]["last"] for log in logs] == [False, False, True, True]
    assert logs[-1].metadata.loss_parallel
    # each of the 4 micro-batches is forwarded and backwarded on every rank, labelled with its index
    for log in logs:
        assert {e.micro_batch_index for e in log.events if e.phase.value == "backward"} == {0, 1, 2, 3}


@slow
def test_tiny_llama_tp2_x_pp2_gpipe():
    from peakledger.traces.mesh_run import measure_mesh

    cfg = preset("tiny-llama")
    setup = TrainingSetup(**BASE, world_size=4, tp=2, pp=2, grad_accum=4, pp_schedule="gpipe")
    logs = measure_mesh(cfg, setup)
    _check_logs(cfg, setup, logs)
    # the last stage computes the loss on vocabulary-sharded logits (loss_parallel): the head's local output
    # (B x T, V / tp) is what the stage keeps, and no tensor of the whole vocabulary's width is allocated
    blocks = {(e.block.name, e.block.shape, e.block.category.value) for e in logs[-1].events}
    assert ("lm_head.mm", (2 * 32, cfg.vocab_size // 2), "activation") in blocks
    assert not any(shape and shape[-1] == cfg.vocab_size for _, shape, _ in blocks)


@slow
def test_tiny_gpt_fsdp2_x_pp2():
    """torchtitan's FSDP2 on each stage (blocks, then the stage module as the root); the stages' embedding and
    head are separate parameters, each sharded over dp."""
    from peakledger.traces.mesh_run import measure_mesh

    cfg = preset("tiny")
    setup = TrainingSetup(**BASE, world_size=4, pp=2, grad_accum=4, pp_schedule="1f1b", dp_engine="fsdp2")
    logs = measure_mesh(cfg, setup)
    _check_logs(cfg, setup, logs)
    assert logs[0].metadata.engines == ["pipeline", "fsdp2"]
    assert set(logs[0].metadata.fsdp_units) == {"model", "transformer.h.0"}


@slow
def test_tiny_llama_fsdp2_x_tp2_x_pp2_sequence_parallel():
    """8 processes: (pp 2, dp 2, tp 2)."""
    from peakledger.traces.mesh_run import measure_mesh

    cfg = preset("tiny-llama")
    setup = TrainingSetup(**BASE, world_size=8, tp=2, pp=2, grad_accum=4, pp_schedule="1f1b", dp_engine="fsdp2",
                          sequence_parallel=True)
    logs = measure_mesh(cfg, setup, timeout_s=240)
    _check_logs(cfg, setup, logs)
    assert logs[5].metadata.mesh == {"pp": 1, "dp": 0, "tp": 1}
    assert logs[0].metadata.engines == ["pipeline", "dtensor-tp", "fsdp2"]
