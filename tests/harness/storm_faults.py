"""The storm's faults: each makes one thing go wrong, waits (bounded) for what the watchdog must do about it, and
undoes itself whatever happens. Each returns a line saying what came of it and records its incidents in the run.

Faults of the engine's own making (`tests/harness/inject`): ``diverge`` (the ranks diverge at a collective) and
``crash`` (a request the sampler dies of). From outside: a stopped or killed rank, a killed API server. Around the
engine: the page garbage or hung, the receiver slow or down, the state directory full, a restart that fails, and the
watchdog itself SIGKILLed during a capture, a restart and a proof.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import requests

from tests.harness.faults import frozen, kill
from tests.harness.watcher import event_time

if TYPE_CHECKING:
    from tests.harness.storm import FaultRun, Storm

RESTART_WAIT = 240.0  # a freeze or a death to its restart, the evidence included
RECOVER_WAIT = 300.0  # a restart to a served generation (a CPU vLLM loads in about a minute here)


def _opened(s: Storm, run: FaultRun, kind: str, timeout: float = 90.0) -> str:
    e = s.wait_event("incident_opened", run.started, timeout, kind=kind)
    inc = str(e["incident"])
    run.incidents.append(inc)
    return inc


def _recovered(s: Storm, run: FaultRun, inc: str) -> str:
    started = s.wait_event("restart_started", run.started, RESTART_WAIT, incident=inc)
    rec = s.wait_event("recovered", run.started, RECOVER_WAIT, incident=inc)
    s.wait_event("resolved", run.started, 60, incident=inc)
    return f"{inc}: restarted, recovered after {float(rec.get('downtime') or 0):.0f}s " \
           f"(restart at +{_t(started) - run.started:.0f}s)"


def _t(e: dict[str, Any]) -> float:
    return event_time(e)


@contextlib.contextmanager
def _rank_stopped(s: Storm, rank: int) -> Iterator[None]:
    with frozen(s.server.process(f"VLLM::Worker_TP{rank}")):
        yield


def stop_rank(s: Storm, run: FaultRun) -> str:
    with _rank_stopped(s, s.rng.randrange(2)):
        inc = _opened(s, run, "frozen")
        s.wait_event("restart_started", run.started, RESTART_WAIT, incident=inc)
    return _recovered(s, run, inc)


def kill_rank(s: Storm, run: FaultRun) -> str:
    kill(s.server.process(f"VLLM::Worker_TP{s.rng.randrange(2)}"))
    return _recovered(s, run, _opened(s, run, "down"))


def kill_api_server(s: Storm, run: FaultRun) -> str:
    import psutil

    kill(psutil.Process(s.server.pid))
    return _recovered(s, run, _opened(s, run, "down"))


@contextlib.contextmanager
def _injected(s: Storm, fault: str) -> Iterator[None]:
    s.inject.write_text(fault)
    try:
        time.sleep(0.5)  # the engine reads the flag again at most every 0.2 s
        yield
    finally:
        s.inject.write_text("")


def diverge(s: Storm, run: FaultRun) -> str:
    """The engine's own: Worker_TP1 ends a step in a collective its peers never join (under the storm's load)."""
    with _injected(s, "diverge"):
        inc = _opened(s, run, "frozen")
    return _recovered(s, run, inc)


def crash(s: Storm, run: FaultRun) -> str:
    """The engine's own: a request with a repetition penalty makes the sampler index outside a tensor."""
    with _injected(s, "illegal_access"), contextlib.suppress(requests.RequestException):
        requests.post(f"{s.server.url}/v1/completions", timeout=120, json={
            "model": s.server.model.name, "prompt": "storm", "max_tokens": 4, "repetition_penalty": 1.3})
    return _recovered(s, run, _opened(s, run, "down"))


def failed_restart(s: Storm, run: FaultRun) -> str:
    """A rank stopped and the first restart refused: ``restart_failed``, then (after the backoff) a restart that
    works, for the same incident."""
    s.fail_flag.write_text("fail")
    try:
        with _rank_stopped(s, 1):
            inc = _opened(s, run, "frozen")
            s.wait_event("restart_failed", run.started, RESTART_WAIT, incident=inc)
            first = s.wait_event("restart_started", run.started, 10, incident=inc)
            s.wait_event("restart_started", _t(first) + 0.01, 120, incident=inc)
    finally:
        s.fail_flag.write_text("")
    return "failed once, then " + _recovered(s, run, inc)


def _page(s: Storm, run: FaultRun, mode: str) -> str:
    """The page unreadable past ``alerts.blind_after``: a blind incident, alerted; resolved once the page is back,
    and never a restart."""
    assert s.proxy is not None
    s.proxy.set_mode(mode)
    try:
        blind = s.wait_event("transition", run.started, 60, to="blind")
        inc = _opened(s, run, "blind", 60)
    finally:
        s.proxy.set_mode("pass")
    s.wait_event("resolved", run.started, 60, incident=inc)
    restarts = [e for e in s.events() if e.get("event") == "restart_started" and _t(e) >= run.started]
    assert not restarts, f"a page that cannot be read restarted the engine: {restarts}"
    return f"blind after {_t(blind) - run.started:.0f}s ({blind.get('reason')}), {inc} resolved, no restart"


def garbage_page(s: Storm, run: FaultRun) -> str:
    return _page(s, run, "garbage")


def hung_page(s: Storm, run: FaultRun) -> str:
    return _page(s, run, "hang")


def _receiver(s: Storm, mode: str, then: Callable[[Storm, FaultRun], str], run: FaultRun, hold: float) -> str:
    s.receiver_mode = mode
    try:
        time.sleep(1)
        out = then(s, run)
        time.sleep(max(0.0, hold - (time.time() - run.started)))
    finally:
        s.receiver_mode = "ok"
    return f"receiver {mode} for {time.time() - run.started:.0f}s; {out}"


def receiver_down(s: Storm, run: FaultRun) -> str:
    """The receiver answers 503 through a whole incident: retried for ``alerts.retry_for``, then marked failed."""
    return _receiver(s, "down", kill_rank, run, 40)


def slow_receiver(s: Storm, run: FaultRun) -> str:
    return _receiver(s, "slow", stop_rank, run, 0)


def disk_full(s: Storm, run: FaultRun) -> str:
    """The state directory's filesystem full while the page turns to garbage (a blind incident to write down)."""
    filler = s.state_dir / "storm-filler"
    written = 0
    try:
        with open(filler, "wb") as f:
            chunk = b"\0" * (1 << 20)
            with contextlib.suppress(OSError):
                while True:
                    f.write(chunk)
                    f.flush()
                    written += len(chunk)
            with contextlib.suppress(OSError):  # the last bytes, so that not even a line fits
                while True:
                    f.write(b"\0" * 512)
                    f.flush()
        assert s.proxy is not None
        s.proxy.set_mode("garbage")
        time.sleep(15)
        s.proxy.set_mode("pass")
        time.sleep(3)
    finally:
        if s.proxy is not None:
            s.proxy.set_mode("pass")
        with contextlib.suppress(FileNotFoundError):
            filler.unlink()
    s.settle(90)
    w = s.watchdog
    assert w is not None and w.alive(), "the watchdog died of a full disk"
    e = s.wait_event("resolved", run.started, 60)
    return f"filled {written >> 20} MiB; the watchdog lived on; events again after ({e.get('event')})"


def _killed_at(s: Storm, run: FaultRun, event: str) -> str:
    """A rank stopped; the watchdog SIGKILLed just after ``event`` and started again: the incident goes on, one
    restart at most."""
    with _rank_stopped(s, 0):
        inc = _opened(s, run, "frozen")
        if event != "incident_opened":
            s.wait_event(event, run.started, RESTART_WAIT + 60, incident=inc)
        s.kill_watchdog()
        if event == "incident_opened":
            s.wait_event("restart_started", run.started, RESTART_WAIT, incident=inc)
    return f"killed after {event}; " + _recovered(s, run, inc)


def kill_watchdog_in_capture(s: Storm, run: FaultRun) -> str:
    return _killed_at(s, run, "incident_opened")


def kill_watchdog_in_restart(s: Storm, run: FaultRun) -> str:
    return _killed_at(s, run, "restart_started")


def kill_watchdog_in_proof(s: Storm, run: FaultRun) -> str:
    return _killed_at(s, run, "restart_steps")


FAULTS: dict[str, Callable[[Storm, FaultRun], str]] = {
    f.__name__: f for f in (stop_rank, kill_rank, kill_api_server, diverge, crash, failed_restart, garbage_page,
                            hung_page, receiver_down, slow_receiver, disk_full, kill_watchdog_in_capture,
                            kill_watchdog_in_restart, kill_watchdog_in_proof)
}
# the quick ones come more often once each kind has run
WEIGHTS = {"garbage_page": 3, "hung_page": 3, "slow_receiver": 1, "stop_rank": 2, "diverge": 2}
