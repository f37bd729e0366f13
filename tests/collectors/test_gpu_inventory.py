"""``GpuCollector.inventory``: the GPUs of the node, read once when asked, against the fake libraries."""

from __future__ import annotations

import contextlib

from collector_helpers import opened_with, read

from otel_forge.collectors.amd import AmdCollector
from otel_forge.collectors.nvidia import NvidiaCollector
from testkit.gpu_fakes import fake_amdsmi, fake_nvml

GiB = 1024**3


def test_nvidia_inventory_has_the_exact_shape_with_mig_instances() -> None:
    with opened_with(fake_nvml, NvidiaCollector, {"count": 2, "mig": {"0": ["1g.10gb", "3g.40gb"]}}) as (_, collector):
        inventory = collector.inventory()
    assert inventory == {
        "vendor": "nvidia",
        "driver_version": "999.99-fake",
        "cuda_version": "12.4",
        "gpus": [
            {
                "index": 0,
                "name": "NVIDIA H100 80GB HBM3",
                "uuid": "GPU-1a2b0000-0000-4000-8000-000000000000",
                "memory_bytes": 80 * GiB,
                "mig": [
                    {"gpu_instance_id": 1, "name": "NVIDIA H100 80GB HBM3 MIG 1g.10gb", "memory_bytes": 10 * GiB},
                    {"gpu_instance_id": 2, "name": "NVIDIA H100 80GB HBM3 MIG 3g.40gb", "memory_bytes": 40 * GiB},
                ],
            },
            {
                "index": 1,
                "name": "NVIDIA H100 80GB HBM3",
                "uuid": "GPU-1a2b0001-0000-4000-8000-000000000001",
                "memory_bytes": 80 * GiB,
                "mig": [],
            },
        ],
    }


def test_inventory_is_read_when_asked_not_per_read() -> None:
    with opened_with(fake_nvml, NvidiaCollector, {"count": 2}) as (nvml, collector):
        for _ in range(3):
            read(collector)
        assert nvml.calls("nvmlSystemGetCudaDriverVersion") == 0
        collector.inventory()
        collector.inventory()
        assert nvml.calls("nvmlSystemGetCudaDriverVersion") == 2


def test_a_field_that_fails_is_none() -> None:
    scenario = {
        "count": 3,
        "cuda_driver_version": None,  # NotSupported
        "lost": ["1"],
        "errors": {"2": {"memory": "Unknown"}},
    }
    with opened_with(fake_nvml, NvidiaCollector, scenario) as (_, collector):
        inventory = collector.inventory()
    assert inventory["cuda_version"] is None and inventory["driver_version"] == "999.99-fake"
    lost, erring = inventory["gpus"][1], inventory["gpus"][2]
    assert lost == {"index": 1, "name": None, "uuid": None, "memory_bytes": None, "mig": []}
    assert erring["memory_bytes"] is None and erring["name"] == "NVIDIA H100 80GB HBM3"


def test_a_selected_mig_instance_brings_its_gpu_entry() -> None:
    uuid = "MIG-3c4d0002-0000-4000-8000-000000000002"
    scenario = {"count": 2, "mig": {"0": ["1g.10gb", "3g.40gb"]}}
    with opened_with(fake_nvml, NvidiaCollector, scenario, gpus=uuid) as (_, collector):
        (gpu,) = collector.inventory()["gpus"]
    assert gpu["index"] == 0 and gpu["memory_bytes"] == 80 * GiB
    assert [instance["gpu_instance_id"] for instance in gpu["mig"]] == [2]


def test_a_closed_collector_gives_what_it_knows_without_calling_the_library() -> None:
    with fake_nvml({"count": 1}) as nvml:
        with opened_with(contextlib.nullcontext, NvidiaCollector, nvml) as (_, collector):  # type: ignore[arg-type]
            pass  # closed on exit
        nvml.reset_counts()
        inventory = collector.inventory()
        assert nvml.call_counts() == {}
    assert inventory["driver_version"] is None and inventory["gpus"][0]["memory_bytes"] is None
    assert inventory["gpus"][0]["uuid"] == "GPU-1a2b0000-0000-4000-8000-000000000000"


def test_amd_inventory() -> None:
    with opened_with(fake_amdsmi, AmdCollector, {"count": 2}) as (_, collector):
        inventory = collector.inventory()
    assert inventory["vendor"] == "amd"
    assert inventory["driver_version"] == "6.8.5" and inventory["cuda_version"] is None
    assert [gpu["index"] for gpu in inventory["gpus"]] == [0, 1]
    assert all(gpu["memory_bytes"] == 192 * GiB and gpu["mig"] == [] for gpu in inventory["gpus"])
    assert all(gpu["name"] and gpu["uuid"] for gpu in inventory["gpus"])


def test_the_node_inventory_names_the_gpus_and_their_tags_say_how_many() -> None:
    from otel_forge.collectors.inventory import inventory_tags, node_inventory

    with opened_with(fake_nvml, NvidiaCollector, {"count": 8}) as (_, collector):
        inventory = node_inventory([collector])
    (nvidia,) = inventory["gpus"]
    assert nvidia["vendor"] == "nvidia" and len(nvidia["gpus"]) == 8 and nvidia["cuda_version"] == "12.4"
    tags = inventory_tags(inventory)
    assert tags["otel_forge.gpu.model"] == "8 x NVIDIA H100 80GB HBM3"
    assert tags["otel_forge.gpu.driver"] == "999.99-fake"
