"""This machine's readings as Triton's metrics show them: CPU utilization and memory from /proc, and the
GPUs through NVML. Workers publish their GPU readings with each heartbeat (workers/presence.py), so that
the control plane's /metrics (metrics.py) shows the GPUs of every worker's machine.
"""
from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

# Triton's GPU metrics: (name, type, help, the GpuReader reading it shows)
GPU_FAMILIES = (
    ("nv_gpu_utilization", "gauge", "GPU utilization rate [0.0 - 1.0)", "utilization"),
    ("nv_gpu_memory_total_bytes", "gauge", "GPU total memory, in bytes", "memory_total"),
    ("nv_gpu_memory_used_bytes", "gauge", "GPU used memory, in bytes", "memory_used"),
    ("nv_gpu_power_usage", "gauge", "GPU power usage in watts", "power_usage"),
    ("nv_gpu_power_limit", "gauge", "GPU power management limit in watts", "power_limit"),
    ("nv_energy_consumption", "counter", "GPU energy consumption in joules since the driver loaded",
     "energy"),
)
Sample = tuple[str, str, str, dict[str, str], float]  # (family, type, help, labels, value)


class GpuReader:
    """This machine's NVIDIA GPUs as NVML reads them (the `gpu` extra: nvidia-ml-py); no readings where
    NVML does not answer (no library, no driver, no GPU). Workers publish theirs with each heartbeat,
    so that the control plane's /metrics shows the GPUs of every worker's machine."""

    def __init__(self) -> None:
        self._nvml: Any = None
        try:
            import pynvml

            pynvml.nvmlInit()
            self._nvml = pynvml
        except Exception:  # no NVML library or no GPU: no GPU metrics
            self._nvml = None

    @property
    def active(self) -> bool:
        return self._nvml is not None

    def readings(self) -> list[dict[str, Any]]:
        """Per GPU: uuid, and what NVML answers of utilization (0-1), memory_total and memory_used (bytes),
        power_usage and power_limit (W), energy (J); a reading this GPU does not support is left out."""
        nv = self._nvml
        if nv is None:
            return []
        out = []
        try:
            count = nv.nvmlDeviceGetCount()
        except Exception:
            return []
        for i in range(count):
            try:
                h = nv.nvmlDeviceGetHandleByIndex(i)
                uuid = nv.nvmlDeviceGetUUID(h)
            except Exception:
                continue
            reading: dict[str, Any] = {"uuid": uuid.decode() if isinstance(uuid, bytes) else str(uuid)}
            for key, read in (("utilization", lambda h: nv.nvmlDeviceGetUtilizationRates(h).gpu / 100),
                              ("memory_total", lambda h: nv.nvmlDeviceGetMemoryInfo(h).total),
                              ("memory_used", lambda h: nv.nvmlDeviceGetMemoryInfo(h).used),
                              ("power_usage", lambda h: nv.nvmlDeviceGetPowerUsage(h) / 1000),
                              ("power_limit", lambda h: nv.nvmlDeviceGetPowerManagementLimit(h) / 1000),
                              ("energy", lambda h: nv.nvmlDeviceGetTotalEnergyConsumption(h) / 1000)):
                try:
                    reading[key] = float(read(h))
                except Exception:  # NVML_ERROR_NOT_SUPPORTED and the like: that metric is not there
                    pass
            out.append(reading)
        return out


def gpu_samples(readings: Iterable[dict[str, Any]]) -> list[Sample]:
    """Readings of GPUs (from several machines; one GPU read by several processes counts once, by its
    UUID) -> Triton's GPU families, labelled by gpu_uuid."""
    by_uuid = {r["uuid"]: r for r in readings if isinstance(r, dict) and isinstance(r.get("uuid"), str)}
    out: list[Sample] = []
    for name, kind, help_, key in GPU_FAMILIES:
        for uuid, reading in sorted(by_uuid.items()):
            value = reading.get(key)
            if isinstance(value, (int, float)):
                out.append((name, kind, help_, {"gpu_uuid": uuid}, value))
    return out


class HostMetrics:
    """Triton's CPU metrics for this machine, and GPU metrics for its GPUs and those workers report."""

    def __init__(self) -> None:
        self._last: tuple[int, int] | None = None
        self.gpus = GpuReader()

    def samples(self, reported: Iterable[dict[str, Any]] = ()) -> list[Sample]:
        """`reported`: the GPU readings the workers published (metrics.collect)."""
        out: list[Sample] = []
        util = self._cpu_utilization()
        if util is not None:
            out.append(("nv_cpu_utilization", "gauge", "CPU utilization rate [0.0 - 1.0]", {}, util))
        mem = _meminfo()
        if mem:
            total, available = mem
            out.append(("nv_cpu_memory_total_bytes", "gauge", "CPU total memory (RAM), in bytes", {}, total))
            out.append(("nv_cpu_memory_used_bytes", "gauge", "CPU used memory (RAM), in bytes", {},
                        total - available))
        return out + gpu_samples([*reported, *self.gpus.readings()])

    def _cpu_utilization(self) -> float | None:
        try:
            fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        except (OSError, ValueError):
            return None
        idle, total = fields[3] + fields[4], sum(fields)
        last, self._last = self._last, (idle, total)
        if last is None or total == last[1]:
            return 0.0
        return 1.0 - (idle - last[0]) / (total - last[1])


def _meminfo() -> tuple[int, int] | None:
    try:
        info = {line.split(":")[0]: int(line.split()[1]) * 1024
                for line in Path("/proc/meminfo").read_text().splitlines() if line.split()[1:]}
        return info["MemTotal"], info["MemAvailable"]
    except (OSError, KeyError, ValueError):
        return None
