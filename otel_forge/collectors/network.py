"""Network: bytes, packets, errors and drops per interface; loopback and virtual ones filtered.

Beside them, the bytes of every interface summed, loopback and virtual ones included: that is what
MLflow's monitor counts (``psutil.net_io_counters()``) under ``network_*_megabytes``, and a key MLflow
also writes keeps MLflow's meaning.
"""

from __future__ import annotations

import os

import psutil

from otel_forge.collectors.base import HardwareCollector, Readings
from otel_forge.config import ForgeConfig

_VIRTUAL_PREFIXES = ("lo", "docker", "veth", "br-", "virbr", "cni", "flannel", "cali", "ifb", "tun", "tap")
_SYSFS_VIRTUAL = "/sys/devices/virtual/net"
_DIRECTIONS = ("receive", "transmit")


def is_physical_interface(name: str) -> bool:
    """Loopback, bridges, veths and other software interfaces carry no traffic off the node."""
    if name.startswith(_VIRTUAL_PREFIXES):
        return False
    return not os.path.exists(os.path.join(_SYSFS_VIRTUAL, name))


class NetworkCollector(HardwareCollector):
    name = "network"

    def __init__(self, include_virtual: bool = False) -> None:
        self._include_virtual = include_virtual

    @classmethod
    def create(cls, config: ForgeConfig) -> NetworkCollector:
        return cls()

    def read(self, readings: Readings) -> None:
        # One read for both: the per-interface series and the all-interface sum come from the same counters.
        all_interfaces = dict.fromkeys(_DIRECTIONS, 0)
        for interface, io in psutil.net_io_counters(pernic=True, nowrap=True).items():
            all_interfaces["receive"] += io.bytes_recv
            all_interfaces["transmit"] += io.bytes_sent
            if not self._include_virtual and not is_physical_interface(interface):
                continue
            for direction, nbytes, packets, errors, dropped in (
                ("receive", io.bytes_recv, io.packets_recv, io.errin, io.dropin),
                ("transmit", io.bytes_sent, io.packets_sent, io.errout, io.dropout),
            ):
                attributes = {"network.interface.name": interface, "network.io.direction": direction}
                readings.add("system.network.io", nbytes, attributes)
                readings.add("system.network.packet.count", packets, attributes)
                readings.add("system.network.errors", errors, attributes)
                readings.add("system.network.packet.dropped", dropped, attributes)
        for direction, nbytes in all_interfaces.items():
            readings.add("otel_forge.network.io.all_interfaces", nbytes, {"network.io.direction": direction})
