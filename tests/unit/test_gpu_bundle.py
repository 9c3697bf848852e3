"""GPU evidence in the incident: the real two-rank NCCL hang's NVML samples (one H200 pair, tests/data/gpu) beside
the stacks of a frozen TP=2 engine. Power corroborates the stacks in the bundle; it decides nothing."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from tests.facts import line_of, says
from tests.fakes import FakeGpuSource
from tests.unit.test_evidence_bundle import ENGINE, TP0, TP1, context, incident, stuck_capture
from watchdog.config.gpu import GpuSection
from watchdog.evidence.bundle.write import write_bundle
from watchdog.evidence.explain.findings import assess
from watchdog.evidence.gpu.gather import gather_gpu
from watchdog.evidence.gpu.nvml import GpuMonitor
from watchdog.evidence.gpu.readings import GpuProc, GpuSample, sample_from_json

DATA = Path(__file__).resolve().parents[1] / "data" / "gpu"


def two_rank_hang() -> list[list[GpuSample]]:
    """The nccl2 run: rank 0 (GPU 0) entered an all_reduce its peer never joined; rank 1 (GPU 1) held back.
    Their pids become the test engine's TP0 and TP1."""
    samples = [sample_from_json(s) for s in json.loads((DATA / "nvml-samples.json").read_text())["nccl2"]]
    pid_of = {0: TP0.pid, 1: TP1.pid}
    samples = [replace(s, procs=tuple(GpuProc(pid_of[s.index], p.used_bytes) for p in s.procs)) for s in samples]
    by_t: dict[float, list[GpuSample]] = {}
    for s in samples:
        by_t.setdefault(s.t, []).append(s)
    return [by_t[t] for t in sorted(by_t)]


def test_the_bundle_says_per_rank_gpu_what_power_adds_to_the_stacks(tmp_path: Path) -> None:
    rounds = two_rank_hang()
    monitor = GpuMonitor(FakeGpuSource(rounds), keep_seconds=1e12, clock=lambda: rounds[-1][0].t)
    for _ in rounds:
        monitor.tick()  # no thread: the samples as the sampler would have taken them
    since, until = rounds[0][0].t, rounds[-1][0].t
    ev = gather_gpu([TP0, TP1], monitor, GpuSection(ras=False, flight_recorder=False), since, freeze=True,
                    now=until)
    cap = stuck_capture()
    path = write_bundle(tmp_path, incident(until), cap, assess(cap, work_pending=True), context(), ev)
    m = json.loads((path / "manifest.json").read_text())
    states = {r["index"]: (r["state"], r["ranks"]) for r in m["gpu"]["readings"]}
    assert states == {0: ("spinning", ["VLLM::Worker_TP0"]), 1: ("idle", ["VLLM::Worker_TP1"])}
    # TP0 waits in all_reduce on a GPU busy at idle power; TP1 is stopped with its GPU idle
    tp0 = next(line for line in m["gpu"]["ranks"] if line.startswith("VLLM::Worker_TP0"))
    assert "busy at idle power" in tp0 and "agrees" in tp0
    assert any(line.startswith("VLLM::Worker_TP1") and "idle" in line for line in m["gpu"]["ranks"])
    assert m["decision"] == "stuck" and m["culprit"] == "Worker_TP1"  # the stacks decided; power only agrees
    summary = (path / "summary.md").read_text()
    assert line_of(summary, "GPUs").startswith("## ")
    assert says(line_of(summary, "GPU 0"), "VLLM::Worker_TP0", "spinning")
    assert {"gpu.jsonl", "gpu.md"} <= set(m["files"])
    assert len((path / "gpu.jsonl").read_text().splitlines()) == sum(map(len, rounds))


def test_no_gpu_no_gpu_section(tmp_path: Path) -> None:
    cap = stuck_capture()
    path = write_bundle(tmp_path, incident(1_760_000_000.0), cap, assess(cap, work_pending=True), context())
    m = json.loads((path / "manifest.json").read_text())
    assert "gpu" not in m and "GPUs" not in (path / "summary.md").read_text()
    assert not (path / "gpu.md").exists()


def test_the_daemon_exports_and_traces_gpu_samples_and_replay_skips_them(tmp_path: Path) -> None:
    from watchdog.config.load import Config
    from watchdog.core.types import Scrape
    from watchdog.service.daemon import Daemon
    from watchdog.service.trace import TraceWriter, read_trace

    rounds = two_rank_hang()
    d = Daemon(Config(), tmp_path)
    d.parts.trace = trace = TraceWriter(tmp_path / "trace.jsonl")
    trace.write(Scrape(1.0, 2.0, None, "refused", "nothing listening"))
    d.parts.gpu = gpu = GpuMonitor(FakeGpuSource(rounds), keep_seconds=1e12, clock=lambda: rounds[-1][0].t)
    for _ in rounds[:3]:
        gpu.tick()
    d._gpu_samples()
    d._gpu_samples()  # nothing new: nothing written twice
    trace.close()
    lines = [json.loads(x) for x in (tmp_path / "trace.jsonl").read_text().splitlines()]
    assert [x["kind"] for x in lines].count("gpu") == sum(len(r) for r in rounds[:3])
    assert [type(o).__name__ for o in read_trace(tmp_path / "trace.jsonl")] == ["Scrape"]
    last = rounds[2]
    assert d.exporter.gpu_power.labels("0")._value.get() == last[0].power_w
    assert d.exporter.gpu_util.labels("1")._value.get() == last[1].util
    d.events.close()


def test_engine_processes_holding_a_gpu_get_a_native_dump_beside_the_rounds(tmp_path: Path) -> None:
    """Their host thread waits in CUDA or NCCL, which only native frames show: one --native dump each, after the two
    plain rounds that decide (native frames churn inside a wait: compared, they would read as movement)."""
    from tests.unit.test_evidence_bundle import ENGINE_WAITING, WORKER_ALLREDUCE, pyspy_json
    from watchdog.config.load import Config
    from watchdog.evidence.bundle.investigate import Investigator
    from watchdog.evidence.collect.capture import Capturer
    from watchdog.scrape.engine_http import EngineHTTP

    native_tp1 = json.loads((DATA / "spin-pyspy-native.json").read_text())  # a real host blocked in a device sync
    calls: list[list[str]] = []

    def runner(argv: list[str], timeout: float) -> tuple[int, str, str]:
        calls.append(list(argv))
        pid = int(argv[argv.index("--pid") + 1])
        if "--native" in argv:
            return 0, json.dumps(native_tp1) if pid == TP1.pid else pyspy_json(pid, WORKER_ALLREDUCE), ""
        return 0, pyspy_json(pid, ENGINE_WAITING if pid == ENGINE.pid else WORKER_ALLREDUCE), ""

    rounds = two_rank_hang()
    now = rounds[-1][0].t
    monitor = GpuMonitor(FakeGpuSource(rounds), keep_seconds=1e12, clock=lambda: now)
    for _ in rounds:
        monitor.tick()
    cfg = Config().with_overrides(capture={"rounds": 2, "gap": 0.1})
    inv = Investigator(cfg, EngineHTTP("http://127.0.0.1:9"), finder=lambda: [ENGINE, TP0, TP1],
                       capturer=Capturer("py-spy", runner=runner), gpu=monitor)
    evidence = inv.investigate(work_pending=True)
    native = [int(a[a.index("--pid") + 1]) for a in calls if "--native" in a]
    plain = [int(a[a.index("--pid") + 1]) for a in calls if "--native" not in a]
    assert sorted(native) == [TP0.pid, TP1.pid]  # once each, after the rounds
    assert sorted(plain) == sorted([ENGINE.pid, TP0.pid, TP1.pid] * 2)
    by_pid = {f.process.pid: f for f in evidence.findings.processes}
    assert by_pid[TP1.pid].native is not None and by_pid[TP1.pid].native.cls.value == "device_wait"
    assert by_pid[ENGINE.pid].native is None
    path = write_bundle(tmp_path, incident(now), evidence.capture, evidence.findings, context())
    m = json.loads((path / "manifest.json").read_text())
    assert any(f.startswith("dumps/native-") for f in m["files"])
    assert next(p for p in m["processes"] if p["pid"] == TP1.pid)["native"]["class"] == "device_wait"


def test_configured_recorder_prefixes_stand_in_for_an_environ_setproctitle_overwrote(tmp_path: Path) -> None:
    """Seen on the two-H200 run: setproctitle overwrote /proc/PID/environ, so the recorder's settings could not be
    read there. The configured prefixes are used instead: the pipe is asked and the dump read back, for real."""
    import os
    import subprocess
    import sys
    import threading

    from watchdog.core.processes import EngineProcess
    from watchdog.core.roles import Role
    from watchdog.evidence.gpu.fr_trigger import trigger
    from watchdog.evidence.gpu.gather import fr_configs

    pipe_prefix, dump_prefix = str(tmp_path / "pipe_"), str(tmp_path / "fr_")
    os.mkfifo(pipe_prefix + "0.pipe")
    dump = (DATA / "nccl-fr-stalled-rank0.pickle").read_bytes()

    def recorder() -> None:  # what torch's recorder thread does: a line on the pipe, then the dump file
        with open(pipe_prefix + "0.pipe", "rb") as f:
            f.readline()
        (tmp_path / "fr_0").write_bytes(dump)

    thread = threading.Thread(target=recorder, daemon=True)
    thread.start()
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], env={"PATH": os.environ["PATH"]},
                             start_new_session=True)
    try:
        proc = EngineProcess(child.pid, Role.WORKER, "VLLM::Worker_TP0", {"TP": 0})
        assert fr_configs([proc], GpuSection()) is None  # unset: each environ as it is
        configs = fr_configs([proc], GpuSection(fr_pipe_prefix=pipe_prefix, fr_dump_prefix=dump_prefix))
        assert configs is not None and configs[child.pid] is not None
        t = trigger([child.pid], None, 10.0, configs=configs)
    finally:
        child.kill()
        child.wait(10)
    thread.join(10)
    assert [(r.rank, r.data == dump) for r in t.ranks] == [(0, True)]


def test_an_engine_of_one_rank_is_not_asked_for_a_recorder_dump_that_cannot_come(tmp_path: Path) -> None:
    """Seen on the real vLLM 0.25.1 CUDA build at TP=1 (one H200): the frozen EngineCore's pipe was asked and no dump
    came in the 10 s settle, so the bundle reached disk 10 s late. vLLM makes no NCCL communicator for one rank: the
    recorder is not asked and the bundle says why. A worker rank (issue 19: one rank in its own NCCL group) still is."""
    import os
    import subprocess
    import sys
    import threading

    from watchdog.core.processes import EngineProcess
    from watchdog.core.roles import Role
    from watchdog.evidence.gpu.gather import SINGLE_RANK

    pipe_prefix, dump_prefix = str(tmp_path / "pipe_"), str(tmp_path / "fr_")
    os.mkfifo(pipe_prefix + "0.pipe")
    asked: list[bytes] = []

    def torch_monitor() -> None:  # torch's monitor thread at TP=1: it reads the pipe, and has nothing to dump
        with open(pipe_prefix + "0.pipe", "rb") as f:
            asked.append(f.readline())

    thread = threading.Thread(target=torch_monitor, daemon=True)
    thread.start()
    env = {"PATH": os.environ["PATH"], "TORCH_FR_BUFFER_SIZE": "2000", "TORCH_NCCL_DEBUG_INFO_PIPE_FILE": pipe_prefix,
           "TORCH_FR_DUMP_TEMP_FILE": dump_prefix}
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], env=env, start_new_session=True)
    cfg = GpuSection(ras=False, fr_settle=1.0)
    try:
        core = EngineProcess(child.pid, Role.ENGINE_CORE, "VLLM::EngineCore", {})
        one = gather_gpu([core], None, cfg, 0.0, freeze=True, now=1.0)
        assert one.fr_verdict == SINGLE_RANK and one.fr_seconds == 0.0 and not asked
        assert not [p for p in one.problems if "Flight Recorder" in p or "pipe" in p], one.problems
        worker = EngineProcess(child.pid, Role.WORKER, "VLLM::Worker_TP0", {"TP": 0})
        ranked = gather_gpu([core, worker], None, cfg, 0.0, freeze=True, now=1.0)
        thread.join(5)
        assert asked == [b"1\n"], "a worker rank's recorder is asked"
        assert any("no readable dump" in p for p in ranked.problems), ranked.problems
    finally:
        child.kill()
        child.wait(10)
