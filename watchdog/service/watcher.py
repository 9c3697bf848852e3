"""One tick of the watch: collect a finished probe, scrape, judge, start a probe if the judge wants one.

Used by ``watchdog check`` and by the daemon. The edges (page, probe, process table) come in behind small protocols,
so tests drive the watcher with fakes and the daemon with the real ones (`build_watcher`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Protocol

from watchdog.config.load import Config
from watchdog.core.types import (
    Observation,
    PageReading,
    ProbeFinished,
    ProbeStarted,
    Scrape,
    ServerProcess,
    Transition,
)
from watchdog.evidence.collect.discover import server_for_url
from watchdog.judge.judge import Judge
from watchdog.scrape.engine_http import EngineHTTP
from watchdog.scrape.fetch import MetricsFetcher
from watchdog.scrape.probe import Prober


class Fetcher(Protocol):
    def scrape(self) -> Scrape: ...


class ServerFinder(Protocol):
    def __call__(self) -> ServerProcess: ...


class ProbeSender(Protocol):
    @property
    def in_flight(self) -> bool: ...
    def start(self) -> ProbeStarted: ...
    def poll(self) -> ProbeFinished | None: ...
    def wait(self, timeout: float) -> None: ...


ObservationSink = Callable[[Observation, float], None]


class Watcher:
    def __init__(
        self,
        fetcher: Fetcher,
        judge: Judge,
        prober: ProbeSender | None = None,
        sinks: list[ObservationSink] | None = None,
        find_server: ServerFinder | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.fetcher, self.judge, self.prober = fetcher, judge, prober
        self.find_server = find_server
        self.sinks = sinks or []
        self.clock, self.wall = clock, wall
        # the last page the judge could read (a failed scrape keeps it: a wedged engine's gauges hold their values,
        # and a slow answer at suspicion must not cost the stacks their running/waiting); the evidence thread reads it
        self.page: PageReading | None = None

    def tick(self) -> list[Transition]:
        out: list[Transition] = []
        if self.prober is not None and (done := self.prober.poll()) is not None:
            out += self.feed(done)
        scrape = self.fetcher.scrape()
        if scrape.page is not None:
            self.page = scrape.page
        if self.find_server is not None and scrape.error_kind in ("refused", "unreachable"):
            out += self.feed(self.find_server())  # the port is closed: is a server for it booting?
        out += self.feed(scrape)
        if self.prober is not None and self.judge.wants_probe(self.clock()):
            out += self.feed(self.prober.start())
        return out

    def wall_of(self, t: float) -> float:
        return self.wall() - (self.clock() - t)

    def feed(self, obs: Observation) -> list[Transition]:
        wall = obs.wall if isinstance(obs, Scrape) else self.wall_of(obs.t)
        for sink in self.sinks:
            sink(obs, wall)
        return self.judge.observe(obs)


def build_watcher(cfg: Config, http: EngineHTTP | None = None, sinks: list[ObservationSink] | None = None,
                  clock: Callable[[], float] = time.monotonic, wall: Callable[[], float] = time.time) -> Watcher:
    """The real watcher for a config, on the engine's one HTTP session (made here when not given)."""
    http = http or EngineHTTP(cfg.engine.url, cfg.scrape.limits(), cfg.api_key().reveal())
    prober = Prober(http, cfg.probe.timeout, cfg.probe.model, clock) if cfg.probe.enabled else None

    def find_server() -> ServerProcess:
        tree = server_for_url(cfg.engine.url, cfg.capture.docker_container)
        if tree is None:
            return ServerProcess(clock(), None)
        return ServerProcess(clock(), tree.pid, tree.started, tree.titles)

    fetcher = MetricsFetcher(http, clock=clock, wall=wall)
    return Watcher(fetcher, Judge(cfg.thresholds()), prober, sinks, find_server, clock=clock, wall=wall)
