"""Hardware health: a background thread samples each device (NVML on GPUs when available, psutil on the
host) and keeps the latest snapshot, which the training loop reads without ever waiting on it.

No jax here. A snapshot is {"time", "step", "devices": {name: {reading: value}}, "errors"}; readings a
device does not support are simply absent.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import psutil

GB = 1024**3


class HostSource:
    """Host memory and CPU: what there is to watch on a CPU-only machine (and on every GPU host too)."""

    name = "host"

    def __init__(self):
        self._proc = psutil.Process()
        psutil.cpu_percent(interval=None)  # starts the interval the next call measures over

    def read(self) -> dict[str, dict[str, float]]:
        vm = psutil.virtual_memory()
        return {
            "host": {
                "mem_used_gb": (vm.total - vm.available) / GB,
                "mem_percent": vm.percent,
                "cpu_percent": psutil.cpu_percent(interval=None),
                "rss_gb": self._proc.memory_info().rss / GB,
            }
        }

    def close(self) -> None:
        pass


class NvmlSource:
    """Per-GPU temperature, power, SM clock, memory, ECC counts, throttle reasons and Xid events through NVML
    (the calls are checked against the installed nvidia-ml-py: tests/test_dashboard.py)."""

    name = "nvml"

    def __init__(self):
        import pynvml  # the nvidia-ml-py package; absent on CPU installs

        self._nv = pynvml
        pynvml.nvmlInit()
        count = pynvml.nvmlDeviceGetCount()
        if count == 0:
            pynvml.nvmlShutdown()
            raise RuntimeError("NVML found no GPU")
        self._handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
        self._xid = [0] * count
        self._last_xid = [0] * count
        self._events = self._register_xid()
        nv = pynvml
        # Reasons that mean the chip is being slowed against our will (not idle, not app clocks).
        self._bad_throttle = (
            nv.nvmlClocksThrottleReasonHwSlowdown
            | nv.nvmlClocksThrottleReasonSwThermalSlowdown
            | nv.nvmlClocksThrottleReasonHwThermalSlowdown
            | nv.nvmlClocksThrottleReasonHwPowerBrakeSlowdown
        )

    def _register_xid(self):
        nv = self._nv
        try:
            events = nv.nvmlEventSetCreate()
        except nv.NVMLError:
            return None
        for h in self._handles:
            try:
                nv.nvmlDeviceRegisterEvents(h, nv.nvmlEventTypeXidCriticalError, events)
            except nv.NVMLError:  # not supported on this device or driver: no Xid readings for it
                pass
        return events

    def _drain_xid(self) -> None:
        nv = self._nv
        while self._events is not None:
            try:
                ev = nv.nvmlEventSetWait(self._events, 0)
            except nv.NVMLError:  # Timeout = no pending event
                return
            i = nv.nvmlDeviceGetIndex(ev.device)  # handles were opened by index, so this is ours
            self._xid[i] += 1
            self._last_xid[i] = int(ev.eventData)

    def _device(self, i: int, h) -> dict[str, float]:
        nv, out = self._nv, {}
        probes = {
            "temp_c": lambda: nv.nvmlDeviceGetTemperature(h, nv.NVML_TEMPERATURE_GPU),
            "power_w": lambda: nv.nvmlDeviceGetPowerUsage(h) / 1000.0,
            "sm_clock_mhz": lambda: nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_SM),  # falls when throttled
            "mem_used_gb": lambda: nv.nvmlDeviceGetMemoryInfo(h).used / GB,
            "util_percent": lambda: nv.nvmlDeviceGetUtilizationRates(h).gpu,
            "ecc_corrected": lambda: nv.nvmlDeviceGetTotalEccErrors(
                h, nv.NVML_MEMORY_ERROR_TYPE_CORRECTED, nv.NVML_VOLATILE_ECC
            ),
            "ecc_uncorrected": lambda: nv.nvmlDeviceGetTotalEccErrors(
                h, nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nv.NVML_VOLATILE_ECC
            ),
            "throttle_reasons": lambda: nv.nvmlDeviceGetCurrentClocksThrottleReasons(h),
        }
        for key, probe in probes.items():
            try:
                out[key] = float(probe())
            except nv.NVMLError:  # NotSupported (ECC off, consumer card...): leave the reading out
                pass
        if "throttle_reasons" in out:
            out["throttled"] = float(bool(int(out["throttle_reasons"]) & self._bad_throttle))
        if self._events is not None:
            out["xid_count"], out["last_xid"] = float(self._xid[i]), float(self._last_xid[i])
        return out

    def read(self) -> dict[str, dict[str, float]]:
        self._drain_xid()
        return {f"gpu{i}": self._device(i, h) for i, h in enumerate(self._handles)}

    def close(self) -> None:
        nv = self._nv
        if self._events is not None:
            nv.nvmlEventSetFree(self._events)
        nv.nvmlShutdown()


def open_sources() -> tuple[list, str]:
    """NVML when the module imports and sees a GPU; the host always. Returns (sources, why no NVML)."""
    sources, why = [], ""
    try:
        sources.append(NvmlSource())
    except ImportError:
        why = "nvidia-ml-py not installed"
    except Exception as e:  # NVMLError_LibraryNotFound / DriverNotLoaded / no GPU: a CPU machine
        why = f"NVML unavailable: {e}"
    sources.append(HostSource())
    return sources, why


def ecc_total(snapshot: dict | None) -> float:
    """Every ECC error the snapshot counts, over all devices (injected ones included)."""
    if not snapshot:
        return 0.0
    return sum(v for dev in snapshot["devices"].values() for k, v in dev.items() if k.startswith("ecc_"))


class HealthCollector:
    """Samples every `every_s` seconds in a daemon thread. The loop sets `step` and calls `latest()`,
    a plain attribute read: it never blocks on a slow or hung driver call."""

    def __init__(self, *, every_s: float, sources: list, injected_ecc: Callable[[int], int] | None = None):
        self.every_s, self.sources = every_s, sources
        self.step = 0
        self._injected_ecc = injected_ecc
        self._latest: dict | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="health-collector", daemon=True)

    def start(self) -> HealthCollector:
        self._thread.start()
        return self

    def latest(self) -> dict | None:
        return self._latest

    def sample(self) -> dict:
        devices, errors = {}, []
        for src in self.sources:
            try:
                devices.update(src.read())
            except Exception as e:  # a GPU fallen off the bus is itself the news: report, keep sampling
                errors.append(f"{src.name}: {e!r}"[:200])
        step = self.step
        if self._injected_ecc is not None and devices:
            n = self._injected_ecc(step)
            if n:
                first = next(iter(devices.values()))
                first["ecc_injected"] = float(n)
        snap = {"time": time.time(), "step": step, "devices": devices, "errors": errors}
        self._latest = snap  # one reference swap: readers see the old or the new snapshot, whole
        return snap

    def _run(self) -> None:
        self.sample()
        while not self._stop.wait(self.every_s):
            self.sample()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=2 * self.every_s + 1)
        for src in self.sources:
            src.close()
