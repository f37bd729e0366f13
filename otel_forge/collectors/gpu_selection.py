"""Which GPUs a collector reads: the ``gpus`` setting resolved against the devices present.

``all`` is every device; ``visible`` follows the vendor's visibility variable the way the
runtime does (CUDA_VISIBLE_DEVICES for NVIDIA; ROCR_VISIBLE_DEVICES, then HIP_VISIBLE_DEVICES
for AMD); anything else is a comma-separated list of indices and UUIDs. Pure: no library calls.

A device is a whole GPU (its key is its index) or a MIG instance (its key is its ``hw.id``, e.g.
``0_mig1``, and its UUID ``MIG-...``, as CUDA_VISIBLE_DEVICES names it). An index selects only a
whole GPU; a ``MIG-`` UUID only a MIG instance; a GPU UUID (with or without ``GPU-``) only a GPU.

Two caveats of ``visible``, both from the runtimes rather than from us: CUDA numbers devices
fastest-first unless ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` while NVML numbers them in PCI order, so
index entries are only exact with that setting (UUIDs always are); and a negative index (the
common ``CUDA_VISIBLE_DEVICES=-1``) ends the list, as it does for CUDA.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence

NVIDIA_VISIBLE_ENV = ("CUDA_VISIBLE_DEVICES",)
AMD_VISIBLE_ENV = ("ROCR_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES")

DeviceKey = int | str  # a GPU's index, or a MIG instance's hw.id
Device = tuple[DeviceKey, str]  # (key, uuid)


def select_gpus(
    spec: str, devices: Sequence[Device], visible_env_vars: Sequence[str], environ: Mapping[str, str] | None = None
) -> list[DeviceKey]:
    """The keys of ``devices`` that ``spec`` selects, in the order it names them.

    Raises ``ValueError`` naming the entry when an index or UUID matches no device (or a UUID
    prefix matches several).
    """
    text = spec.strip()
    if text.lower() == "all":
        return [index for index, _ in devices]
    if text.lower() == "visible":
        environ = os.environ if environ is None else environ
        for name in visible_env_vars:
            if name in environ:
                return _resolve(environ[name], devices, f"{name}={environ[name]!r}", stop_at_negative=True)
        return [index for index, _ in devices]
    return _resolve(text, devices, f"gpus={spec!r}", stop_at_negative=False)


def _resolve(text: str, devices: Sequence[Device], source: str, stop_at_negative: bool) -> list[DeviceKey]:
    selected: list[DeviceKey] = []
    for entry in (part.strip() for part in text.split(",")):
        if not entry:
            continue
        if _is_int(entry) and int(entry) < 0 and stop_at_negative:
            break
        index = _match(entry, devices, source)
        if index not in selected:
            selected.append(index)
    return selected


def _match(entry: str, devices: Sequence[Device], source: str) -> DeviceKey:
    if _is_int(entry):
        wanted = int(entry)
        if any(isinstance(index, int) and index == wanted for index, _ in devices):
            return wanted
        raise ValueError(f"no GPU with index {entry} ({source}; present: {_present(devices)})")
    key = _uuid_key(entry)
    matches = [index for index, uuid in devices if key and _uuid_key(uuid).startswith(key)]
    if len(matches) == 1:
        return matches[0]
    if not matches:
        raise ValueError(f"no GPU with UUID {entry} ({source}; present: {_present(devices)})")
    raise ValueError(f"GPU UUID prefix {entry} matches GPUs {matches} ({source})")


def _uuid_key(uuid: str) -> str:
    """UUIDs compare without case and without the ``GPU-`` prefix ROCm and CUDA spell differently.

    ``MIG-`` stays: a bare UUID prefix must not pick a MIG instance instead of its GPU.
    """
    lowered = uuid.strip().lower()
    return lowered[4:] if lowered.startswith("gpu-") else lowered


def _is_int(text: str) -> bool:
    try:
        int(text)
    except ValueError:
        return False
    return True


def _present(devices: Sequence[Device]) -> str:
    return ", ".join(f"{index} {uuid}" for index, uuid in devices) or "none"
