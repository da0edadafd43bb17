"""Which ONNX Runtime and execution provider specd uses, and why."""

from __future__ import annotations

import contextlib
import ctypes.util
import functools
import os
from dataclasses import dataclass


class DeviceUnavailable(RuntimeError):
    """The device asked for cannot be used (no CUDA build, libraries, or device)."""


@dataclass(frozen=True)
class RuntimeChoice:
    ort_version: str
    package: str  # "onnxruntime" or "onnxruntime-gpu"
    provider: str  # "CUDAExecutionProvider" / "CPUExecutionProvider"
    device: str  # "cuda:0" / "cpu"
    reason: str

    def describe(self) -> str:
        return (f"ONNX Runtime {self.ort_version} ({self.package}), {self.provider} "
                f"on {self.device}: {self.reason}")


def parse_device(device: str) -> tuple[str, int]:
    """"cpu" -> ("cpu", 0); "cuda" / "cuda:N" -> ("cuda", N); anything else: ValueError."""
    if device == "cpu":
        return "cpu", 0
    if device == "cuda":
        return "cuda", 0
    if device.startswith("cuda:") and device[5:].isdigit():
        return "cuda", int(device[5:])
    raise ValueError(f"unknown device {device!r}: use cpu or cuda:N")


def session_providers(device: str) -> list[str | tuple[str, dict[str, int]]]:
    """The `providers` argument of an InferenceSession on `device` ("cpu" / "cuda:N"):
    CUDA first with the CPU for the nodes it has no kernel for. Device 0 is named without
    options: ORT >= 1.26 warns on every session given a device_id while it looks for a
    plugin EP first (the built-in CUDA EP is used either way)."""
    kind, index = parse_device(device)
    if kind == "cpu":
        return ["CPUExecutionProvider"]
    cuda: str | tuple[str, dict[str, int]] = (
        "CUDAExecutionProvider" if index == 0 else ("CUDAExecutionProvider", {"device_id": index}))
    return [cuda, "CPUExecutionProvider"]


def _package_name() -> str:
    from importlib import metadata

    for name in ("onnxruntime-gpu", "onnxruntime"):
        try:
            metadata.version(name)
            return name
        except metadata.PackageNotFoundError:
            continue
    return "onnxruntime"


def choose_runtime(device: str = "auto") -> RuntimeChoice:
    """device: "auto", "cpu" or "cuda[:N]". "auto" is $SPECD_DEVICE where that is set,
    else CUDA where onnxruntime-gpu finds a GPU and its libraries, else the CPU."""
    import onnxruntime as ort

    source = ""
    if device == "auto" and os.environ.get("SPECD_DEVICE", "").strip():
        device, source = os.environ["SPECD_DEVICE"].strip(), " (from $SPECD_DEVICE)"
    kind, index = "auto", 0
    if device != "auto":
        try:
            kind, index = parse_device(device)
        except ValueError:
            raise ValueError(f"unknown device {device!r}{source}: use auto, cpu, cuda or "
                             "cuda:N") from None

    pkg, version = _package_name(), ort.__version__
    available = ort.get_available_providers()
    if kind == "cpu":
        return RuntimeChoice(version, pkg, "CPUExecutionProvider", "cpu", "CPU requested")
    if "CUDAExecutionProvider" not in available:
        why = ("CUDA EP not available: the CPU package onnxruntime is installed"
               if pkg == "onnxruntime" else "CUDA EP not available in this build")
        if kind == "cuda":
            raise DeviceUnavailable(why)
        return RuntimeChoice(version, pkg, "CPUExecutionProvider", "cpu", why)
    problem = cuda_problem(index)
    if problem is not None:
        if kind == "cuda":
            raise DeviceUnavailable(f"cuda:{index} cannot be used: {problem}")
        return RuntimeChoice(version, pkg, "CPUExecutionProvider", "cpu",
                             f"CUDA EP not usable ({problem})")
    return RuntimeChoice(version, pkg, "CUDAExecutionProvider", f"cuda:{index}",
                         "onnxruntime-gpu with a CUDA device")


def ort_error_line(exc: BaseException, limit: int = 300) -> str:
    """The first line of an ONNX Runtime exception (its messages run to many lines)."""
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0][:limit]


@functools.cache
def cuda_problem(index: int = 0) -> str | None:
    """Why ONNX Runtime cannot use CUDA device `index` (None: it can). A build with the
    CUDA EP lists it whether or not the CUDA and cuDNN libraries it loads are present, so
    this allocates one value on the device, which loads them (the CUDA context's start
    is paid here, once per process)."""
    import numpy as np
    import onnxruntime as ort

    with contextlib.suppress(Exception):  # onnxruntime-gpu >= 1.21: the nvidia-* wheels
        ort.preload_dlls()
    try:
        ort.OrtValue.ortvalue_from_numpy(np.zeros(1, np.float32), "cuda", index)
    except Exception as exc:  # ORT's own error types
        missing = [lib for lib in ("cudart", "cublas") if ctypes.util.find_library(lib) is None]
        hint = f"; lib{missing[0]} is not installed" if missing else ""
        return f"{ort_error_line(exc, 200)}{hint}"
    return None
