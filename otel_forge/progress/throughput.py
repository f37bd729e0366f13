"""Throughput and model FLOPs utilisation (MFU) from the job's steps per second.

FLOPs per step: the ``flops_per_step`` setting, else 6 x parameters x tokens per step (the dense
transformer's forward and backward, Kaplan et al. 2020; torchtitan and Megatron use it, plus an
attention term we leave out: MFU is slightly under-stated for long sequences). Peak: the setting,
else the dense BF16 tensor peak of the GPU's model, from the vendors' datasheets:
- NVIDIA H100 SXM 989 TFLOP/s, H100 PCIe 756, H200 989 (H100/H200 datasheets, "BF16 Tensor Core",
  without sparsity), A100 312 (A100 datasheet), B200 2,250 and GB200 2,500 per GPU (DGX B200 and
  GB200 NVL72 pages, dense), L40S 362, L4 121, A10 125, V100 125 (FP16 tensor; V100 has no BF16);
- AMD MI300X 1,307, MI325X 1,307, MI250X 383 (Instinct datasheets, BF16 dense).
"""

from __future__ import annotations

from collections.abc import Iterable

# Substring of the GPU's model name (NVML's name, amdsmi's market name) -> FLOP/s; longest match first.
PEAK_FLOPS: tuple[tuple[str, float], ...] = (
    ("GB200", 2.5e15),
    ("B200", 2.25e15),
    ("H200", 989e12),
    ("H100 PCIe", 756e12),
    ("H100", 989e12),
    ("A100", 312e12),
    ("L40S", 362e12),
    ("A10G", 125e12),
    ("A10", 125e12),
    ("L4", 121e12),
    ("V100", 125e12),
    ("MI325X", 1.307e15),
    ("MI300X", 1.307e15),
    ("MI250X", 383e12),
)


def peak_flops(model: str) -> float | None:
    """One GPU's dense BF16 peak by its model name, None for a model not in the table."""
    for name, flops in sorted(PEAK_FLOPS, key=lambda entry: -len(entry[0])):
        if name.lower() in model.lower():
            return flops
    return None


def flops_per_step(flops: float | None, parameters: float | None, tokens: float | None) -> float | None:
    if flops is not None:
        return flops
    if parameters is not None and tokens is not None:
        return 6.0 * parameters * tokens
    return None


def mfu(
    steps_per_s: float, step_flops: float | None, models: Iterable[str], gpus: int, peak: float | None = None
) -> float | None:
    """Achieved FLOP/s over the job's ``gpus`` GPUs' peak; None where a figure is missing."""
    if step_flops is None or gpus <= 0:
        return None
    if peak is None:
        peaks = [p for model in models if (p := peak_flops(model)) is not None]
        peak = min(peaks) if peaks else None  # a mixed node runs at its slowest GPU's pace
    if peak is None:
        return None
    return steps_per_s * step_flops / (peak * gpus)
