# porter.Engine on the built-in GPT: training from NumPy batches, evaluation, the memory
# report, checkpoints that resume bit for bit, Hugging Face export and import, batch errors.
import math

import numpy as np
import pytest

from conftest import (MICRO_BATCH, SEQ, VOCAB, require_porter, step_batches, tiny_gpt,
                      token_batch)

porter = require_porter()


def train(engine, steps, first=0):
    return [engine.train_step(step_batches(first + s))["loss"] for s in range(steps)]


def test_loss_falls():
    engine = porter.Engine(porter.Config(tiny_gpt()))
    losses = train(engine, 6)
    assert all(math.isfinite(x) for x in losses), losses
    assert losses[0] == pytest.approx(math.log(VOCAB), rel=0.1)  # a random init's loss
    assert losses[-1] < 0.9 * losses[0], losses
    assert engine.global_steps == 6
    ev = engine.evaluate(step_batches(100))
    assert math.isfinite(ev) and ev < losses[0]


def test_step_result_and_memory_report():
    engine = porter.Engine(tiny_gpt())  # a dict is a config too
    r = engine.train_step(step_batches(0))
    assert r["step"] == 1
    assert r["tokens"] == 2 * MICRO_BATCH * SEQ
    assert r["grad_norm"] > 0 and 0 < r["clip_coef"] <= 1
    assert r["peak_bytes"] > 0 and not r["skipped"]
    m = engine.memory_report()
    assert m["capacity_bytes"] == 64 << 20
    assert set(m["peak_by_category"]) == {"params", "grads", "optimizer", "activations",
                                          "checkpoints", "staging", "workspace", "comm"}
    for key in ["peak_bytes", "peak_activation_bytes", "predicted_activation_bytes",
                "model_state_bytes", "predicted_peak_bytes", "offload", "host_state", "table"]:
        assert key in m, key
    # On the cpu device the plan's prediction is measured to the byte.
    assert m["peak_activation_bytes"] == m["predicted_activation_bytes"]
    assert m["model_state_bytes"] == (m["current_by_category"]["params"] +
                                      m["current_by_category"]["grads"] +
                                      m["current_by_category"]["optimizer"])


def test_params_as_numpy():
    engine = porter.Engine(tiny_gpt())
    p = engine.params()
    assert p.dtype == np.float32 and p.ndim == 1
    assert np.isfinite(p).all()
    engine.train_step(step_batches(0))
    assert not np.array_equal(p, engine.params())


def test_save_and_resume_bit_for_bit(tmp_path):
    cfg = porter.Config(tiny_gpt())
    a = porter.Engine(cfg)
    train(a, 2)
    a.save(tmp_path / "ckpt")
    next_loss = a.train_step(step_batches(2))["loss"]
    after = a.params()

    b = porter.Engine(cfg)
    b.load(tmp_path / "ckpt")
    assert b.global_steps == 2
    resumed = b.train_step(step_batches(2))["loss"]
    assert resumed.hex() == next_loss.hex()
    assert np.array_equal(b.params(), after)


def test_hugging_face_export_and_import(tmp_path):
    cfg = porter.Config(tiny_gpt())
    a = porter.Engine(cfg)
    train(a, 1)
    a.save_hf(tmp_path / "hf")
    assert (tmp_path / "hf" / "config.json").exists()
    assert (tmp_path / "hf" / "model.safetensors").exists()
    b = porter.Engine(cfg, model=tmp_path / "hf")
    assert np.array_equal(a.params(), b.params())
    assert b.evaluate(step_batches(5)) == a.evaluate(step_batches(5))
    # porter.model.from in the config reads the same model and weights.
    d = tiny_gpt()
    d["porter"]["model"] = {"from": str(tmp_path / "hf"), "seq_len": SEQ}
    c = porter.Engine(porter.Config(d))
    assert np.array_equal(a.params(), c.params())
    # A key set to another value than config.json's is porter's error.
    d["porter"]["model"]["hidden"] = 48
    with pytest.raises(porter.InvalidArgument, match="hidden"):
        porter.Config(d)


def test_gpt_tiny_example_config(repo):
    # The make demo config, smaller: its optimal plan with offloaded checkpoints.
    cfg = porter.Config.from_file(
        repo / "examples" / "gpt-tiny.json",
        set=["porter.model.seq_len=32", "train_micro_batch_size_per_gpu=2"])
    engine = porter.Engine(cfg)
    assert "host holds" in engine.plan_description()
    rng = np.random.default_rng(0)
    for _ in range(2):
        tokens = rng.integers(0, 256, size=(2, 32), dtype=np.int32)
        r = engine.train_step([{"tokens": tokens, "targets": np.roll(tokens, -1, axis=1)}])
        assert math.isfinite(r["loss"])


def test_wrong_batch_shape_is_invalid_argument():
    engine = porter.Engine(tiny_gpt())
    bad = token_batch(0, 0, seq=SEQ - 1)
    with pytest.raises(porter.InvalidArgument) as e:
        engine.train_step([bad, token_batch(0, 1)])
    assert isinstance(e.value, ValueError)
    assert str(SEQ - 1) in str(e.value)
    with pytest.raises(porter.InvalidArgument):  # one micro-batch of two
        engine.train_step([token_batch(0, 0)])
    with pytest.raises(porter.InvalidArgument, match="same shape"):
        engine.train_step([{"tokens": np.zeros((4, 16), np.int32),
                            "targets": np.zeros((4, 15), np.int32)}] * 2)
    with pytest.raises(porter.InvalidArgument, match="integers"):
        engine.train_step([{"tokens": np.zeros((4, 16), np.float32),
                            "targets": np.zeros((4, 16), np.int32)}] * 2)
    with pytest.raises(porter.InvalidArgument, match="dict"):
        engine.train_step("tokens")
    # Nothing changed: the engine trains on.
    assert engine.global_steps == 0
    assert math.isfinite(engine.train_step(step_batches(0))["loss"])


def test_out_of_range_token_is_invalid_argument():
    engine = porter.Engine(tiny_gpt())
    b = step_batches(0)
    b[1]["targets"][0, 0] = VOCAB
    with pytest.raises(porter.InvalidArgument, match=str(VOCAB)):
        engine.train_step(b)


def test_out_of_memory():
    cfg = tiny_gpt()
    cfg["porter"]["device"]["memory_limit"] = "256KiB"
    with pytest.raises(porter.OutOfMemoryError) as e:
        porter.Engine(cfg)
    assert isinstance(e.value, MemoryError)
    assert e.value.requested_bytes > 0
