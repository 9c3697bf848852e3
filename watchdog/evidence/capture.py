"""Take the evidence: py-spy dumps of every engine process, in parallel, twice, with /proc facts beside them.

Each dump has a timeout. A process that cannot be suspended (it is stopped: SIGSTOP, or a debugger) is
dumped again with ``--nonblocking``. ``--locals`` is off unless asked for: locals hold prompts and secrets.
When py-spy is missing or ptrace is denied, the capture records exactly that, with the fix, and goes on.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Protocol

import psutil

from watchdog.childenv import child_env
from watchdog.evidence.model import Capture, Dump, EngineProcess, ProcFacts

log = logging.getLogger(__name__)

PTRACE_HINT = ("ptrace was denied: run the watchdog as root or with CAP_SYS_PTRACE (AmbientCapabilities="
               "CAP_SYS_PTRACE in its unit; --cap-add SYS_PTRACE for a container), and check "
               "/proc/sys/kernel/yama/ptrace_scope (3 forbids ptrace entirely)")
MISSING_HINT = "py-spy was not found: install it into the watchdog's venv (pip install py-spy) or set capture.pyspy"


class DumpRunner(Protocol):
    def __call__(self, argv: Sequence[str], timeout: float) -> tuple[int, str, str]: ...


def run_argv(argv: Sequence[str], timeout: float) -> tuple[int, str, str]:
    """The real runner: an argv list, never a shell, with a timeout, without systemd's notify variables."""
    try:
        r = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout, check=False, env=child_env())
    except subprocess.TimeoutExpired:
        return 124, "", f"timed out after {timeout:g}s"
    return r.returncode, r.stdout, r.stderr


def find_pyspy(configured: str = "") -> str | None:
    if configured:
        return configured if os.access(configured, os.X_OK) else None
    beside = Path(sys.executable).with_name("py-spy")
    if beside.exists():
        return str(beside)
    return shutil.which("py-spy")


def proc_facts(pid: int) -> ProcFacts | None:
    try:
        p = psutil.Process(pid)
        with p.oneshot():
            cpu = p.cpu_times()
            threads = p.num_threads()
            stat = Path(f"/proc/{pid}/stat").read_text()
        state = stat.rsplit(")", 1)[1].split()[0]
        try:
            wchan = Path(f"/proc/{pid}/wchan").read_text().strip()
        except OSError:
            wchan = ""
        return ProcFacts(state, wchan, cpu.user + cpu.system, threads)
    except (psutil.Error, OSError, IndexError):
        return None


class Capturer:
    def __init__(self, pyspy: str | None, timeout: float = 10.0, native: bool = False, with_locals: bool = False,
                 runner: DumpRunner = run_argv, clock: Callable[[], float] = time.monotonic) -> None:
        self.pyspy = pyspy
        self.timeout = timeout
        self.native = native
        self.with_locals = with_locals
        self.runner = runner
        self.clock = clock

    def dump_one(self, pid: int) -> Dump:
        t0 = self.clock()
        facts = proc_facts(pid)
        if self.pyspy is None:
            return Dump(pid, t0, False, "", MISSING_HINT, facts=facts)
        argv = [self.pyspy, "dump", "--json", "--pid", str(pid)]
        if self.native:
            argv.append("--native")
        if self.with_locals:
            argv.append("--locals")
        nonblocking = facts is not None and facts.state in ("T", "t")
        rc, out, err = self.runner([*argv, "--nonblocking"] if nonblocking else argv, self.timeout)
        if rc != 0 and not nonblocking and "suspend" in err.lower():
            nonblocking = True
            rc, out, err = self.runner([*argv, "--nonblocking"], self.timeout)
        seconds = self.clock() - t0
        if rc == 0 and out.strip():
            return Dump(pid, t0, True, out, "", nonblocking, facts, seconds)
        return Dump(pid, t0, False, "", self._explain_failure(pid, rc, err), nonblocking, facts, seconds)

    def _explain_failure(self, pid: int, rc: int, err: str) -> str:
        low = err.lower()
        if not psutil.pid_exists(pid) or "no such process" in low:
            return "the process exited during the capture"
        if "permission denied" in low or "operation not permitted" in low or "ptrace" in low:
            return PTRACE_HINT
        if rc == 124:
            return f"py-spy {err.strip()}"
        return f"py-spy failed (exit {rc}): {err.strip()[:300]}"

    def dump_all(self, pids: Sequence[int]) -> dict[int, Dump]:
        if not pids:
            return {}
        with ThreadPoolExecutor(max_workers=min(16, len(pids)), thread_name_prefix="pyspy") as pool:
            return dict(zip(pids, pool.map(self.dump_one, pids), strict=True))

    def dump_serial(self, pids: Sequence[int]) -> dict[int, Dump]:
        return {pid: self.dump_one(pid) for pid in pids}

    def capture(self, processes: Sequence[EngineProcess], rounds: int = 2, gap: float = 3.0,
                sleep: Callable[[float], None] = time.sleep) -> Capture:
        pids = [p.pid for p in processes]
        taken: list[dict[int, Dump]] = []
        for i in range(rounds):
            if i:
                sleep(gap)
            taken.append(self.dump_all(pids))
        problems = sorted({d.error for r in taken for d in r.values() if not d.ok})
        if not processes:
            problems.append("no engine process found (looked for VLLM:: titles, sglang schedulers, Ray workers)")
        options: dict[str, object] = {"native": self.native, "locals": self.with_locals, "rounds": rounds,
                                      "gap_seconds": gap, "pyspy": self.pyspy}
        return Capture(tuple(processes), tuple(taken), tuple(problems), options)
