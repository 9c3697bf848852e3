"""Capture: py-spy argv, retries, failure explanations (fake runner) and one real py-spy dump of a real process."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import psutil
import pytest

from tests.facts import says
from watchdog.core.processes import LOCAL, EngineProcess, Failure, Problem, ProcessId
from watchdog.core.roles import Role
from watchdog.core.types import Decision
from watchdog.evidence.collect.capture import (
    MISSING_HINT,
    PTRACE_HINT,
    Capturer,
    find_pyspy,
    proc_facts,
    run_argv,
)
from watchdog.evidence.explain.findings import assess
from watchdog.evidence.stacks.parse import parse_pyspy_json
from watchdog.host.ptrace import scope_note
from watchdog.nodes.protocol import dump_from_json, dump_to_json

PYSPY = "/opt/fake/py-spy"
SLEEPER = "import time\ndef parked_here():\n    print('ready', flush=True)\n    time.sleep({seconds})\nparked_here()\n"


def thread_json(pid: int, function: str = "parked_here") -> str:
    return json.dumps([{"pid": pid, "thread_id": 1, "thread_name": "MainThread", "os_thread_id": pid,
                        "active": False, "owns_gil": False,
                        "frames": [{"name": function, "filename": "/x/app.py", "module": None,
                                    "short_filename": "app.py", "line": 3, "locals": None}]}])


class FakeRunner:
    """Records every call; answers from a function of (argv, call number)."""

    def __init__(self, answer: Any) -> None:
        self.answer = answer
        self.calls: list[tuple[Any, float]] = []
        self.lock = threading.Lock()

    def __call__(self, argv: Sequence[str], timeout: float) -> tuple[int, str, str]:
        with self.lock:
            self.calls.append((argv, timeout))
            n = len(self.calls)
        return self.answer(list(argv), n)  # type: ignore[no-any-return]

    @property
    def argvs(self) -> list[list[str]]:
        return [list(a) for a, _ in self.calls]


def ok_answer(argv: list[str], n: int) -> tuple[int, str, str]:
    return 0, thread_json(int(argv[argv.index("--pid") + 1])), ""


def _end(p: subprocess.Popen[bytes]) -> None:
    if p.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(p.pid, signal.SIGCONT)  # a stopped process must never outlive the test stopped
        p.kill()
    p.wait(timeout=10)
    if p.stdout is not None:
        p.stdout.close()


def start_sleeper(seconds: float = 60) -> subprocess.Popen[bytes]:
    """A real Python process parked in time.sleep inside parked_here(); returns once it is there."""
    p = subprocess.Popen([sys.executable, "-c", SLEEPER.format(seconds=seconds)], stdout=subprocess.PIPE,
                         start_new_session=True)
    assert p.stdout is not None
    if p.stdout.readline() != b"ready\n":
        _end(p)
        raise AssertionError("the sleeper did not start")
    time.sleep(0.05)  # from the print into time.sleep
    return p


@pytest.fixture
def sleeper() -> Iterator[subprocess.Popen[bytes]]:
    p = start_sleeper()
    try:
        yield p
    finally:
        _end(p)


def _wait_state(pid: int, state: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        facts = proc_facts(pid)
        if facts is not None and facts.state == state:
            return
        time.sleep(0.01)
    raise AssertionError(f"pid {pid} never reached state {state}")


# ---------------------------------------------------------------------------------------------- dump_one (fake runner)


def test_success_json_and_plain_argv() -> None:
    pid = os.getpid()
    runner = FakeRunner(ok_answer)
    d = Capturer(PYSPY, timeout=7.5, runner=runner).dump_one(pid)
    assert d.ok and d.pid == pid and not d.nonblocking and d.error == ""
    assert json.loads(d.output)[0]["pid"] == pid
    assert runner.calls == [([PYSPY, "dump", "--json", "--pid", str(pid)], 7.5)]
    assert isinstance(runner.calls[0][0], list)  # an argv list, never a shell string
    assert d.facts is not None and d.facts.state in ("R", "S") and d.facts.threads >= 1


def test_failed_to_suspend_is_retried_nonblocking() -> None:
    pid = os.getpid()

    def answer(argv: list[str], n: int) -> tuple[int, str, str]:
        if "--nonblocking" not in argv:
            return 1, "", "Error: Failed to get stack traces\n\nCaused by:\n    0: Failed to suspend process\n"
        return ok_answer(argv, n)

    runner = FakeRunner(answer)
    d = Capturer(PYSPY, runner=runner).dump_one(pid)
    assert d.ok and d.nonblocking
    assert runner.argvs == [[PYSPY, "dump", "--json", "--pid", str(pid)],
                            [PYSPY, "dump", "--json", "--pid", str(pid), "--nonblocking"]]


def test_other_failures_are_not_retried() -> None:
    runner = FakeRunner(lambda argv, n: (1, "", "Error: something else broke"))
    d = Capturer(PYSPY, runner=runner).dump_one(os.getpid())
    assert not d.ok and len(runner.calls) == 1
    assert d.error == "py-spy failed (exit 1): Error: something else broke"


def test_nonblocking_retry_failing_too_is_reported() -> None:
    runner = FakeRunner(lambda argv, n: (1, "", "Failed to suspend process"))
    d = Capturer(PYSPY, runner=runner).dump_one(os.getpid())
    assert not d.ok and d.nonblocking and len(runner.calls) == 2
    assert "Failed to suspend process" in d.error


def test_stopped_process_is_dumped_nonblocking_at_once(sleeper: subprocess.Popen[bytes]) -> None:
    os.kill(sleeper.pid, signal.SIGSTOP)
    try:
        _wait_state(sleeper.pid, "T")
        runner = FakeRunner(ok_answer)
        d = Capturer(PYSPY, runner=runner).dump_one(sleeper.pid)
    finally:
        os.kill(sleeper.pid, signal.SIGCONT)
    assert d.ok and d.nonblocking
    assert d.facts is not None and d.facts.state == "T"
    assert runner.argvs == [[PYSPY, "dump", "--json", "--pid", str(sleeper.pid), "--nonblocking"]]


@pytest.mark.parametrize("err", [
    "Error: Permission Denied: Try running again with elevated permissions by going 'sudo env \"PATH=$PATH\" !!'",
    "Error: Operation not permitted (os error 1)",
    "Error: Failed to attach: ptrace(PTRACE_SEIZE) failed",
])
def test_ptrace_denied_gives_the_hint(err: str) -> None:
    d = Capturer(PYSPY, runner=FakeRunner(lambda argv, n: (1, "", err))).dump_one(os.getpid())
    assert not d.ok and d.error.startswith(PTRACE_HINT) and d.failure is Failure.DENIED
    assert "CAP_SYS_PTRACE" in d.error and "ptrace_scope" in d.error


def test_timeout_rc_124() -> None:
    d = Capturer(PYSPY, timeout=2, runner=FakeRunner(lambda argv, n: (124, "", "timed out after 2s"))).dump_one(
        os.getpid())
    assert not d.ok and d.failure is Failure.TIMEOUT
    assert d.error.startswith("py-spy timed out after 2s: the process may be in uninterruptible sleep (state D")
    assert "it was in state R" in d.error  # this test process, running


def test_run_argv_timeout_is_124() -> None:
    t0 = time.monotonic()
    rc, out, err = run_argv([sys.executable, "-c", "import time; time.sleep(20)"], 0.5)
    assert (rc, out) == (124, "") and err == "timed out after 0.5s"
    assert time.monotonic() - t0 < 10


def test_run_argv_passes_arguments_verbatim_without_a_shell() -> None:
    rc, out, _ = run_argv([sys.executable, "-c", "import sys; print(sys.argv[1:])", "$(id)", "a;b", "*"], 20)
    assert rc == 0 and out.strip() == "['$(id)', 'a;b', '*']"


def test_run_argv_exit_stderr_and_a_missing_program() -> None:
    rc, out, err = run_argv(["/bin/sh", "-c", "echo out; echo err >&2; exit 3"], 20)
    assert (rc, out, err) == (3, "out\n", "err\n")
    assert run_argv(["no-such-py-spy-for-the-watchdog"], 20) == (
        127, "", "program not found: no-such-py-spy-for-the-watchdog")  # a result, never an exception


def test_empty_output_with_rc0_is_a_failure() -> None:
    d = Capturer(PYSPY, runner=FakeRunner(lambda argv, n: (0, "  \n", ""))).dump_one(os.getpid())
    assert not d.ok and d.error.startswith("py-spy failed (exit 0)")


def test_locals_only_when_asked_and_native_flag() -> None:
    pid = os.getpid()
    plain, with_locals, native = FakeRunner(ok_answer), FakeRunner(ok_answer), FakeRunner(ok_answer)
    Capturer(PYSPY, runner=plain).dump_one(pid)
    Capturer(PYSPY, with_locals=True, runner=with_locals).dump_one(pid)
    Capturer(PYSPY, native=True, runner=native).dump_one(pid)
    assert "--locals" not in plain.argvs[0] and "--native" not in plain.argvs[0]
    assert with_locals.argvs == [[PYSPY, "dump", "--json", "--pid", str(pid), "--locals"]]
    assert native.argvs == [[PYSPY, "dump", "--json", "--pid", str(pid), "--native"]]


def test_pyspy_missing() -> None:
    runner = FakeRunner(ok_answer)
    cap = Capturer(None, runner=runner)
    procs = [EngineProcess(os.getpid(), Role.ENGINE_CORE, "VLLM::EngineCore")]
    c = cap.capture(procs, rounds=2, gap=0.0, sleep=lambda s: None)
    assert runner.calls == []
    assert len(c.rounds) == 2
    assert all(not d.ok and d.error == MISSING_HINT for r in c.rounds for d in r.values())
    assert c.problems == (Problem(MISSING_HINT),) and not c.complete
    assert c.options["pyspy"] is None


def test_find_pyspy() -> None:
    assert find_pyspy("/nonexistent/py-spy") is None
    assert find_pyspy(sys.executable) == sys.executable  # any executable configured is taken as is
    found = find_pyspy()
    assert found is not None and os.access(found, os.X_OK)


# ---------------------------------------------------------------------------------------------- capture / dump_all


def test_process_exiting_between_rounds() -> None:
    short = start_sleeper(1.0)
    try:
        live = os.getpid()

        def answer(argv: list[str], n: int) -> tuple[int, str, str]:
            pid = int(argv[argv.index("--pid") + 1])
            if psutil.pid_exists(pid):
                return ok_answer(argv, n)
            return 1, "", "Error: Failed to get process executable name. Check that the process is running."

        def gap(seconds: float) -> None:
            assert seconds == 0.25
            short.wait(timeout=20)  # it ends on its own between the rounds, and is reaped: gone, not a zombie

        procs = [EngineProcess(live, Role.ENGINE_CORE, "VLLM::EngineCore"),
                 EngineProcess(short.pid, Role.WORKER, "VLLM::Worker_TP0", {"TP": 0})]
        c = Capturer(PYSPY, runner=FakeRunner(answer)).capture(procs, rounds=2, gap=0.25, sleep=gap)
    finally:
        _end(short)
    assert [sorted(r) for r in c.rounds] == [sorted([ProcessId(LOCAL, live), procs[1].id])] * 2
    assert c.rounds[0][procs[1].id].ok and c.rounds[1][ProcessId(LOCAL, live)].ok
    gone = c.rounds[1][procs[1].id]
    assert not gone.ok and gone.failure is Failure.GONE and says(gone.error, "exited") and gone.facts is None
    assert c.problems == (Problem(gone.error),) and not c.complete
    assert c.options == {"native": False, "native_pids": [], "locals": False, "rounds": 2, "gap_seconds": 0.25,
                         "pyspy": PYSPY}


def test_capture_with_no_process_says_so() -> None:
    c = Capturer(PYSPY, runner=FakeRunner(ok_answer)).capture([], rounds=2, gap=0, sleep=lambda s: None)
    assert c.rounds == ({}, {}) and not c.complete
    assert c.problems and "no engine process found" in c.problems[0].text


def test_dump_all_parallel_keeps_pid_mapping() -> None:
    pids = [4_000_001, 4_000_002, 4_000_003, 4_000_004, 4_000_005, 4_000_006]
    barrier = threading.Barrier(len(pids), timeout=20)

    def answer(argv: list[str], n: int) -> tuple[int, str, str]:
        pid = int(argv[argv.index("--pid") + 1])
        barrier.wait()  # every dump is in flight at once: they really run in parallel
        time.sleep((pids[-1] - pid) * 0.01)  # and finish in reverse order
        return ok_answer(argv, n)

    runner = FakeRunner(answer)
    got = Capturer(PYSPY, runner=runner).dump_all(pids)
    assert list(got) == pids
    assert all(d.pid == pid and json.loads(d.output)[0]["pid"] == pid for pid, d in got.items())
    assert all(isinstance(a, list) and a[0] == PYSPY for a, _ in runner.calls)
    assert Capturer(PYSPY, runner=runner).dump_all([]) == {}


def test_dump_serial_keeps_pid_mapping() -> None:
    got = Capturer(PYSPY, runner=FakeRunner(ok_answer)).dump_serial([4_000_011, 4_000_012])
    assert {pid: json.loads(d.output)[0]["pid"] for pid, d in got.items()} == {4_000_011: 4_000_011,
                                                                              4_000_012: 4_000_012}


# ---------------------------------------------------------------------------------------------- real py-spy


def test_real_pyspy_dump_of_a_real_sleeper(sleeper: subprocess.Popen[bytes]) -> None:
    pyspy = find_pyspy()
    assert pyspy is not None, "py-spy is missing from the venv"
    proc = EngineProcess(sleeper.pid, Role.WORKER, "VLLM::Worker_TP0", {"TP": 0})
    c = Capturer(pyspy, timeout=30).capture([proc], rounds=2, gap=0.1)
    dumps = [r[proc.id] for r in c.rounds]
    assert all(d.ok for d in dumps), f"py-spy could not dump a child process here: {[d.error for d in dumps]}"
    assert c.complete and c.problems == ()
    ps = parse_pyspy_json(json.loads(dumps[0].output), pid=sleeper.pid, title=proc.title)
    functions = [f.function for t in ps.threads for f in t.frames]
    assert "parked_here" in functions or "sleep" in " ".join(functions)
    assert ps.pid == sleeper.pid and ps.source == "py-spy-json"
    assert dumps[0].facts is not None and dumps[0].facts.state == "S"


def test_real_pyspy_dump_of_a_stopped_process(sleeper: subprocess.Popen[bytes]) -> None:
    pyspy = find_pyspy()
    assert pyspy is not None
    os.kill(sleeper.pid, signal.SIGSTOP)
    try:
        _wait_state(sleeper.pid, "T")
        d = Capturer(pyspy, timeout=30).dump_one(sleeper.pid)
    finally:
        os.kill(sleeper.pid, signal.SIGCONT)
    assert d.ok, f"py-spy --nonblocking failed on a stopped process: {d.error}"
    assert d.nonblocking and d.facts is not None and d.facts.state == "T"
    ps = parse_pyspy_json(json.loads(d.output), pid=sleeper.pid)
    assert "parked_here" in [f.function for t in ps.threads for f in t.frames]


# -- degrading out loud: each failure kind named, with its fix; what can still be read is read --------------------


@pytest.mark.parametrize(("scope", "meaning"), [("0", "classic"), ("1", "only descendants"), ("2", "admin-only"),
                                                ("3", "no attach at all")])
def test_ptrace_scope_note(tmp_path: Path, scope: str, meaning: str) -> None:
    f = tmp_path / "ptrace_scope"
    f.write_text(scope + "\n")
    assert scope_note(f).startswith(f" (kernel.yama.ptrace_scope is {scope} here: ") and meaning in scope_note(f)
    assert scope_note(tmp_path / "absent") == ""  # no Yama: nothing to say


def test_native_unreadable_falls_back_to_python_only_and_says_so() -> None:
    def answer(argv: list[str], n: int) -> tuple[int, str, str]:
        if "--native" in argv:
            return 1, "", "Error: Failed to unwind native stack: no unwind info"
        return ok_answer(argv, n)

    runner = FakeRunner(answer)
    pid = os.getpid()
    c = Capturer(PYSPY, native=True, runner=runner).capture(
        [EngineProcess(pid, Role.WORKER, "VLLM::Worker_TP0")], rounds=1, gap=0)
    d = c.rounds[0][ProcessId(LOCAL, pid)]
    assert d.ok and d.failure is Failure.NATIVE_UNREADABLE and json.loads(d.output)[0]["frames"]
    assert d.error.startswith("--native could not be read (Error: Failed to unwind native stack: no unwind info): "
                              "Python-only stacks, taken again without --native")
    assert runner.argvs == [[PYSPY, "dump", "--json", "--pid", str(pid), "--native"],
                            [PYSPY, "dump", "--json", "--pid", str(pid)]]
    assert c.complete and c.problems == (Problem(d.error),)  # read, but the incident says what was lost


def test_native_and_python_both_failing_is_a_failure_not_a_fallback() -> None:
    d = Capturer(PYSPY, native=True, runner=FakeRunner(lambda argv, n: (1, "", f"Error: broken {n}"))).dump_one(
        os.getpid())
    assert not d.ok and d.failure is Failure.OTHER and d.error == "py-spy failed (exit 1): Error: broken 2"


def test_native_denied_is_not_retried_without_native() -> None:
    runner = FakeRunner(lambda argv, n: (1, "", "Error: Operation not permitted (os error 1)"))
    d = Capturer(PYSPY, native=True, runner=runner).dump_one(os.getpid())
    assert d.failure is Failure.DENIED and len(runner.calls) == 1


def test_missing_and_gone_have_their_kinds() -> None:
    assert Capturer(None).dump_one(os.getpid()).failure is Failure.MISSING
    p = subprocess.Popen([sys.executable, "-c", "pass"], start_new_session=True)
    p.wait(timeout=10)
    d = Capturer(PYSPY, runner=FakeRunner(lambda argv, n: (1, "", "Error: No such process (os error 3)"))).dump_one(
        p.pid)
    assert d.failure is Failure.GONE and says(d.error, "exited")


def test_real_timeout_of_a_hanging_pyspy(tmp_path: Path, sleeper: subprocess.Popen[bytes]) -> None:
    """A py-spy that never answers (as on a process in state D): the real runner kills it at the timeout."""
    hanging = tmp_path / "py-spy"
    hanging.write_text("#!/bin/sh\nexec sleep 60\n")
    hanging.chmod(0o755)
    c = Capturer(str(hanging), timeout=0.5).capture(
        [EngineProcess(sleeper.pid, Role.WORKER, "VLLM::Worker_TP0")], rounds=1, gap=0)
    d = c.rounds[0][ProcessId(LOCAL, sleeper.pid)]
    assert not d.ok and d.failure is Failure.TIMEOUT
    assert d.error.startswith("py-spy timed out after 0.5s: the process may be in uninterruptible sleep (state D")
    assert "it was in state S" in d.error and Problem(d.error) in c.problems
    f = assess(c, work_pending=True)
    assert f.decision is Decision.UNDECIDED and "py-spy timed out after 0.5s" in f.reason


def _as_nobody(argv: Sequence[str], timeout: float) -> tuple[int, str, str]:
    """The real runner, with py-spy dropped to an unprivileged user: ptrace of root's processes is refused."""
    return run_argv(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", *argv], timeout)


def test_real_pyspy_refused_by_the_kernel_is_named_with_its_fix() -> None:
    pyspy = find_pyspy()
    assert pyspy is not None and os.geteuid() == 0, "this test drops from root to nobody"
    a, b = start_sleeper(), start_sleeper()
    try:
        procs = [EngineProcess(a.pid, Role.ENGINE_CORE, "VLLM::EngineCore"),
                 EngineProcess(b.pid, Role.WORKER, "VLLM::Worker_TP0")]
        c = Capturer(pyspy, timeout=30, runner=_as_nobody).capture(procs, rounds=2, gap=0)
    finally:
        _end(a)
        _end(b)
    dumps = [d for r in c.rounds for d in r.values()]
    assert all(not d.ok and d.failure is Failure.DENIED for d in dumps), [d.error for d in dumps]
    assert all("CAP_SYS_PTRACE" in d.error and "ptrace_scope" in d.error for d in dumps)
    assert not c.complete and len(c.problems) == 1
    f = assess(c, work_pending=True)
    # never read as healthy: the stacks cannot decide, and the reason names the cause and the fix once for both
    assert f.decision is Decision.UNDECIDED
    assert f.reason.startswith("incomplete capture (VLLM::EngineCore, VLLM::Worker_TP0: ptrace was denied")
    assert f.reason.count("ptrace was denied") == 1


def test_quiet_pause_cpu_is_measured_between_rounds_with_no_pyspy_attached(sleeper: subprocess.Popen[bytes]) -> None:
    """A real spinning process and a real sleeper: each later round carries what the process used in the pause just
    before it (no dump in flight: the pool is joined first), over the pause's own length; the first round none."""
    burner = subprocess.Popen([sys.executable, "-c", "while True: pass"], start_new_session=True)
    try:
        procs = [EngineProcess(burner.pid, Role.ENGINE_CORE, "VLLM::EngineCore"),
                 EngineProcess(sleeper.pid, Role.WORKER, "VLLM::Worker_TP0", {"TP": 0})]
        in_flight: list[int] = []

        def answer(argv: list[str], n: int) -> tuple[int, str, str]:
            in_flight.append(1)
            time.sleep(0.3)  # a slow dump: it must not count in the pause
            in_flight.pop()
            return ok_answer(argv, n)

        def pause(seconds: float) -> None:
            assert not in_flight and seconds == 0.8
            time.sleep(seconds)

        c = Capturer(PYSPY, runner=FakeRunner(answer)).capture(procs, rounds=3, gap=0.8, sleep=pause)
    finally:
        _end(burner)
    assert all(d.quiet is None for d in c.rounds[0].values())
    for later in c.rounds[1:]:
        burn, sleep = later[procs[0].id].quiet, later[procs[1].id].quiet
        assert burn is not None and sleep is not None
        assert 0.8 <= burn[1] < 5 and 0.8 <= sleep[1] < 5  # the pause itself, not the dumps around it
        assert burn[0] > 0.05 and sleep[0] < 0.05  # the spinner spun; the sleeper slept
    got = dump_from_json(json.loads(json.dumps(dump_to_json(c.rounds[1][procs[0].id]))), burner.pid, 0.0)
    assert got == c.rounds[1][procs[0].id]  # it crosses the wire from another node's agent unchanged
