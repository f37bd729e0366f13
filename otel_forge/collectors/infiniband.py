"""InfiniBand and RoCE ports: traffic, packets, error counters, state and link rate, from sysfs.

Each port of each RDMA device is read the way node_exporter's infiniband collector reads it
(procfs's ``sysfs/class_infiniband.go``): ``<root>/<device>/ports/<port>/`` holds ``link_layer``
(``InfiniBand``, or ``Ethernet`` for RoCE), ``state`` (``4: ACTIVE``), ``phys_state`` (``5: LinkUp``),
``rate`` (``100 Gb/sec (4X EDR)``), the port's PMA counters in ``counters/`` (and, before kernel 4.5,
their 64-bit forms in ``counters_ext/``) and driver counters in ``hw_counters/`` (mlx5: RoCE and
transport errors; no byte counts there). Only the files named below are read: each counter file
is a query to the adapter. A missing folder, a missing file, an unreadable one or a counter the
adapter does not keep (``N/A (no PMA)``) costs that value alone.

Units: ``port_rcv_data`` and ``port_xmit_data`` count 4-byte words (the spec's PortXmitData is
octets / 4): bytes are the counter x 4, as node_exporter reports them.

Wrap: a port whose adapter has extended counters gives 64-bit values (``counters/`` on kernels
since 4.5, ``counters_ext/*_64`` before; the 64-bit file is preferred where both exist). A legacy
adapter's 32-bit PortCounters saturate at 2**32 - 1 (the spec), and wrap where a driver or the
subnet manager's PerfMgr resets them: each counter is kept as a running total per port that adds
the raw value's growth, and where a counter that has never exceeded 32 bits goes down, its growth
modulo 2**32 (a wrap; a reset at an arbitrary value is then over-counted by at most one turn, a
saturated counter grows by nothing until it is reset). A 64-bit counter that goes down, and an
error counter (8 to 32 bits wide, saturating), was reset: the total grows by the new raw value.
So every counter is monotonic for OpenTelemetry's cumulative sums, as psutil's ``nowrap=True``
makes the network and disk counters.
"""

from __future__ import annotations

import os
import re

from otel_forge.collectors.base import CollectorUnavailable, HardwareCollector, Readings
from otel_forge.collectors.kernel_files import read_int, read_text
from otel_forge.config import ForgeConfig

DEFAULT_ROOT = "/sys/class/infiniband"

# (direction, 64-bit file in counters_ext/, file in counters/)
_DATA_FILES = (("receive", "port_rcv_data_64", "port_rcv_data"), ("transmit", "port_xmit_data_64", "port_xmit_data"))
_PACKET_FILES = (
    ("receive", "port_rcv_packets_64", "port_rcv_packets"),
    ("transmit", "port_xmit_packets_64", "port_xmit_packets"),
)
# (metric, direction, 64-bit file in counters_ext/, file in counters/)
_CAST_PACKET_FILES = (
    ("otel_forge.infiniband.unicast.packets", "receive", "port_unicast_rcv_packets", "unicast_rcv_packets"),
    ("otel_forge.infiniband.unicast.packets", "transmit", "port_unicast_xmit_packets", "unicast_xmit_packets"),
    ("otel_forge.infiniband.multicast.packets", "receive", "port_multicast_rcv_packets", "multicast_rcv_packets"),
    ("otel_forge.infiniband.multicast.packets", "transmit", "port_multicast_xmit_packets", "multicast_xmit_packets"),
)
_BYTES_PER_DATA_WORD = 4

# The port's PMA error counters (counters/) and, for RoCE and the transport, the driver's (hw_counters/):
# ``error.type`` is the file's name.
PMA_ERROR_COUNTERS = (
    "symbol_error",
    "port_rcv_errors",
    "port_rcv_remote_physical_errors",
    "port_rcv_switch_relay_errors",
    "port_rcv_discards",
    "port_xmit_discards",
    "port_rcv_constraint_errors",
    "port_xmit_constraint_errors",
    "link_downed",
    "link_error_recovery",
    "local_link_integrity_errors",
    "excessive_buffer_overrun_errors",
    "VL15_dropped",
)
HW_ERROR_COUNTERS = (
    "out_of_buffer",
    "out_of_sequence",
    "packet_seq_err",
    "local_ack_timeout_err",
    "implied_nak_seq_err",
    "rnr_nak_retry_err",
    "rx_icrc_encapsulated",
)

# The kernel's names (drivers/infiniband/core/sysfs.c), in snake case: every one is reported, 1 for
# the port's current state and 0 for the others, so a change is a change of value, not of series.
PORT_STATES = ("down", "init", "armed", "active", "active_defer")
PHYSICAL_STATES = (
    "sleep",
    "polling",
    "disabled",
    "port_configuration_training",
    "link_up",
    "link_error_recovery",
    "phy_test",
)

_WIDE = 1 << 32
_CAMEL_BOUNDARY = re.compile(r"(?<=[a-z0-9])(?=[A-Z])")
_NOT_IN_NAME = re.compile(r"[^a-z0-9]+")


def parse_state(text: str) -> str | None:
    """``4: ACTIVE`` -> ``active``, ``5: LinkUp`` -> ``link_up``; None when the text is not ``<id>: <name>``."""
    number, sep, name = text.partition(":")
    if not sep or not number.strip().isdigit() or not name.strip():
        return None
    snake = _CAMEL_BOUNDARY.sub("_", name.strip()).lower()
    return _NOT_IN_NAME.sub("_", snake).strip("_") or None


def parse_rate(text: str) -> float | None:
    """``100 Gb/sec (4X EDR)`` -> bytes per second (12.5e9); None when there is no number of Gb/s."""
    parts = text.split()
    if len(parts) < 2 or not parts[1].startswith("Gb/s"):
        return None
    try:
        gigabits = float(parts[0])
    except ValueError:
        return None
    return gigabits * 1e9 / 8


def _read_text(path: str) -> str | None:
    text = read_text(path)
    return text.strip() if text is not None else None


def _port_numbers(ports_dir: str) -> list[str]:
    try:
        return sorted((name for name in os.listdir(ports_dir) if name.isdigit()), key=int)
    except OSError:
        return []


class _RunningTotals:
    """Monotonic totals of raw counters, per (device, port, file): see the module's docstring."""

    def __init__(self) -> None:
        self._last: dict[tuple[str, str, str], tuple[int, int, bool]] = {}  # raw, total, seen 64 bits

    def advance(self, key: tuple[str, str, str], raw: int, wraps: bool) -> int:
        previous = self._last.get(key)
        if previous is None:
            total, wide = raw, raw >= _WIDE
        else:
            last, total, wide = previous
            wide = wide or raw >= _WIDE
            if raw >= last:
                total += raw - last
            elif wraps and not wide:
                total += (raw - last) % _WIDE
            else:
                total += raw  # reset: counting from 0 again
        self._last[key] = (raw, total, wide)
        return total


class InfinibandCollector(HardwareCollector):
    """Every port of every device under ``root`` (``/sys/class/infiniband``), read each time anew."""

    name = "infiniband"

    def __init__(self, root: str = DEFAULT_ROOT) -> None:
        self._root = root
        self._totals = _RunningTotals()

    @classmethod
    def create(cls, config: ForgeConfig) -> InfinibandCollector:
        collector = cls(config.infiniband_root)
        if not collector.devices():
            raise CollectorUnavailable(f"no InfiniBand or RoCE device under {config.infiniband_root}")
        return collector

    def devices(self) -> list[str]:
        try:
            return sorted(name for name in os.listdir(self._root) if os.path.isdir(os.path.join(self._root, name)))
        except OSError:
            return []

    def ports(self) -> list[tuple[str, str, str]]:
        """(device, port number, the port's folder) of every port, in order."""
        found = []
        for device in self.devices():
            ports_dir = os.path.join(self._root, device, "ports")
            found += [(device, port, os.path.join(ports_dir, port)) for port in _port_numbers(ports_dir)]
        return found

    def describe(self) -> list[str]:
        """One line per port: ``mlx5_0 port 1: InfiniBand, 4: ACTIVE, 200 Gb/sec (4X HDR)``."""
        return [
            f"{device} port {port}: "
            + ", ".join(
                _read_text(os.path.join(path, name)) or f"{name} unknown" for name in ("link_layer", "state", "rate")
            )
            for device, port, path in self.ports()
        ]

    def read(self, readings: Readings) -> None:
        for device, port, path in self.ports():
            self._read_port(readings, device, port, path)

    def _read_port(self, readings: Readings, device: str, port: str, path: str) -> None:
        link_layer = (_read_text(os.path.join(path, "link_layer")) or "unknown").lower()
        attributes = {
            "otel_forge.infiniband.device": device,
            "otel_forge.infiniband.port": port,
            "otel_forge.infiniband.link_layer": link_layer,
        }
        state = parse_state(_read_text(os.path.join(path, "state")) or "")
        physical_state = parse_state(_read_text(os.path.join(path, "phys_state")) or "")
        self._states(
            readings, "otel_forge.infiniband.status", "otel_forge.infiniband.state", PORT_STATES, state, attributes
        )
        self._states(
            readings,
            "otel_forge.infiniband.physical_status",
            "otel_forge.infiniband.physical_state",
            PHYSICAL_STATES,
            physical_state,
            attributes,
        )
        readings.add("otel_forge.infiniband.rate", parse_rate(_read_text(os.path.join(path, "rate")) or ""), attributes)

        def counter(folder: str, name: str, wraps: bool) -> int | None:
            raw = read_int(os.path.join(path, folder, name))
            return None if raw is None else self._totals.advance((device, port, f"{folder}/{name}"), raw, wraps)

        def preferred(extended: str, legacy: str) -> int | None:
            value = counter("counters_ext", extended, wraps=False)
            return value if value is not None else counter("counters", legacy, wraps=True)

        for direction, extended, legacy in _DATA_FILES:
            words = preferred(extended, legacy)
            io = {**attributes, "network.io.direction": direction}
            readings.add("otel_forge.infiniband.io", None if words is None else words * _BYTES_PER_DATA_WORD, io)
        for direction, extended, legacy in _PACKET_FILES:
            readings.add(
                "otel_forge.infiniband.packets",
                preferred(extended, legacy),
                {**attributes, "network.io.direction": direction},
            )
        for metric, direction, extended, legacy in _CAST_PACKET_FILES:
            readings.add(metric, preferred(extended, legacy), {**attributes, "network.io.direction": direction})
        for folder, names in (("counters", PMA_ERROR_COUNTERS), ("hw_counters", HW_ERROR_COUNTERS)):
            for name in names:
                readings.add(
                    "otel_forge.infiniband.errors",
                    counter(folder, name, wraps=False),
                    {**attributes, "error.type": name},
                )

    @staticmethod
    def _states(
        readings: Readings,
        metric: str,
        attribute: str,
        known: tuple[str, ...],
        current: str | None,
        attributes: dict[str, str],
    ) -> None:
        if current is None:
            return  # unreadable: no claim about the port's state
        for state in known if current in known else (*known, current):
            readings.add(metric, 1 if state == current else 0, {**attributes, attribute: state})
