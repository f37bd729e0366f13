"""A ``/sys/class/infiniband`` tree in a folder, laid out as the kernel (and node_exporter's fixtures) lay it out.

``write_device`` writes a device and its ports; ``set_file`` changes one file between two reads (a counter
that grows or wraps, a port that goes down). ``published_devices`` are the devices of node_exporter's
``collector/fixtures/sys.ttar`` (mlx4_0, i40iw0) and procfs's ``testdata/fixtures.ttar`` (mlx5_0, with
``hw_counters``), with their values. An agent reads such a tree with ``OTEL_FORGE_INFINIBAND_ROOT``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

Files = Mapping[str, "int | str"]


@dataclass(frozen=True)
class Port:
    """One port's files: ``counters`` (counters/), ``counters_ext`` and ``hw_counters`` (None: no such folder)."""

    link_layer: str = "InfiniBand"
    state: str = "4: ACTIVE"
    phys_state: str = "5: LinkUp"
    rate: str = "200 Gb/sec (4X HDR)"
    counters: Files = field(default_factory=dict)
    counters_ext: Files | None = None
    hw_counters: Files | None = None


def write_device(
    root: Path, device: str, ports: Mapping[int, Port], fw_ver: str = "20.39.1002", hca_type: str = "MT4123"
) -> Path:
    """``root/<device>/`` with ``fw_ver``, ``hca_type`` and ``ports/<n>/...``; returns the device's folder."""
    folder = root / device
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "fw_ver").write_text(fw_ver + "\n")
    (folder / "hca_type").write_text(hca_type + "\n")
    for number, port in ports.items():
        path = folder / "ports" / str(number)
        path.mkdir(parents=True, exist_ok=True)
        for name in ("link_layer", "state", "phys_state", "rate"):
            (path / name).write_text(f"{getattr(port, name)}\n")
        for sub, files in (
            ("counters", port.counters),
            ("counters_ext", port.counters_ext),
            ("hw_counters", port.hw_counters),
        ):
            if files is None:
                continue
            (path / sub).mkdir(exist_ok=True)
            for name, value in files.items():
                (path / sub / name).write_text(f"{value}\n")
    return folder


def set_file(root: Path, device: str, port: int, name: str, value: int | str) -> None:
    """Write ``root/<device>/ports/<port>/<name>`` (``counters/port_rcv_data``, ``state``, ...) in one step:
    written beside and renamed, so a reader never sees it half-written."""
    path = root / device / "ports" / str(port) / name
    partial = path.with_name(path.name + ".partial")
    partial.write_text(f"{value}\n")
    partial.replace(path)


# --- node_exporter's and procfs's published fixtures ----------------------------------------------------

_MLX4_COUNTERS_EXT = {
    "port_multicast_rcv_packets": 93,
    "port_multicast_xmit_packets": 16,
    "port_rcv_data_64": 4631917,
    "port_rcv_packets_64": 0,
    "port_unicast_rcv_packets": 61148,
    "port_unicast_xmit_packets": 61239,
    "port_xmit_data_64": 3733440,
    "port_xmit_packets_64": 0,
}
_NO_PMA = "N/A (no PMA)"

PUBLISHED: dict[str, tuple[dict[int, Port], str, str]] = {
    # node_exporter collector/fixtures/sys.ttar: a ConnectX-3 on a kernel before 4.5 (counters_ext/).
    "mlx4_0": (
        {
            1: Port(
                rate="40 Gb/sec (4X QDR)",
                counters={
                    "link_downed": 0,
                    "link_error_recovery": 0,
                    "multicast_rcv_packets": 93,
                    "multicast_xmit_packets": 16,
                    "port_rcv_constraint_errors": 0,
                    "port_rcv_data": 4631917,
                    "port_rcv_discards": 0,
                    "port_rcv_errors": 0,
                    "port_rcv_packets": 6825908347,
                    "port_xmit_constraint_errors": 0,
                    "port_xmit_data": 3733440,
                    "port_xmit_discards": 5,
                    "port_xmit_packets": 6235865,
                    "port_xmit_wait": 4294967295,
                    "unicast_rcv_packets": 61148,
                    "unicast_xmit_packets": 61239,
                },
                counters_ext=_MLX4_COUNTERS_EXT,
            ),
            2: Port(
                rate="40 Gb/sec (4X QDR)",
                counters={
                    "link_downed": 0,
                    "link_error_recovery": 0,
                    "multicast_rcv_packets": 0,
                    "multicast_xmit_packets": 0,
                    "port_rcv_data": 0,
                    "port_xmit_data": 0,
                    "unicast_rcv_packets": 0,
                    "unicast_xmit_packets": 0,
                },
                counters_ext=_MLX4_COUNTERS_EXT,
            ),
        },
        "2.31.5050",
        "MT4099",
    ),
    # procfs testdata/fixtures.ttar: a ConnectX-4 (mlx5) with its driver counters (hw_counters/).
    "mlx5_0": (
        {
            1: Port(
                rate="25 Gb/sec (1X EDR)",
                counters={
                    "VL15_dropped": 0,
                    "excessive_buffer_overrun_errors": 0,
                    "link_downed": 0,
                    "link_error_recovery": 0,
                    "local_link_integrity_errors": 0,
                    "multicast_rcv_packets": 0,
                    "multicast_xmit_packets": 0,
                    "port_rcv_constraint_errors": 0,
                    "port_rcv_data": 18126345378,
                    "port_rcv_errors": 0,
                    "port_rcv_packets": 541889824,
                    "port_rcv_remote_physical_errors": 0,
                    "port_rcv_switch_relay_errors": 0,
                    "port_xmit_constraint_errors": 0,
                    "port_xmit_data": 2880761508848,
                    "port_xmit_discards": 0,
                    "port_xmit_packets": 10907922116,
                    "port_xmit_wait": 0,
                    "symbol_error": 0,
                    "unicast_rcv_packets": 541889824,
                    "unicast_xmit_packets": 10907922116,
                },
                hw_counters={
                    "duplicate_request": 41,
                    "implied_nak_seq_err": 0,
                    "lifespan": 10,
                    "local_ack_timeout_err": 131,
                    "out_of_buffer": 0,
                    "out_of_sequence": 1,
                    "packet_seq_err": 1,
                    "req_cqe_error": 3481,
                    "req_cqe_flush_error": 80,
                    "resp_cqe_error": 8109,
                    "rnr_nak_retry_err": 0,
                    "roce_adp_retrans": 99,
                    "rx_read_requests": 175528982,
                    "rx_write_requests": 742114,
                },
            )
        },
        "14.28.2006",
        "MT4118",
    ),
    # node_exporter collector/fixtures/sys.ttar: Intel's iWARP adapter, whose port has no PMA.
    "i40iw0": (
        {
            1: Port(
                rate="10 Gb/sec (4X)",
                counters={
                    name: _NO_PMA
                    for name in (
                        "VL15_dropped",
                        "excessive_buffer_overrun_errors",
                        "link_downed",
                        "link_error_recovery",
                        "local_link_integrity_errors",
                        "port_rcv_constraint_errors",
                        "port_rcv_data",
                        "port_rcv_errors",
                        "port_rcv_packets",
                        "port_rcv_remote_physical_errors",
                        "port_rcv_switch_relay_errors",
                        "port_xmit_constraint_errors",
                        "port_xmit_data",
                        "port_xmit_discards",
                        "port_xmit_packets",
                        "port_xmit_wait",
                        "symbol_error",
                    )
                },
            )
        },
        "0.2",
        "I40IW",
    ),
}


def published_devices(root: Path, names: tuple[str, ...] = tuple(PUBLISHED)) -> Path:
    """The published fixtures' devices ``names`` under ``root``; returns ``root``."""
    for name in names:
        ports, fw_ver, hca_type = PUBLISHED[name]
        write_device(root, name, ports, fw_ver=fw_ver, hca_type=hca_type)
    return root


def training_node(root: Path, healthy: bool = True) -> Path:
    """What a GPU node of a training cluster has: two InfiniBand HDR ports (the GPUs' fabric) and a RoCE port.

    Not ``healthy``: ``mlx5_1`` is down (no link: polling) after 3 link-downed events, and ``mlx5_0``
    counts symbol errors.
    """
    counters = {"port_rcv_data": 25_000_000_000, "port_xmit_data": 24_000_000_000, "port_rcv_packets": 9_000_000}
    counters |= {"port_xmit_packets": 8_500_000, "symbol_error": 0 if healthy else 42, "link_downed": 0}
    write_device(root, "mlx5_0", {1: Port(counters=counters, hw_counters={"out_of_sequence": 0})})
    down = {"state": "1: DOWN", "phys_state": "2: Polling", "rate": "10 Gb/sec (4X)"}
    write_device(
        root,
        "mlx5_1",
        {
            1: Port(
                **({} if healthy else down),
                counters={**counters, "symbol_error": 0, "link_downed": 0 if healthy else 3},
            )
        },
    )
    write_device(
        root,
        "mlx5_2",
        {
            1: Port(
                link_layer="Ethernet", rate="100 Gb/sec (2X HDR)", counters=counters, hw_counters={"out_of_buffer": 0}
            )
        },
    )
    return root
