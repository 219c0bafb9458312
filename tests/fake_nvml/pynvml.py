"""Stands in for NVIDIA's NVML library (nvidia-ml-py's `pynvml`) where there is no GPU: two GPUs with fixed
readings, the second without power readings (as some GPUs answer NVML_ERROR_NOT_SUPPORTED). Each
process's GPUs are named after its Despina role, so a test can tell which process reported them. Put
on PYTHONPATH by tests/test_metrics.py only; nothing of Despina is replaced."""
from __future__ import annotations

import sys
from types import SimpleNamespace

ROLE = sys.argv[1] if len(sys.argv) > 1 else "test"


class NVMLError(Exception):
    pass


def nvmlInit() -> None:
    pass


def nvmlDeviceGetCount() -> int:
    return 2


def nvmlDeviceGetHandleByIndex(i: int) -> int:
    return i


def nvmlDeviceGetUUID(h: int) -> str:
    return f"GPU-{ROLE}-{h}"


def nvmlDeviceGetUtilizationRates(h: int) -> SimpleNamespace:
    return SimpleNamespace(gpu=25 * (h + 1), memory=10)


def nvmlDeviceGetMemoryInfo(h: int) -> SimpleNamespace:
    return SimpleNamespace(total=80 * 2**30, used=(h + 1) * 2**30, free=0)


def nvmlDeviceGetPowerUsage(h: int) -> int:
    if h == 1:
        raise NVMLError("Not Supported")
    return 150_000  # mW


def nvmlDeviceGetPowerManagementLimit(h: int) -> int:
    if h == 1:
        raise NVMLError("Not Supported")
    return 700_000


def nvmlDeviceGetTotalEnergyConsumption(h: int) -> int:
    return 1_000_000 * (h + 1)  # mJ
