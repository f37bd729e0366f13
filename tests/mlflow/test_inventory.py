"""The node's inventory in the run, against the REAL ``mlflow server`` behind the counting proxy: once
per run, as ``<prefix>inventory.json`` (``system/inventory.json`` for a run of one node or a node's
own run, ``system/<node>/inventory.json`` in a job's run of a few nodes), a few tags only where the
run is the node's alone; never a read of the run to find where its artifacts live."""

from __future__ import annotations

import importlib.metadata
import json
import platform
import socket
from pathlib import Path
from typing import Any

import psutil

import otel_forge
from otel_forge.collectors.inventory import cpu_model, node_inventory
from otel_forge.mlflow.system_metrics.node_run import NODE_TAG, PARENT_RUN_TAG
from testkit.proxy import GET_RUN, LOG_BATCH
from testkit.servers import wait_for


def _monitor(run_id: str, uri: str, tmp_path: Path, **settings: Any) -> Any:
    return otel_forge.monitor(
        in_process=True,
        run_id=run_id,
        tracking_uri=uri,
        sampling_interval=0.1,
        samples_per_window=1,
        prometheus=False,
        collectors=("cpu", "memory"),
        spool_dir=str(tmp_path),
        **settings,
    )


def _inventory(client: Any, run_id: str, path: str, tmp_path: Path) -> dict[str, Any]:
    local = client.download_artifacts(run_id, path, str(tmp_path / run_id))
    return json.loads(Path(local).read_text())


def test_the_inventory_says_what_the_machine_is() -> None:
    inventory = node_inventory([])
    assert inventory["host"] == socket.gethostname() and inventory["kernel"] == platform.release()
    assert inventory["python"] == platform.python_version()
    assert inventory["cpu"]["model"] == cpu_model() and inventory["cpu"]["logical_cores"] == psutil.cpu_count()
    assert inventory["memory_bytes"] == psutil.virtual_memory().total
    assert inventory["packages"]["otel-forge"] == importlib.metadata.version("otel-forge")
    try:
        torch = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:  # a Python without torch (./run-tests installs it)
        torch = None
    assert inventory["packages"]["torch"] == torch  # read, not imported
    assert inventory["gpus"] == []  # no GPU collector


def test_cpu_model_comes_from_proc_cpuinfo(tmp_path) -> None:
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nvendor_id\t: GenuineIntel\nmodel name\t: Intel(R) Xeon(R) Platinum 8480+\n")
    assert cpu_model(cpuinfo) == "Intel(R) Xeon(R) Platinum 8480+"


def test_a_run_of_one_node_has_its_inventory_and_a_few_tags(client, experiment_id, proxy, tmp_path) -> None:
    run_id = client.create_run(experiment_id).info.run_id
    monitor = _monitor(run_id, proxy.uri, tmp_path, experiment_id=experiment_id)
    wait_for(lambda: proxy.count(LOG_BATCH) >= 3, 15, 0.05, message="three windows")
    monitor.stop()

    inventory = _inventory(client, run_id, "system/inventory.json", tmp_path)
    assert inventory["host"] == socket.gethostname() and inventory["cpu"]["model"] == cpu_model()
    tags = client.get_run(run_id).data.tags
    assert tags["otel_forge.host"] == socket.gethostname()
    assert tags.get("otel_forge.cpu.model") == cpu_model()
    assert proxy.count(GET_RUN) == 0  # the artifact store found from the experiment, not the run


def test_a_jobs_run_of_a_few_nodes_has_one_inventory_per_node_and_no_node_tags(
    client, experiment_id, proxy, tmp_path
) -> None:
    run_id = client.create_run(experiment_id).info.run_id
    monitors = [_monitor(run_id, proxy.uri, tmp_path, node_id=f"node_{i}", experiment_id=experiment_id) for i in (0, 1)]
    wait_for(lambda: proxy.count(LOG_BATCH) >= 4, 15, 0.05, message="two windows a node")
    for monitor in monitors:
        monitor.stop()

    artifacts = {a.path for a in client.list_artifacts(run_id, "system/node_0")} | {
        a.path for a in client.list_artifacts(run_id, "system/node_1")
    }
    assert artifacts == {"system/node_0/inventory.json", "system/node_1/inventory.json"}
    assert _inventory(client, run_id, "system/node_1/inventory.json", tmp_path)["host"] == socket.gethostname()
    assert not [tag for tag in client.get_run(run_id).data.tags if tag in ("otel_forge.host", "otel_forge.cpu.model")]


def test_a_node_run_holds_its_nodes_inventory_and_tags(client, experiment_id, proxy, tmp_path) -> None:
    job_run_id = client.create_run(experiment_id).info.run_id
    monitor = _monitor(
        job_run_id, proxy.uri, tmp_path, node_id="node_4", node_runs_above=0, experiment_id=experiment_id
    )
    wait_for(lambda: proxy.count(LOG_BATCH) >= 2, 15, 0.05, message="two windows")
    monitor.stop()

    (node_run,) = client.search_runs(
        [experiment_id], f"tags.`{PARENT_RUN_TAG}` = '{job_run_id}' AND tags.`{NODE_TAG}` = 'node_4'"
    )
    assert _inventory(client, node_run.info.run_id, "system/inventory.json", tmp_path)["python"]
    assert node_run.data.tags["otel_forge.host"] == socket.gethostname()
    assert client.list_artifacts(job_run_id) == []  # the job's run: nothing of the node's
    assert proxy.count(GET_RUN) == 0
