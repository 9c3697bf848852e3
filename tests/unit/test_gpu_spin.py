"""GPU states read over the stall, not over the work before it (issue 19), on a real H200 run (tests/data/gpu-spin):
one rank, ``VLLM::Worker_TP0`` alone in its NCCL group, did real work for 15 s, then launched a kernel that spins and
waited for it in ``torch.cuda.synchronize``, watched by the real ``watchdog run``. The work before the stall read
1 % utilisation, the spin 100 %, both near 123 W: judged together they were "mixed"; over the stall, a spin."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from tests.facts import says
from tests.fakes import FakeGpuSource
from tests.unit.test_evidence_bundle import context, incident
from watchdog.config.gpu import GpuSection
from watchdog.core.processes import LOCAL, Capture, Dump, EngineProcess, ProcessId, ProcFacts
from watchdog.core.roles import Role
from watchdog.core.types import State, Transition
from watchdog.evidence.bundle.coordinator import EvidenceCoordinator
from watchdog.evidence.bundle.investigate import EvidenceDone, EvidenceJob, EvidenceRunner
from watchdog.evidence.bundle.write import write_bundle
from watchdog.evidence.explain.findings import assess
from watchdog.evidence.gpu.culprit import RankView, gpu_culprit
from watchdog.evidence.gpu.gather import GpuEvidence, gather_gpu
from watchdog.evidence.gpu.nvml import GpuMonitor
from watchdog.evidence.gpu.readings import GpuProc, GpuSample, GpuState, read_all, read_stall, sample_from_json
from watchdog.service.daemon import Daemon

DATA = Path(__file__).resolve().parents[1] / "data" / "gpu-spin"
BUNDLE = DATA / "bundle"
MANIFEST = json.loads((BUNDLE / "manifest.json").read_text())
WALL = datetime.fromisoformat(MANIFEST["created"]).timestamp()  # the bundle's capture
WEDGED = json.loads((DATA / "wedged.json").read_text())["t"]  # the rank's own clock: the spin launched
STALL_WINDOW, CAPTURE_SECONDS = 20.0, 2.6  # watchdog.toml's judge.stall_window; "stacks ... in 2.6s" (watchdog.log)
API = EngineProcess(678, Role.API_SERVER, "VLLM::APIServer")
TP0 = EngineProcess(679, Role.WORKER, "VLLM::Worker_TP0", {"TP": 0})


def samples() -> list[GpuSample]:
    return [sample_from_json(json.loads(line)) for line in (BUNDLE / "gpu.jsonl").read_text().splitlines()]


def last_progress() -> float:
    """The wall time of the last scrape, before the freeze, whose generation counter moved: the judge's stall start,
    read again from the recorded trace."""
    frozen = next(e for e in map(json.loads, (DATA / "events.jsonl").read_text().splitlines())
                  if e.get("to") == "frozen")
    until = datetime.fromisoformat(frozen["time"].replace("Z", "+00:00")).timestamp()
    last, before = 0.0, None
    for rec in map(json.loads, (DATA / "trace.jsonl").read_text().splitlines()):
        if rec.get("kind") != "scrape" or rec["wall"] > until:
            continue
        n = rec["engines"]["0"]["counters"]["generation_tokens"]
        if before is not None and n != before:
            last = rec["wall"]
        before = n
    return last


def monitor_of(recorded: list[GpuSample]) -> GpuMonitor:
    mon = GpuMonitor(FakeGpuSource([[s] for s in recorded]), keep_seconds=1e12, clock=lambda: recorded[-1].t)
    for _ in recorded:
        mon.tick()  # no thread: the samples as the sampler took them
    return mon


def test_the_recording_holds_work_then_a_spin() -> None:
    s = samples()
    before = [x for x in s if x.t < WEDGED]
    during = [x for x in s if WEDGED + 1.0 < x.t <= WALL]
    assert len(before) >= 10 and len(during) >= 8
    assert all(x.util is not None and x.util <= 10 for x in before)  # the stand-in's small steps: 1 %
    assert all(x.util == 100 for x in during)
    assert all(x.power_w is not None and 110 < x.power_w < 140 for x in s)  # near idle power, 700 W limit


def test_the_old_window_mixed_the_work_with_the_hang() -> None:
    """What the bundle said before issue 19: a window of stall_window + capture seconds before the capture."""
    [r] = read_all(samples(), WALL - STALL_WINDOW - CAPTURE_SECONDS, WALL)
    assert r.state is GpuState.UNKNOWN and says(r.why, "mixed")


def test_over_the_stall_the_gpu_spins_and_no_earlier_sample_counts() -> None:
    start = last_progress()
    assert WEDGED < start < WEDGED + 1.5  # the last scrape that saw steps, just after the spin's launch
    assert f"from {datetime.fromtimestamp(start, UTC):%H:%M:%S}" in MANIFEST["gpu"]["lines"][1]  # what the run used
    [r] = read_stall(samples(), start, WALL)
    assert r.state is GpuState.SPINNING, r.why
    assert r.samples == sum(1 for s in samples() if start < s.t <= WALL) == MANIFEST["gpu"]["readings"][0]["samples"]
    assert r.util == 100 and r.power_w is not None and 115 < r.power_w < 130 and r.power_limit_w == 700
    assert r.pids == (TP0.pid,)
    # the samples before the stall are left out: adding more of them changes nothing
    earlier = [GpuSample(start - k, 0, util=0, power_w=600.0, power_limit_w=700.0) for k in range(1, 40)]
    assert read_stall(earlier + samples(), start, WALL) == [r]


def test_the_boundary_sample_at_the_last_progress_is_work_not_stall() -> None:
    """NVML's figures cover the period that ends at the reading: one stamped at the last progress is the work."""
    s0 = 1_800_000_000.0
    at = GpuSample(s0, 0, util=100, power_w=650.0, power_limit_w=700.0, procs=(GpuProc(7),))
    after = [GpuSample(s0 + dt, 0, util=100, power_w=120.0, power_limit_w=700.0, procs=(GpuProc(8),))
             for dt in (1e-6, 1.0, 2.0)]
    [r] = read_stall([at, *after], s0, s0 + 2.0)
    assert (r.samples, r.pids, r.state) == (3, (8,), GpuState.SPINNING)
    [inclusive] = read_all([at, *after], s0, s0 + 2.0)  # a window that takes the boundary in has it
    assert inclusive.samples == 4 and 7 in inclusive.pids
    assert read_stall([at, *after], s0 + 2.0, s0 + 9.0) == []  # nothing after the window's start: no reading
    assert read_stall([at, *after], s0, s0 + 1.5)[0].samples == 2  # and nothing past its end


def test_gather_reads_over_the_stall_and_says_its_window() -> None:
    recorded, start = samples(), last_progress()
    cfg = GpuSection(ras=False, flight_recorder=False)
    since = WALL - STALL_WINDOW - CAPTURE_SECONDS
    ev = gather_gpu([API, TP0], monitor_of(recorded), cfg, since, freeze=True, now=WALL, stalled_since=start)
    [r] = ev.readings
    assert r.state is GpuState.SPINNING and r.ranks == ("VLLM::Worker_TP0",)
    assert len(ev.samples) == len(recorded)  # the timeline keeps the work before the stall
    line = next(x for x in ev.lines() if x.startswith("GPU states read"))
    hms = datetime.fromtimestamp(start, UTC).strftime("%H:%M:%S.%f")[:-5]  # tenths, as the line gives them
    assert says(line, hms, "last progress", f"{WALL - start:.1f} s"), line
    old = gather_gpu([API, TP0], monitor_of(recorded), cfg, since, freeze=True, now=WALL)
    assert old.readings[0].state is GpuState.UNKNOWN and says(old.lines()[1], "no stall start known")


def capture() -> Capture:
    """The freeze's capture as the run took it: two rounds of both processes and the worker's native dump."""
    procs = {p["pid"]: p for p in MANIFEST["processes"]}

    def dump(name: str, pid: int, t: float, cpu: float) -> Dump:
        p = procs[pid]
        facts = ProcFacts(p["state"], p["wchan"] or "", cpu, p["threads"])
        return Dump(pid, t, True, (BUNDLE / "dumps" / name).read_text(), facts=facts)

    cpu = {pid: p["cpu_seconds_between_captures"] or 0.0 for pid, p in procs.items()}
    rounds = tuple({ProcessId(LOCAL, pid): dump(f"round{i}-{pid}-{title}.json", pid, WALL - 3 + 2 * i,
                                                10 + (i - 1) * cpu[pid])
                    for pid, title in ((678, "VLLM-APIServer"), (679, "VLLM-Worker_TP0"))} for i in (1, 2))
    return Capture((API, TP0), rounds, (), dict(MANIFEST["capture_options"]),
                   {TP0.id: dump("native-679-VLLM-Worker_TP0.json", 679, WALL, 14.0)})


def bundle(tmp_path: Path, ev: GpuEvidence) -> tuple[dict[str, Any], str]:
    cap = capture()
    path = write_bundle(tmp_path, incident(WALL), cap, assess(cap, work_pending=True), context(), ev)
    return json.loads((path / "manifest.json").read_text()), (path / "summary.md").read_text()


def test_the_bundle_says_the_rank_waits_on_its_own_spinning_gpu(tmp_path: Path) -> None:
    cfg, since = GpuSection(ras=False, flight_recorder=False), WALL - STALL_WINDOW - CAPTURE_SECONDS
    ev = gather_gpu([API, TP0], monitor_of(samples()), cfg, since, freeze=True, now=WALL,
                    stalled_since=last_progress())
    m, summary = bundle(tmp_path / "new", ev)
    assert m["gpu"]["culprit"] == "Worker_TP0" and m["gpu"]["culprit_sources"] == ["stacks+power"]
    assert says(m["headline"], "Worker_TP0", "waits on its own GPU", "idle power"), m["headline"]
    assert not says(m["headline"], "parked") and m["runbook"] == "frozen-waiting-on-gpu"
    # the stacks' own stuck reason names the wait on the device too (the recording, made before, said "parked")
    assert says(m["decision_reason"], "Worker_TP0", "own GPU", "device_wait"), m["decision_reason"]
    assert not says(m["decision_reason"], "every rank parked")
    assert says(summary.splitlines()[2], "Worker_TP0", "own GPU", "idle power")
    assert [r["state"] for r in m["gpu"]["readings"]] == ["spinning"]
    # judged over the old window the GPU says nothing: no GPU culprit, no power in the headline
    old = gather_gpu([API, TP0], monitor_of(samples()), cfg, since, freeze=True, now=WALL)
    m_old, _ = bundle(tmp_path / "old", old)
    assert m_old["gpu"]["culprit"] is None and [r["state"] for r in m_old["gpu"]["readings"]] == ["unknown"]
    assert not says(m_old["headline"], "idle power")


def test_a_lone_rank_is_named_only_with_its_gpu_spinning() -> None:
    lone = RankView("Worker_TP0", 0, "device_wait", (), GpuState.SPINNING)
    c = gpu_culprit([lone])
    assert (c.culprit, c.rank, c.sources) == ("Worker_TP0", 0, ("stacks+power",))
    assert says(c.reason, "rank 0", "idle power", "own device")
    for gpu in (None, GpuState.UNKNOWN, GpuState.WORKING, GpuState.IDLE):
        assert gpu_culprit([RankView("Worker_TP0", 0, "device_wait", (), gpu)]).culprit is None
    two = [lone, RankView("Worker_TP1", 1, "device_wait", (), GpuState.SPINNING)]
    assert gpu_culprit(two).culprit is None  # two in their own device waits, nobody waiting: no single culprit


def test_the_stall_start_travels_from_the_judge_to_the_bundle() -> None:
    # the daemon: the judge's stall start (monotonic) as wall time; None while the judge sees no stall
    track = SimpleNamespace(stall_start=100.0)
    watcher: Any = SimpleNamespace(judge=SimpleNamespace(tracks={"0": track}), wall_of=lambda t: t + 1e9)
    assert Daemon._stalled_since(watcher, "0") == 1e9 + 100.0
    track.stall_start = None
    assert Daemon._stalled_since(watcher, "0") is None and Daemon._stalled_since(watcher, "9") is None

    # the coordinator: into the freeze's job
    class Runner:
        def __init__(self) -> None:
            self.jobs: list[EvidenceJob] = []

        def request(self, job: EvidenceJob) -> None:
            self.jobs.append(job)

        def poll(self) -> list[EvidenceDone]:
            return []

    runner = Runner()
    coord = EvidenceCoordinator(runner, 20.0)
    coord.on_transition(Transition(9.0, "0", State.SUSPECT, State.FROZEN, "x"), 9.0)
    assert runner.jobs == []  # the freeze's bundle is its incident's: asked for when the incident opens
    coord.bundle("0", State.FROZEN, "inc-1", "x", 9.0, stalled_since=2e9 - 8)
    job = runner.jobs[-1]
    assert job.bundle and job.stalled_since == 2e9 - 8 and job.incident == "inc-1" and job.reuse_after == 9.0 - 20

    # the runner: into the bundle's write
    class Investigator:
        def __init__(self) -> None:
            self.written: list[float | None] = []

        def investigate(self, work_pending: bool, engine: str) -> Any:
            return SimpleNamespace(findings=None, seconds=0.0)

        def write(self, *args: Any, stalled_since: float | None = None) -> Path:
            self.written.append(stalled_since)
            return Path("/nonexistent/bundle")

    inv = Investigator()
    r = EvidenceRunner(inv)  # type: ignore[arg-type]
    try:
        done = r._run(runner.jobs[-1])  # in this thread: the runner's own thread waits for jobs meanwhile
    finally:
        r.stop()
    assert inv.written == [2e9 - 8] and done.bundle == Path("/nonexistent/bundle")
