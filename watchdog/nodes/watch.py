"""The head's side of rank liveness: one long-lived ``liveness`` session per node through its shared connection,
read in a thread; the latest report and its time kept for `views`. A stream that breaks is started again (after
a short backoff); meanwhile the report ages and the node turns blind. Lines are capped in length."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable

from watchdog.config.nodes import NodeSection
from watchdog.nodes.liveness import NodeView, view
from watchdog.nodes.protocol import ProtocolError, RankState, ranks_from_report
from watchdog.nodes.transport import NodeError, NodeLink

log = logging.getLogger(__name__)
MAX_LINE = 256 * 1024


class LivenessStream:
    def __init__(self, link: NodeLink, clock: Callable[[], float] = time.monotonic) -> None:
        self.link, self.node, self.clock = link, link.node, clock
        self.ranks: tuple[RankState, ...] | None = None
        self.received: float | None = None
        self.error = ""
        self._proc: subprocess.Popen[bytes] | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"liveness-{self.node.name}", daemon=True)

    def start(self) -> LivenessStream:
        self._thread.start()
        return self

    def view(self) -> NodeView:
        age = None if self.received is None else self.clock() - self.received
        return view(self.node.name, self.ranks, age, self.node.liveness_stale, self.error)

    def _run(self) -> None:
        backoff = 0.5
        # not tenacity: this keeps a stream open for the watch's life (it is started again even when it ends cleanly,
        # and every report read resets the backoff), a supervisor loop with no call that succeeds and stops it
        while not self._stop.is_set():
            try:
                self._proc = self.link.start("liveness")
                assert self._proc.stdin is not None and self._proc.stdout is not None
                self._proc.stdin.write(json.dumps({"interval": self.node.liveness_interval}).encode())
                self._proc.stdin.close()
                while not self._stop.is_set():
                    line = self._proc.stdout.readline(MAX_LINE)
                    if not line:
                        break
                    report = json.loads(line)
                    if not report.get("ok"):
                        raise ProtocolError(str(report.get("error")))
                    self.ranks, self.received, self.error = ranks_from_report(report), self.clock(), ""
                    backoff = 0.5
                if not self._stop.is_set():
                    self.error = "the liveness stream ended" + self._stderr()
            except NodeError as e:
                self.error = e.message
            except (ProtocolError, ValueError, OSError) as e:
                self.error = f"bad liveness stream: {e}"
            self._end()
            if self.error:
                log.warning("node %s: %s", self.node.name, self.error)
            self._stop.wait(backoff)
            backoff = min(backoff * 2, 5.0)

    def _stderr(self) -> str:
        if self._proc is None or self._proc.stderr is None:
            return ""
        with contextlib.suppress(OSError, subprocess.TimeoutExpired):
            self._proc.wait(timeout=1)
            text = os.read(self._proc.stderr.fileno(), 4096).decode(errors="replace").strip()
            return f": {text.splitlines()[-1][:200]}" if text else ""
        return ""

    def _end(self) -> None:
        p, self._proc = self._proc, None
        if p is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()
            for f in (p.stdout, p.stderr):
                if f is not None:
                    f.close()

    def stop(self) -> None:
        self._stop.set()
        p = self._proc
        if p is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
        self._thread.join(10)


class NodeWatch:
    """Every node's liveness, for the daemon: `views` each pass; `changes` says what changed since the last call."""

    def __init__(self, nodes: tuple[NodeSection, ...], links: dict[str, NodeLink] | None = None) -> None:
        self.links = links or {n.name: NodeLink(n) for n in nodes}
        self.streams = [LivenessStream(self.links[n.name]).start() for n in nodes]
        self._last: dict[str, str] = {}

    def views(self) -> list[NodeView]:
        return [s.view() for s in self.streams]

    def changes(self, views: list[NodeView]) -> list[NodeView]:
        out = [v for v in views if self._last.get(v.node) != v.status]
        self._last.update({v.node: v.status for v in views})
        return out

    def close(self) -> None:
        for s in self.streams:
            s.stop()
        for link in self.links.values():
            link.close()
