#!/usr/bin/python3
"""Trains a small float-feature regressor composed from porter's layer library, with
DeepSpeed's step API, from NumPy batches, and prints the falling loss.

    PYTHONPATH=build/release/python /usr/bin/python3 examples/python/train_mlp.py --steps 200

(after `make build`, plain /usr/bin/python3 finds porter; examples/python/README.md).
"""
import argparse

import numpy as np

import porter

FEATURES = 16
MICRO_BATCH = 32
ACCUMULATION = 2

# Three stages (each a checkpointable unit of the plan), then the loss. Shapes in "batch" are
# per sample: the micro-batch's x is (MICRO_BATCH, FEATURES).
MODEL = {
    "stages": [
        {"type": "sequential", "layers": [{"type": "linear", "in": FEATURES, "out": 64},
                                          {"type": "relu"}]},
        {"type": "residual", "inner": {"type": "sequential", "layers": [
            {"type": "layernorm", "dim": 64}, {"type": "linear", "in": 64, "out": 64},
            {"type": "silu"}, {"type": "linear", "in": 64, "out": 64}]}},
        {"type": "sequential", "layers": [{"type": "rmsnorm", "dim": 64},
                                          {"type": "linear", "in": 64, "out": 1}]},
    ],
    "loss": {"type": "mse"},
    "batch": {"x": {"dtype": "f32", "shape": [FEATURES]}, "y": {"dtype": "f32", "shape": [1]}},
    "input": "x",
    "target": "y",
}

CONFIG = {
    "train_micro_batch_size_per_gpu": MICRO_BATCH,
    "gradient_accumulation_steps": ACCUMULATION,
    "gradient_clipping": 1.0,
    "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.0}},
    "porter": {
        "device": {"type": "cpu", "memory_limit": "16MiB", "threads": 1},
        "checkpointing": {"policy": "full"},
        "train": {"seed": 1},
    },
}


def batch(rng, weights):
    """A micro-batch of a smooth target: y = tanh(x . w)."""
    x = rng.standard_normal((MICRO_BATCH, FEATURES), dtype=np.float32)
    y = np.tanh(x @ weights).astype(np.float32).reshape(MICRO_BATCH, 1)
    return {"x": x, "y": y}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--print-every", type=int, default=20)
    args = parser.parse_args()

    engine = porter.Engine(porter.Config(CONFIG), model=porter.LayerModel(MODEL))
    print("plan:", engine.plan_description())
    rng = np.random.default_rng(0)
    weights = rng.standard_normal(FEATURES).astype(np.float32) / np.sqrt(FEATURES)
    for step in range(args.steps):
        result = None
        for _ in range(ACCUMULATION):
            engine.forward(batch(rng, weights))
            engine.backward()
            result = engine.step()  # None until the accumulation boundary
        if step == 0 or (step + 1) % args.print_every == 0 or step + 1 == args.steps:
            print(f"step {result['step']:4d}  loss {result['loss']:.5f}  "
                  f"grad norm {result['grad_norm']:.4f}")
    report = engine.memory_report()
    print(f"peak {report['peak_bytes']} bytes of {report['capacity_bytes']}; activations "
          f"{report['peak_activation_bytes']} (predicted {report['predicted_activation_bytes']})")


if __name__ == "__main__":
    main()
