"""torch's MemTracker on a HF Llama config under FakeTensorMode: bf16 weights (as HF loads them with
dtype=torch.bfloat16, `no_init_weights`), one forward + backward + AdamW step, its peak and the time of each stage.
The one MemTracker program the speed benchmarks compare peakledger with: bench/traced_speed.py calls
`memtracker_step` in its own process (timed by stage); bench/warm_cache_speed.py runs this file as a whole process
(timed from start to exit, its imports included), so it imports nothing but torch and transformers:

    python bench/memtracker_step.py CONFIG.json MICRO_BATCH SEQ_LEN    # prints the result as JSON; exit 1 on failure
"""

from __future__ import annotations

import json
import sys
import time


def memtracker_step(config: dict, micro_batch: int, seq_len: int) -> dict:
    """{"build", "step", "total" (seconds), "peak" (bytes), "device"}, or with "failed" (the stage and the error)."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.mem_tracker import MemTracker
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.initialization import no_init_weights

    out = {}
    t0 = time.perf_counter()
    stage = "build"
    try:
        with FakeTensorMode():
            cfg = LlamaConfig(**{k: v for k, v in config.items() if k not in ("model_type", "architectures")})
            with no_init_weights():
                model = LlamaForCausalLM._from_config(cfg, dtype=torch.bfloat16)
            model.train()
            out["build"] = time.perf_counter() - t0
            optim = torch.optim.AdamW(model.parameters(), lr=1e-4)
            ids = torch.randint(0, cfg.vocab_size, (micro_batch, seq_len))
            stage = "step"
            t1 = time.perf_counter()
            mt = MemTracker()
            mt.track_external(model, optim)
            with mt:
                loss = model(input_ids=ids, labels=ids).loss
                loss.backward()
                optim.step()
                optim.zero_grad()
            out["step"] = time.perf_counter() - t1
            snap = mt.get_tracker_snapshot("peak")
            dev = next(iter(snap))
            out["peak"] = snap[dev]["Total"]
            out["device"] = str(dev)
    except Exception as e:
        out["failed"] = f"{stage}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    out["total"] = time.perf_counter() - t0
    return out


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        result = memtracker_step(json.load(f), int(sys.argv[2]), int(sys.argv[3]))
    print(json.dumps(result))
    sys.exit(1 if "failed" in result else 0)
