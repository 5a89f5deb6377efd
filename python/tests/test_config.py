# porter.Config from dicts and files, and its errors as Python exceptions with porter's text.
import json
import subprocess

import pytest

from conftest import require_porter, tiny_gpt

porter = require_porter()


def test_config_from_dict_round_trips():
    c = porter.Config(tiny_gpt())
    assert c.world_size == 1
    assert c.source == "<dict>"
    d = c.to_dict()
    assert d["train_micro_batch_size_per_gpu"] == 4
    assert d["porter"]["model"]["layers"] == 2
    assert d["porter"]["checkpointing"]["policy"] == "full"
    # The resolved config parses again to the same config.
    assert porter.Config(d).to_dict() == d


def test_world_size_implied_by_the_batch_sizes():
    cfg = tiny_gpt(train_batch_size=16)  # 16 / (4 x 2): two data-parallel ranks
    assert porter.Config(cfg).world_size == 2
    assert porter.Config(cfg, world_size=2).world_size == 2


def test_config_from_file_with_overrides(repo):
    c = porter.Config.from_file(repo / "examples" / "gpt-tiny.json",
                                set=["porter.model.layers=2", "porter.model.seq_len=32"])
    assert c.source == str(repo / "examples" / "gpt-tiny.json") + \
        " + --set porter.model.layers=2 + --set porter.model.seq_len=32"
    d = c.to_dict()
    assert d["porter"]["model"]["layers"] == 2
    assert d["porter"]["model"]["seq_len"] == 32


def test_unknown_key_warns_and_strict_raises():
    cfg = tiny_gpt()
    cfg["porter"]["model"]["layer"] = 3
    with pytest.warns(porter.ConfigWarning, match=r"porter\.model\.layer\b"):
        c = porter.Config(cfg)
    assert any("porter.model.layer" in w and "layers" in w for w in c.warnings), c.warnings
    with pytest.raises(porter.InvalidArgument, match=r"porter\.model\.layer\b"):
        porter.Config(cfg, strict=True)


def test_bad_value_raises_invalid_argument_with_porters_message(tmp_path, porter_cli):
    cfg = tiny_gpt()
    cfg["zero_optimization"] = {"stage": 7}
    with pytest.raises(porter.InvalidArgument) as e:
        porter.Config(cfg)
    assert isinstance(e.value, ValueError)
    assert isinstance(e.value, porter.Error)
    message = str(e.value)
    assert message.startswith("zero_optimization.stage: ")
    # The CLI says the same about the same config.
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(cfg))
    r = subprocess.run([porter_cli, "config", "check", str(path)], capture_output=True,
                       text=True)
    assert r.returncode == 2
    assert message in r.stderr, r.stderr


def test_bad_types_are_invalid_arguments():
    with pytest.raises(porter.InvalidArgument, match="expected a dict"):
        porter.estimate(["not", "a", "config"])
    cfg = tiny_gpt()
    cfg["porter"]["train"]["seed"] = float("nan")
    with pytest.raises(porter.InvalidArgument, match=r"porter\.train\.seed"):
        porter.Config(cfg)


def test_missing_file_is_an_os_error(tmp_path):
    with pytest.raises(porter.IoError) as e:
        porter.Config.from_file(tmp_path / "missing.json")
    assert isinstance(e.value, OSError)
    assert "missing.json" in str(e.value)


def test_exception_hierarchy():
    assert issubclass(porter.InvalidArgument, ValueError)
    assert issubclass(porter.IoError, OSError)
    assert issubclass(porter.OutOfMemoryError, MemoryError)
    assert issubclass(porter.TimeoutError, TimeoutError)
    for name in ["InvalidArgument", "UsageError", "IoError", "OutOfMemoryError", "CudaError",
                 "NcclError", "TimeoutError", "PeerError", "InternalError"]:
        assert issubclass(getattr(porter, name), porter.Error)
    assert issubclass(porter.Error, RuntimeError)
