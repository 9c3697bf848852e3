"""Take the evidence: py-spy dumps of every engine process, in parallel, twice, with /proc facts beside them.

Each dump has a timeout. A process that cannot be suspended (it is stopped: SIGSTOP, or a debugger) is
dumped again with ``--nonblocking``. ``--locals`` is off unless asked for: locals hold prompts and secrets.
Every failure gets one kind (`Failure`: denied, missing, timeout, native_unreadable, gone, other), decided once
here from py-spy's exit and stderr, and a text with its fix; the capture goes on with what can still be read. When
``--native`` cannot be read the dump is taken again without it (Python-only stacks) and says so; a stopped process
is never asked for native frames (py-spy cannot unwind one), and its native dump says why instead.
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Protocol

import psutil

from watchdog.core.processes import Capture, Dump, EngineProcess, Failure, Problem, ProcFacts
from watchdog.host.proc_stat import read_stat
from watchdog.host.ptrace import scope_note
from watchdog.host.run import run_text

log = logging.getLogger(__name__)

PTRACE_HINT = ("ptrace was denied: run the watchdog as root or with CAP_SYS_PTRACE (AmbientCapabilities="
               "CAP_SYS_PTRACE in its unit; --cap-add SYS_PTRACE for a container), and check "
               "/proc/sys/kernel/yama/ptrace_scope (3 forbids ptrace entirely)")
MAX_OUTPUT = 64 * 1024 * 1024  # each of stdout and stderr: a py-spy dump of thousands of threads stays well below
KILL_GRACE = 0.5  # py-spy ends at SIGTERM; kept short, as the capture's worst case (`deadlines`) counts only timeouts
NO_ENGINE = "no engine process found (looked for VLLM:: titles, sglang schedulers, Ray workers)"
MISSING_HINT = "py-spy was not found: install it into the watchdog's venv (pip install py-spy) or set capture.pyspy"


STOPPED_NATIVE = ("no native frames: the process is stopped (state T), and py-spy unwinds native stacks only of a "
                  "process it suspends itself (blocking: 'Failed to suspend process'; --nonblocking refuses --native): "
                  "its Python frames are where it stopped")


def _stopped(facts: ProcFacts | None) -> bool:
    return facts is not None and facts.state in ("T", "t")


class DumpRunner(Protocol):
    def __call__(self, argv: Sequence[str], timeout: float) -> tuple[int, str, str]: ...


def run_argv(argv: Sequence[str], timeout: float) -> tuple[int, str, str]:
    """The real runner (`watchdog.host.run.run_text`: an argv, never a shell, in a session of its own, without
    systemd's notify variables): (exit status, stdout, stderr); 124 when it timed out (its process group ended),
    127 when it could not start, 1 when its output was past the cap."""
    return run_text(argv, timeout, max_out=MAX_OUTPUT, max_err=MAX_OUTPUT,  # docker logs: the log on stderr
                    kill_grace=KILL_GRACE)


def find_pyspy(configured: str = "") -> str | None:
    if configured:
        return configured if os.access(configured, os.X_OK) else None
    beside = Path(sys.executable).with_name("py-spy")
    if beside.exists():
        return str(beside)
    return shutil.which("py-spy")


def cpu_seconds(pid: int) -> float | None:
    """CPU (user + system, every thread) the process has used, or None when it is gone or unreadable."""
    st = read_stat(pid)
    return None if st is None else st.cpu_seconds


def proc_facts(pid: int) -> ProcFacts | None:
    st = read_stat(pid)
    if st is None:
        return None
    try:
        wchan = Path(f"/proc/{pid}/wchan").read_text().strip()
    except OSError:
        wchan = ""
    return ProcFacts(st.state, wchan, st.cpu_seconds, st.num_threads)


class Capturer:
    def __init__(self, pyspy: str | None, timeout: float = 10.0, native: bool = False, with_locals: bool = False,
                 runner: DumpRunner = run_argv, clock: Callable[[], float] = time.monotonic) -> None:
        self.pyspy = pyspy
        self.timeout = timeout
        self.native = native
        self.with_locals = with_locals
        self.runner = runner
        self.clock = clock

    def dump_one(self, pid: int, native: bool | None = None) -> Dump:
        """One dump; ``native`` overrides the capturer's own --native setting for this one."""
        t0 = self.clock()
        facts = proc_facts(pid)
        if self.pyspy is None:
            return Dump(pid, t0, False, "", MISSING_HINT, facts=facts, failure=Failure.MISSING)
        native = self.native if native is None else native
        note, degraded = "", None
        if native and _stopped(facts):  # py-spy cannot unwind it: Python frames, said so, not a copy called native
            native, note, degraded = False, STOPPED_NATIVE, Failure.NATIVE_UNREADABLE
        rc, out, err, nonblocking = self._run(self.pyspy, pid, facts, native)
        if native and not (rc == 0 and out.strip()) and self._kind(pid, rc, err) == Failure.OTHER:
            # --native needs unwind information py-spy may not find: the Python frames still decide
            native_err = err.strip()[:200] or f"exit {rc}"
            rc, out, err, nonblocking = self._run(self.pyspy, pid, facts, False)
            note = (f"--native could not be read ({native_err}): Python-only stacks, taken again without --native "
                    "(set capture.native = false, or give py-spy the libraries' symbols)")
            degraded = Failure.NATIVE_UNREADABLE
        seconds = self.clock() - t0
        if rc == 0 and out.strip():
            return Dump(pid, t0, True, out, note, nonblocking, facts, seconds, degraded)
        kind = self._kind(pid, rc, err)
        return Dump(pid, t0, False, "", self._explain(kind, rc, err, facts), nonblocking, facts, seconds, kind)

    def _run(self, pyspy: str, pid: int, facts: ProcFacts | None, native: bool) -> tuple[int, str, str, bool]:
        argv = [pyspy, "dump", "--json", "--pid", str(pid)]
        if native:
            argv.append("--native")
        if self.with_locals:
            argv.append("--locals")
        nonblocking = _stopped(facts)
        rc, out, err = self.runner([*argv, "--nonblocking"] if nonblocking else argv, self.timeout)
        if rc != 0 and not nonblocking and "suspend" in err.lower():
            nonblocking = True
            rc, out, err = self.runner([*argv, "--nonblocking"], self.timeout)
        return rc, out, err, nonblocking

    @staticmethod
    def _kind(pid: int, rc: int, err: str) -> Failure:
        """The one place py-spy's exit and stderr are read for why it failed."""
        low = err.lower()
        if not psutil.pid_exists(pid) or "no such process" in low:
            return Failure.GONE
        if "permission denied" in low or "operation not permitted" in low or "ptrace" in low:
            return Failure.DENIED
        if rc == 124:
            return Failure.TIMEOUT
        return Failure.OTHER

    def _explain(self, kind: Failure, rc: int, err: str, facts: ProcFacts | None) -> str:
        if kind == Failure.GONE:
            return "the process exited during the capture"
        if kind == Failure.DENIED:
            return PTRACE_HINT + scope_note()
        if kind == Failure.TIMEOUT:
            seen = ""
            if facts:
                wchan = f", wchan {facts.wchan}" if facts.wchan not in ("", "0") else ""
                seen = f"; it was in state {facts.state}{wchan}"
            return (f"py-spy timed out after {self.timeout:g}s: the process may be in uninterruptible sleep "
                    f"(state D: a driver or I/O wait; read /proc/PID/stack as root){seen}; raise capture.timeout "
                    "if it is only slow")
        return f"py-spy failed (exit {rc}): {err.strip()[:300]}"

    def dump_all(self, pids: Sequence[int], native: bool | None = None) -> dict[int, Dump]:
        if not pids:
            return {}
        with ThreadPoolExecutor(max_workers=min(16, len(pids)), thread_name_prefix="pyspy") as pool:
            return dict(zip(pids, pool.map(lambda pid: self.dump_one(pid, native), pids), strict=True))

    def dump_serial(self, pids: Sequence[int]) -> dict[int, Dump]:
        return {pid: self.dump_one(pid) for pid in pids}

    def _quiet_cpu(self, pids: Sequence[int], gap: float,
                   sleep: Callable[[float], None]) -> dict[int, tuple[float, float]]:
        """Sleep ``gap`` and return what each process used meanwhile, no py-spy attached: (CPU seconds, seconds)."""
        before = {pid: cpu_seconds(pid) for pid in pids}
        t0 = self.clock()
        sleep(gap)
        after = {pid: cpu_seconds(pid) for pid in pids}
        span = self.clock() - t0
        return {pid: (round(a - b, 3), round(span, 3)) for pid in pids
                if (b := before[pid]) is not None and (a := after[pid]) is not None}

    def capture(self, processes: Sequence[EngineProcess], rounds: int = 2, gap: float = 3.0,
                sleep: Callable[[float], None] = time.sleep, native_pids: frozenset[int] = frozenset()) -> Capture:
        """Every process, ``rounds`` times, ``gap`` apart; then one --native dump of each of ``native_pids`` (processes
        holding a GPU: their host thread waits in CUDA or NCCL, which only native frames show). The rounds decide;
        the native dumps explain (native frames churn inside a wait, so they are never compared)."""
        pids = [p.pid for p in processes]
        taken: list[dict[int, Dump]] = []
        for i in range(rounds):
            if not i:
                taken.append(self.dump_all(pids))
                continue
            quiet = self._quiet_cpu(pids, gap, sleep)
            taken.append({pid: replace(d, quiet=quiet.get(pid)) for pid, d in self.dump_all(pids).items()})
        problems = [Problem(e) for e in sorted({d.error for r in taken for d in r.values()
                                                if d.failure is not None or not d.ok})]
        if not processes:
            problems.append(Problem(NO_ENGINE))
        extra = [] if self.native else sorted(native_pids)  # with capture.native every round is native already
        stopped = [pid for pid in extra if _stopped(taken[-1][pid].facts if taken and pid in taken[-1] else None)]
        native = self.dump_all([pid for pid in extra if pid not in stopped], native=True)
        for pid in stopped:  # its Python frames are in the rounds already; a second copy would pass for native ones
            d = taken[-1][pid]
            native[pid] = Dump(pid, d.t, False, "", STOPPED_NATIVE, d.nonblocking, d.facts, 0.0,
                               Failure.NATIVE_UNREADABLE)
        options: dict[str, object] = {"native": self.native, "native_pids": extra,
                                      "locals": self.with_locals, "rounds": rounds,
                                      "gap_seconds": gap, "pyspy": self.pyspy}
        ids = {p.pid: p.id for p in processes}
        return Capture(tuple(processes), tuple({ids[pid]: d for pid, d in r.items()} for r in taken), tuple(problems),
                       options, {ids[pid]: d for pid, d in native.items()})
