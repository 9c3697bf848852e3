"""GPU samples through NVML (nvidia-ml-py, ``import pynvml``): the I/O behind ``readings.py``.

``NvmlSource`` reads every GPU (utilisation, power and its limit, SM clock, memory, the processes holding memory).
``GpuMonitor`` samples a ``GpuSource`` in a background thread, slowly in normal operation (``gpu.interval``) and
densely once told of a suspicion (``gpu.dense_interval`` until ``dense_for`` s later), and keeps a ring of recent
samples for the bundle's timeline. No GPU, no driver, or no pynvml: the source says why it is unavailable, the
monitor does nothing, and nothing raises. (Tests replay samples through ``tests.fakes.FakeGpuSource``.)
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

from watchdog.evidence.gpu.readings import GpuProc, GpuSample

log = logging.getLogger(__name__)


class GpuSource(Protocol):
    def open(self) -> str:
        """Prepare; "" when usable, else why GPU evidence is unavailable."""
        ...

    def sample(self) -> list[GpuSample]: ...


class NvmlSource:
    """The real source. pynvml is imported on open, so a machine without it only loses GPU evidence."""

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self.clock = clock
        self._nvml: Any = None
        self._handles: list[tuple[int, Any, str, str, float | None, int | None]] = []

    def open(self) -> str:
        try:
            import pynvml  # type: ignore[import-untyped,unused-ignore]  # noqa: PLC0415 - optional
        except ImportError:
            return "nvidia-ml-py is not installed (pip install nvidia-ml-py)"
        try:
            pynvml.nvmlInit()
            count = pynvml.nvmlDeviceGetCount()
        except pynvml.NVMLError as e:
            return f"NVML cannot be used: {e}"
        if count == 0:
            return "NVML sees no GPU"
        self._nvml = pynvml
        for i in range(count):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            name = self._try(pynvml.nvmlDeviceGetName, h)
            uuid = self._try(pynvml.nvmlDeviceGetUUID, h)
            limit_mw = self._try(pynvml.nvmlDeviceGetEnforcedPowerLimit, h)
            mem = self._try(pynvml.nvmlDeviceGetMemoryInfo, h)
            self._handles.append((i, h, str(name or ""), str(uuid or ""),
                                  limit_mw / 1000 if limit_mw else None, getattr(mem, "total", None)))
        return ""

    def _try(self, fn: Callable[..., Any], *args: Any) -> Any:
        error: type[Exception] = self._nvml.NVMLError if self._nvml is not None else Exception
        try:
            return fn(*args)
        except error:  # this query is not supported on this GPU, or the GPU is lost: no value
            return None

    def sample(self) -> list[GpuSample]:
        if self._nvml is None:
            return []
        nv = self._nvml
        out = []
        for index, h, name, uuid, limit, total in self._handles:
            t = self.clock()
            util = self._try(nv.nvmlDeviceGetUtilizationRates, h)
            power_mw = self._try(nv.nvmlDeviceGetPowerUsage, h)
            clock = self._try(nv.nvmlDeviceGetClockInfo, h, nv.NVML_CLOCK_SM)
            mem = self._try(nv.nvmlDeviceGetMemoryInfo, h)
            procs = self._try(nv.nvmlDeviceGetComputeRunningProcesses, h) or []
            out.append(GpuSample(
                t, index, uuid, name, getattr(util, "gpu", None),
                round(power_mw / 1000, 2) if power_mw is not None else None, limit, clock,
                getattr(mem, "used", None), total,
                tuple(GpuProc(int(p.pid), p.usedGpuMemory if isinstance(p.usedGpuMemory, int) else None)
                      for p in procs)))
        return out

    def close(self) -> None:
        if self._nvml is not None:
            self._try(self._nvml.nvmlShutdown)
            self._nvml = None


class GpuMonitor:
    """Samples a source in its own thread; ``window(since, until)`` for the evidence, ``dense(now)`` on suspicion."""

    def __init__(self, source: GpuSource, interval: float = 5.0, dense_interval: float = 0.5,
                 dense_for: float = 120.0, keep_seconds: float = 600.0,
                 clock: Callable[[], float] = time.time) -> None:
        self.source = source
        self.interval = interval
        self.dense_interval = dense_interval
        self.dense_for = dense_for
        self.clock = clock
        self.unavailable = ""
        self._samples: collections.deque[GpuSample] = collections.deque()
        self._keep = keep_seconds
        self._dense_until = 0.0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> str:
        """Open the source and start sampling; returns why GPU evidence is unavailable ("" when it runs)."""
        self.unavailable = self.source.open()
        if self.unavailable:
            log.info("GPU evidence unavailable: %s", self.unavailable)
            return self.unavailable
        self._thread = threading.Thread(target=self._run, name="gpu-sampler", daemon=True)
        self._thread.start()
        return ""

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def dense(self, now: float | None = None) -> None:
        """A suspicion: sample densely for ``dense_for`` seconds from now."""
        with self._lock:
            self._dense_until = max(self._dense_until, (now if now is not None else self.clock()) + self.dense_for)
        self._wake.set()

    def tick(self) -> float:
        """Take one round of samples; the seconds until the next one."""
        try:
            taken = self.source.sample()
        except Exception as e:  # a lost GPU or driver must not take the sampler down
            log.warning("GPU sample failed: %s", e)
            taken = []
        now = self.clock()
        with self._lock:
            self._samples.extend(taken)
            while self._samples and self._samples[0].t < now - self._keep:
                self._samples.popleft()
            return self.dense_interval if now < self._dense_until else self.interval

    def window(self, since: float, until: float | None = None) -> list[GpuSample]:
        end = until if until is not None else float("inf")
        with self._lock:
            return [s for s in self._samples if since <= s.t <= end]

    def _run(self) -> None:
        while not self._stop.is_set():
            wait = self.tick()
            self._wake.clear()
            self._wake.wait(wait)


def gpu_availability(source: GpuSource | None = None) -> dict[str, object]:
    """For ``watchdog check --json``: whether GPU evidence can be taken here, and why not."""
    src = source or NvmlSource()
    why = src.open()
    gpus = len(src.sample()) if not why else 0
    if isinstance(src, NvmlSource):
        src.close()
    return {"available": not why, "gpus": gpus, "why": why}
