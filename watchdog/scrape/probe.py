"""The probe: one tiny real generation, to see what the page cannot.

A request stuck on the first step after idle leaves the page at running=0, waiting=0 forever. When the
judgement cannot tell idle from stuck it asks for a probe: ``max_tokens=1``, a unique prompt (so the
prefix cache answers nothing), a hard deadline, at most one in flight. It runs in a background thread
so the watcher keeps scraping while it waits; its outcome reaches the judgement as an observation.
The same generation proves an engine back after a restart (`generate_once`). Both go through the engine's one
HTTP session (`watchdog.scrape.engine_http`).
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

from watchdog.core.types import NO_ANSWER, ProbeFinished, ProbeStarted
from watchdog.scrape.engine_http import LOST, EngineHTTP, HttpFailure

log = logging.getLogger(__name__)


class Prober:
    def __init__(
        self,
        http: EngineHTTP,
        timeout: float,
        model: str = "",
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.http = http
        self.timeout = timeout
        self.model = model
        self._clock = clock
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._started: ProbeStarted | None = None
        self._finished: ProbeFinished | None = None
        self._thread: threading.Thread | None = None

    @property
    def in_flight(self) -> bool:
        with self._lock:
            return self._started is not None and self._finished is None

    def start(self) -> ProbeStarted:
        """Send a probe in the background. Only one may be in flight."""
        with self._lock:
            if self._started is not None and self._finished is None:
                raise RuntimeError("a probe is already in flight")
            started = ProbeStarted(self._clock(), next(self._ids))
            self._started, self._finished = started, None
        self._thread = threading.Thread(target=self._run, args=(started,), name=f"probe-{started.probe_id}",
                                        daemon=True)
        self._thread.start()
        return started

    def poll(self) -> ProbeFinished | None:
        """The outcome of the probe in flight, once, when it has one."""
        with self._lock:
            done, self._finished = self._finished, None
            if done is not None:
                self._started = None
            return done

    def wait(self, timeout: float) -> None:
        if self._thread is not None:
            self._thread.join(timeout)

    def _run(self, started: ProbeStarted) -> None:
        ok, answered, detail = self._send()
        finished = ProbeFinished(self._clock(), started.probe_id, ok, answered, detail)
        log.debug("probe %d: ok=%s answered=%s %s", started.probe_id, ok, answered, detail)
        with self._lock:
            self._finished = finished

    def _send(self) -> tuple[bool, bool, str]:
        ok, answered, detail, self.model = generate_once(self.http, self.timeout, self.model)
        return ok, answered, detail


def generate_once(http: EngineHTTP, timeout: float, model: str = "") -> tuple[bool, bool, str, str]:
    """One ``max_tokens=1`` generation: (ok, answered, detail, model). ``answered`` is False when no response came
    before the deadline (or the connection closed without one). An empty ``model`` is looked up in /v1/models
    (the returned one is then known)."""
    t0 = time.monotonic()
    try:
        model = model or _discover_model(http, timeout)
        body: dict[str, Any] = {
            "model": model,
            "prompt": f"{uuid.uuid4().hex} liveness probe",
            "max_tokens": 1,
            "temperature": 0,
            "stream": False,
        }
        reply = http.post_json("/v1/completions", body, read_timeout=timeout)
    except HttpFailure as e:
        if e.kind == NO_ANSWER:
            return False, False, f"no answer within {timeout:g}s", model
        if e.kind == LOST:
            return False, False, f"connection lost after {time.monotonic() - t0:.1f}s without an answer", model
        if e.kind in ("refused", "unreachable"):
            return False, True, "cannot connect to the server", model
        return False, True, f"request failed: {e.message}", model
    except _ModelLookupFailed as e:
        return False, e.answered, str(e), model
    elapsed = time.monotonic() - t0
    if reply.status != 200:
        return False, True, f"HTTP {reply.status} from /v1/completions: {reply.text()}", model
    try:
        choices = reply.json().get("choices")
    except (ValueError, AttributeError):
        return False, True, "HTTP 200 but the body is not JSON", model
    if not choices:
        return False, True, "HTTP 200 but no choices in the answer", model
    return True, True, f"one token generated in {elapsed:.2f}s", model


def _discover_model(http: EngineHTTP, timeout: float) -> str:
    try:
        reply = http.get("/v1/models", accept="application/json", read_timeout=timeout)
    except HttpFailure as e:
        if e.kind in (NO_ANSWER, LOST):
            raise _ModelLookupFailed(f"/v1/models gave no answer within {timeout:g}s", answered=False) from None
        raise _ModelLookupFailed(f"/v1/models: {e.message}") from None
    if reply.status != 200:
        raise _ModelLookupFailed(f"HTTP {reply.status} from /v1/models (set probe.model, or the API key?)")
    try:
        return str(reply.json()["data"][0]["id"])
    except (ValueError, KeyError, IndexError, TypeError):
        raise _ModelLookupFailed("/v1/models lists no model") from None


class _ModelLookupFailed(Exception):
    def __init__(self, message: str, answered: bool = True) -> None:
        super().__init__(message)
        self.answered = answered
