"""Checkpoint save and load: the device and host memory a training checkpoint needs, rank by rank.

Modules: state.py (what a checkpoint holds: a rank's training state, tensor by tensor, who writes which tensor,
which steps save, and what a checkpoint makes differ between ranks) and save_load.py (the ops of a save after an
optimizer step and of a load at the start of the run, mode by mode: their device and host blocks and durations).
"""

from __future__ import annotations

from .save_load import STORAGE_BANDWIDTH, load_checkpoint, save_checkpoint
from .state import (
    FULL_MODES,
    StateTensor,
    dcp_writers,
    host_pool,
    rank_signature,
    rank_signatures,
    rank_state,
    saves_after,
    sharded_writers,
    signature_ranks,
    state_dict_items,
    step_pool,
    written_by,
)

__all__ = ["StateTensor", "rank_state", "state_dict_items", "written_by", "sharded_writers", "dcp_writers",
           "saves_after", "rank_signature", "signature_ranks", "rank_signatures", "save_checkpoint", "load_checkpoint",
           "host_pool", "step_pool", "FULL_MODES",
           "STORAGE_BANDWIDTH"]
