"""Which run a request's points go to, in-process against the session's server: the header, else the
resource's ``mlflow.run_id``, else the run served; OTLP's JSON as well as protobuf; and a node agent
that serves no run refuses what names none (a partial success that says how to name one)."""

from __future__ import annotations

import json

import pytest
from google.protobuf import json_format
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceResponse
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from otlp_requests import gauges, post

from otel_forge.config import ForgeConfig
from otel_forge.mlflow.received_runs import ReceivedRuns
from testkit.servers import free_port, wait_for


def _runs(tmp_path, uri: str, serves_a_run: bool = True) -> ReceivedRuns:
    config = ForgeConfig.resolve(
        environ={}, otlp_receiver=True, otlp_receiver_grpc_port=free_port(), otlp_receiver_http_port=free_port(),
        sampling_interval_s=0.2, spool_dir=str(tmp_path / "spool"), prometheus=False,
    )  # fmt: skip
    return ReceivedRuns(config, uri, serves_a_run=serves_a_run).start()


def _named_by_resource(run_id: str, name: str, value: float) -> bytes:
    request = gauges(1, name, value)
    request.resource_metrics[0].resource.attributes.append(
        KeyValue(key="mlflow.run_id", value=AnyValue(string_value=run_id))
    )
    return request.SerializeToString()


def test_the_header_then_the_resource_attribute_then_the_served_run(mlflow_server, client, tmp_path):
    experiment = client.create_experiment(f"otlp-routing-{tmp_path.name}")
    served, by_header, by_resource = (client.create_run(experiment).info.run_id for _ in range(3))
    runs = _runs(tmp_path, mlflow_server.uri)
    runs.serve(served)
    try:
        port = runs.receiver.http_port
        assert post(port, gauges(1, "plain", 1.0).SerializeToString())[0] == 200
        assert post(port, gauges(1, "headed", 2.0).SerializeToString(), **{"x-mlflow-run-id": by_header})[0] == 200
        assert post(port, _named_by_resource(by_resource, "attributed", 3.0))[0] == 200
        # The header wins over the resource attribute.
        both = _named_by_resource(by_resource, "both", 4.0)
        assert post(port, both, **{"x-mlflow-run-id": by_header})[0] == 200
        # OTLP's JSON encoding, to the run served.
        as_json = json_format.MessageToJson(gauges(1, "json", 5.0)).encode()
        status, content_type, body, _ = post(port, as_json, "application/json")
        assert (status, content_type) == (200, "application/json") and json.loads(body) == {}
    finally:
        runs.stop(10.0)

    def keys(run_id: str) -> dict[str, float]:
        return {k: v for k, v in client.get_run(run_id).data.metrics.items() if k.startswith("otlp/")}

    assert keys(served) == {"otlp/plain/i_0": 1.0, "otlp/json/i_0": 5.0}
    assert keys(by_header) == {"otlp/headed/i_0": 2.0, "otlp/both/i_0": 4.0}
    assert keys(by_resource) == {"otlp/attributed/i_0": 3.0}


def test_an_agent_that_serves_no_run_refuses_what_names_none_and_takes_what_does(mlflow_server, client, tmp_path):
    run_id = client.create_run(client.create_experiment(f"otlp-agent-{tmp_path.name}")).info.run_id
    runs = _runs(tmp_path, mlflow_server.uri, serves_a_run=False)
    try:
        status, _, body, _ = post(runs.receiver.http_port, gauges(3, "nowhere").SerializeToString())
        partial = ExportMetricsServiceResponse.FromString(body).partial_success
        assert status == 200 and partial.rejected_data_points == 3
        assert "no run named: set the x-mlflow-run-id header or the mlflow.run_id resource attribute" in (
            partial.error_message
        )
        assert post(runs.receiver.http_port, _named_by_resource(run_id, "named", 7.0))[0] == 200
        wait_for(lambda: client.get_run(run_id).data.metrics.get("otlp/named/i_0") == 7.0, 30, message="named")
    finally:
        runs.stop(10.0)


@pytest.mark.parametrize("prefix", ["", "received/"])
def test_the_prefix_is_a_setting(mlflow_server, client, tmp_path, prefix):
    run_id = client.create_run(client.create_experiment(f"otlp-prefix-{tmp_path.name}")).info.run_id
    config = ForgeConfig.resolve(
        environ={"OTEL_FORGE_OTLP_RECEIVER_PREFIX": prefix}, otlp_receiver=True, otlp_receiver_grpc_port=free_port(),
        otlp_receiver_http_port=free_port(), sampling_interval_s=0.2, spool_dir=str(tmp_path / "spool"),
        prometheus=False,
    )  # fmt: skip
    runs = ReceivedRuns(config, mlflow_server.uri).start()
    runs.serve(run_id)
    try:
        assert post(runs.receiver.http_port, gauges(1, "gauge", 1.5).SerializeToString())[0] == 200
    finally:
        runs.stop(10.0)
    assert client.get_run(run_id).data.metrics == {f"{prefix}gauge/i_0": 1.5}
