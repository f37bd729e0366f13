"""The CLI in-process: doctor's report and the one-line usage errors."""

import argparse
import json
import os
import shlex

import pytest

from otel_forge.cli import build_parser, main


def test_doctor_json_reports_collectors_config_sources_and_endpoints(capsys, monkeypatch):
    monkeypatch.setenv("MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL", "3")
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_ENDPOINT", raising=False)
    assert main(["doctor", "--json", "--collectors", "cpu,memory", "--prometheus-port", "0"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["collectors"]["cpu"]["present"] is True
    assert report["collectors"]["nvidia"] == {"present": False, "reason": "not in the collectors setting"}
    assert report["config"]["sampling_interval_s"] == {
        "value": 3.0,
        "source": "env MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL",
        "not_used": [],
    }
    assert report["config"]["collectors"]["source"] == "--collectors"
    assert report["endpoints"]["otlp"].startswith("disabled")
    assert report["endpoints"]["prometheus"].startswith("free")


def test_doctor_shows_the_node_id_and_job_key_with_where_they_came_from(capsys, monkeypatch):
    for name, value in {
        "SLURM_JOB_ID": "77",
        "SLURM_STEP_ID": "0",
        "SLURM_NODEID": "1",
        "SLURM_JOB_NUM_NODES": "2",
        "SLURM_PROCID": "2",
        "SLURM_LOCALID": "0",
    }.items():
        monkeypatch.setenv(name, value)
    for name in ("OTEL_FORGE_NODE_ID", "MLFLOW_SYSTEM_METRICS_NODE_ID", "OTEL_FORGE_JOB_ID"):
        monkeypatch.delenv(name, raising=False)
    assert main(["doctor", "--collectors", "cpu", "--no-prometheus"]) == 0
    out = capsys.readouterr().out
    assert "node: id=node_1 (launcher SLURM_NODEID)" in out
    assert "job: key=slurm-77.0 (launcher SLURM_JOB_ID, SLURM_STEP_ID)" in out
    assert main(["doctor", "--json", "--collectors", "cpu", "--no-prometheus", "--job-id", "nightly"]) == 0
    node = json.loads(capsys.readouterr().out)["node"]
    assert (node["job_key"], node["job_key_source"]) == ("nightly", "--job-id")


@pytest.mark.parametrize(
    ("nodes", "where"),
    [
        ("2", "mlflow: system/node_1/<key> in the job's run (a job of 2 node(s); node runs above 8)"),
        ("2048", "mlflow: system/<key> in the node's own run under the job's run (a job of 2048 node(s); node runs"),
    ],
)
def test_doctor_says_where_the_nodes_windows_land_in_mlflow(capsys, monkeypatch, nodes, where):
    for name, value in {"SLURM_JOB_ID": "77", "SLURM_NODEID": "1", "SLURM_JOB_NUM_NODES": nodes}.items():
        monkeypatch.setenv(name, value)
    for name in ("OTEL_FORGE_NODE_ID", "MLFLOW_SYSTEM_METRICS_NODE_ID", "OTEL_FORGE_NODE_RUNS_ABOVE"):
        monkeypatch.delenv(name, raising=False)
    assert main(["doctor", "--collectors", "cpu", "--no-prometheus"]) == 0
    assert where in capsys.readouterr().out


def test_doctor_text_names_each_collector(capsys):
    assert main(["doctor", "--collectors", "cpu", "--otlp-endpoint", "http://127.0.0.1:9"]) == 0
    out = capsys.readouterr().out
    assert "cpu      present" in out
    assert "memory   absent: not in the collectors setting" in out
    assert "otlp       http/protobuf http://127.0.0.1:9/v1/metrics: unreachable" in out


@pytest.mark.parametrize(
    "argv",
    [
        ["monitor", "--interval", "-1"],
        ["monitor", "--duration", "soon"],
        ["doctor", "--gpus", ""],
        ["monitor", "--otlp-protocol", "smtp"],
        ["monitor", "--duration", "inf"],
        ["monitor", "--duration", "nan"],
        ["monitor", "--prometheus-host", "x..y"],
        ["monitor", "--prometheus-host", ""],
        ["monitor", "--interval", "1e-9"],
        ["monitor", "--interval", "1e10", "--otlp-endpoint", "http://127.0.0.1:9"],
        ["monitor", "--collectors", ""],
        ["monitor", "--gpus", "x,-1"],
        ["monitor", "--node-id", "../../x y"],
        ["run", "--interval", "0.001", "--", "true"],
        ["run", "--collectors", "", "--", "true"],
    ],
)
def test_bad_values_are_one_line_and_exit_2(argv, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("otel-forge: error: invalid ")


def test_unknown_command_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["frobnicate"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: otel-forge ")  # the usage, then one line saying what is wrong
    assert [line for line in err.splitlines() if "error" in line] == [err.splitlines()[-1]]


@pytest.mark.parametrize(
    ("argv", "last_line"),
    [
        (["run", "--experimnt", "x", "--", "true"], "unrecognized arguments: --experimnt; did you mean --experiment?"),
        (["monitor", "--intervl", "3"], "unrecognized arguments: --intervl 3; did you mean --interval?"),
        (["doctor", "--jsn"], "unrecognized arguments: --jsn; did you mean --json?"),
    ],
)
def test_a_mistyped_flag_prints_the_commands_usage_and_the_flag_meant(argv, last_line, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"usage: otel-forge {argv[0]} "), err
    assert err.splitlines()[-1] == f"otel-forge {argv[0]}: error: {last_line}", err


def test_a_flag_like_no_other_gets_no_guess(capsys):
    with pytest.raises(SystemExit):
        main(["monitor", "--zzzzzz"])
    assert "did you mean" not in capsys.readouterr().err


def _subcommands() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    [commands] = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(commands.choices)


@pytest.mark.parametrize("name", ["run", "monitor", "doctor", "replay"])
def test_every_command_has_a_wrapped_description_and_examples_that_parse(name):
    command = _subcommands()[name]
    text = command.format_help()
    assert command.description, name
    examples = [line.strip() for line in text.splitlines() if line.startswith("  otel-forge ")]
    assert examples, text
    for example in examples:
        build_parser().parse_args(shlex.split(example)[1:])  # exits 2 on an example that does not parse
    prose = [line for line in text.splitlines() if not line.startswith("  otel-forge ")]
    assert max(len(line) for line in prose) <= 100, text


def test_doctor_with_nothing_detected_never_prints_none(capsys, monkeypatch):
    for name in list(os.environ):
        if name.startswith(("SLURM_", "OMPI_", "PMI", "OTEL_", "MLFLOW_", "KUBERNETES_")) or name in (
            "RANK", "LOCAL_RANK", "WORLD_SIZE", "GROUP_RANK", "NODE_RANK", "TORCHELASTIC_RUN_ID",
        ):  # fmt: skip
            monkeypatch.delenv(name)
    assert main(["doctor", "--collectors", "cpu", "--no-prometheus"]) == 0
    out = capsys.readouterr().out
    assert "None" not in out, [line for line in out.splitlines() if "None" in line]
    assert "node: id none (one node) host=" in out and "job: none" in out


def test_doctor_shows_pending_spools_with_their_delivery_counts(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("OTEL_FORGE_SPOOL_DIR", str(tmp_path))
    from otel_forge.mlflow.spool_files import writer_identity
    from otel_forge.mlflow.system_metrics.window_spool import WindowSpool
    from otel_forge.mlflow.system_metrics.windows import Window

    header = {"run_id": "run1", "node_id": "node_0", **writer_identity()}  # this process writes it
    spool = WindowSpool(tmp_path / "run1-node_0-1", max_bytes=1 << 20, header=header)
    assert spool.append(Window(0, 1000, (("system/node_0/cpu_utilization_percentage", 12.5),)))
    spool.write_stats({"delivered": 3, "retried": 2, "spooled": 1, "dropped": 0})
    assert main(["doctor", "--collectors", "cpu", "--tracking-uri", "http://user:pw@127.0.0.1:9"]) == 0
    out = capsys.readouterr().out
    assert (
        f"run run1 node node_0: 1 window(s) pending (delivered 3, retried 2, spooled 1, dropped 0); "
        f"writer running (pid {os.getpid()}); otel-forge replay {tmp_path / 'run1-node_0-1'}"
    ) in out
    assert "pw" not in out and "http://***@127.0.0.1:9: does not answer" in out


def test_doctor_json_lists_the_spool(tmp_path, capsys, monkeypatch):
    from otel_forge.mlflow.system_metrics.window_spool import WindowSpool
    from otel_forge.mlflow.system_metrics.windows import Window

    monkeypatch.setenv("OTEL_FORGE_SPOOL_DIR", str(tmp_path))
    spool = WindowSpool(tmp_path / "r-n-1", max_bytes=1 << 20, header={"run_id": "r", "node_id": None})
    spool.append(Window(0, 1000, (("system/x", 1.0),)))
    spool.append(Window(1, 2000, (("system/x", 2.0),)))
    assert main(["doctor", "--json", "--collectors", "cpu"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["spools"] == [
        {
            "path": str(tmp_path / "r-n-1"),
            "run_id": "r",
            "node_id": None,
            "pending": 2,
            "unit": "window(s)",
            "writer": "ended",
            "stats": {},
            "replay": f"otel-forge replay {tmp_path / 'r-n-1'}",
        }
    ]


def test_doctor_names_a_running_jobs_journal_its_run_and_an_end_not_yet_come(monkeypatch, tmp_path, capsys):
    """A journal whose writer (this process) runs and whose run is open: doctor names the run and says its
    end has not come, not "not open" and "KILLED (its process died)"."""
    from otel_forge.mlflow.training.run_journal import RunJournal

    monkeypatch.setenv("OTEL_FORGE_SPOOL_DIR", str(tmp_path))
    journal = RunJournal.create(tmp_path, "http://127.0.0.1:5000")
    journal.metrics({"loss": 0.5, "lr": 0.1}, step=0, timestamp_ms=1)
    journal.opened({"run_id": "0123abcd", "experiment": "e"})
    journal.metrics({"loss": 0.4}, step=1, timestamp_ms=2)
    assert main(["doctor", "--collectors", "cpu"]) == 0
    out = capsys.readouterr().out
    said = "run 0123abcd node this host: 3 metric value(s) pending (run end not yet, its process runs); writer running"
    assert f"{said} (pid {os.getpid()})" in out, out


def test_repeated_sdk_errors_are_let_through_once_a_minute():
    import logging

    from otel_forge.cli import RepeatFilter

    repeat = RepeatFilter("opentelemetry", interval_s=60.0)

    def record(name, msg):
        return logging.LogRecord(name, logging.ERROR, __file__, 1, msg, (), None)

    failed = "Failed to export metrics batch"
    assert repeat.filter(record("opentelemetry.exporter.otlp.proto.http.metric_exporter", failed))
    assert not repeat.filter(record("opentelemetry.exporter.otlp.proto.http.metric_exporter", failed))
    assert repeat.filter(record("opentelemetry.exporter.otlp.proto.http.metric_exporter", "another message"))
    assert repeat.filter(record("otel_forge.mlflow.delivery.engine", failed)) and repeat.filter(
        record("otel_forge.mlflow.delivery.engine", failed)
    )


def test_doctor_says_which_variable_won_and_which_was_not_used(capsys, monkeypatch):
    monkeypatch.setenv("OTEL_FORGE_SAMPLING_INTERVAL", "2")
    monkeypatch.setenv("OTEL_METRIC_EXPORT_INTERVAL", "5000")
    monkeypatch.setenv("OTEL_METRIC_EXPORT_TIMEOUT", "4000")
    assert main(["doctor", "--collectors", "cpu", "--no-prometheus"]) == 0
    lines = {line.split()[0]: line for line in capsys.readouterr().out.splitlines() if line.startswith("  ")}
    assert (
        "(env OTEL_FORGE_SAMPLING_INTERVAL; set but not used: OTEL_METRIC_EXPORT_INTERVAL)"
        in lines["sampling_interval_s"]
    )
    assert "4.0" in lines["export_timeout_s"] and "(env OTEL_METRIC_EXPORT_TIMEOUT)" in lines["export_timeout_s"]


def test_doctor_checks_a_scheme_less_grpc_endpoint_by_its_host_and_port(capsys):
    import socket

    with socket.create_server(("127.0.0.1", 0)) as listening:
        port = listening.getsockname()[1]
        assert (
            main(
                [
                    "doctor",
                    "--collectors",
                    "cpu",
                    "--no-prometheus",
                    "--otlp-protocol",
                    "grpc",
                    "--otlp-endpoint",
                    f"127.0.0.1:{port}",
                ]
            )
            == 0
        )
    otlp = next(line for line in capsys.readouterr().out.splitlines() if line.strip().startswith("otlp "))
    assert f"grpc 127.0.0.1:{port}: answers" in otlp, otlp


def test_doctor_prints_the_nodes_inventory(capsys):
    import platform
    import socket

    assert main(["doctor", "--collectors", "cpu", "--no-prometheus"]) == 0
    out = capsys.readouterr().out
    assert f"  host     {socket.gethostname()}, kernel {platform.release()}, Python {platform.python_version()}" in out
    assert "  packages torch " in out
    assert main(["doctor", "--json", "--collectors", "cpu", "--no-prometheus"]) == 0
    inventory = json.loads(capsys.readouterr().out)["inventory"]
    assert inventory["host"] == socket.gethostname() and inventory["gpus"] == []


def test_the_otel_sdks_errors_are_one_line_in_an_otel_forge_process():
    """A collect that outlasts a short interval under load: the SDK's own error, one line (no traceback)."""
    import subprocess
    import sys

    script = (
        "import logging\n"
        "from otel_forge.cli import configure_process\n"
        "configure_process(0)\n"
        "try:\n"
        "    raise TimeoutError('Timed out while executing callback')\n"
        "except TimeoutError:\n"
        "    logger = logging.getLogger('opentelemetry.sdk.metrics._internal.export')\n"
        "    logger.exception('Metric collection timed out.')\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=False)
    assert result.stderr.splitlines() == [
        "otel-forge: ERROR opentelemetry.sdk.metrics._internal.export: Metric collection timed out. "
        "(TimeoutError('Timed out while executing callback'))"
    ], result.stderr
