"""The ``gpus`` filter: all, visible (CUDA / ROCm variables), lists of indices and UUIDs."""

from __future__ import annotations

import pytest

from otel_forge.collectors.gpu_selection import AMD_VISIBLE_ENV, NVIDIA_VISIBLE_ENV, select_gpus

DEVICES = [
    (0, "GPU-1a2b0000-0000-4000-8000-000000000000"),
    (1, "GPU-1a2b0001-0000-4000-8000-000000000001"),
    (2, "GPU-77770002-0000-4000-8000-000000000002"),
    (3, "GPU-88880003-0000-4000-8000-000000000003"),
]


def test_all_selects_every_device() -> None:
    assert select_gpus("all", DEVICES, NVIDIA_VISIBLE_ENV, environ={"CUDA_VISIBLE_DEVICES": "1"}) == [0, 1, 2, 3]


def test_visible_unset_selects_every_device() -> None:
    assert select_gpus("visible", DEVICES, NVIDIA_VISIBLE_ENV, environ={}) == [0, 1, 2, 3]


def test_visible_empty_selects_none() -> None:
    assert select_gpus("visible", DEVICES, NVIDIA_VISIBLE_ENV, environ={"CUDA_VISIBLE_DEVICES": ""}) == []


def test_visible_by_index_keeps_the_listed_order() -> None:
    environ = {"CUDA_VISIBLE_DEVICES": "3,1"}
    assert select_gpus("visible", DEVICES, NVIDIA_VISIBLE_ENV, environ=environ) == [3, 1]


def test_visible_by_uuid_prefix_like_cuda() -> None:
    environ = {"CUDA_VISIBLE_DEVICES": "GPU-7777, GPU-1a2b0001"}
    assert select_gpus("visible", DEVICES, NVIDIA_VISIBLE_ENV, environ=environ) == [2, 1]


def test_visible_negative_index_ends_the_list_like_cuda() -> None:
    assert select_gpus("visible", DEVICES, NVIDIA_VISIBLE_ENV, environ={"CUDA_VISIBLE_DEVICES": "-1"}) == []
    assert select_gpus("visible", DEVICES, NVIDIA_VISIBLE_ENV, environ={"CUDA_VISIBLE_DEVICES": "2,-1,0"}) == [2]


def test_visible_amd_prefers_rocr_over_hip() -> None:
    environ = {"ROCR_VISIBLE_DEVICES": "0", "HIP_VISIBLE_DEVICES": "1"}
    assert select_gpus("visible", DEVICES, AMD_VISIBLE_ENV, environ=environ) == [0]
    assert select_gpus("visible", DEVICES, AMD_VISIBLE_ENV, environ={"HIP_VISIBLE_DEVICES": "1"}) == [1]


def test_visible_ignores_the_other_vendors_variable() -> None:
    assert select_gpus("visible", DEVICES, AMD_VISIBLE_ENV, environ={"CUDA_VISIBLE_DEVICES": "1"}) == [0, 1, 2, 3]


def test_list_of_indices_and_uuids_without_duplicates() -> None:
    assert select_gpus("2, GPU-88880003, 2, 0", DEVICES, NVIDIA_VISIBLE_ENV, environ={}) == [2, 3, 0]


def test_uuid_matches_without_case_or_gpu_prefix() -> None:
    assert select_gpus("gpu-88880003", DEVICES, NVIDIA_VISIBLE_ENV, environ={}) == [3]
    assert select_gpus("77770002-0000", DEVICES, AMD_VISIBLE_ENV, environ={}) == [2]


def test_unknown_index_names_it() -> None:
    with pytest.raises(ValueError, match="index 7"):
        select_gpus("0,7", DEVICES, NVIDIA_VISIBLE_ENV, environ={})


def test_negative_index_in_an_explicit_list_is_an_error() -> None:
    with pytest.raises(ValueError, match="index -1"):
        select_gpus("-1", DEVICES, NVIDIA_VISIBLE_ENV, environ={})


def test_unknown_uuid_names_it_and_the_variable() -> None:
    with pytest.raises(ValueError, match="GPU-ffff.*CUDA_VISIBLE_DEVICES"):
        select_gpus("visible", DEVICES, NVIDIA_VISIBLE_ENV, environ={"CUDA_VISIBLE_DEVICES": "GPU-ffff"})


def test_ambiguous_uuid_prefix_is_an_error() -> None:
    with pytest.raises(ValueError, match=r"GPU-1a2b matches GPUs \[0, 1\]"):
        select_gpus("GPU-1a2b", DEVICES, NVIDIA_VISIBLE_ENV, environ={})


def test_bare_gpu_prefix_matches_nothing() -> None:
    with pytest.raises(ValueError, match="no GPU with UUID GPU-"):
        select_gpus("GPU-", DEVICES, NVIDIA_VISIBLE_ENV, environ={})
