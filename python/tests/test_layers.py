# A model from the layer library (porter.LayerModel) trained with DeepSpeed's step API from
# NumPy batches of named float tensors; the example script.
import math
import pathlib
import re
import subprocess
import sys

import numpy as np
import pytest

from conftest import require_porter

porter = require_porter()

FEATURES = 16
MICRO_BATCH = 8

SPEC = {
    "stages": [
        {"type": "sequential", "layers": [{"type": "linear", "in": FEATURES, "out": 32},
                                          {"type": "relu"}]},
        {"type": "sequential", "layers": [{"type": "layernorm", "dim": 32},
                                          {"type": "linear", "in": 32, "out": 1}]},
    ],
    "loss": {"type": "mse"},
    "batch": {"x": {"dtype": "f32", "shape": [FEATURES]}, "y": {"dtype": "f32", "shape": [1]}},
    "input": "x",
    "target": "y",
}


def config(**porter_over):
    c = {
        "train_micro_batch_size_per_gpu": MICRO_BATCH,
        "gradient_accumulation_steps": 2,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.0}},
        "porter": {"device": {"type": "cpu", "memory_limit": "8MiB", "threads": 1},
                   "checkpointing": {"policy": "full"}, "train": {"seed": 3}},
    }
    c["porter"].update(porter_over)
    return porter.Config(c)


def batch(step, m):
    rng = np.random.default_rng(10 * step + m)
    x = rng.standard_normal((MICRO_BATCH, FEATURES), dtype=np.float32)
    y = np.tanh(x[:, :1] - x[:, 1:2]).astype(np.float32)
    return {"x": x, "y": y}


def test_step_api_is_train_step_bit_for_bit():
    cfg = config()
    a = porter.Engine(cfg, model=porter.LayerModel(SPEC))
    b = porter.Engine(cfg, model=SPEC)  # the spec as a dict is a model too
    for step in range(3):
        ra = a.train_step([batch(step, 0), batch(step, 1)])
        losses = []
        for m in range(2):
            losses.append(b.forward(batch(step, m)))
            b.backward()
            r = b.step()
            if m == 0:
                assert r is None and not b.is_gradient_accumulation_boundary()
        assert r is not None and r["step"] == step + 1
        assert r["loss"].hex() == ra["loss"].hex()
        assert (losses[0] + losses[1]) / 2 == pytest.approx(r["loss"], rel=1e-6)
    assert a.global_steps == b.global_steps == 3
    assert np.array_equal(a.params(), b.params())


def test_loss_falls_and_output():
    engine = porter.Engine(config(), model=porter.LayerModel(SPEC))
    losses = [engine.train_step([batch(s, 0), batch(s, 1)])["loss"] for s in range(30)]
    assert all(math.isfinite(x) for x in losses)
    assert losses[-1] < 0.5 * losses[0], losses
    b = batch(99, 0)
    engine.forward(b, keep_output=True)
    out = engine.output()
    assert out.shape == (MICRO_BATCH, 1) and out.dtype == np.float32
    assert np.isfinite(out).all()
    engine.backward()


def test_batches_are_viewed_not_copied():
    engine = porter.Engine(config(), model=porter.LayerModel(SPEC))
    b = batch(0, 0)
    x = b["x"]
    before = sys.getrefcount(x)
    engine.forward(b)
    # The engine's micro-batch holds the array itself (Note [NumPy batches]). (Counted outside
    # the assert: pytest's rewritten asserts hold references of their own.)
    after = sys.getrefcount(x)
    assert after == before + 1
    engine.backward()
    # A Fortran-order array is copied: the same values give the same loss.
    f = {"x": np.asfortranarray(batch(0, 1)["x"]), "y": batch(0, 1)["y"]}
    before = sys.getrefcount(f["x"])
    engine.forward(f)
    after = sys.getrefcount(f["x"])
    assert after == before
    engine.backward()
    r = engine.step()
    ref = porter.Engine(config(), model=porter.LayerModel(SPEC))
    assert ref.train_step([batch(0, 0), batch(0, 1)])["loss"].hex() == r["loss"].hex()


def test_classifier_with_int64_labels():
    # Sequences of features, attention, and int64 labels as a data pipeline writes them.
    spec = {
        "stages": [
            {"type": "sequential", "layers": [{"type": "linear", "in": FEATURES, "out": 32},
                                              {"type": "gelu"}]},
            {"type": "attention", "dim": 32, "heads": 4},
            {"type": "sequential", "layers": [{"type": "layernorm", "dim": 32},
                                              {"type": "linear", "in": 32, "out": 4}]},
        ],
        "loss": {"type": "cross_entropy"},
        "batch": {"x": {"dtype": "f32", "shape": [8, FEATURES]},
                  "label": {"dtype": "i32", "shape": [8]}},
        "input": "x",
        "target": "label",
    }
    engine = porter.Engine(config(), model=porter.LayerModel(spec))
    rng = np.random.default_rng(0)
    losses = []
    for _ in range(30):
        micro = []
        for _ in range(2):
            x = rng.standard_normal((MICRO_BATCH, 8, FEATURES), dtype=np.float32)
            label = (x[..., 0] > 0).astype(np.int64) + 2 * (x[..., 1] > 0).astype(np.int64)
            micro.append({"x": x, "label": label})
        losses.append(engine.train_step(micro)["loss"])
    assert losses[0] == pytest.approx(math.log(4), rel=0.2)
    assert np.mean(losses[-5:]) < 0.8 * losses[0], losses


def test_batch_errors():
    engine = porter.Engine(config(), model=porter.LayerModel(SPEC))
    b = batch(0, 0)
    with pytest.raises(porter.InvalidArgument, match="float64"):
        engine.forward({"x": b["x"].astype(np.float64), "y": b["y"]})
    with pytest.raises(porter.InvalidArgument) as e:
        engine.forward({"x": b["x"][:, :FEATURES - 1], "y": b["y"]})
    assert str(FEATURES - 1) in str(e.value)
    with pytest.raises(porter.UsageError):
        engine.backward()  # no forward ran
    # Nothing changed: the step runs.
    engine.forward(b)
    engine.backward()
    engine.forward(batch(0, 1))
    engine.backward()
    assert engine.step()["step"] == 1


def test_bad_spec_is_invalid_argument():
    bad = dict(SPEC)
    bad["loss"] = {"type": "hinge"}
    with pytest.raises(porter.InvalidArgument, match="hinge"):
        porter.LayerModel(bad)
    with pytest.raises(porter.InvalidArgument, match="model"):
        porter.Engine(config(), model=42)


def test_save_hf_needs_a_built_in_model(tmp_path):
    engine = porter.Engine(config(), model=SPEC)
    with pytest.raises(porter.UsageError, match="save"):
        engine.save_hf(tmp_path / "hf")


def test_save_and_resume_bit_for_bit(tmp_path):
    a = porter.Engine(config(), model=SPEC)
    a.train_step([batch(0, 0), batch(0, 1)])
    a.save(tmp_path / "ckpt")
    want = a.train_step([batch(1, 0), batch(1, 1)])["loss"]
    b = porter.Engine(config(), model=SPEC)
    b.load(tmp_path / "ckpt")
    assert b.train_step([batch(1, 0), batch(1, 1)])["loss"].hex() == want.hex()


def test_init_distributed_without_a_launcher():
    d = porter.init_distributed(config())
    assert (d.rank, d.world_size, d.distributed) == (0, 1, False)
    engine = porter.Engine(config(), model=SPEC, distributed=d)
    assert engine.rank == 0
    assert math.isfinite(engine.train_step([batch(0, 0), batch(0, 1)])["loss"])


def distributed_config(micro_batches, world_size):
    """ZeRO stage 2 over `world_size` data-parallel ranks of `micro_batches` each."""
    return {
        "train_micro_batch_size_per_gpu": MICRO_BATCH,
        "gradient_accumulation_steps": micro_batches,
        "train_batch_size": MICRO_BATCH * micro_batches * world_size,
        "zero_optimization": {"stage": 2},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.0}},
        "porter": {"device": {"type": "cpu", "memory_limit": "8MiB", "threads": 1},
                   "checkpointing": {"policy": "full"}, "train": {"seed": 3},
                   "comm": {"timeout_s": 60}},
    }


def test_two_ranks_under_porter_launch(tmp_path, porter_cli):
    worker = pathlib.Path(__file__).parent / "dist_worker.py"
    subprocess.run([porter_cli, "launch", "-n", "2", "--", sys.executable, str(worker),
                    str(tmp_path)], check=True, capture_output=True, timeout=120)
    r0, r1 = np.load(tmp_path / "rank0.npz"), np.load(tmp_path / "rank1.npz")
    assert list(r0["world"]) == [2, 2, 0] and list(r1["world"]) == [2, 2, 1]
    # The all-gathered parameters are the same bits on both ranks.
    assert np.array_equal(r0["params"], r1["params"])
    # One rank of 4 micro-batches sees what the two ranks of 2 see (Note [Token sampling]'s
    # rule for every data type): the same training, within the reduction's rounding.
    one = porter.Engine(porter.Config(distributed_config(micro_batches=4, world_size=1)), SPEC)
    losses = [one.train_step([batch(s, m) for m in range(4)])["loss"] for s in range(3)]
    assert np.allclose((r0["losses"] + r1["losses"]) / 2, losses, rtol=1e-5)
    assert np.allclose(one.params(), r0["params"], rtol=1e-4, atol=1e-6)


def test_example_trains(repo):
    script = pathlib.Path(repo) / "examples" / "python" / "train_mlp.py"
    r = subprocess.run([sys.executable, str(script), "--steps", "40", "--print-every", "10"],
                       capture_output=True, text=True, check=True)
    losses = [float(x) for x in re.findall(r"loss ([0-9.]+)", r.stdout)]
    assert len(losses) == 5, r.stdout
    assert losses[-1] < 0.2 * losses[0], r.stdout
