"""How much memory the device that will hold the models has, and how much of it is free.

`probe_for("cpu")` reads the system's available memory (psutil); `probe_for("cuda:N")`
reads NVML (package nvidia-ml-py). `FakeProbe` answers fixed numbers, for tests and for
planning against a snapshot taken before measuring (measuring loads models, which would
otherwise eat into the free memory it is meant to plan with).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from specd.ort_models.providers import parse_device


class ProbeError(RuntimeError):
    """The device cannot be probed (message for the user)."""


@dataclass(frozen=True)
class DeviceMemory:
    device: str  # "cpu" / "cuda:0"
    total_bytes: int
    free_bytes: int

    @property
    def used_bytes(self) -> int:
        return self.total_bytes - self.free_bytes


class MemoryProbe(Protocol):
    device: str

    def read(self) -> DeviceMemory: ...


class CpuProbe:
    """System RAM: total and `available` (free + reclaimable page cache)."""

    device = "cpu"

    def read(self) -> DeviceMemory:
        import psutil

        vm = psutil.virtual_memory()
        return DeviceMemory(self.device, int(vm.total), int(vm.available))


class CudaProbe:
    """One NVIDIA GPU through NVML (the whole device, all processes)."""

    def __init__(self, index: int = 0):
        self.index = index
        self.device = f"cuda:{index}"
        try:
            import pynvml  # from the nvidia-ml-py package
        except ImportError:
            raise ProbeError(f"cannot probe {self.device}: NVML bindings missing; install "
                             "nvidia-ml-py (pip install 'specd[gpu]')") from None
        self._nvml = pynvml
        try:
            pynvml.nvmlInit()
            self._handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        except pynvml.NVMLError as exc:
            raise ProbeError(f"cannot probe {self.device}: NVML: {exc}") from None

    def read(self) -> DeviceMemory:
        try:
            info = self._nvml.nvmlDeviceGetMemoryInfo(self._handle)
        except self._nvml.NVMLError as exc:
            raise ProbeError(f"cannot probe {self.device}: NVML: {exc}") from None
        return DeviceMemory(self.device, int(info.total), int(info.free))


class FakeProbe:
    """Fixed numbers (tests, or a snapshot taken earlier by another probe)."""

    def __init__(self, total: int, free: int, device: str = "cpu"):
        if not 0 <= free <= total:
            raise ValueError(f"free {free} must be within 0..total {total}")
        self.device = device
        self._mem = DeviceMemory(device, total, free)

    @classmethod
    def snapshot(cls, probe: MemoryProbe) -> FakeProbe:
        m = probe.read()
        return cls(m.total_bytes, m.free_bytes, m.device)

    def read(self) -> DeviceMemory:
        return self._mem


def probe_for(device: str) -> MemoryProbe:
    kind, index = parse_device(device)
    return CpuProbe() if kind == "cpu" else CudaProbe(index)
