"""The CLI in-process: doctor's report and the one-line usage errors."""

import json

import pytest

from otel_forge.cli import main


def test_doctor_json_reports_collectors_config_sources_and_endpoints(capsys, monkeypatch):
    monkeypatch.setenv("MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL", "3")
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_ENDPOINT", raising=False)
    assert main(["doctor", "--json", "--collectors", "cpu,memory", "--prometheus-port", "0"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["collectors"]["cpu"]["present"] is True
    assert report["collectors"]["nvidia"] == {"present": False, "reason": "not in the collectors setting"}
    assert report["config"]["sampling_interval_s"] == {
        "value": 3.0, "source": "env MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL"}
    assert report["config"]["collectors"]["source"] == "--collectors"
    assert report["endpoints"]["otlp"].startswith("disabled")
    assert report["endpoints"]["prometheus"].startswith("free")


def test_doctor_text_names_each_collector(capsys):
    assert main(["doctor", "--collectors", "cpu", "--otlp-endpoint", "http://127.0.0.1:9"]) == 0
    out = capsys.readouterr().out
    assert "cpu      present" in out
    assert "memory   absent: not in the collectors setting" in out
    assert "otlp       http/protobuf http://127.0.0.1:9/v1/metrics: unreachable" in out


@pytest.mark.parametrize("argv", [
    ["monitor", "--interval", "-1"],
    ["monitor", "--duration", "soon"],
    ["doctor", "--gpus", ""],
    ["monitor", "--otlp-protocol", "smtp"],
])
def test_bad_values_are_one_line_and_exit_2(argv, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("otel-forge: error: invalid ")


def test_unknown_command_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["frobnicate"])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.count("\n") == 1
