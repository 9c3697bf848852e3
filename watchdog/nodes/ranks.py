"""On the node: the engine's processes and their state (running, stopped, zombie, gone), cheaply, every few seconds.

Discovery (every process's command line) runs once and again only when a rank is gone or every
``rediscover_every`` seconds (every ``GONE_REDISCOVER`` seconds while a rank is missing, so a restarted rank is
seen within seconds); in between each known rank costs one read of ``/proc/PID/stat``. A rank that is gone stays
reported as gone until a new process with its title appears (a restart).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from watchdog.core.processes import EngineProcess
from watchdog.host.proc_stat import read_stat
from watchdog.nodes.protocol import RANK_STATES

GONE_REDISCOVER = 5.0  # seconds between discoveries while a rank is reported gone (waiting for its successor)


class RankTracker:
    def __init__(self, find: Callable[[], Sequence[EngineProcess]], rediscover_every: float = 30.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.find, self.every, self.clock = find, rediscover_every, clock
        self.known: dict[int, tuple[EngineProcess, int]] = {}  # pid -> (process, start time)
        self.gone: dict[str, dict[str, Any]] = {}  # title -> its last report, while no successor exists
        self.found_at = -1e18

    def _rediscover(self) -> None:
        self.found_at = self.clock()
        fresh: dict[int, tuple[EngineProcess, int]] = {}
        for p in self.find():
            st = read_stat(p.pid)
            if st is not None:
                fresh[p.pid] = (p, st.starttime)
        for pid, (p, started) in self.known.items():
            if pid not in fresh or fresh[pid][1] != started:
                self.gone[p.title] = {"pid": pid, "title": p.title, "role": p.role.value, "state": "gone"}
        self.known = fresh
        for p, _ in fresh.values():
            self.gone.pop(p.title, None)

    def poll(self) -> list[dict[str, Any]]:
        if self.clock() - self.found_at >= (min(self.every, GONE_REDISCOVER) if self.gone else self.every):
            self._rediscover()
        report = []
        lost = False
        for pid, (p, started) in list(self.known.items()):
            st = read_stat(pid)
            state = "gone" if st is None or st.starttime != started else RANK_STATES.get(st.state, "running")
            if state == "gone":
                lost = True
                del self.known[pid]
                self.gone[p.title] = {"pid": pid, "title": p.title, "role": p.role.value, "state": "gone"}
                continue
            report.append({"pid": pid, "title": p.title, "role": p.role.value, "state": state})
        if lost:  # look for successors at once (a restart), then report what is still missing as gone
            self._rediscover()
            report = [r for r in report if r["pid"] in self.known]
            known_pids = {r["pid"] for r in report}
            report += [{"pid": pid, "title": p.title, "role": p.role.value, "state": "running"}
                       for pid, (p, _) in self.known.items() if pid not in known_pids]
        return report + list(self.gone.values())

