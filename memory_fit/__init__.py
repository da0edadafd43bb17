"""specd.memory_fit: device memory probes, per-model memory costs and the context planner.

    probe = probe_for("cpu")                    # or "cuda:0"
    free = FakeProbe.snapshot(probe)            # before measuring loads anything
    cost_t = measure(built_target, "cpu")       # cached in the graph folder
    cost_d = measure(built_draft, "cpu")
    plan = fit(cost_t, cost_d, probe=free, slots=1, margin_bytes=512 << 20)
    print(plan.table())
"""

from .measure import MeasureError, ModelCost, measure
from .plan import DEFAULT_MARGIN_BYTES, DEFAULT_MIN_CTX, FitError, ModelRow, Plan, fit
from .probes import CpuProbe, CudaProbe, DeviceMemory, FakeProbe, ProbeError, probe_for

__all__ = [
    "DEFAULT_MARGIN_BYTES", "DEFAULT_MIN_CTX", "CpuProbe", "CudaProbe", "DeviceMemory",
    "FakeProbe", "FitError", "MeasureError", "ModelCost", "ModelRow", "Plan", "ProbeError",
    "fit", "measure", "probe_for",
]
