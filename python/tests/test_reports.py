# porter.estimate and porter.plan: the reports `porter estimate --json` and `porter plan --json`
# print, as dicts.
import json
import subprocess

from conftest import require_porter, tiny_gpt

porter = require_porter()


def test_estimate_is_the_clis_json(tmp_path, porter_cli):
    path = tmp_path / "tiny.json"
    path.write_text(json.dumps(tiny_gpt()))
    report = porter.estimate(porter.Config.from_file(path))
    r = subprocess.run([porter_cli, "estimate", "--config", str(path), "--json"],
                       capture_output=True, text=True, check=True)
    assert report == json.loads(r.stdout)


def test_estimate_of_a_dict():
    report = porter.estimate(tiny_gpt(), budget="0.5")
    assert report["config"] == "<dict>"
    assert report["world_size"] == 1
    assert [s["stage"] for s in report["zero"]["stages"]] == [0, 1, 2, 3]
    policies = {p["policy"]: p for p in report["policies"]}
    assert set(policies) >= {"none", "full", "uniform", "block", "sqrt", "selective", "optimal"}
    assert policies["full"]["activation_peak_bytes"] < policies["none"]["activation_peak_bytes"]
    assert report["verdict"]["policy"] == "full"
    assert report["verdict"]["fits"] is True


def test_plan_matches_the_clis_bytes(tmp_path, porter_cli):
    path = tmp_path / "tiny.json"
    path.write_text(json.dumps(tiny_gpt()))
    report = porter.plan(porter.Config.from_file(path))
    r = subprocess.run([porter_cli, "plan", "--config", str(path), "--json"],
                       capture_output=True, text=True, check=True)
    cli = json.loads(r.stdout)
    assert list(report) == list(cli)
    # Bytes and the schedule are the analytic model's; times may differ run to run.
    for key in ["config", "world_size", "zero_stage", "policy", "description", "schedule",
                "predicted_activation_peak_bytes", "predicted_total_peak_bytes",
                "none_activation_peak_bytes"]:
        assert report[key] == cli[key], key
    assert [s["name"] for s in report["stages"]] == [s["name"] for s in cli["stages"]]


def test_plan_with_a_budget():
    report = porter.plan(tiny_gpt(), budget="0.9")
    assert report["policy"] == "optimal"
    assert report["budget_bytes"] > 0
    assert report["predicted_activation_peak_bytes"] <= report["none_activation_peak_bytes"]
