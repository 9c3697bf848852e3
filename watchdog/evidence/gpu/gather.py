"""GPU evidence for one incident, gathered in one call: the I/O edge the coordinator calls on a freeze.

``gather_gpu`` takes the engine's processes, an NVML ``GpuMonitor`` (or None) and the [gpu] settings; it asks RAS
(bounded), triggers every rank's Flight Recorder (bounded by ``fr_settle``, before anything is restarted) and
reads the GPU samples around the freeze: the timeline from a minute before, each GPU's state over the stall alone
(from the last progress the judge saw to the capture; the samples from before it would mix the work with the
hang). ``write_gpu_files`` puts it into a bundle directory: ``gpu.jsonl`` (timeline), ``gpu.md`` (one line per
GPU, the window they were read over, RAS and recorder verdicts), ``nccl-ras.txt``, ``flight-recorder-rank<N>``.
Nothing here raises for a missing GPU, RAS or recorder: each absence is a line in ``problems``.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

from watchdog.config.gpu import GpuSection, ras_host_port
from watchdog.core.processes import LOCAL, EngineProcess
from watchdog.core.roles import ENGINE_ROLES, Role
from watchdog.evidence.gpu.flight_recorder import FrConfig, FrSummary, cross_rank_fr, summarize
from watchdog.evidence.gpu.fr_dump import DumpError, load_dump
from watchdog.evidence.gpu.fr_trigger import config_of, trigger
from watchdog.evidence.gpu.nccl_ras import query_ras
from watchdog.evidence.gpu.nvml import GpuMonitor
from watchdog.evidence.gpu.ras_status import RasStatus, parse_ras
from watchdog.evidence.gpu.readings import (
    GpuReading,
    GpuSample,
    GpuThresholds,
    attach_ranks,
    read_all,
    read_stall,
    summary_line,
)


@dataclass(frozen=True, slots=True)
class GpuEvidence:
    samples: tuple[GpuSample, ...] = ()
    readings: tuple[GpuReading, ...] = ()
    ras_text: str = ""
    ras: RasStatus | None = None
    fr_dumps: dict[int, bytes] = field(default_factory=dict)
    fr: tuple[FrSummary, ...] = ()
    fr_verdict: str = ""
    fr_seconds: float = 0.0
    problems: tuple[str, ...] = ()
    window: tuple[float, float] | None = None  # wall times the readings were judged over
    window_from: str = ""  # what the window's start is ("the last progress seen", ...)

    def lines(self) -> list[str]:
        out = [summary_line(r) for r in self.readings]
        if self.window is not None and self.readings:
            a, b = self.window
            out.append(f"GPU states read from {_hms(a)} ({self.window_from}) to {_hms(b)} UTC, {b - a:.1f} s; "
                       f"the timeline (gpu.jsonl) starts a minute earlier")
        if self.ras is not None:
            out.append(self.ras.verdict())
        out.extend(s.line() for s in self.fr)
        if self.fr_verdict:
            out.append(f"Flight Recorder: {self.fr_verdict}")
        out.extend(f"problem: {p}" for p in self.problems)
        return out


def _hms(wall: float) -> str:
    return datetime.fromtimestamp(wall, UTC).strftime("%H:%M:%S.%f")[:-5]


SINGLE_RANK = ("not asked: the engine is one rank (EngineCore runs the model itself): it makes no NCCL "
               "communicator, so no recorder has anything to dump")


def single_rank(processes: Sequence[EngineProcess]) -> bool:
    """vLLM at TP=PP=DP=1: one EngineCore, no rank in its title, no worker. vLLM's collectives return at once for a
    group of one and it makes no NCCL communicator, so no Flight Recorder dump can come (asked, one never came in 10 s
    on an H200, torch 2.11)."""
    engine = [p for p in processes if p.role in ENGINE_ROLES]
    return bool(engine) and all(p.role == Role.ENGINE_CORE and not p.ranks for p in engine)


def gather_gpu(processes: Sequence[EngineProcess], monitor: GpuMonitor | None, cfg: GpuSection,
               since: float, freeze: bool, now: float | None = None,
               stalled_since: float | None = None) -> GpuEvidence:
    """``since``: wall time the readings start when no stall start is known (the timeline starts a minute before
    it). ``stalled_since``: the wall time of the last progress the judge saw: each GPU's state is read over the
    stall alone, (stalled_since, now], and the timeline starts a minute before the earlier of the two."""
    problems: list[str] = []
    end = now if now is not None else time.time()
    samples: list[GpuSample] = []
    readings: list[GpuReading] = []
    window: tuple[float, float] | None = None
    start = min(since, stalled_since) if stalled_since is not None else since
    if monitor is None or monitor.unavailable:
        problems.append(f"GPU evidence unavailable: {monitor.unavailable if monitor else 'no GPU sampler'}")
    else:
        samples = monitor.window(start - 60.0, end)
        th = GpuThresholds(busy_util=cfg.busy_util, spin_power_fraction=cfg.spin_power_fraction)
        if stalled_since is not None:
            window = (stalled_since, end)
            readings = attach_ranks(read_stall(samples, stalled_since, end, th), processes)
        else:
            window = (since, end)
            readings = attach_ranks(read_all(samples, since, end, th), processes)
    ras_text, ras = "", None
    if cfg.ras:
        host, port = ras_host_port(cfg.ras_address)
        answer = query_ras(host, port, cfg.ras_timeout)
        ras_text = answer.text
        if answer.ok:
            ras = parse_ras(answer.text)
        else:
            problems.append(answer.error)
    dumps: dict[int, bytes] = {}
    summaries: list[FrSummary] = []
    verdict, fr_seconds = "", 0.0
    if freeze and cfg.flight_recorder and processes and single_rank(processes):
        verdict = SINGLE_RANK
    elif freeze and cfg.flight_recorder and processes:
        # every rank's pipe under each process's prefix: a title's TP/PP numbers are not the global rank
        here = [p for p in processes if p.node == LOCAL]  # another node's pid is no process of this host
        t = trigger([p.pid for p in here], None, cfg.fr_settle, configs=fr_configs(here, cfg))
        fr_seconds = t.seconds
        problems.extend(t.problems)
        for r in t.ranks:
            if r.error:
                problems.append(f"Flight Recorder rank {r.rank}: {r.error}")
            if r.data:
                dumps[r.rank] = r.data
                s, why = _summary(r.data, r.rank)
                if s is not None:
                    summaries.append(s)
                    problems.extend(f"Flight Recorder rank {r.rank}: {p}" for p in s.problems)
                else:
                    problems.append(f"Flight Recorder rank {r.rank}: {why} (its bytes are kept in the bundle)")
        verdict = cross_rank_fr(summaries)
    return GpuEvidence(tuple(samples), tuple(readings), ras_text, ras, dumps, tuple(summaries), verdict, fr_seconds,
                       tuple(dict.fromkeys(problems)), window,
                       "the last progress seen" if stalled_since is not None else "no stall start known: the window "
                       "before the capture")


def _summary(data: bytes, rank: int) -> tuple[FrSummary | None, str]:
    """One rank's dump read, or why not: a dump of any shape costs its own rank's summary, never the bundle."""
    try:
        return summarize(load_dump(data), rank), ""
    except DumpError as e:
        return None, str(e)
    except Exception as e:  # belt and braces: load_dump and summarize promise DumpError only
        return None, f"unreadable dump ({type(e).__name__})"


def fr_configs(processes: Sequence[EngineProcess], cfg: GpuSection) -> dict[int, FrConfig | None] | None:
    """The configured prefixes stand in for an environ that does not show the recorder (setproctitle clobbered
    it); None: read every process's environ as it is."""
    if not cfg.fr_pipe_prefix:
        return None
    out: dict[int, FrConfig | None] = {}
    for p in processes:
        seen = config_of(p.pid)
        out[p.pid] = seen if seen is not None and seen.can_dump else FrConfig(
            1, cfg.fr_pipe_prefix, cfg.fr_dump_prefix, ("from gpu.fr_pipe_prefix: the environ did not show it",))
    return out


def write_gpu_files(directory: Path, ev: GpuEvidence) -> list[str]:
    """Write the GPU evidence into an incident directory (still the .partial one); the names written."""
    written = []

    def put(name: str, data: bytes) -> None:
        path = directory / name
        with open(path, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        written.append(name)

    if ev.samples:
        put("gpu.jsonl", "".join(json.dumps(s.to_json()) + "\n" for s in ev.samples).encode())
    put("gpu.md", ("# GPU evidence\n\n" + "".join(f"- {line}\n" for line in ev.lines())).encode())
    if ev.ras_text:
        put("nccl-ras.txt", ev.ras_text.encode())
    for rank, data in sorted(ev.fr_dumps.items()):
        put(f"flight-recorder-rank{rank}.pickle", data)
    return written
