"""GPU readings beside the stacks: what each rank's GPU was doing around a suspicion. Pure.

Samples come from NVML (`watchdog.evidence.gpu.nvml`); this module only reads them. A GPU over a window is:

- ``spinning``: busy (NVML utilisation >= ``busy_util`` in most samples) while drawing little power (median power
  <= ``spin_power_fraction`` of the GPU's own power limit). A kernel is resident but does no arithmetic and moves
  no memory: a spin-wait on a flag (a collective waiting for a peer that never comes, a hung kernel). Measured on
  an H200 (700 W limit): one spinning thread 122 W (17 %) and a spin on every SM (see tests/data/gpu) against
  635-694 W (91-99 %) for matmuls and 80 W (11 %) idle.
- ``idle``: utilisation <= ``idle_util`` in most samples: no kernel resident.
- ``working``: busy at a power above that fraction: kernels doing real work.
- ``unknown``: too few samples, or the readings are mixed (a phase change inside the window).

NVML's "utilisation" is the fraction of time *some* kernel was resident, not how hard it worked: that is why a
spin reads 100 %. Power is what tells the two apart. Power never decides a verdict alone: it corroborates (or
contradicts) what the stacks say, and goes into the explanation and the bundle.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum

from watchdog.core.processes import LOCAL, EngineProcess

MIB = 1024 * 1024


class GpuState(StrEnum):
    SPINNING = "spinning"
    IDLE = "idle"
    WORKING = "working"
    UNKNOWN = "unknown"


@dataclass(frozen=True, slots=True)
class GpuProc:
    pid: int
    used_bytes: int | None = None


@dataclass(frozen=True, slots=True)
class GpuSample:
    """One NVML reading of one GPU; ``None`` where NVML did not answer that query (not supported, lost)."""

    t: float  # wall time of the reading
    index: int
    uuid: str = ""
    name: str = ""
    util: int | None = None  # percent of the sample period a kernel was resident
    power_w: float | None = None
    power_limit_w: float | None = None  # the enforced limit: the scale for "little power"
    sm_clock_mhz: int | None = None
    mem_used_bytes: int | None = None
    mem_total_bytes: int | None = None
    procs: tuple[GpuProc, ...] = ()

    def to_json(self) -> dict[str, object]:
        return {"t": round(self.t, 3), "index": self.index, "uuid": self.uuid, "name": self.name, "util": self.util,
                "power_w": self.power_w, "power_limit_w": self.power_limit_w, "sm_clock_mhz": self.sm_clock_mhz,
                "mem_used_bytes": self.mem_used_bytes, "mem_total_bytes": self.mem_total_bytes,
                "procs": [{"pid": p.pid, "used_bytes": p.used_bytes} for p in self.procs]}


def sample_from_json(raw: Mapping[str, object]) -> GpuSample:
    """The inverse of ``GpuSample.to_json`` (bundles and recorded device data); raises ValueError when malformed."""
    def num(key: str) -> float | None:
        v = raw.get(key)
        if v is None:
            return None
        if isinstance(v, bool) or not isinstance(v, int | float):
            raise ValueError(f"{key}: not a number")
        return v

    def whole(key: str) -> int | None:
        v = num(key)
        return None if v is None else int(v)

    procs_raw = raw.get("procs", [])
    if not isinstance(procs_raw, list):
        raise ValueError("procs: not a list")
    procs = []
    for p in procs_raw:
        if not isinstance(p, dict) or not isinstance(p.get("pid"), int):
            raise ValueError("procs: entry without a pid")
        used = p.get("used_bytes")
        procs.append(GpuProc(p["pid"], used if isinstance(used, int) else None))
    t, index = num("t"), whole("index")
    if t is None or index is None:
        raise ValueError("a sample needs t and index")
    return GpuSample(t, index, str(raw.get("uuid", "")), str(raw.get("name", "")), whole("util"), num("power_w"),
                     num("power_limit_w"), whole("sm_clock_mhz"), whole("mem_used_bytes"), whole("mem_total_bytes"),
                     tuple(procs))


@dataclass(frozen=True, slots=True)
class GpuThresholds:
    busy_util: int = 90  # percent: a kernel resident nearly all the time
    idle_util: int = 10
    spin_power_fraction: float = 0.25  # of the power limit: at or below this while busy is a spin
    min_samples: int = 3
    majority: float = 0.7  # this share of the samples must agree (busy, or idle)


@dataclass(frozen=True, slots=True)
class GpuReading:
    index: int
    state: GpuState
    why: str
    samples: int
    util: float | None = None  # medians over the window
    power_w: float | None = None
    power_limit_w: float | None = None
    sm_clock_mhz: float | None = None
    pids: tuple[int, ...] = ()
    mem_used_bytes: int | None = None
    name: str = ""
    ranks: tuple[str, ...] = field(default_factory=tuple)  # labels of the engine processes holding it

    def to_json(self) -> dict[str, object]:
        return {"index": self.index, "name": self.name, "state": self.state.value, "why": self.why,
                "samples": self.samples, "util": self.util, "power_w": self.power_w,
                "power_limit_w": self.power_limit_w, "sm_clock_mhz": self.sm_clock_mhz, "pids": list(self.pids),
                "mem_used_bytes": self.mem_used_bytes, "ranks": list(self.ranks)}


def _median(values: Iterable[float | int | None]) -> float | None:
    vals = [float(v) for v in values if v is not None]
    return round(statistics.median(vals), 2) if vals else None


def read_gpu(samples: Sequence[GpuSample], th: GpuThresholds = GpuThresholds()) -> GpuReading:
    """One GPU's state over a window of its samples (all of the same index)."""
    if not samples:
        raise ValueError("read_gpu needs at least one sample")
    index = samples[0].index
    util = _median(s.util for s in samples)
    power = _median(s.power_w for s in samples)
    limit = _median(s.power_limit_w for s in samples)
    clock = _median(s.sm_clock_mhz for s in samples)
    pids = tuple(sorted({p.pid for s in samples for p in s.procs}))
    mem = samples[-1].mem_used_bytes

    def reading(state: GpuState, why: str) -> GpuReading:
        return GpuReading(index, state, why, len(samples), util, power, limit, clock, pids, mem, samples[-1].name)

    utils = [s.util for s in samples if s.util is not None]
    if len(utils) < th.min_samples:
        return reading(GpuState.UNKNOWN, f"{len(utils)} utilisation readings, {th.min_samples} needed")
    busy = sum(u >= th.busy_util for u in utils) / len(utils)
    idle = sum(u <= th.idle_util for u in utils) / len(utils)
    if idle >= th.majority:
        return reading(GpuState.IDLE, f"utilisation {util:g} %: no kernel resident")
    if busy < th.majority:
        return reading(GpuState.UNKNOWN, f"mixed utilisation (median {util:g} %, busy in {busy:.0%} of samples)")
    if power is None or not limit:
        return reading(GpuState.UNKNOWN, f"busy ({util:g} %) but NVML gave no power or power limit")
    share = power / limit
    if share <= th.spin_power_fraction:
        return reading(GpuState.SPINNING, f"busy at idle power: a kernel spinning ({util:g} % at {power:g} W, "
                                          f"{share:.0%} of its {limit:g} W limit)")
    return reading(GpuState.WORKING, f"working ({util:g} % at {power:g} W, {share:.0%} of its {limit:g} W limit)")


def read_all(samples: Iterable[GpuSample], since: float, until: float,
             th: GpuThresholds = GpuThresholds()) -> list[GpuReading]:
    """Every GPU's reading over [since, until] (wall time), in index order."""
    by_gpu: dict[int, list[GpuSample]] = {}
    for s in samples:
        if since <= s.t <= until:
            by_gpu.setdefault(s.index, []).append(s)
    return [read_gpu(sorted(v, key=lambda s: s.t), th) for _, v in sorted(by_gpu.items())]


def read_stall(samples: Iterable[GpuSample], stalled_since: float, until: float,
               th: GpuThresholds = GpuThresholds()) -> list[GpuReading]:
    """Every GPU's reading over a stall: the samples stamped after ``stalled_since`` (the last progress the judge
    saw) up to ``until`` (the capture). A sample stamped at the last progress itself is left out: NVML's figures
    describe the period that ends at the reading, the work before the stall. Samples from before the stall would
    mix the work with the hang (utilisation busy in some samples, idle in others: "mixed")."""
    return read_all([s for s in samples if s.t > stalled_since], stalled_since, until, th)


def attach_ranks(readings: Sequence[GpuReading], processes: Sequence[EngineProcess]) -> list[GpuReading]:
    """Name the engine processes (by pid) that hold each GPU's memory: this host's only, as the GPUs are."""
    labels = {p.pid: p.label for p in processes if p.node == LOCAL}
    out = []
    for r in readings:
        names = tuple(labels[pid] for pid in r.pids if pid in labels)
        out.append(GpuReading(r.index, r.state, r.why, r.samples, r.util, r.power_w, r.power_limit_w,
                              r.sm_clock_mhz, r.pids, r.mem_used_bytes, r.name, names))
    return out


def gpu_of(readings: Sequence[GpuReading], p: EngineProcess) -> GpuReading | None:
    """The GPU whose memory ``p`` holds; None for another node's process (these readings are this host's GPUs)."""
    return next((r for r in readings if p.pid in r.pids), None) if p.node == LOCAL else None


def corroborate(stack_class: str, reading: GpuReading | None) -> str:
    """What the GPU adds to a rank's stack class, as one sentence ("" when it has nothing to add)."""
    if reading is None or reading.state == GpuState.UNKNOWN:
        return ""
    waits = stack_class in {"device_wait", "in_collective"}
    gpu = f"GPU {reading.index}"
    if reading.state == GpuState.SPINNING:
        tail = "agrees: the host waits on a kernel that never finishes" if waits else \
            "although the stack does not show a device wait"
        return f"{gpu} busy at idle power (a kernel spinning), {tail}"
    if reading.state == GpuState.WORKING:
        tail = "the host waits while the GPU computes: a long kernel, not a hang" if waits else "computing"
        return f"{gpu} working, {tail}"
    tail = "yet the host waits on the device: the wait is not on this GPU's kernels" if waits else "no kernel resident"
    return f"{gpu} idle, {tail}"


def summary_line(r: GpuReading) -> str:
    """One line per GPU for summary.md."""
    who = ", ".join(r.ranks) if r.ranks else (f"pids {', '.join(map(str, r.pids))}" if r.pids else "no process")
    mem = f", {r.mem_used_bytes // MIB} MiB used" if r.mem_used_bytes is not None else ""
    clock = f", SM {r.sm_clock_mhz:g} MHz" if r.sm_clock_mhz is not None else ""
    return f"GPU {r.index} ({who}): {r.state.value}: {r.why}{clock}{mem} [{r.samples} samples]"
