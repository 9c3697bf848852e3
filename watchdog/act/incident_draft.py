"""One step of the incident machine being written: the new `Book` and the commands so far, with the few moves
every transition makes (keep the incident, save, write an event, alert unless paused). Pure."""

from __future__ import annotations

import hashlib
from dataclasses import replace
from typing import Any

from watchdog.act.incident_types import (
    ACTIVE,
    Book,
    Command,
    Emit,
    Incident,
    Kind,
    Memory,
    Notify,
    Save,
    Settings,
)
from watchdog.core.runbooks import Runbook
from watchdog.core.types import incident_id


class Draft:
    def __init__(self, book: Book, settings: Settings, wall: float, nonce: str) -> None:
        self.book, self.s, self.wall, self.nonce = book, settings, wall, nonce
        self.out: list[Command] = []

    @property
    def memory(self) -> Memory:
        return self.book.memory

    def new_id(self, at: float, engine: str, kind: Kind, salt: str = "") -> str:
        """A fresh id: ``nonce`` (random, from the edge) mixed with ``salt`` keeps two ids of one step apart."""
        token = hashlib.blake2s(f"{self.nonce}/{salt}".encode(), digest_size=2).hexdigest() if salt else self.nonce
        return incident_id(at, self.s.stack, engine, kind.value, token)

    def keep(self, inc: Incident, **book: Any) -> Incident:
        """``inc`` as the open incident, with other fields of the book changed too."""
        self.book = replace(self.book, memory=replace(self.memory, incident=inc), **book)
        return inc

    def close(self, **book: Any) -> None:
        """No incident open now."""
        self.book = replace(self.book, memory=replace(self.memory, incident=None), **book)

    def update(self, **book: Any) -> None:
        self.book = replace(self.book, **book)

    def remember(self, **memory: Any) -> None:
        self.book = replace(self.book, memory=replace(self.memory, **memory))

    def save(self) -> None:
        self.out.append(Save())

    def emit(self, inc: Incident, name: str, **fields: Any) -> None:
        self.out.append(Emit(name, inc, fields))

    def notify(self, inc: Incident, event: str, summary: str, details: dict[str, Any], resolved: bool = False,
               state: str | None = None, runbook: Runbook | None = None) -> None:
        """An alert, or while paused the event that says it was not sent. ``state``: the engine's, as the alert
        shows it (default: serving when resolved, the recovery's phase while one runs, else the verdict's)."""
        if self.book.paused:
            self.emit(inc, "alert_suppressed", alert=event, why="paused")
            return
        if state is None:
            v = self.book.verdicts.get(inc.engine)
            state = "serving" if resolved else inc.phase.value if inc.phase in ACTIVE \
                else v.state.value if v else "unknown"
        self.out.append(Notify(event, inc, summary, details, state, resolved, runbook))
