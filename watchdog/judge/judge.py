"""The judgement: observations in, verdicts out. Pure: no I/O, no clock; time arrives with each observation.

Per engine (vLLM's ``engine`` label) the judge keeps a small track and decides a state:

- ``starting``  the server answers (or its port is open) but no generation has yet proven it serves;
- ``idle``      proven, nothing pending;
- ``working``   work pending and progress within the suspicion delay;
- ``suspect``   work pending and no progress for ``suspect_after`` seconds: a long step or a freeze;
                a later stage (stack evidence) may confirm it (frozen) or clear it (working);
- ``frozen``    work pending and no progress for ``stall_window`` seconds, or stacks confirmed it;
- ``down``      nothing listening, HTTP 5xx, or the engine's series vanished;
- ``blind``     the page cannot be read or has no engine series: the watchdog cannot judge and says so.

Work pending means running > 0 or waiting > 0 on the page, or a probe request outstanding (the page
cannot show a request stuck on the first step after idle). Progress means any work counter advancing or
the KV-cache usage changing (the only thing that moves during a long chunked prefill).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from watchdog.core.types import (
    DOWN_KINDS,
    NO_ANSWER,
    SERVING_COUNTERS,
    Decision,
    EngineReading,
    Observation,
    ProbeFinished,
    ProbeStarted,
    Scrape,
    ServerProcess,
    StackEvidence,
    State,
    Transition,
    Verdict,
)
from watchdog.judge.track import ProbeTrack, Thresholds, Track

SERVER = "server"  # the pseudo-engine that carries verdicts before any engine has been seen


_UNREADABLE = "; the page cannot be read now ("


@dataclass
class Judge:
    thresholds: Thresholds = field(default_factory=Thresholds)
    tracks: dict[str, Track] = field(default_factory=dict)
    probe: ProbeTrack = field(default_factory=ProbeTrack)
    server_answered: bool = False
    last_scrape_ok: bool = False
    last_answer_wall: float = 0.0
    server_process: ServerProcess | None = None

    # -- public API ------------------------------------------------------------------------------------

    def observe(self, obs: Observation) -> list[Transition]:
        if isinstance(obs, Scrape):
            return self._on_scrape(obs)
        if isinstance(obs, ProbeStarted):
            self.probe.in_flight, self.probe.last_started = obs, obs.t
            return []
        if isinstance(obs, ProbeFinished):
            return self._on_probe_finished(obs)
        if isinstance(obs, ServerProcess):
            self.server_process = obs
            return []
        return self._on_evidence(obs)

    def verdicts(self) -> list[Verdict]:
        return [tr.verdict for tr in self.tracks.values() if tr.verdict is not None]

    def wants_probe(self, t: float) -> bool:
        """Whether a probe request would tell the judgement something the page cannot."""
        th, pr = self.thresholds, self.probe
        if th.probe_interval <= 0 or pr.in_flight is not None or not self.last_scrape_ok:
            return False
        since_last = None if pr.last_started is None else t - pr.last_started
        for tr in self.tracks.values():
            if tr.engine == SERVER or tr.running > 0 or tr.waiting > 0:
                continue  # the page itself shows whether this engine's work moves
            if since_last is None:
                return True
            gap = th.probe_interval if tr.ready and pr.stuck_since is None else min(th.probe_retry, th.probe_interval)
            if since_last >= gap:
                return True
        return False

    def wants_stacks(self, t: float) -> list[str]:
        """Engines due for another look at the stacks: an explained long step, or a suspicion the stacks could not
        decide (a capture that failed on a busy box may succeed the next time). Suspicions themselves are asked for
        by their transition."""
        return [tr.engine for tr in self.tracks.values()
                if tr.next_check is not None and t >= tr.next_check and tr.verdict is not None
                and (tr.explained is not None or (tr.undecided and tr.verdict.state == State.SUSPECT))]

    # -- scrapes ---------------------------------------------------------------------------------------

    def _on_scrape(self, s: Scrape) -> list[Transition]:
        self.last_scrape_ok = s.ok
        if s.page is None:
            return self._on_failed_scrape(s)
        self.server_answered = True
        self.last_answer_wall = s.wall
        self.tracks.pop(SERVER, None)
        engines = s.page.engines
        if not engines:
            if s.page.vllm_series:
                why = (f"the page has {s.page.vllm_series} vllm: series but none of the engine's "
                       "(running, waiting, token counters): vLLM runs with --disable-log-stats?")
            else:
                why = "the page has no vllm: series: not a vLLM server, or log stats are disabled"
            return self._set_all(s.t, State.BLIND, why)
        out: list[Transition] = []
        for name, tr in self.tracks.items():
            if name not in engines:
                tr.forget_incarnation()
                out += self._set(tr, s.t, State.DOWN, "the engine's series vanished from the page")
        for name, reading in engines.items():
            tr = self.tracks.setdefault(name, Track(engine=name))
            out += self._judge_engine(tr, reading, s)
        return out

    def _on_failed_scrape(self, s: Scrape) -> list[Transition]:
        if s.error_kind in DOWN_KINDS:
            if s.error_kind != "http_5xx":
                self.server_answered = False
                for tr in self.tracks.values():
                    tr.forget_incarnation()
                booting = self._booting_server(s)
                if booting:
                    return self._set_all(s.t, State.STARTING, f"{s.error}; {booting}")
            return self._set_all(s.t, State.DOWN, s.error)
        if s.error_kind == NO_ANSWER and not self.server_answered:
            return self._set_all(s.t, State.STARTING, f"{s.error}: still loading?")
        if s.error_kind == NO_ANSWER:
            return self._set_all(s.t, State.DOWN, f"the API server stopped answering: {s.error}")
        if not self.tracks:
            return self._set_all(s.t, State.BLIND, f"cannot read the page ({s.error_kind}): {s.error}")
        out: list[Transition] = []
        for tr in self.tracks.values():
            v = tr.verdict
            if v is not None and v.state == State.FROZEN:
                # a confirmed freeze stays one: an unreadable page shows no progress (seen live: a stalled vLLM on
                # CPU starves its own API server, and its page trickled in for 10 s); only progress on it clears it
                base = v.reason.split(_UNREADABLE)[0]
                start = tr.stall_start
                out += self._set(tr, s.t, State.FROZEN, f"{base}{_UNREADABLE}{s.error_kind}): nothing shows progress",
                                 s.t - start if start is not None else v.stalled_for, v.stacks_only)
            else:
                out += self._set(tr, s.t, State.BLIND, f"cannot read the page ({s.error_kind}): {s.error}")
        return out

    def _booting_server(self, s: Scrape) -> str:
        """Why a closed port means starting: a server process for it, newer than the last answer, was just seen.

        vLLM binds its port only once the engine is up, so while it loads weights the port refuses.
        A process older than the last answer is the old server on its way out: that is down.
        """
        p = self.server_process
        if p is None or p.pid is None or s.t - p.t > 5.0 or p.started_wall <= self.last_answer_wall:
            return ""
        what = ", ".join(p.titles) if p.titles else "no engine process yet"
        return f"but vLLM server pid {p.pid} is running ({what}): starting up"

    def _judge_engine(self, tr: Track, r: EngineReading, s: Scrape) -> list[Transition]:
        t, th = s.t, self.thresholds
        tr.model = r.model or tr.model
        if r.running is None or r.waiting is None:
            missing = "vllm:num_requests_running" if r.running is None else "vllm:num_requests_waiting"
            return self._set(tr, t, State.BLIND, f"{missing} is missing or not a finite number")
        if not r.counters:
            return self._set(tr, t, State.BLIND, "no token or request counters for this engine on the page")
        tr.running, tr.waiting = r.running, r.waiting
        progress, restarted = self._progress(tr, r)
        if restarted:
            tr.forget_incarnation()
            tr.running, tr.waiting = r.running, r.waiting
        if tr.counters is None:  # first sight of this incarnation: has it served before the watchdog looked?
            tr.served = any(r.counters.get(c, 0) > 0 for c in SERVING_COUNTERS)
        tr.counters, tr.kv = dict(r.counters), r.kv_usage
        if progress:
            tr.last_progress = t
            tr.forget_stacks()
            if SERVING_COUNTERS & set(progress):
                tr.ready = True
                self.probe.stuck_since = None
        page_pending = r.running > 0 or r.waiting > 0
        # Before the first generation has succeeded, a slow probe is part of starting (the first generation after
        # a start takes 3-20 s here: warm-up), not a stall; a start that never finishes is for the boot timeout.
        # An engine that had served before the watchdog first saw it (a watchdog restarted over a wedge) is not
        # warming up: its first generation outstanding is pending work like any other.
        probe_since = self._probe_pending_since() if tr.ready or tr.served else None
        if page_pending or probe_since is not None:
            if tr.pending_since is None:
                tr.pending_since = t if page_pending or probe_since is None else probe_since
        else:
            tr.pending_since = None
        work = f"running={r.running:g} waiting={r.waiting:g}"
        if not page_pending and probe_since is not None:
            work += ", a probe request outstanding"
        if (stall_start := tr.stall_start) is not None:
            stalled = t - stall_start
            if tr.confirmed is not None and tr.confirmed.taken >= stall_start:
                return self._set(tr, t, State.FROZEN, f"stacks confirm: {tr.confirmed.reason} ({work})", stalled)
            if tr.explained is not None and tr.explained.taken >= stall_start:
                return self._set(tr, t, State.WORKING, self._long_step(tr, t, stalled, work), stalled,
                                 stacks_only=True)
            if stalled >= th.stall_window:
                blind = f"; metrics only: the stacks could not decide ({tr.undecided})" if tr.undecided else ""
                return self._set(tr, t, State.FROZEN,
                                 f"no progress for {stalled:.0f}s with work pending ({work}){blind}", stalled)
            if stalled >= th.suspect_after:
                return self._set(tr, t, State.SUSPECT, f"no progress for {stalled:.0f}s with work pending ({work}); "
                                 f"a long step or a freeze (frozen at {th.stall_window:g}s)", stalled)
            if page_pending:
                moved = ", ".join(sorted(progress)) if progress else "nothing yet"
                return self._set(tr, t, State.WORKING, f"{work}; moved: {moved}", stalled)
        if restarted:
            return self._set(tr, t, State.STARTING, "counters went backwards: the engine restarted")
        if not tr.ready:
            why = "answering; waiting for a first generation to prove the engine serves"
            first = self._probe_pending_since()
            if first is not None:
                why += f" (the first generation has been outstanding for {t - first:.0f}s)"
            elif self.probe.last_error:
                why += f" (last probe: {self.probe.last_error})"
            return self._set(tr, t, State.STARTING, why)
        return self._set(tr, t, State.IDLE, "no work pending")

    def _progress(self, tr: Track, r: EngineReading) -> tuple[list[str], bool]:
        """Names of what moved since the last page, and whether the counters went backwards."""
        if tr.counters is None:
            return [], False
        moved: list[str] = []
        for name, value in r.counters.items():
            before = tr.counters.get(name)
            if before is None:
                continue
            if value < before:
                return [], True
            if value > before:
                moved.append(name)
        if r.kv_usage is not None and tr.kv is not None and abs(r.kv_usage - tr.kv) > self.thresholds.kv_epsilon:
            moved.append("kv_cache_usage")
        return moved, False

    # -- probes and evidence ---------------------------------------------------------------------------

    def _probe_pending_since(self) -> float | None:
        starts = [x for x in (self.probe.stuck_since,
                              self.probe.in_flight.t if self.probe.in_flight else None) if x is not None]
        return min(starts) if starts else None

    def _on_probe_finished(self, p: ProbeFinished) -> list[Transition]:
        started = self.probe.in_flight.t if self.probe.in_flight else p.t
        self.probe.in_flight = None
        if p.ok:
            self.probe.stuck_since, self.probe.last_error = None, ""
            for tr in self.tracks.values():
                tr.ready = True
            return []
        self.probe.last_error = p.detail
        if not p.answered and self.probe.stuck_since is None:
            self.probe.stuck_since = started
        return []

    def _on_evidence(self, e: StackEvidence) -> list[Transition]:
        """Stacks decide a suspicion, or re-check a long step they explained. They never undo a freeze: once frozen,
        only progress on the page or a successful generation clears it (the stacks may only hold a restart)."""
        tr = self.tracks.get(e.engine)
        if tr is None or tr.verdict is None:
            return []
        v = tr.verdict
        if e.taken < v.since or (tr.last_progress is not None and tr.last_progress > e.taken):
            return []  # taken before the engine's current state began, or before it moved: says nothing about now
        rechecking = v.state == State.WORKING and tr.explained is not None
        if v.state != State.SUSPECT and not rechecking:
            return []
        if e.decision == Decision.STUCK:
            tr.confirmed, tr.explained, tr.next_check = e, None, None
            again = " on a re-check of a long step" if rechecking else ""
            return self._set(tr, e.t, State.FROZEN, f"stacks confirm{again}: {e.reason}", v.stalled_for)
        if e.decision in (Decision.UNDECIDED, Decision.IDLE):
            # the metric window decides unless a later look does; its verdict says why the stacks could not (idle:
            # the work the suspicion saw is gone from the page, and the page's own progress will say so)
            tr.undecided, tr.explained, tr.next_check = e.reason, None, None
            if not rechecking:
                tr.retries += 1
                tr.next_check = self._next_look(e.t, tr.retries)
            return []
        tr.explained, tr.checks = e, tr.checks + 1
        tr.next_check = self._next_look(e.t, tr.checks)
        work = f"running={tr.running:g} waiting={tr.waiting:g}"
        return self._set(tr, e.t, State.WORKING, self._long_step(tr, e.t, v.stalled_for, work), v.stalled_for,
                         stacks_only=True)

    def _next_look(self, t: float, looks: int) -> float:
        """When to look at the stacks again after ``looks`` looks: suspect_after, then twice that, ... at most
        recheck_max."""
        return t + min(self.thresholds.suspect_after * 2.0 ** (looks - 1), self.thresholds.recheck_max)

    def _long_step(self, tr: Track, t: float, stalled: float, work: str) -> str:
        assert tr.explained is not None
        nxt = f"; next look in {max(0.0, tr.next_check - t):.0f}s" if tr.next_check is not None else ""
        return (f"a long step: nothing moved on the page for {stalled:.0f}s ({work}) but the stacks show work: "
                f"{tr.explained.reason} (checked {tr.checks}x{nxt})")

    # -- bookkeeping -----------------------------------------------------------------------------------

    def _set_all(self, t: float, state: State, reason: str) -> list[Transition]:
        if not self.tracks:
            self.tracks[SERVER] = Track(engine=SERVER)
        out: list[Transition] = []
        for tr in self.tracks.values():
            out += self._set(tr, t, state, reason)
        return out

    def _set(self, tr: Track, t: float, state: State, reason: str, stalled: float = 0.0,
             stacks_only: bool = False) -> list[Transition]:
        old = tr.verdict
        since = old.since if old is not None and old.state == state else t
        tr.verdict = Verdict(tr.engine, state, reason, since, t, stalled, tr.incarnation, tr.model, tr.last_progress,
                             stacks_only)
        if old is not None and old.state == state:
            return []
        return [Transition(t, tr.engine, old.state if old else None, state, reason)]


def worst(verdicts: Iterable[Verdict]) -> Verdict | None:
    """The verdict an operator should see first."""
    order = [State.FROZEN, State.DOWN, State.BLIND, State.SUSPECT, State.STARTING, State.WORKING, State.IDLE]
    ranked = sorted(verdicts, key=lambda v: order.index(v.state))
    return ranked[0] if ranked else None
