"""Evidence assessment on py-spy-JSON captures built from vLLM 0.32 frames, incident bundles, context, triage CLI."""

from __future__ import annotations

import copy
import json
import os
import secrets
import socket
import stat
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from tests.facts import line_of, says
from watchdog.config.load import Config
from watchdog.core.processes import Capture, Dump, EngineProcess, Failure, Problem, ProcessId, ProcFacts
from watchdog.core.types import Decision, EngineReading, PageReading, Scrape, incident_id
from watchdog.evidence.bundle import write as bundle
from watchdog.evidence.bundle.investigate import Investigator
from watchdog.evidence.bundle.write import BundleError, BundleHeader, list_bundles, prune, write_bundle
from watchdog.evidence.collect.capture import PTRACE_HINT
from watchdog.evidence.collect.context import RING_WARNING, Context, LogSource, gather, log_tail
from watchdog.evidence.explain.classes import Cls, Status
from watchdog.evidence.explain.findings import Findings, PageWork, assess
from watchdog.judge.judge import Judge
from watchdog.scrape.engine_http import EngineHTTP
from watchdog.service.watcher import Watcher

ROOT = Path(__file__).resolve().parents[2]
DUMPS = ROOT / "tests" / "data" / "dumps"
TEMPLATE = json.loads((DUMPS / "pyspy-real-mimic-worker-locals.json").read_text())

SITE = "/opt/vllm/lib/python3.12/site-packages"
STDLIB = "/usr/lib/python3.12"
SHM = f"{SITE}/vllm/distributed/device_communicators/shm_broadcast.py"
MPX = f"{SITE}/vllm/v1/executor/multiproc_executor.py"
CORE = f"{SITE}/vllm/v1/engine/core.py"

# Frames as py-spy 0.4 prints them on vLLM 0.32 (reference §4), innermost first: (function, file, line).
Frames = list[tuple[str, str, int]]
READER: Frames = [
    ("Poller.poll", f"{SITE}/zmq/sugar/poll.py", 106),
    ("SpinCondition.wait", SHM, 198),
    ("MessageQueue.acquire_read", SHM, 698),
    ("_GeneratorContextManager.__enter__", f"{STDLIB}/contextlib.py", 137),
    ("MessageQueue.dequeue", SHM, 780),
]
WORKER_IDLE: Frames = [*READER, ("WorkerProc.worker_busy_loop", MPX, 806), ("WorkerProc.worker_main", MPX, 707)]
ENGINE_WAITING: Frames = [
    *READER,
    ("MultiprocExecutor.collective_rpc.<locals>.get_response", MPX, 388),
    ("FutureWrapper._wait_for_response", MPX, 96),
    ("FutureWrapper.result", MPX, 80),
    ("EngineCore.step", CORE, 390),
    ("EngineCoreProc._process_engine_step", CORE, 901),
    ("EngineCoreProc.run_busy_loop", CORE, 876),
    ("EngineCoreProc.run_engine_core", CORE, 850),
]
MODEL_LAYERS: Frames = [
    ("RowParallelLinear.forward", f"{SITE}/vllm/model_executor/layers/linear.py", 1420),
    ("Qwen2MLP.forward", f"{SITE}/vllm/model_executor/models/qwen2.py", 98),
    ("Qwen2DecoderLayer.forward", f"{SITE}/vllm/model_executor/models/qwen2.py", 260),
    ("Qwen2Model.forward", f"{SITE}/vllm/model_executor/models/qwen2.py", 390),
    ("CPUModelRunner._model_forward", f"{SITE}/vllm/v1/worker/cpu_model_runner.py", 120),
    ("CPUModelRunner.execute_model", f"{SITE}/vllm/v1/worker/gpu_model_runner.py", 2500),
    ("CPUWorker.execute_model", f"{SITE}/vllm/v1/worker/cpu_worker.py", 180),
    ("WorkerProc.worker_busy_loop", MPX, 812),
    ("WorkerProc.worker_main", MPX, 707),
]
WORKER_ALLREDUCE: Frames = [
    ("_CPUSHMDistributed.all_reduce", f"{SITE}/vllm/distributed/device_communicators/cpu_communicator.py", 215),
    ("CpuCommunicator.all_reduce", f"{SITE}/vllm/distributed/device_communicators/cpu_communicator.py", 52),
    ("GroupCoordinator.all_reduce", f"{SITE}/vllm/distributed/parallel_state.py", 504),
    ("tensor_model_parallel_all_reduce", f"{SITE}/vllm/distributed/communication_op.py", 14),
    *MODEL_LAYERS,
]
WORKER_FORWARD: Frames = [
    ("Qwen2Attention.forward", f"{SITE}/vllm/model_executor/models/qwen2.py", 170),
    *MODEL_LAYERS[1:],
]


def pyspy_json(pid: int, main: Frames, main_name: str | None = "MainThread") -> str:
    """py-spy --json output in the format of the stored real dump: its DeathPipeMonitor thread plus our main."""
    helper, tmpl_main = copy.deepcopy(TEMPLATE[0]), copy.deepcopy(TEMPLATE[1])
    frame_tmpl = tmpl_main["frames"][0]
    helper["pid"] = tmpl_main["pid"] = pid
    helper["os_thread_id"], tmpl_main["os_thread_id"] = pid + 1, pid
    tmpl_main["thread_name"] = main_name
    tmpl_main["frames"] = [frame_tmpl | {"name": fn, "filename": file, "short_filename": file.rsplit("/", 1)[-1],
                                         "line": line, "locals": None} for fn, file, line in main]
    for f in helper["frames"]:
        f["locals"] = None
    return json.dumps([helper, tmpl_main])


API = EngineProcess(100, "api_server", "", {}, 1)
ENGINE = EngineProcess(101, "engine_core", "VLLM::EngineCore", {}, 100)
TP0 = EngineProcess(102, "worker", "VLLM::Worker_TP0", {"TP": 0}, 101)
TP1 = EngineProcess(103, "worker", "VLLM::Worker_TP1", {"TP": 1}, 101)
PROCS = (API, ENGINE, TP0, TP1)
BY_PID = {p.pid: p for p in PROCS}
API_FRAMES: Frames = [("EpollSelector.select", f"{STDLIB}/selectors.py", 468),
                      ("BaseEventLoop._run_once", f"{STDLIB}/asyncio/base_events.py", 1898)]


Round = dict[int, tuple[Frames | None, str, float]]  # pid -> (main thread frames or None: failed, state, CPU s)


def dump(p: EngineProcess, frames: Frames | None, state: str = "S", cpu: float = 10.0, t: float = 0.0,
         error: str = "") -> Dump:
    facts = ProcFacts(state, "do_sys_poll" if state == "S" else "", cpu, 4)
    if frames is None:
        return Dump(p.pid, t, False, "", error or "py-spy failed (exit 1): boom", facts=facts)
    return Dump(p.pid, t, True, pyspy_json(p.pid, frames), nonblocking=state == "T", facts=facts, seconds=0.2)


def rounds(*per_round: Round) -> tuple[dict[ProcessId, Dump], ...]:
    return tuple({BY_PID[pid].id: dump(BY_PID[pid], fr, st, cpu, t=3.0 * i) for pid, (fr, st, cpu) in r.items()}
                 for i, r in enumerate(per_round))


def capture(*per_round: Round,
            procs: Sequence[EngineProcess] = PROCS, problems: tuple[str, ...] = ()) -> Capture:
    return Capture(tuple(procs), rounds(*per_round), tuple(Problem(p) for p in problems),
                   {"native": False, "locals": False, "rounds": len(per_round), "gap_seconds": 3.0, "pyspy": "py-spy"})


def stopped_tp1_round(cpu: float) -> Round:
    # Measured on 0.32 CPU TP=2 with TP1 SIGSTOPped: TP0 spins in all_reduce, EngineCore waits on the reply.
    return {API.pid: (API_FRAMES, "S", 1.0), ENGINE.pid: (ENGINE_WAITING, "S", 5.0),
            TP0.pid: (WORKER_ALLREDUCE, "R", cpu), TP1.pid: (WORKER_FORWARD, "T", 7.0)}


def parked_round() -> Round:
    """The poll-parking signature: EngineCore waits on a reply, every worker parked in its reader."""
    return {ENGINE.pid: (ENGINE_WAITING, "S", 5.0), TP0.pid: (WORKER_IDLE, "S", 20.0),
            TP1.pid: (WORKER_IDLE, "S", 20.0)}


def stuck_capture() -> Capture:
    return capture(stopped_tp1_round(20.0), stopped_tp1_round(23.0))


def by_pid(f: Findings) -> dict[int, Any]:
    return {pf.process.pid: pf for pf in f.processes}


# ---------------------------------------------------------------------------------------------- assess


def test_template_format_is_what_the_parser_reads() -> None:
    from watchdog.evidence.stacks.parse import parse_pyspy_json

    ps = parse_pyspy_json(json.loads(pyspy_json(102, WORKER_ALLREDUCE)))
    assert ps.pid == 102 and [t.name for t in ps.threads] == ["DeathPipeMonitor", "MainThread"]
    assert ps.threads[1].frames[0].function == "_CPUSHMDistributed.all_reduce"
    assert not any(f.native for t in ps.threads for f in t.frames)


def test_stopped_tp1_is_stuck_with_tp1_the_culprit() -> None:
    f = assess(stuck_capture(), work_pending=True)
    assert f.decision is Decision.STUCK
    assert f.complete and f.problems == ()
    assert f.cross_rank.culprit == "Worker_TP1"
    assert "Worker_TP1" in f.reason and "stopped" in f.cross_rank.reason
    assert f.hypothesis.status is Status.CONTRADICTED
    p = by_pid(f)
    assert p[103].explanation.cls is Cls.STOPPED and p[103].state == "T"
    assert p[102].explanation.cls is Cls.IN_COLLECTIVE and p[102].state == "R"
    assert p[102].explanation.frames[0].function == "_CPUSHMDistributed.all_reduce"
    assert p[101].explanation.cls is Cls.ENGINE_WAITING_WORKERS
    assert [p[pid].moved for pid in (101, 102, 103)] == [False, False, False]
    assert p[102].cpu_seconds == 3.0 and p[103].cpu_seconds == 0.0
    assert p[100].explanation is not None and p[100].explanation.role == "api_server"


def test_stopped_rank_whose_nonblocking_stack_differs_does_not_count_as_moving() -> None:
    second = stopped_tp1_round(23.0)
    second[TP1.pid] = (WORKER_ALLREDUCE, "T", 7.0)  # a torn --nonblocking read: different frames, still stopped
    f = assess(capture(stopped_tp1_round(20.0), second), work_pending=True)
    assert by_pid(f)[103].moved is False  # still stopped: a torn read is not movement
    assert f.decision is Decision.STUCK and f.cross_rank.culprit == "Worker_TP1"


def test_worker_in_model_forward_is_working() -> None:
    r: Round = {API.pid: (API_FRAMES, "S", 1.0), ENGINE.pid: (ENGINE_WAITING, "S", 5.0),
                TP0.pid: (WORKER_FORWARD, "R", 20.0), TP1.pid: (WORKER_FORWARD, "R", 20.0)}
    f = assess(capture(r, r), work_pending=True)  # even with identical stacks: a long step, not a freeze
    assert f.decision is Decision.WORKING
    assert "model_forward" in f.reason and "Worker_TP0" in f.reason
    assert by_pid(f)[102].explanation.cls is Cls.MODEL_FORWARD


def test_stacks_moving_between_rounds_is_working() -> None:
    parked = {API.pid: (API_FRAMES, "S", 1.0), **parked_round()}
    later = dict(parked)
    later[TP0.pid] = (WORKER_ALLREDUCE, "R", 22.0)
    f = assess(capture(parked, later), work_pending=True)
    assert f.decision is Decision.WORKING
    assert says(f.reason, "moved", "Worker_TP0") and not says(f.reason, "Worker_TP1"), f.reason
    assert by_pid(f)[102].moved is True and by_pid(f)[103].moved is False
    assert f.hypothesis.status is Status.CONTRADICTED and "moved" in f.hypothesis.reason


def test_a_wait_loop_passing_through_its_own_lines_is_not_moving() -> None:
    """Spin/poll loops with timeouts change line numbers while they wait: only leaving the wait is progress."""
    parked = parked_round()
    later = dict(parked)
    later[TP1.pid] = ([("Poller.poll", f"{SITE}/zmq/sugar/poll.py", 107), *WORKER_IDLE[1:]], "S", 20.0)
    f = assess(capture(parked, later, procs=(ENGINE, TP0, TP1)), work_pending=True)
    assert by_pid(f)[TP1.pid].moved is False
    assert f.decision is Decision.STUCK


def test_poll_parking_signature_two_identical_rounds() -> None:
    parked = parked_round()
    f = assess(capture(parked, parked, procs=(ENGINE, TP0, TP1)), work_pending=True)
    assert f.decision is Decision.STUCK and f.cross_rank.culprit is None
    assert f.hypothesis.status is Status.SUPPORTED


def test_missing_dump_for_a_worker_is_undecided() -> None:
    r = stopped_tp1_round(20.0)
    del r[TP1.pid]  # no dump at all of TP1 in either round
    f = assess(capture(r, r), work_pending=True)
    assert f.decision is Decision.UNDECIDED and not f.complete
    assert f.reason.startswith("incomplete capture") and "VLLM::Worker_TP1" in f.reason
    assert by_pid(f)[103].explanation is None and by_pid(f)[103].state == "?"


def test_failed_dump_for_a_worker_is_undecided_with_its_error() -> None:
    r = stopped_tp1_round(20.0)
    caps = capture(r, r)
    bad = Dump(TP0.pid, 0.0, False, "", PTRACE_HINT, facts=ProcFacts("R", "", 20.0, 4))
    caps = Capture(caps.processes, tuple({**rnd, TP0.id: bad} for rnd in caps.rounds), (Problem(PTRACE_HINT),),
                   caps.options)
    f = assess(caps, work_pending=True)
    assert f.decision is Decision.UNDECIDED and "incomplete capture" in f.reason and PTRACE_HINT in f.reason
    assert f.problems == (PTRACE_HINT,)
    assert by_pid(f)[102].state == "R" and by_pid(f)[102].error == PTRACE_HINT


def test_second_round_missing_for_a_worker_is_not_stuck() -> None:
    """Nothing can be said to have stood still when a rank's second dump failed (it timed out, or it exited)."""
    parked = parked_round()
    later = dict(parked)
    later[TP1.pid] = (None, "S", 20.0)
    f = assess(capture(parked, later, procs=(ENGINE, TP0, TP1)), work_pending=True)
    assert by_pid(f)[103].moved is None
    assert f.decision is Decision.UNDECIDED and not f.complete
    assert says(f.reason, "incomplete", "VLLM::Worker_TP1", "py-spy failed (exit 1): boom"), f.reason  # its error
    del later[TP1.pid]  # absent from the last round altogether
    f = assess(capture(parked, later, procs=(ENGINE, TP0, TP1)), work_pending=True)
    assert f.decision is Decision.UNDECIDED
    assert says(f.reason, "incomplete", "VLLM::Worker_TP1", "last round"), f.reason


def test_single_round_is_undecided() -> None:
    parked = parked_round()
    f = assess(capture(parked, procs=(ENGINE, TP0, TP1)), work_pending=True)
    assert f.decision is Decision.UNDECIDED and "single capture" in f.reason
    assert f.complete
    assert all(pf.moved is None and pf.cpu_seconds is None for pf in f.processes)
    assert f.hypothesis.status is Status.INCONCLUSIVE and "single capture" in f.hypothesis.reason


def test_no_engine_process_is_undecided() -> None:
    f = assess(Capture((), ({}, {}), (Problem("no engine process found"),)), work_pending=None)
    assert f.decision is Decision.UNDECIDED and f.processes == () and not f.complete


# ---------------------------------------------------------------------------------------------- bundles


def context(**kw: Any) -> Context:
    base: dict[str, Any] = {
        "metrics_page": 'vllm:num_requests_running{engine="0",model_name="m"} 4.0\n',
        "log_tail": f"INFO 10:00:00 core.py:1] {RING_WARNING} in 60 seconds\n", "log_source": "/var/log/vllm.log",
        "ring_warnings": 1, "versions": {"watchdog": "0.1.0", "vllm": "0.32.0", "py-spy": "0.4.1"},
        "problems": (Problem("nvidia-smi failed (exit 9): no GPU"),)}
    return Context(**(base | kw))


def incident(created: float, state: str = "frozen") -> BundleHeader:
    return BundleHeader(incident_id(created, "vllm", "0", state, secrets.token_hex(2)), "0", state,
                        "no progress for 120s with 4 running", "http://127.0.0.1:8000", created)


def write(root: Path, created: float = 1_760_000_000.0, cap: Capture | None = None) -> Path:
    cap = cap or stuck_capture()
    return write_bundle(root, incident(created), cap, assess(cap, work_pending=True), context())


def test_bundle_contents_and_manifest(tmp_path: Path) -> None:
    root = tmp_path / "state" / "incidents"
    path = write(root)
    assert path.parent == root and path.name.startswith("20251009T") and "-engine0-frozen-" in path.name
    assert stat.S_IMODE(path.stat().st_mode) == 0o700
    assert stat.S_IMODE((path / "dumps").stat().st_mode) == 0o700
    assert stat.S_IMODE(root.stat().st_mode) == 0o700
    m = json.loads((path / "manifest.json").read_text())
    assert m["version"] == 1 and m["id"] == path.name
    assert m["created"] == "2025-10-09T08:53:20+00:00"
    assert (m["engine"], m["state"], m["decision"], m["culprit"]) == ("0", "frozen", "stuck", "Worker_TP1")
    assert m["poll_parking"]["status"] == "CONTRADICTED" and m["capture_complete"] is True
    assert m["versions"] == {"watchdog": "0.1.0", "vllm": "0.32.0", "py-spy": "0.4.1"}
    assert m["ring_buffer_warnings_in_log"] == 1 and m["problems"] == ["nvidia-smi failed (exit 9): no GPU"]
    procs = {p["pid"]: p for p in m["processes"]}
    assert set(procs) == {100, 101, 102, 103}
    assert procs[103]["class"] == "stopped" and procs[103]["nonblocking"] is True and procs[103]["state"] == "T"
    assert procs[102]["class"] == "in_collective" and procs[102]["moved"] is False
    assert procs[102]["frames"][0] == {"function": "_CPUSHMDistributed.all_reduce", "file": WORKER_ALLREDUCE[0][1],
                                       "line": 215, "native": False}
    assert procs[102]["cpu_seconds_between_captures"] == 3.0 and procs[102]["wchan"] == ""
    assert all({"class", "frames", "role", "title"} <= set(p) for p in m["processes"])
    # every file listed is there; raw dumps are py-spy's output verbatim
    assert sorted(m["files"]) == sorted(str(f.relative_to(path)) for f in path.rglob("*")
                                        if f.is_file() and f.name not in ("manifest.json", "summary.md"))
    raw = path / "dumps" / "round1-102-VLLM-Worker_TP0.json"
    assert raw.read_text() == stuck_capture().rounds[0][TP0.id].output
    assert len(list((path / "dumps").iterdir())) == 8  # 4 processes x 2 rounds
    assert (path / "dumps" / "round2-100-process.json").is_file()  # the untitled API server
    assert (path / "metrics.txt").read_text().startswith("vllm:num_requests_running")
    assert RING_WARNING in (path / "log-tail.txt").read_text()
    assert not (path / "gpu.csv").exists()
    summary = (path / "summary.md").read_text()
    assert "Worker_TP1" in summary and "CONTRADICTED" in summary and "STUCK" not in summary.split("\n")[0]
    assert "**stuck**" in summary and says(line_of(summary, "VLLM::Worker_TP1", "103"), "T", "stopped")
    assert "nvidia-smi failed" in summary


def test_failed_dump_is_written_as_its_error(tmp_path: Path) -> None:
    r = stopped_tp1_round(20.0)
    r[TP0.pid] = (None, "R", 20.0)
    path = write(tmp_path, cap=capture(r, r))
    assert json.loads((path / "dumps" / "round1-102-VLLM-Worker_TP0.json").read_text()) == {
        "error": "py-spy failed (exit 1): boom"}
    m = json.loads((path / "manifest.json").read_text())
    assert m["decision"] == "undecided" and m["capture_complete"] is False
    tp0 = next(p for p in m["processes"] if p["pid"] == 102)
    assert tp0["class"] is None and tp0["frames"] == [] and tp0["error"] == "py-spy failed (exit 1): boom"
    assert "no stack" in (path / "summary.md").read_text()


def test_crash_writing_manifest_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real = bundle._write
    written: list[str] = []

    def failing(path: Path, text: str) -> None:
        written.append(path.name)
        if path.name == "manifest.json":
            raise OSError(28, "No space left on device")
        real(path, text)

    monkeypatch.setattr(bundle, "_write", failing)
    with pytest.raises(BundleError, match="No space left on device") as e:
        write(tmp_path)
    assert str(tmp_path) in str(e.value)
    assert "summary.md" in written and "manifest.json" in written  # it failed at the very end
    assert list_bundles(tmp_path) == []
    assert list(tmp_path.iterdir()) == []  # no partial directory left behind


def test_partial_dir_from_a_crash_is_never_listed_and_pruned_when_old(tmp_path: Path) -> None:
    done = write(tmp_path)
    cap = stuck_capture()
    m = bundle.manifest(incident(1_760_000_100.0), cap, assess(cap, True), context(), [])
    old = tmp_path / f"{bundle.PARTIAL}{m['id']}"
    old.mkdir()
    (old / "manifest.json").write_text(json.dumps(m))  # the crash came after the manifest, before the rename
    fresh = tmp_path / f"{bundle.PARTIAL}20250909T090000Z-engine0-frozen-beef"
    fresh.mkdir()
    (fresh / "manifest.json").write_text(json.dumps(m))
    assert [b["id"] for b in list_bundles(tmp_path)] == [done.name]
    two_hours_ago = time.time() - 7200
    os.utime(old, (two_hours_ago, two_hours_ago))
    removed = prune(tmp_path, max_count=10, max_bytes=1 << 30)
    assert removed == [old.name]
    assert not old.exists() and fresh.exists() and done.exists()  # a young one may still be being written


def _sizes(root: Path) -> list[int]:
    return [sum(f.stat().st_size for f in Path(b["path"]).rglob("*") if f.is_file()) for b in list_bundles(root)]


def test_retention_by_count_deletes_oldest_first(tmp_path: Path) -> None:
    paths = [write(tmp_path, created) for created in (1_760_000_300.0, 1_760_000_100.0, 1_760_000_200.0)]
    assert [b["path"] for b in list_bundles(tmp_path)] == [str(paths[1]), str(paths[2]), str(paths[0])]
    assert prune(tmp_path, max_count=3, max_bytes=1 << 30) == []
    assert prune(tmp_path, max_count=1, max_bytes=1 << 30) == [paths[1].name, paths[2].name]
    assert [b["path"] for b in list_bundles(tmp_path)] == [str(paths[0])]


def test_retention_by_bytes_deletes_oldest_first(tmp_path: Path) -> None:
    paths = [write(tmp_path, created) for created in (1_760_000_100.0, 1_760_000_200.0, 1_760_000_300.0)]
    sizes = _sizes(tmp_path)
    assert prune(tmp_path, max_count=10, max_bytes=sum(sizes)) == []
    assert prune(tmp_path, max_count=10, max_bytes=sizes[1] + sizes[2]) == [paths[0].name]
    assert prune(tmp_path, max_count=10, max_bytes=sizes[2] - 1) == [paths[1].name, paths[2].name]
    assert list_bundles(tmp_path) == [] and list(tmp_path.iterdir()) == []


def test_unwritable_root_is_a_bundle_error(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory\n")
    with pytest.raises(BundleError, match=r"cannot write incident bundle under .*a-file/incidents: Not a directory"):
        write(blocker / "incidents")
    assert blocker.read_text() == "not a directory\n"


def test_list_and_prune_of_a_missing_root(tmp_path: Path) -> None:
    assert list_bundles(tmp_path / "nope") == [] and prune(tmp_path / "nope", 1, 1) == []


# ---------------------------------------------------------------------------------------------- context


class Runner:
    def __init__(self, rc: int = 0, out: str = "", err: str = "") -> None:
        self.answer = (rc, out, err)
        self.calls: list[tuple[list[str], float]] = []

    def __call__(self, argv: Sequence[str], timeout: float) -> tuple[int, str, str]:
        assert isinstance(argv, list)
        self.calls.append((argv, timeout))
        return self.answer


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_log_tail_from_file_and_ring_warnings_counted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # no nvidia-smi: no GPU state
    monkeypatch.setattr("watchdog.evidence.collect.context.shutil.which", lambda name: None)
    log = tmp_path / "vllm.log"
    warn = f"INFO 05-01 10:0{{}}:00 [shm_broadcast.py:466] {RING_WARNING} in 60 seconds. This typically happens ..."
    lines = [warn.format(0), "INFO something else", warn.format(1), warn.format(2), "INFO tail", warn.format(3)]
    log.write_text("\n".join(lines) + "\n")
    text, where, problem = log_tail(LogSource(file=str(log), lines=4))
    assert (where, problem) == (str(log), "")
    assert text.splitlines() == lines[-4:]
    runner = Runner()
    http = EngineHTTP(f"http://127.0.0.1:{_closed_port()}")
    ctx = gather(http, "page", LogSource(file=str(log), lines=4), [], None, runner)
    assert ctx.ring_warnings == 3 and ctx.log_source == str(log) and ctx.metrics_page == "page"
    assert ctx.problems == () and runner.calls == []
    assert ctx.versions.get("watchdog") and "vllm" not in ctx.versions  # nobody answered /version


def test_log_tail_missing_file_is_a_problem(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("watchdog.evidence.collect.context.shutil.which", lambda name: None)
    missing = tmp_path / "gone.log"
    text, where, problem = log_tail(LogSource(file=str(missing)))
    assert (text, where) == ("", str(missing))
    assert says(problem, "log file", str(missing), "No such file or directory"), problem  # the path and the OS
    ctx = gather(EngineHTTP(f"http://127.0.0.1:{_closed_port()}"), "", LogSource(file=str(missing)), [], None, Runner())
    assert ctx.problems == (Problem(problem),) and ctx.ring_warnings == 0


def test_log_tail_from_journal_and_docker(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("watchdog.evidence.collect.context.shutil.which", lambda name: f"/usr/bin/{name}")
    journal = Runner(out=f"2025-05-01T10:00:00 host vllm[1]: {RING_WARNING}\n")
    text, where, problem = log_tail(LogSource(journal_unit="vllm.service", lines=50), journal, timeout=4)
    assert journal.calls == [(["journalctl", "-u", "vllm.service", "-n", "50", "--no-pager", "-o", "short-iso"], 4)]
    assert RING_WARNING in text and where == "journalctl -u vllm.service" and problem == ""
    docker = Runner(out="stdout line\n", err=f"{RING_WARNING}\n")  # docker logs: the container's stderr on stderr
    text, where, problem = log_tail(LogSource(docker_container="vllm-0", lines=20), docker)
    assert docker.calls[0][0] == ["docker", "logs", "--tail", "20", "vllm-0"]
    assert text == f"stdout line\n{RING_WARNING}\n" and where == "docker logs --tail" and problem == ""
    failing = Runner(rc=1, err="Error: No such container: vllm-0\n")
    _, _, problem = log_tail(LogSource(docker_container="vllm-0"), failing)
    assert says(problem, "docker logs", "exit 1", "Error: No such container: vllm-0"), problem  # docker's stderr
    monkeypatch.setattr("watchdog.evidence.collect.context.shutil.which", lambda name: None)
    unused = Runner()
    assert says(log_tail(LogSource(journal_unit="x"), unused)[2], "journalctl", "not installed")
    assert unused.calls == []
    assert log_tail(LogSource(), unused) == ("", "", "")


# ---------------------------------------------------------------------------------------------- the CLI


def watchdog(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "watchdog", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=120, check=False)


def test_explain_json_one_file() -> None:
    r = watchdog("explain", str(DUMPS / "vllm-pr41834-worker-tp0-ep0-idle-shm-poll.txt"), "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert [(p["name"], p["class"]) for p in out["processes"]] == [("Worker_TP0_EP0", "idle_reader_wait")]
    assert out["processes"][0]["frames"][0]["file"].endswith("zmq/sugar/poll.py")
    assert "cross_rank" not in out and "poll_parking" not in out


def test_explain_json_two_files_gives_cross_rank_and_poll_parking(tmp_path: Path) -> None:
    mimic = tmp_path / "tp1.json"
    mimic.write_text(pyspy_json(103, WORKER_ALLREDUCE))
    r = watchdog("explain", str(DUMPS / "vllm-repo55536668370-enginecore-idle-input-queue.txt"), str(mimic),
                 "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    classes = [(p["role"], p["class"]) for p in out["processes"]]
    assert classes == [("engine_core", "engine_idle"), ("worker", "in_collective")]
    assert all(p["frames"] and {"function", "file", "line"} <= set(p["frames"][0]) for p in out["processes"])
    assert set(out["cross_rank"]) == {"culprit", "reason"} and set(out["poll_parking"]) == {"status", "reason"}
    assert out["poll_parking"]["status"] == "CONTRADICTED"  # a rank in a collective


def test_explain_unreadable_input_is_usage_error(tmp_path: Path) -> None:
    prose = tmp_path / "notes.txt"
    prose.write_text("the engine hung again, no dump taken\n")
    r = watchdog("explain", str(prose), "--json")
    assert r.returncode == 64 and "no stack dump recognised" in r.stderr
    r = watchdog("explain", str(tmp_path / "absent.txt"))
    assert r.returncode == 64 and "absent.txt" in r.stderr


def test_incidents_show_report_over_a_state_dir(tmp_path: Path) -> None:
    state = tmp_path / "state"
    stuck = write(state / "incidents", 1_760_000_000.0)
    parked = parked_round()
    parking = write(state / "incidents", 1_760_000_600.0, capture(parked, parked, procs=(ENGINE, TP0, TP1)))
    (state / "incidents" / f"{bundle.PARTIAL}junk").mkdir()

    r = watchdog("incidents", "--state-dir", str(state), "--json")
    assert r.returncode == 0, r.stderr
    rows = json.loads(r.stdout)
    assert [(x["id"], x["decision"], x["culprit"], x["poll_parking"]) for x in rows] == [
        (stuck.name, "stuck", "Worker_TP1", "CONTRADICTED"), (parking.name, "stuck", None, "SUPPORTED")]
    r = watchdog("incidents", "--state-dir", str(state))
    assert r.returncode == 0 and stuck.name in r.stdout and "culprit=Worker_TP1" in r.stdout

    r = watchdog("show", stuck.name[:20], "--state-dir", str(state))  # a prefix is enough
    assert r.returncode == 0, r.stderr
    assert r.stdout == (stuck / "summary.md").read_text()
    r = watchdog("show", "no-such-incident", "--state-dir", str(state))
    assert r.returncode == 2 and "no incident" in r.stderr

    r = watchdog("report", "--state-dir", str(state), "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == {"incidents": 2, "poll_parking": {"CONTRADICTED": 1, "SUPPORTED": 1},
                                    "culprits_by_role": {"worker": 1, "none": 1}, "decisions": {"stuck": 2},
                                    "known_hangs": {"lost_wakeup/fixed": 1, "none": 1}}  # 0.32.0 has the fix
    r = watchdog("report", "--state-dir", str(state))
    assert r.returncode == 0 and "2 incidents" in r.stdout and "SUPPORTED" in r.stdout


def test_incidents_empty_state_dir(tmp_path: Path) -> None:
    r = watchdog("incidents", "--state-dir", str(tmp_path))
    assert r.returncode == 0 and r.stdout.strip() == "no incidents"


def test_failure_kinds_reach_the_reason_manifest_and_summary(tmp_path: Path) -> None:
    """Denied ranks and a Python-only fallback are named by kind, with their fixes, and never read as healthy."""
    r = stopped_tp1_round(20.0)
    caps = capture(r, r)
    denied = PTRACE_HINT + " (kernel.yama.ptrace_scope is 1 here: restricted)"
    native = "--native could not be read (Error: no unwind info): Python-only stacks, taken again without --native"
    rounds_ = []
    for taken in caps.rounds:
        rnd = dict(taken)
        for p in (TP0, TP1):
            rnd[p.id] = Dump(p.pid, 0.0, False, "", denied, facts=ProcFacts("R", "", 20.0, 4),
                              failure=Failure.DENIED)
        e = rnd[ENGINE.id]
        rnd[ENGINE.id] = Dump(e.pid, e.t, True, e.output, native, facts=e.facts, failure=Failure.NATIVE_UNREADABLE)
        rounds_.append(rnd)
    caps = Capture(caps.processes, tuple(rounds_), (Problem(native), Problem(denied)), caps.options)
    f = assess(caps, work_pending=True)
    assert f.decision is Decision.UNDECIDED
    assert says(f.reason, "incomplete", "VLLM::Worker_TP0", "VLLM::Worker_TP1", denied), f.reason
    path = write_bundle(tmp_path, incident(1_760_000_000.0), caps, f, context(problems=()))
    m = json.loads((path / "manifest.json").read_text())
    assert [(x["round"], x["pid"], x["kind"]) for x in m["capture_failures"]] == [
        (1, 101, "native_unreadable"), (1, 102, "denied"), (1, 103, "denied"),
        (2, 101, "native_unreadable"), (2, 102, "denied"), (2, 103, "denied")]
    assert {p["pid"]: p["failures"] for p in m["processes"]} == {100: [], 101: ["native_unreadable"],
                                                                102: ["denied"], 103: ["denied"]}
    assert m["problems"] == sorted([native, denied])
    summary = (path / "summary.md").read_text()
    assert says(line_of(summary, "capture complete"), "NO", "denied", "4", "native_unreadable", "2")
    assert line_of(summary, "Capture problems").startswith("## ") and "CAP_SYS_PTRACE" in summary
    assert "Python-only stacks" in summary


class OnePage:
    def __init__(self, page: PageReading | None) -> None:
        self.page = page

    def scrape(self) -> Scrape:
        return Scrape(1.0, 1.7e9, self.page, None if self.page else "refused")


def test_the_investigator_weighs_the_page_the_judge_read_and_reads_none_itself() -> None:
    """Wired as the daemon wires it (``reading``: the watcher's last page): the engine's port is closed, so any
    running/waiting the assessment gets came from the judge's reading."""
    fetcher = OnePage(PageReading({"0": EngineReading("0", "m", 1.0, 3.0), "1": EngineReading("1", "m", 0.0, 0.0)}, 0))
    watcher = Watcher(fetcher, Judge())
    http = EngineHTTP(f"http://127.0.0.1:{_closed_port()}")
    inv = Investigator(Config(), http, finder=list, reading=lambda: watcher.page)
    assert inv.page_work("0") is None  # no pass yet: nothing read
    watcher.tick()
    assert inv.page_work("0") == PageWork(running=1.0, waiting=3.0)
    assert inv.page_work("1") == PageWork(running=0.0, waiting=0.0)
    assert inv.page_work("") is None  # two engines: which one is not known
    fetcher.page = None
    watcher.tick()
    assert inv.page_work("0") == PageWork(running=1.0, waiting=3.0)  # a failed scrape: the last page read stands
    assert Investigator(Config(), http, finder=list).page_work("0") is None  # its own read: nobody answers
