"""The head's side of rank liveness: one long-lived ``liveness`` session per node through its shared connection,
read in a thread; the latest report and its time kept for `views`. A stream that breaks, or stays open but silent
for ``liveness_stale`` seconds, is ended and started again (after a short backoff); meanwhile the report ages and
the node turns blind. Lines are capped in length, reports checked field by field (`protocol.ranks_from_report`),
and the stream's stderr is read beside its lines (its tail kept for the error), so nothing the node sends can
freeze the thread or end it."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import selectors
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator, Mapping

from watchdog.config.nodes import NodeSection
from watchdog.host.run import end_group, signal_group
from watchdog.nodes.liveness import NodeView, view
from watchdog.nodes.protocol import ProtocolError, RankState, clean, load_json, ranks_from_report
from watchdog.nodes.transport import KILL_GRACE, NodeError, NodeLink

log = logging.getLogger(__name__)
MAX_LINE = 256 * 1024
MAX_STDERR = 16 * 1024  # what is kept of the stream's stderr (its last bytes: the error message, if it ends)


class Silent(Exception):
    """The stream stays open but sends nothing."""


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
            err = bytearray()
            try:
                self._proc = self.link.start("liveness")
                assert self._proc.stdin is not None
                self._proc.stdin.write(json.dumps({"interval": self.node.liveness_interval}).encode())
                self._proc.stdin.close()
                for line in self._lines(self._proc, err):
                    report = load_json(line, "a liveness report")
                    if not isinstance(report, dict) or report.get("ok") is not True:
                        error = report.get("error") if isinstance(report, dict) else "not an object"
                        raise ProtocolError(clean(error or "refused, no reason given"))
                    self.ranks, self.received, self.error = ranks_from_report(report), self.clock(), ""
                    backoff = 0.5
                if not self._stop.is_set():
                    self.error = "the liveness stream ended" + self._stderr(err)
            except Silent as e:
                self.error = f"{e}: the stream was ended, starting it again"
            except NodeError as e:
                self.error = e.message
            except (ProtocolError, OSError) as e:
                self.error = f"bad liveness stream: {e}"
            except Exception as e:  # never let the watch's thread die: a node not watched would stay blind for good
                self.error = f"liveness stream failed: {type(e).__name__}: {clean(e, 200)}"
            self._end()
            if self.error:
                log.warning("node %s: %s", self.node.name, self.error)
            self._stop.wait(backoff)
            backoff = min(backoff * 2, 5.0)

    def _lines(self, proc: subprocess.Popen[bytes], err: bytearray) -> Iterator[bytes]:
        """The stream's lines as they come; stderr read beside them (its last ``MAX_STDERR`` bytes kept), so a
        chatty agent cannot fill the pipe and freeze the stream. `Silent` when no line comes for ``liveness_stale``
        seconds (an agent stuck, a connection that stays up but carries nothing); a line over ``MAX_LINE``, an error."""
        assert proc.stdout is not None and proc.stderr is not None
        silence = max(self.node.liveness_stale, 2 * self.node.liveness_interval)
        buf = bytearray()
        with selectors.DefaultSelector() as sel:
            sel.register(proc.stdout, selectors.EVENT_READ, "out")
            sel.register(proc.stderr, selectors.EVENT_READ, "err")
            last = time.monotonic()
            while not self._stop.is_set() and any(k.data == "out" for k in sel.get_map().values()):
                # checked every time round, not only when nothing came: a steady stderr, or a trickle of bytes that
                # never makes a line, is no report either
                if time.monotonic() - last >= silence:
                    raise Silent(f"no liveness report for {silence:g}s")
                # no shorter wake-up: `stop` kills the stream's group, and its pipes' EOF wakes this select (with
                # eight nodes, a poll twice a second per stream would be most of the head's CPU)
                events = sel.select(max(0.0, last + silence - time.monotonic()))
                for key, _ in events:
                    chunk = os.read(key.fd, 65536)
                    if not chunk:
                        sel.unregister(key.fileobj)
                        continue
                    if key.data == "err":
                        err.extend(chunk)
                        del err[:-MAX_STDERR]
                        continue
                    buf.extend(chunk)
                    while (at := buf.find(b"\n")) >= 0:
                        line, buf[:] = bytes(buf[:at]), buf[at + 1:]
                        last = time.monotonic()
                        yield line
                    if len(buf) > MAX_LINE:
                        raise ProtocolError(f"a liveness line over {MAX_LINE} bytes")

    def _stderr(self, err: bytearray) -> str:
        """The last line the agent (or ssh) wrote to stderr, once it exited (waited on briefly)."""
        if self._proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._proc.wait(timeout=1)
            if self._proc.stderr is not None:
                with contextlib.suppress(OSError, ValueError):
                    os.set_blocking(self._proc.stderr.fileno(), False)
                    err.extend(os.read(self._proc.stderr.fileno(), 4096) or b"")
        text = err.decode(errors="replace").strip()
        return f": {clean(text.splitlines()[-1], 200)}" if text else ""

    def _end(self) -> None:
        p, self._proc = self._proc, None
        if p is not None:
            end_group(p, KILL_GRACE)  # the stream's ssh leads a session of its own (`NodeLink.start`)
            for f in (p.stdout, p.stderr):
                if f is not None:
                    f.close()

    def stop(self) -> None:
        self._stop.set()
        p = self._proc
        if p is not None:  # wakes the thread reading it, which ends the group (`_end`)
            signal_group(p.pid, signal.SIGKILL)
        self._thread.join(10)


class NodeWatch:
    """Every node's liveness, for the daemon: `views` each pass; `changes` says what changed since the last call.
    Its streams run over ``links`` (`transport.open_links`), which their owner closes."""

    def __init__(self, nodes: tuple[NodeSection, ...], links: Mapping[str, NodeLink],
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.streams = [LivenessStream(links[n.name], clock).start() for n in nodes]
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
