"""The InfiniBand collector on sysfs trees laid out as the kernel and node_exporter's fixtures lay them out.

Two devices and their ports, bytes from 4-byte words, 64-bit counters preferred, a 32-bit counter that
wraps between two reads, folders and files that are missing or unreadable, a port that goes down, link
rates; and the readings through the real instruments to the MLflow keys and the Prometheus names.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from collector_helpers import read
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from otel_points import as_named_points
from prometheus_client.openmetrics.parser import text_string_to_metric_families

from otel_forge.collectors import open_collectors
from otel_forge.collectors.base import CollectorUnavailable, Readings
from otel_forge.collectors.infiniband import InfinibandCollector, parse_rate, parse_state
from otel_forge.config import ForgeConfig
from otel_forge.mlflow.keys import KeyMapper
from otel_forge.mlflow.system_metrics.windows import WindowFolder
from otel_forge.names import INFINIBAND_LINK_ERRORS, METRICS
from otel_forge.pipeline.instruments import InstrumentSet
from otel_forge.pipeline.prometheus_rendering import PrometheusRendering
from testkit.infiniband_sysfs import Port, published_devices, set_file, write_device
from testkit.servers import PROMETHEUS_ACCEPT

SPECS = {spec.name: spec for spec in METRICS if spec.source == "infiniband"}
WORD = 4  # port_*_data count 4-byte words
NEAR_WRAP = 2**32 - 100


def values(readings: Readings, metric: str, device: str, port: str = "1", **match: str) -> dict[str, float]:
    """Values of ``metric`` for one port, keyed by what tells them apart (direction, error type or state)."""
    found = {}
    for attributes, value in readings.get(metric):
        if attributes["otel_forge.infiniband.device"] != device or attributes["otel_forge.infiniband.port"] != port:
            continue
        if any(attributes.get(key) != wanted for key, wanted in match.items()):
            continue
        label = next(
            (
                str(attributes[key])
                for key in (
                    "network.io.direction",
                    "error.type",
                    "otel_forge.infiniband.state",
                    "otel_forge.infiniband.physical_state",
                )
                if key in attributes
            ),
            "",
        )
        found[label] = value
    return found


def current_state(readings: Readings, device: str, port: str = "1") -> str:
    (state,) = [s for s, v in values(readings, "otel_forge.infiniband.status", device, port).items() if v == 1]
    return state


@pytest.fixture
def published(tmp_path: Path) -> Path:
    return published_devices(tmp_path / "infiniband")


# --- what a read gives ----------------------------------------------------------------------------------


def test_two_devices_every_port_with_bytes_from_words_and_64_bit_counters_first(published: Path) -> None:
    readings = read(InfinibandCollector(str(published)))

    ports = {
        (a["otel_forge.infiniband.device"], a["otel_forge.infiniband.port"])
        for a, _ in readings.get("otel_forge.infiniband.rate")
    }
    assert ports == {("mlx4_0", "1"), ("mlx4_0", "2"), ("mlx5_0", "1"), ("i40iw0", "1")}
    # mlx5 on a kernel since 4.5: counters/ are 64-bit; bytes = words x 4 (node_exporter's values).
    assert values(readings, "otel_forge.infiniband.io", "mlx5_0") == {
        "receive": 18126345378 * WORD,
        "transmit": 2880761508848 * WORD,
    }
    # mlx4 before 4.5: counters_ext/*_64 wins over the 32-bit counters/ file (0 on port 2).
    assert values(readings, "otel_forge.infiniband.io", "mlx4_0", "2") == {
        "receive": 4631917 * WORD,
        "transmit": 3733440 * WORD,
    }
    assert values(readings, "otel_forge.infiniband.packets", "mlx5_0") == {
        "receive": 541889824,
        "transmit": 10907922116,
    }
    assert values(readings, "otel_forge.infiniband.unicast.packets", "mlx4_0") == {"receive": 61148, "transmit": 61239}
    assert values(readings, "otel_forge.infiniband.multicast.packets", "mlx4_0") == {"receive": 93, "transmit": 16}
    errors = values(readings, "otel_forge.infiniband.errors", "mlx5_0")
    assert errors["symbol_error"] == 0 and errors["VL15_dropped"] == 0
    # The driver's counters of hw_counters/ (mlx5): the transport's errors.
    assert errors["local_ack_timeout_err"] == 131 and errors["out_of_sequence"] == 1
    assert values(readings, "otel_forge.infiniband.errors", "mlx4_0")["port_xmit_discards"] == 5
    assert current_state(readings, "mlx4_0", "2") == "active"
    assert values(readings, "otel_forge.infiniband.physical_status", "mlx5_0")["link_up"] == 1
    assert values(readings, "otel_forge.infiniband.rate", "mlx5_0") == {"": 25e9 / 8}
    for metric in readings.metrics():
        for attributes, _ in readings.get(metric):
            assert set(attributes) <= set(SPECS[metric].attributes), metric
            assert attributes["otel_forge.infiniband.link_layer"] == "infiniband"


def test_a_port_without_pma_or_hw_counters_gives_what_it_has(published: Path) -> None:
    readings = read(InfinibandCollector(str(published)))

    # i40iw0's counters all read "N/A (no PMA)": no counter at all, but its state and rate.
    for metric in ("otel_forge.infiniband.io", "otel_forge.infiniband.packets", "otel_forge.infiniband.errors"):
        assert values(readings, metric, "i40iw0") == {}, metric
    assert current_state(readings, "i40iw0") == "active"
    assert values(readings, "otel_forge.infiniband.rate", "i40iw0") == {"": 10e9 / 8}
    # mlx4_0 has no hw_counters folder: only its PMA counters.
    assert set(values(readings, "otel_forge.infiniband.errors", "mlx4_0")) <= set(INFINIBAND_LINK_ERRORS) | {
        "port_rcv_discards",
        "port_xmit_discards",
        "port_rcv_constraint_errors",
        "port_xmit_constraint_errors",
    }


def test_roce_ports_carry_the_ethernet_link_layer(tmp_path: Path) -> None:
    counters = {"port_rcv_data": 1000, "port_xmit_data": 2000}
    write_device(
        tmp_path, "mlx5_2", {1: Port(link_layer="Ethernet", counters=counters, hw_counters={"out_of_buffer": 7})}
    )

    readings = read(InfinibandCollector(str(tmp_path)))

    assert {a["otel_forge.infiniband.link_layer"] for a, _ in readings.get("otel_forge.infiniband.io")} == {"ethernet"}
    assert values(readings, "otel_forge.infiniband.errors", "mlx5_2") == {"out_of_buffer": 7}


def test_a_missing_or_unreadable_file_costs_that_value_alone(tmp_path: Path) -> None:
    port = Port(counters={"port_rcv_data": 10, "port_xmit_data": 20, "symbol_error": 1}, hw_counters={})
    path = write_device(tmp_path, "mlx5_0", {1: port}) / "ports" / "1"
    (path / "rate").unlink()  # the driver refuses to say (EINVAL on some ports): the same for us
    (path / "counters" / "port_xmit_data").unlink()
    (path / "counters" / "symbol_error").unlink()
    (path / "counters" / "symbol_error").mkdir()  # a read that fails (EISDIR), as EACCES would

    readings = read(InfinibandCollector(str(tmp_path)))

    assert values(readings, "otel_forge.infiniband.io", "mlx5_0") == {"receive": 10 * WORD}
    assert values(readings, "otel_forge.infiniband.errors", "mlx5_0") == {}
    assert values(readings, "otel_forge.infiniband.rate", "mlx5_0") == {}
    assert current_state(readings, "mlx5_0") == "active"


# --- counters over reads --------------------------------------------------------------------------------


def test_a_32_bit_data_counter_that_wraps_keeps_growing(tmp_path: Path) -> None:
    legacy = {"port_rcv_data": NEAR_WRAP, "port_xmit_data": 5, "port_rcv_packets": 2**32 - 1}
    write_device(tmp_path, "mlx4_0", {1: Port(counters=legacy)})
    collector = InfinibandCollector(str(tmp_path))
    first = read(collector)

    set_file(tmp_path, "mlx4_0", 1, "counters/port_rcv_data", 50)  # 150 words later, past 2**32
    set_file(tmp_path, "mlx4_0", 1, "counters/port_rcv_packets", 9)  # saturated, then reset by the PerfMgr
    second = read(collector)
    set_file(tmp_path, "mlx4_0", 1, "counters/port_rcv_data", 1050)
    third = read(collector)

    io = [values(r, "otel_forge.infiniband.io", "mlx4_0")["receive"] for r in (first, second, third)]
    assert io == [NEAR_WRAP * WORD, (NEAR_WRAP + 150) * WORD, (NEAR_WRAP + 1150) * WORD]
    assert values(second, "otel_forge.infiniband.packets", "mlx4_0")["receive"] == 2**32 - 1 + 10
    assert values(third, "otel_forge.infiniband.io", "mlx4_0")["transmit"] == 5 * WORD


def test_a_64_bit_counter_or_an_error_counter_that_goes_down_was_reset(tmp_path: Path) -> None:
    port = Port(counters={"port_rcv_data": 2**40, "symbol_error": 100}, counters_ext=None)
    write_device(tmp_path, "mlx5_0", {1: port})
    collector = InfinibandCollector(str(tmp_path))
    read(collector)

    set_file(tmp_path, "mlx5_0", 1, "counters/port_rcv_data", 1000)  # the driver reloaded
    set_file(tmp_path, "mlx5_0", 1, "counters/symbol_error", 3)  # perfquery -R, then 3 more
    readings = read(collector)

    assert values(readings, "otel_forge.infiniband.io", "mlx5_0")["receive"] == (2**40 + 1000) * WORD
    assert values(readings, "otel_forge.infiniband.errors", "mlx5_0")["symbol_error"] == 103


def test_a_port_that_goes_down_between_reads_says_so(tmp_path: Path) -> None:
    write_device(tmp_path, "mlx5_0", {1: Port(counters={"port_rcv_data": 7, "link_downed": 0})})
    write_device(tmp_path, "mlx5_1", {1: Port(counters={"port_rcv_data": 7})})
    collector = InfinibandCollector(str(tmp_path))
    before = read(collector)

    set_file(tmp_path, "mlx5_0", 1, "state", "1: DOWN")
    set_file(tmp_path, "mlx5_0", 1, "phys_state", "2: Polling")
    set_file(tmp_path, "mlx5_0", 1, "counters/link_downed", 1)
    after = read(collector)

    assert current_state(before, "mlx5_0") == "active" and current_state(after, "mlx5_0") == "down"
    # Every state is a series of its own, 1 for the current one: the same series before and after.
    assert values(after, "otel_forge.infiniband.status", "mlx5_0") == {
        "down": 1,
        "init": 0,
        "armed": 0,
        "active": 0,
        "active_defer": 0,
    }
    physical = values(after, "otel_forge.infiniband.physical_status", "mlx5_0")
    assert physical["polling"] == 1 and physical["link_up"] == 0
    assert values(after, "otel_forge.infiniband.errors", "mlx5_0")["link_downed"] == 1
    assert current_state(after, "mlx5_1") == "active"


def test_a_device_that_goes_away_leaves_the_others(published: Path) -> None:
    collector = InfinibandCollector(str(published))
    read(collector)
    for path in sorted((published / "mlx4_0").rglob("*"), reverse=True):
        path.rmdir() if path.is_dir() else path.unlink()
    (published / "mlx4_0").rmdir()

    readings = read(collector)

    devices = {a["otel_forge.infiniband.device"] for a, _ in readings.get("otel_forge.infiniband.rate")}
    assert devices == {"mlx5_0", "i40iw0"}


# --- parsing --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "bytes_per_second"),
    [
        ("100 Gb/sec (4X EDR)", 12.5e9),
        ("25 Gb/sec (1X EDR)", 3.125e9),
        ("10 Gb/sec (4X)", 1.25e9),
        ("2.5 Gb/sec (1X SDR)", 312.5e6),
        ("400 Gb/sec (4X NDR)", 50e9),
        ("", None),
        ("Unknown", None),
        ("fast Gb/sec", None),
    ],
)
def test_rate(text: str, bytes_per_second: float | None) -> None:
    assert parse_rate(text) == bytes_per_second


@pytest.mark.parametrize(
    ("text", "state"),
    [
        ("4: ACTIVE", "active"),
        ("1: DOWN", "down"),
        ("5: ACTIVE_DEFER", "active_defer"),
        ("5: LinkUp", "link_up"),
        ("2: Polling", "polling"),
        ("4: PortConfigurationTraining", "port_configuration_training"),
        ("7: Phy Test", "phy_test"),
        ("ACTIVE", None),
        ("", None),
    ],
)
def test_state(text: str, state: str | None) -> None:
    assert parse_state(text) == state


# --- opening --------------------------------------------------------------------------------------------


def test_without_devices_the_collector_is_absent_with_the_reason(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    for root in (tmp_path / "empty", tmp_path / "missing"):
        config = ForgeConfig.resolve(environ={"OTEL_FORGE_INFINIBAND_ROOT": str(root)})
        with pytest.raises(CollectorUnavailable, match=f"no InfiniBand or RoCE device under {root}"):
            InfinibandCollector.create(config)
        opened = open_collectors(config.replace(collectors=["infiniband"]))
        assert opened.present == () and opened.absent == {"infiniband": f"no InfiniBand or RoCE device under {root}"}


def test_on_by_default_and_opened_on_the_configured_root(published: Path) -> None:
    config = ForgeConfig.resolve(environ={"OTEL_FORGE_INFINIBAND_ROOT": str(published)})
    assert "infiniband" in ForgeConfig.defaults().collectors
    assert ForgeConfig.defaults().infiniband_root == "/sys/class/infiniband"

    collector = InfinibandCollector.create(config)

    assert collector.describe() == [
        "i40iw0 port 1: InfiniBand, 4: ACTIVE, 10 Gb/sec (4X)",
        "mlx4_0 port 1: InfiniBand, 4: ACTIVE, 40 Gb/sec (4X QDR)",
        "mlx4_0 port 2: InfiniBand, 4: ACTIVE, 40 Gb/sec (4X QDR)",
        "mlx5_0 port 1: InfiniBand, 4: ACTIVE, 25 Gb/sec (1X EDR)",
    ]


# --- where the values go --------------------------------------------------------------------------------


def test_readings_through_the_instruments_to_mlflow_keys_and_prometheus_names(tmp_path: Path) -> None:
    """The real path of a sample: collector -> observable instruments -> an SDK collect -> the MLflow
    exporter's key mapper and window folder; and the same collect rendered for /metrics."""
    legacy = {"port_rcv_data": NEAR_WRAP, "port_xmit_data": 0, "symbol_error": 0, "port_xmit_discards": 0}
    write_device(tmp_path, "mlx4_0", {1: Port(rate="40 Gb/sec (4X QDR)", counters=legacy)})
    write_device(tmp_path, "mlx5_0", {1: Port(counters={"port_rcv_data": 0, "port_xmit_data": 0})})
    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader])
    instruments = InstrumentSet(provider.get_meter("otel_forge"), [InfinibandCollector(str(tmp_path))], max_age_s=0.0)
    mapper, folder = KeyMapper("system/node_0/"), WindowFolder(samples_per_window=2)
    try:
        first = reader.get_metrics_data()
        assert folder.add(mapper.sample(as_named_points(first)), 100.0) is None
        # 10 s later: mlx4_0 received 250 MB (its 32-bit word counter wrapped), mlx5_0 sent 500 MB; mlx4_0
        # counted 2 symbol errors and 9 discards, and mlx5_0 went down.
        set_file(tmp_path, "mlx4_0", 1, "counters/port_rcv_data", 62_500_000 - 100)
        set_file(tmp_path, "mlx4_0", 1, "counters/symbol_error", 2)
        set_file(tmp_path, "mlx4_0", 1, "counters/port_xmit_discards", 9)
        set_file(tmp_path, "mlx5_0", 1, "counters/port_xmit_data", 125_000_000)
        set_file(tmp_path, "mlx5_0", 1, "state", "1: DOWN")
        second = reader.get_metrics_data()
        window = folder.add(mapper.sample(as_named_points(second)), 110.0)
        rendering = PrometheusRendering()
        rendering.export(second)
        body, _ = rendering.body(PROMETHEUS_ACCEPT, None)
    finally:
        instruments.unregister()
        provider.shutdown()

    assert window is not None
    keys = dict(window.values)
    assert keys == pytest.approx(
        {
            "system/node_0/infiniband_receive_megabytes_per_second": 25.0,
            "system/node_0/infiniband_transmit_megabytes_per_second": 50.0,
            "system/node_0/infiniband_mlx4_0_1_receive_megabytes_per_second": 25.0,
            "system/node_0/infiniband_mlx4_0_1_transmit_megabytes_per_second": 0.0,
            "system/node_0/infiniband_mlx5_0_1_receive_megabytes_per_second": 0.0,
            "system/node_0/infiniband_mlx5_0_1_transmit_megabytes_per_second": 50.0,
            # Link errors only: the discards are congestion, not a sick link.
            "system/node_0/infiniband_mlx4_0_1_link_errors": 2.0,
            # The window's mean of the two samples: up, then down.
            "system/node_0/infiniband_mlx4_0_1_up": 1.0,
            "system/node_0/infiniband_mlx5_0_1_up": 0.5,
        }
    )
    samples = {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(body.decode())
        for sample in family.samples
        if sample.name.startswith("otel_forge_infiniband_")
    }

    def prometheus(name: str, device: str, **labels: str) -> float:
        port = {"otel_forge_infiniband_device": device, "otel_forge_infiniband_port": "1"}
        wanted = {**port, "otel_forge_infiniband_link_layer": "infiniband", **labels}
        (value,) = [v for (n, found), v in samples.items() if n == name and wanted.items() <= dict(found).items()]
        return value

    receive = {"network_io_direction": "receive"}
    assert prometheus("otel_forge_infiniband_io_bytes_total", "mlx4_0", **receive) == (NEAR_WRAP + 62_500_000) * WORD
    assert prometheus("otel_forge_infiniband_errors_total", "mlx4_0", error_type="symbol_error") == 2
    assert prometheus("otel_forge_infiniband_rate_bytes_per_second", "mlx4_0") == 5e9
    assert prometheus("otel_forge_infiniband_status", "mlx5_0", otel_forge_infiniband_state="down") == 1
    assert (
        prometheus("otel_forge_infiniband_physical_status", "mlx5_0", otel_forge_infiniband_physical_state="link_up")
        == 1
    )
