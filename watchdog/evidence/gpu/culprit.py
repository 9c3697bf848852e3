"""The GPU-aware cross-rank verdict: which GPU rank the others wait for. Pure.

``cross_rank`` (`watchdog.evidence.explain.ranks`) reads stack classes alone. On a real two-GPU tensor-parallel hang
(tests/data/gpu-tp2) that is not enough: rank 1 sat in ``cudaDeviceSynchronize`` (device_wait) behind a
kernel that never ended, and rank 0 was not inside ``all_reduce`` at all: it had run 64 steps ahead, queueing
collectives, until ``cuLaunchKernel`` blocked on a full launch queue (class unknown). Both GPUs read busy at idle
power (rank 1's spin, rank 0's NCCL kernel waiting for its peer). What names the culprit, strongest first:

1. the Flight Recorder: a rank that never entered the collective the others entered;
2. NCCL RAS: a rank that launched fewer operations than the others;
3. stacks with power: a rank waiting on its own device (device_wait, no collective frame) with its GPU spinning,
   while its peers are in a collective or blocked launching more work behind one; or the only GPU rank there is
   (TP=1, a one-rank group), waiting on its own device while that GPU spins.

Each source that names a rank is listed; when they disagree the strongest wins and the disagreement is said.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from watchdog.evidence.gpu.flight_recorder import FrSummary
from watchdog.evidence.gpu.ras_status import RasStatus
from watchdog.evidence.gpu.readings import GpuState
from watchdog.evidence.stacks.frames import Frame

_COLL = re.compile(r"^nccl|c10d::|ProcessGroupNCCL|torch::cuda::nccl|all_?reduce|all_?gather|reduce_scatter")
_LAUNCH = re.compile(r"^cu(?:da)?LaunchKernel")


@dataclass(frozen=True, slots=True)
class RankView:
    name: str  # Worker_TP1
    rank: int | None  # the rank the collectives use (a TP-only engine: the title's TP number)
    cls: str  # stack class value (device_wait, in_collective, unknown, ...)
    frames: tuple[Frame, ...]  # the deciding thread's whole stack, innermost first
    gpu: GpuState | None = None


@dataclass(frozen=True, slots=True)
class GpuCulprit:
    culprit: str | None  # the rank's name, or None
    rank: int | None
    reason: str
    sources: tuple[str, ...] = ()  # which evidence named it: flight_recorder, nccl_ras, stacks+power


def _where(v: RankView) -> str:
    """What a rank's host is doing, in a few words."""
    names = [f.function for f in v.frames if not f.function.startswith("0x")]
    if v.cls == "in_collective" or any(_COLL.search(n) for n in names):
        return "waits in a collective"
    if any(_LAUNCH.search(n) for n in names):
        return "is blocked launching a kernel (its launch queue is full behind a collective that cannot finish)"
    if v.cls == "device_wait":
        return "waits on its own device"
    return f"is {v.cls}"


def _stuck_in_kernel(v: RankView) -> bool:
    return v.cls == "device_wait" and _where(v) == "waits on its own device"


def _peer_waits(v: RankView) -> bool:
    return _where(v).startswith(("waits in a collective", "is blocked launching"))


def _power(v: RankView) -> str:
    if v.gpu is GpuState.SPINNING:
        return " busy at idle power"
    return f" ({v.gpu.value})" if v.gpu is not None else ""


def fr_behind(fr: Sequence[FrSummary]) -> tuple[list[int], int | None]:
    """Ranks whose last entered collective is behind the newest one any rank entered, and that newest seq."""
    seqs = {s.rank: s.last_entered.seq for s in fr if s.last_entered is not None and s.last_entered.seq is not None}
    if len(seqs) < 2:
        return [], None
    top = max(seqs.values())
    return sorted(r for r, q in seqs.items() if q < top), top


def ras_behind(ras: RasStatus | None) -> list[int]:
    if ras is None:
        return []
    return next((b.behind() for b in ras.blocks if b.behind()), [])


def gpu_culprit(ranks: Sequence[RankView], ras: RasStatus | None = None,
                fr: Sequence[FrSummary] = ()) -> GpuCulprit:
    by_rank = {v.rank: v for v in ranks if v.rank is not None}
    named: dict[str, list[int]] = {}
    behind, top = fr_behind(fr)
    if behind:
        named["flight_recorder"] = behind
    if late := ras_behind(ras):
        named["nccl_ras"] = late
    stuck = [v for v in ranks if _stuck_in_kernel(v) and v.gpu in (GpuState.SPINNING, None)]
    waiting = [v for v in ranks if _peer_waits(v)]
    alone = len(ranks) == 1 and len(stuck) == 1 and stuck[0].gpu is GpuState.SPINNING  # no peer can wait for it
    if len(stuck) == 1 and (waiting or alone) and stuck[0].rank is not None:
        named["stacks+power"] = [stuck[0].rank]
    if not named:
        return GpuCulprit(None, None, "no rank is named by the Flight Recorder, NCCL RAS or stacks with power.")
    order = ("flight_recorder", "nccl_ras", "stacks+power")
    first = next(s for s in order if s in named)
    pick = named[first]
    if len(pick) != 1:
        return GpuCulprit(None, None, f"{first} names several ranks ({', '.join(map(str, pick))}): no single culprit.",
                          (first,))
    rank = pick[0]
    agree = tuple(s for s in order if named.get(s) == [rank])
    differ = [s for s in order if s in named and named[s] != [rank]]
    c = by_rank.get(rank)
    name = c.name if c is not None else f"rank {rank}"
    parts = [f"rank {rank} ({name}){_power(c) if c else ''} {_where(c) if c else 'has no stack'}"]
    parts += [f"rank {v.rank} ({v.name}){_power(v)} {_where(v)}" for v in ranks if v.rank != rank]
    said = []
    if "flight_recorder" in named:
        said.append(f"Flight Recorder: rank(s) {', '.join(map(str, named['flight_recorder']))} never entered "
                    f"collective #{top}")
    if ras is not None and "nccl_ras" in named:
        said.append(ras.verdict())
    tail = f"; disagreeing: {', '.join(differ)}" if differ else ""
    return GpuCulprit(name, rank, "; ".join(parts) + ". " + ("; ".join(said) + ". " if said else "")
                      + f"Named by {', '.join(agree)}{tail}.", agree)
