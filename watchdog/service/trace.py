"""Recordings of what the judgement saw, as JSON lines (`watchdog.service.replay` judges them again).

A trace holds observations only (scrapes as readings, probe starts and ends, stack evidence), never
verdicts, so replaying it under other thresholds shows what those thresholds would have decided.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from watchdog.core.types import (
    Decision,
    EngineReading,
    Observation,
    PageReading,
    ProbeFinished,
    ProbeStarted,
    Scrape,
    ServerProcess,
    StackEvidence,
)

TRACE_VERSION = 1


CONTEXT_KINDS = frozenset({"gpu"})

# One encoder for every line: json.dumps with options builds a new JSONEncoder on each call.
_ENCODE = json.JSONEncoder(separators=(",", ":")).encode


class TraceError(Exception):
    """A trace file cannot be read; the message names the line."""


def to_record(obs: Observation, wall: float | None = None) -> dict[str, Any]:
    if isinstance(obs, Scrape):
        rec: dict[str, Any] = {"kind": "scrape", "t": obs.t, "wall": obs.wall}
        if obs.page is None:
            rec.update(error_kind=obs.error_kind, error=obs.error, status=obs.status)
        else:
            if obs.page.vllm_series:
                rec["vllm_series"] = obs.page.vllm_series
            rec["engines"] = {
                name: {"model": e.model, "running": e.running, "waiting": e.waiting, "kv": e.kv_usage,
                       "counters": dict(e.counters)}
                for name, e in obs.page.engines.items()
            }
        return rec
    if isinstance(obs, ProbeStarted):
        return {"kind": "probe_started", "t": obs.t, "wall": wall, "id": obs.probe_id}
    if isinstance(obs, ProbeFinished):
        return {"kind": "probe_finished", "t": obs.t, "wall": wall, "id": obs.probe_id, "ok": obs.ok,
                "answered": obs.answered, "detail": obs.detail}
    if isinstance(obs, ServerProcess):
        return {"kind": "server_process", "t": obs.t, "wall": wall, "pid": obs.pid, "started": obs.started_wall,
                "titles": list(obs.titles)}
    return {"kind": "evidence", "t": obs.t, "wall": wall, "engine": obs.engine, "decision": obs.decision.value,
            "reason": obs.reason, "captured_at": obs.captured_at}


def from_record(rec: dict[str, Any]) -> Observation:
    kind = rec["kind"]
    t = float(rec["t"])
    if kind == "scrape":
        if "engines" not in rec:
            return Scrape(t, float(rec.get("wall") or 0), None, rec["error_kind"], rec.get("error", ""),
                          rec.get("status"))
        engines = {
            name: EngineReading(name, e.get("model", ""), e.get("running"), e.get("waiting"), e.get("kv"),
                                {k: float(v) for k, v in e.get("counters", {}).items()})
            for name, e in rec["engines"].items()
        }
        return Scrape(t, float(rec.get("wall") or 0), PageReading(engines, int(rec.get("vllm_series", 0))))
    if kind == "probe_started":
        return ProbeStarted(t, int(rec["id"]))
    if kind == "probe_finished":
        return ProbeFinished(t, int(rec["id"]), bool(rec["ok"]), bool(rec["answered"]), rec.get("detail", ""))
    if kind == "server_process":
        return ServerProcess(t, rec.get("pid"), float(rec.get("started") or 0), tuple(rec.get("titles", ())))
    if kind == "evidence":
        if "decision" in rec:
            decision = Decision(rec["decision"])
        else:  # traces of 0.1: "stuck" true, false or null
            stuck = rec.get("stuck")
            decision = Decision.UNDECIDED if stuck is None else Decision.STUCK if stuck else Decision.WORKING
        return StackEvidence(t, rec["engine"], decision, rec.get("reason", ""), float(rec.get("captured_at") or 0))
    raise KeyError(f"unknown observation kind {kind!r}")


def read_trace(path: str | os.PathLike[str]) -> Iterator[Observation]:
    try:
        f = open(path, encoding="utf-8")  # noqa: SIM115 - closed by the with below
    except OSError as e:
        raise TraceError(f"{path}: cannot open: {e.strerror}") from None
    with f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
                if rec.get("kind") in CONTEXT_KINDS:
                    continue  # beside the observations, for people: GPU samples
                if rec.get("kind") == "header":
                    if rec.get("version") != TRACE_VERSION:
                        raise TraceError(f"{path}:{n}: trace version {rec.get('version')!r}, "
                                         f"this watchdog reads {TRACE_VERSION}")
                    continue
                yield from_record(rec)
            except TraceError:
                raise
            except (ValueError, KeyError, TypeError) as e:
                raise TraceError(f"{path}:{n}: not a trace record ({type(e).__name__}: {e})") from None


class TraceWriter:
    """Appends observations to a JSON-lines file; rolls it over to ``.1`` past ``max_bytes``.

    One ``os.write`` on an ``O_APPEND`` descriptor, its size counted here (no buffered layer asks the kernel where the
    file ends). A record written with ``hold`` (a calm scrape) waits, with the others held, for the next record
    written without it, a `flush`, or ``hold_seconds``: one write every 30 s while nothing happens; a watchdog killed
    meanwhile loses at most those seconds of calm. Measured in the service's pass at 1 Hz, cold
    (bench/profile_tick.py --cold 90, side by side): the trace's share 57 us a pass with 10 s, 26 with 30 s (the
    batch's write and its first, cold, encoding are paid a third as often)."""

    def __init__(self, path: Path, max_bytes: int = 0, header: dict[str, Any] | None = None,
                 hold_seconds: float = 30.0) -> None:
        self.path = path
        self.max_bytes = max_bytes
        self.hold_seconds = hold_seconds
        self._header = {"kind": "header", "version": TRACE_VERSION, **(header or {})}
        self._fd = -1
        self._size = 0
        self._held: list[tuple[Observation, float | None]] = []  # calm scrapes, encoded when they go out
        self._held_since = 0.0

    def write(self, obs: Observation, wall: float | None = None, hold: bool = False) -> None:
        """Append one observation. An OSError (disk full) drops the open handle and is raised: the next write
        opens the file again. A held observation is encoded when it goes out, with the others held."""
        if hold:
            self._hold(obs, wall)
        else:
            self.write_record(to_record(obs, wall))

    def write_record(self, record: dict[str, Any]) -> None:
        """Append one record, after what is held; a kind the judge does not read (``gpu``) is kept for people and
        skipped by replay."""
        self._write(self._held_bytes() + (_ENCODE(record) + "\n").encode("utf-8"))

    def flush(self) -> None:
        """Write what is held now (a transition, an incident, the end)."""
        if self._held:
            self._write(self._held_bytes())

    def _hold(self, obs: Observation, wall: float | None) -> None:
        now = time.monotonic()
        if not self._held:
            self._held_since = now
        self._held.append((obs, wall))
        if now - self._held_since >= self.hold_seconds:
            self.flush()

    def _held_bytes(self) -> bytes:
        """What is held, encoded in order (one batch: warm code, one write), and no longer held."""
        if not self._held:
            return b""
        held, self._held = self._held, []
        return "".join(_ENCODE(to_record(obs, wall)) + "\n" for obs, wall in held).encode("utf-8")

    def _write(self, data: bytes) -> None:
        try:
            if self._fd < 0:
                self._open()
            self._append(data)
        except OSError:
            self._close_fd()
            raise
        if self.max_bytes and self._size > self.max_bytes:
            self._close_fd()
            os.replace(self.path, self.path.with_name(self.path.name + ".1"))

    def _append(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            n = os.write(self._fd, view)
            view = view[n:]
            self._size += n

    def _open(self) -> None:
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o640)
        self._size = os.fstat(self._fd).st_size
        if self._size == 0:
            self._append((json.dumps(self._header) + "\n").encode("utf-8"))

    def _close_fd(self) -> None:
        if self._fd >= 0:
            fd, self._fd = self._fd, -1
            with contextlib.suppress(OSError):
                os.close(fd)

    def close(self) -> None:
        try:
            self.flush()
        finally:
            self._close_fd()
