# Shared fixtures of the porter Python suite: the module (skipped with the reason when it was
# not built), a tiny GPT config, and NumPy micro-batches for it.
import os
import pathlib

import numpy as np
import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]

try:
    import porter as _porter
    IMPORT_ERROR = None
except ImportError as e:  # the module was not built, or PYTHONPATH misses the build tree
    _porter = None
    IMPORT_ERROR = e

SKIP_REASON = (
    "porter's Python module is not importable ({}): build it with pybind11-dev and python3-dev "
    "installed (make build) and put build/release/python on PYTHONPATH; docs/python.md")


def require_porter():
    """The porter module; the calling test module is skipped, saying why, without it."""
    if IMPORT_ERROR is not None:
        pytest.skip(SKIP_REASON.format(IMPORT_ERROR), allow_module_level=True)
    return _porter


VOCAB = 64
SEQ = 16
MICRO_BATCH = 4


def tiny_gpt(**over):
    """A 2-layer GPT on the simulated cpu device: a few milliseconds a step."""
    cfg = {
        "train_micro_batch_size_per_gpu": MICRO_BATCH,
        "gradient_accumulation_steps": 2,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.0}},
        "porter": {
            "model": {"layers": 2, "hidden": 32, "heads": 2, "seq_len": SEQ, "vocab": VOCAB,
                      "dropout": 0.0},
            "device": {"type": "cpu", "memory_limit": "64MiB", "threads": 1},
            "checkpointing": {"policy": "full"},
            "train": {"seed": 7},
        },
    }
    for k, v in over.items():
        cfg[k] = v
    return cfg


def token_batch(step, micro_batch, batch=MICRO_BATCH, seq=SEQ):
    """A learnable micro-batch: each row counts up from a random start, targets are the next
    token, so the loss falls within a few steps."""
    rng = np.random.default_rng(1000 * step + micro_batch)
    start = rng.integers(0, VOCAB, size=(batch, 1))
    tokens = ((start + np.arange(seq)) % VOCAB).astype(np.int32)
    targets = ((tokens + 1) % VOCAB).astype(np.int32)
    return {"tokens": tokens, "targets": targets}


def step_batches(step, micro_batches=2):
    return [token_batch(step, m) for m in range(micro_batches)]


@pytest.fixture
def repo():
    return REPO


@pytest.fixture
def porter_cli():
    """The porter binary of the same build, when CTest gives it."""
    path = os.environ.get("PORTER_CLI")
    if not path or not os.path.exists(path):
        pytest.skip("PORTER_CLI is not set (CTest sets it to the build's porter)")
    return path
