"""The step API's promise where a user would see it: at a real size, in separate processes on
two ranks, forward / backward / step leave the whole saved training state (parameters, master
weights, AdamW moments, every rank's file) byte for byte as train_step leaves it."""
import pathlib
import subprocess
import sys

WORKER = pathlib.Path(__file__).parent / "real_size_worker.py"


def run(porter_cli, out, mode):
    done = subprocess.run([porter_cli, "launch", "-n", "2", "--", sys.executable, str(WORKER),
                           str(out), mode], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr


def test_step_api_saves_train_steps_state_at_a_real_size_on_two_processes(tmp_path, porter_cli):
    run(porter_cli, tmp_path / "train_step", "train_step")
    run(porter_cli, tmp_path / "api", "api")
    a = sorted(p.relative_to(tmp_path / "train_step")
               for p in (tmp_path / "train_step").rglob("*.bin"))
    b = sorted(p.relative_to(tmp_path / "api") for p in (tmp_path / "api").rglob("*.bin"))
    assert a and a == b, (a, b)
    assert any(p.parts[0] == "rank1" for p in a), a  # both ranks' state
    for rel in a:
        assert (tmp_path / "train_step" / rel).read_bytes() == (tmp_path / "api" / rel).read_bytes(), rel
