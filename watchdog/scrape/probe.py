"""The probe: one tiny real generation, to see what the page cannot.

A request stuck on the first step after idle leaves the page at running=0, waiting=0 forever. When the
judgement cannot tell idle from stuck it asks for a probe: ``max_tokens=1``, a unique prompt (so the
prefix cache answers nothing), a hard deadline, at most one in flight. It runs in a background thread
so the watcher keeps scraping while it waits; its outcome reaches the judgement as an observation.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import requests

from watchdog.config.load import Secret
from watchdog.types import ProbeFinished, ProbeStarted, base_url

log = logging.getLogger(__name__)


class Prober:
    def __init__(
        self,
        url: str,
        timeout: float,
        model: str = "",
        api_key: Secret | None = None,
        session_factory: Callable[[], requests.Session] = requests.Session,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.base = base_url(url)
        self.timeout = timeout
        self.model = model
        self._api_key = api_key or Secret("")
        self._session_factory = session_factory
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
        with self._session_factory() as session:
            ok, answered, detail, self.model = generate_once(session, self.base, self.timeout, self.model,
                                                             self._api_key)
        return ok, answered, detail


def generate_once(session: requests.Session, base: str, timeout: float, model: str = "",
                  api_key: Secret | None = None) -> tuple[bool, bool, str, str]:
    """One ``max_tokens=1`` generation: (ok, answered, detail, model). ``answered`` is False when no response came
    before the deadline. An empty ``model`` is looked up in /v1/models (the returned one is then known)."""
    key = api_key.reveal() if api_key else ""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    session.trust_env = False  # straight to the engine, like the scrape
    t0 = time.monotonic()
    try:
        model = model or _discover_model(session, base, timeout, headers)
        body: dict[str, Any] = {
            "model": model,
            "prompt": f"{uuid.uuid4().hex} liveness probe",
            "max_tokens": 1,
            "temperature": 0,
            "stream": False,
        }
        resp = session.post(f"{base}/v1/completions", json=body, headers=headers, timeout=(min(5.0, timeout), timeout))
    except requests.exceptions.ReadTimeout:
        return False, False, f"no answer within {timeout:g}s", model
    except requests.exceptions.ConnectionError as e:
        if "Read timed out" in str(e) or "RemoteDisconnected" in str(e):
            return False, False, f"connection lost after {time.monotonic() - t0:.1f}s without an answer", model
        return False, True, "cannot connect to the server", model
    except _ModelLookupFailed as e:
        return False, e.answered, str(e), model
    except requests.exceptions.RequestException as e:
        return False, True, f"request failed: {type(e).__name__}", model
    elapsed = time.monotonic() - t0
    if resp.status_code != 200:
        return False, True, f"HTTP {resp.status_code} from /v1/completions: {resp.text[:160].strip()}", model
    try:
        choices = resp.json().get("choices")
    except ValueError:
        return False, True, "HTTP 200 but the body is not JSON", model
    if not choices:
        return False, True, "HTTP 200 but no choices in the answer", model
    return True, True, f"one token generated in {elapsed:.2f}s", model


def _discover_model(session: requests.Session, base: str, timeout: float, headers: dict[str, str]) -> str:
    try:
        resp = session.get(f"{base}/v1/models", headers=headers, timeout=(min(5.0, timeout), timeout))
    except requests.exceptions.ReadTimeout:
        raise _ModelLookupFailed(f"/v1/models gave no answer within {timeout:g}s", answered=False) from None
    if resp.status_code != 200:
        raise _ModelLookupFailed(f"HTTP {resp.status_code} from /v1/models (set probe.model, or the API key?)")
    try:
        data = resp.json()["data"]
        return str(data[0]["id"])
    except (ValueError, KeyError, IndexError, TypeError):
        raise _ModelLookupFailed("/v1/models lists no model") from None


class _ModelLookupFailed(Exception):
    def __init__(self, message: str, answered: bool = True) -> None:
        super().__init__(message)
        self.answered = answered
