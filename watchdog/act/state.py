"""What the watchdog remembers across its own restarts, and the operator's switches, as small JSON files.

In the state directory, each written whole (temp file, fsync, rename) by one writer only:

- ``control.json``  the operator's switches, written by ``watchdog pause / resume / reset``, read by the daemon
  every pass: paused (until when, why), and the time of the last budget reset;
- ``recovery.json`` the daemon's memory: the restarts within the budget window, whether it gave up, and the open
  incident with its phase, so a watchdog restarted between ``restart_started`` and ``recovered`` neither restarts
  twice nor loses the incident; and the open blind incidents, so their ``resolved`` still comes;
- ``status.json``   what the daemon is doing now, rewritten every pass, for ``watchdog status``.

A file that cannot be parsed is moved aside (``*.corrupt-<time>``, kept for a human) with a loud log line, and
the watchdog goes on from empty: it never stops watching because of it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from watchdog.act.incident_types import GaveUp, Incident, Kind, Memory, Phase
from watchdog.core.types import Decision

log = logging.getLogger(__name__)

VERSION = 1
CONTROL, RECOVERY, STATUS = "control.json", "recovery.json", "status.json"


@dataclass(frozen=True, slots=True)
class Control:
    paused: bool = False
    paused_until: float | None = None  # wall time; None while paused means until `watchdog resume`
    reason: str = ""
    paused_at: float = 0.0
    reset_at: float = 0.0  # restarts and a give-up before this no longer count

    def is_paused(self, now: float) -> bool:
        return self.paused and (self.paused_until is None or now < self.paused_until)


def _encode(obj: object) -> str:
    """JSON with one top-level key a line, for people; each value in one piece by the C encoder (``indent=``
    turns it off: the status file, rewritten every few seconds, cost 1.3 ms a write, measured cold)."""
    if not isinstance(obj, dict) or not obj:
        return json.dumps(obj, sort_keys=True) + "\n"
    items = sorted(obj.items())
    return "{\n" + ",\n".join(f" {json.dumps(k)}: {json.dumps(v, sort_keys=True)}" for k, v in items) + "\n}\n"


def write_json(path: Path, obj: object, durable: bool = True) -> None:
    """Replace ``path`` whole: readers see the old file or the new one, never half of one. ``durable`` also
    survives a power cut (fsync); the status file, rewritten every pass, does without."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o640)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(_encode(obj))
            f.flush()
            if durable:
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise


def read_json(path: Path) -> dict[str, Any] | None:
    """The file's object, None when absent; an unreadable file is moved aside and reads as absent."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    try:
        obj = json.loads(text)
        if not isinstance(obj, dict) or obj.get("version") != VERSION:
            raise ValueError(f"not a version {VERSION} state object")
        return obj
    except ValueError as e:
        aside = path.with_name(f"{path.name}.corrupt-{int(time.time())}")
        with contextlib.suppress(OSError):
            os.replace(path, aside)
        log.error("state file %s cannot be used (%s); moved to %s, starting from empty", path, e, aside)
        return None


def _pick(cls: type, obj: dict[str, Any]) -> dict[str, Any]:
    names = {f.name for f in fields(cls)}
    return {k: v for k, v in obj.items() if k in names}


def load_control(state_dir: Path) -> Control:
    obj = read_json(state_dir / CONTROL)
    try:
        return Control(**_pick(Control, obj)) if obj else Control()
    except TypeError:
        return Control()


class ControlFile:
    """The operator's switches as of the last `read`: a stat each time, parsed again only when the file changed."""

    def __init__(self, state_dir: Path) -> None:
        self.state_dir, self.path = state_dir, str(state_dir / CONTROL)  # stat'ed often: the path built once
        self.control = Control()
        self._seen: tuple[int, int, int] | None = (-1, -1, -1)  # not yet read

    def read(self) -> Control:
        try:
            st = os.stat(self.path)
            seen: tuple[int, int, int] | None = (st.st_mtime_ns, st.st_size, st.st_ino)
        except OSError:
            seen = None
        if seen != self._seen:
            self.control = load_control(self.state_dir) if seen is not None else Control()
            self._seen = seen
        return self.control


def save_control(state_dir: Path, control: Control) -> None:
    state_dir.mkdir(parents=True, exist_ok=True, mode=0o750)
    write_json(state_dir / CONTROL, {"version": VERSION, **asdict(control)})


def _incident(obj: dict[str, Any]) -> Incident:
    fields_ = _pick(Incident, obj)
    fields_["kind"], fields_["phase"] = Kind(fields_["kind"]), Phase(fields_.get("phase", Phase.OPEN))
    if fields_.get("evidence") is not None:
        fields_["evidence"] = Decision(fields_["evidence"])
    return Incident(**fields_)


def load_memory(state_dir: Path) -> Memory:
    obj = read_json(state_dir / RECOVERY)
    if not obj:
        return Memory()
    try:
        inc, gave_up = obj.get("incident"), obj.get("gave_up")
        blind = [_incident(b) for b in obj.get("blind") or [] if isinstance(b, dict)]
        return Memory(restarts=tuple(float(x) for x in obj.get("restarts", [])),
                      gave_up=GaveUp(**_pick(GaveUp, gave_up)) if isinstance(gave_up, dict) else None,
                      incident=_incident(inc) if isinstance(inc, dict) else None,
                      blind=tuple(b for b in blind if b.kind == Kind.BLIND and b.unseen))
    except (TypeError, ValueError, KeyError) as e:
        log.error("%s: %s; starting from empty", state_dir / RECOVERY, e)
        return Memory()


def save_memory(state_dir: Path, memory: Memory) -> None:
    write_json(state_dir / RECOVERY, {"version": VERSION, "restarts": list(memory.restarts),
                                      "gave_up": asdict(memory.gave_up) if memory.gave_up else None,
                                      "incident": asdict(memory.incident) if memory.incident else None,
                                      "blind": [asdict(b) for b in memory.blind]})


def save_status(state_dir: Path, status: dict[str, Any]) -> None:
    write_json(state_dir / STATUS, {"version": VERSION, **status}, durable=False)


def touch_status(state_dir: Path) -> None:
    """The daemon still stands by an unchanged status: its mtime moves, its text is not rewritten (a replace of the
    file costs about 0.4 ms of CPU on ext4, measured, as much as the rest of a pass)."""
    os.utime(state_dir / STATUS)


def load_status(state_dir: Path, now: float) -> dict[str, Any] | None:
    """The status as of ``now``: ``confirmed`` is when the daemon last stood by it (its write or its touch), and the
    durations count from the wall times written beside them."""
    path = state_dir / STATUS
    status = read_json(path)
    if status is None:
        return None
    try:
        touched = path.stat().st_mtime
    except OSError:
        touched = 0.0
    status["confirmed"] = max(float(status.get("time", 0.0)), touched)
    for e in status.get("engines", []):
        if isinstance(e, dict) and isinstance(e.get("since"), int | float):
            e["for_seconds"] = round(max(0.0, now - e["since"]), 1)
    rec = status.get("recovery")
    if isinstance(rec, dict) and isinstance(rec.get("since"), int | float):
        rec["seconds"] = round(max(0.0, now - rec["since"]), 1)
    for b in status.get("blind") or []:  # what cannot be seen, counted from when sight was lost
        if isinstance(b, dict) and isinstance(b.get("since"), int | float):
            b["seconds"] = round(max(0.0, now - b["since"]), 1)
    return status
