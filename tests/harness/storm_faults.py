"""The storm's faults: each makes one thing go wrong, waits (bounded) for what the watchdog must do about it, and
undoes itself whatever happens. Each returns a line saying what came of it and records its incidents in the run.

Faults of the engine's own making (`tests/harness/inject`): ``diverge`` (the ranks diverge at a collective),
``crash`` (a request the sampler dies of), ``page_garbage`` and ``page_hang`` (the API server's /metrics answers
garbage or hangs, the engine serving on: blind, never restarted). From outside: a stopped or killed rank, a killed
API server. Around the engine: the receiver slow or down, the state directory full, a restart that fails, the
watchdog's wall clock stepped an hour on during a proof and back while calm (``clock_step``,
`tests/harness/clock_step`), and the watchdog itself SIGKILLed during a capture, a restart and a proof. With the
engine well (nothing may open): the watchdog SIGKILLed, the receiver down.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import requests

from tests.harness.faults import frozen, kill
from tests.harness.storm import FILLER
from tests.harness.watcher import event_time

if TYPE_CHECKING:
    from tests.harness.storm import FaultRun, Storm

RESTART_WAIT = 240.0  # a freeze or a death to its restart, the evidence included
RECOVER_WAIT = 300.0  # a restart to a served generation (a CPU vLLM loads in about a minute here)


def _opened(s: Storm, run: FaultRun, *kinds: str, timeout: float = 90.0) -> str:
    e = s.wait_event("incident_opened", run.started, timeout, where=lambda e: e.get("kind") in kinds)
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
    """A worker killed under load: the engine core may notice and exit (down), or the watchdog may see the step that
    never ends first (frozen); either way one incident, one restart."""
    kill(s.server.process(f"VLLM::Worker_TP{s.rng.randrange(2)}"))
    return _recovered(s, run, _opened(s, run, "down", "frozen"))


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


def _receiver(s: Storm, mode: str, then: Callable[[Storm, FaultRun], str], run: FaultRun, hold: float) -> str:
    s.receiver_mode = mode
    try:
        time.sleep(1)
        out = then(s, run)
        time.sleep(max(0.0, hold - (time.time() - run.started)))
    finally:
        s.receiver_mode = "ok"
        if mode == "down":
            s.quiet.append((run.started, time.time()))
    return f"receiver {mode} for {time.time() - run.started:.0f}s; {out}"


def receiver_down(s: Storm, run: FaultRun) -> str:
    """The receiver answers 503 through a whole incident: retried for ``alerts.retry_for``, then given up."""
    return _receiver(s, "down", kill_rank, run, 40)


def slow_receiver(s: Storm, run: FaultRun) -> str:
    return _receiver(s, "slow", stop_rank, run, 0)


def disk_full(s: Storm, run: FaultRun) -> str:
    """The state directory's filesystem full (to its last bytes) when a rank stops: the watchdog still sees, alerts
    and restarts; what it could not write is lost and said, and the files it keeps are whole. The disk has room again
    once the stall is alerted (the receiver has it)."""
    filler = s.state_dir / FILLER
    written, full_from = 0, time.time()
    try:
        fd = os.open(filler, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            for size in (1 << 20, 4096, 64):  # down to the last bytes: not even a line fits
                with contextlib.suppress(OSError):
                    while True:
                        written += os.write(fd, b"\0" * size)
        finally:
            os.close(fd)
        with _rank_stopped(s, 1):
            deadline, earlier = time.monotonic() + 90, s.earlier()

            def ours(b: dict[str, Any]) -> bool:
                return (b.get("event") == "stall_detected" and _t_alert(b) >= run.started
                        and b.get("incident_id") not in earlier)

            while not any(ours(b) for b in s.receiver.bodies()):
                assert time.monotonic() < deadline, "no stall alerted while the disk was full"
                w = s.watchdog
                assert w is not None and w.alive(), f"the watchdog died of a full disk:\n{w and w.log_tail()}"
                time.sleep(0.3)
            filler.unlink()
            s.full.append((full_from, time.time()))
            inc = next(str(b["incident_id"]) for b in s.receiver.bodies() if ours(b))
            run.incidents.append(inc)
            s.wait_event("restart_started", run.started, RESTART_WAIT, incident=inc)
    finally:
        with contextlib.suppress(FileNotFoundError):
            filler.unlink()
    return f"filled {written >> 20} MiB; alerted while full; " + _recovered(s, run, inc)


def _t_alert(body: dict[str, Any]) -> float:
    return _t({"time": body.get("time")})


def _killed_at(s: Storm, run: FaultRun, event: str) -> str:
    """A rank stopped; the watchdog SIGKILLed just after ``event`` and started again: the incident goes on, one
    restart at most. The rank stays stopped until the incident is over, as a real freeze stays: continued while the
    steps (which outlive the watchdog here) were still stopping the old server, it served the new life's proof
    before the steps took it down (seed 2035643017: recovered after 2 s, then a down incident of its own)."""
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


def _no_incident(s: Storm, run: FaultRun, seconds: float) -> None:
    """Nothing opens for ``seconds`` (but the fault's own incidents): the engine was never at fault."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        theirs = s.earlier() | set(run.incidents)
        opened = [e for e in s.events() if e.get("event") == "incident_opened" and _t(e) >= run.started
                  and e.get("incident") not in theirs]
        assert not opened, f"an incident opened with nothing wrong with the engine: {opened}"
        time.sleep(0.5)


def kill_watchdog_calm(s: Storm, run: FaultRun) -> str:
    """The watchdog SIGKILLed with the engine well and started again: no incident, no alert, the watch goes on."""
    before = len(s.receiver.bodies())
    s.kill_watchdog()
    _no_incident(s, run, 12)
    assert len(s.receiver.bodies()) == before, f"alerts after a calm restart: {s.receiver.bodies()[before:]}"
    return "killed while calm; no incident, no alert"


def receiver_down_calm(s: Storm, run: FaultRun) -> str:
    """The receiver down with the engine well: nothing to send, nothing opens."""
    s.receiver_mode = "down"
    try:
        _no_incident(s, run, 15)
    finally:
        s.receiver_mode = "ok"
        s.quiet.append((run.started, time.time()))
    return "receiver down for 15s while calm; no incident"


def _blind_page(s: Storm, run: FaultRun, fault: str) -> str:
    """The page unreadable, the engine well: a blind incident once the page is unseen for ``blind_after``, resolved
    when it is seen again, and nothing restarted."""
    with _injected(s, fault):
        opened = s.wait_event("incident_opened", run.started, 90, where=lambda e: e.get("unseen") == "page")
    inc = str(opened["incident"])
    run.incidents.append(inc)
    s.wait_event("resolved", run.started, 60, incident=inc)
    earlier = s.earlier()
    restarts = [e for e in s.events() if e.get("event") == "restart_started" and _t(e) >= run.started
                and e.get("incident") not in earlier]
    assert not restarts, f"restarted over a page it could not read: {restarts}"
    return f"{inc}: blind ({opened.get('why')}), resolved once seen, nothing restarted"


def page_garbage(s: Storm, run: FaultRun) -> str:
    return _blind_page(s, run, "page_garbage")


def page_hang(s: Storm, run: FaultRun) -> str:
    """Only /metrics held, /health and the engine serving on: the watchdog asks /health after the page's silence,
    finds the server answering and calls the page blind (``page_hangs``), not the server down (found by this storm:
    it restarted a serving engine)."""
    return _blind_page(s, run, "page_hang")


def clock_step(s: Storm, run: FaultRun) -> str:
    """The wall clock stepped an hour on while a restart is being proved (NTP on a host whose clock was behind):
    no wait ends early, one restart, recovered; then stepped back while calm: nothing opens."""
    s.clock_file.write_text("3600")
    try:
        with _rank_stopped(s, s.rng.randrange(2)):
            inc = _opened(s, run, "frozen")
            s.wait_event("restart_started", run.started, RESTART_WAIT, incident=inc)
        out = _recovered(s, run, inc)
        failed = [e for e in s.events() if e.get("event") == "restart_failed" and e.get("incident") == inc]
        assert not failed, f"a step of the wall clock failed the restart: {failed}"
        s.settle()
    finally:
        s.clock_file.write_text("0")
    time.sleep(1)
    _no_incident(s, run, 12)  # the step back (the fault's incident, stamped an hour on, excepted)
    return f"an hour ahead: {out}; stepped back while calm: nothing opened"


FAULTS: dict[str, Callable[[Storm, FaultRun], str]] = {
    f.__name__: f for f in (stop_rank, kill_rank, kill_api_server, diverge, crash, failed_restart,
                            receiver_down, slow_receiver, disk_full, kill_watchdog_in_capture,
                            kill_watchdog_in_restart, kill_watchdog_in_proof, kill_watchdog_calm,
                            receiver_down_calm, page_garbage, page_hang, clock_step)
}
# once each kind has run, the commonest faults come more often
WEIGHTS = {"stop_rank": 2, "diverge": 2}
