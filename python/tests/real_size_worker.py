# One rank of test_real_size.py's worlds, started by `porter launch`: the built-in GPT at a
# real size (hidden 768, seq 256: every matmul above the kernel table's measured thresholds),
# ZeRO-2 over 2 ranks, accumulation 2, dropout, clipping and full checkpoints offloaded to
# pinned host memory, trained 2 steps either with train_step or with the step API
# (forward / backward / step), then saved whole to <out>.
import sys

import numpy as np

import porter

out, mode = sys.argv[1], sys.argv[2]
MICRO_BATCH, SEQ, VOCAB, ACCUMULATION = 2, 256, 256, 2
config = porter.Config({
    "train_micro_batch_size_per_gpu": MICRO_BATCH,
    "gradient_accumulation_steps": ACCUMULATION,
    "train_batch_size": MICRO_BATCH * ACCUMULATION * 2,
    "gradient_clipping": 1.0,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}},
    "zero_optimization": {"stage": 2, "reduce_bucket_size": 2000000, "overlap_comm": True},
    "activation_checkpointing": {"cpu_checkpointing": True},
    "porter": {
        "model": {"layers": 2, "hidden": 768, "heads": 12, "seq_len": SEQ, "vocab": VOCAB,
                  "dropout": 0.1},
        "device": {"type": "cpu", "threads": 1},
        "checkpointing": {"policy": "full"},
        "comm": {"timeout_s": 120},
        "train": {"seed": 42},
    },
})
d = porter.init_distributed(config)
engine = porter.Engine(config, distributed=d)


def micro_batch(step, m):
    """Global micro-batch 2 * rank + m of `step`: a pure function of its place."""
    rng = np.random.default_rng(1000 * step + 2 * d.rank + m)
    tokens = rng.integers(0, VOCAB, size=(MICRO_BATCH, SEQ + 1), dtype=np.int32)
    return {"tokens": np.ascontiguousarray(tokens[:, :-1]),
            "targets": np.ascontiguousarray(tokens[:, 1:])}


for step in range(2):
    batches = [micro_batch(step, m) for m in range(ACCUMULATION)]
    if mode == "train_step":
        engine.train_step(batches)
        continue
    for mb in batches:
        engine.forward(mb)
        engine.backward()
        result = engine.step()
    assert result is not None
engine.save(out)
