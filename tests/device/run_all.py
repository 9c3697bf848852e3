"""Drive the device run: each program in tests/device/gpu_programs.py, observed with the watchdog's own readers.

    python3 tests/device/run_all.py --out DIR --pyspy PATH

For every scenario: NVML samples through watchdog.evidence.gpu.nvml.NvmlSource (0.5 s apart), py-spy dumps
(plain JSON, --native JSON, --native text) through watchdog.evidence.collect.capture.Capturer; for the NCCL ones also
the recorder settings read from /proc/PID/environ, NCCL RAS answers (healthy, during the stall, with the process
stopped), and Flight Recorder dumps triggered through watchdog.evidence.gpu.fr_trigger (healthy and stalled, timed).
Writes DIR/results.json and the raw files beside it.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from watchdog.evidence.collect.capture import Capturer
from watchdog.evidence.gpu.fr_trigger import config_of, trigger
from watchdog.evidence.gpu.nccl_ras import query_ras
from watchdog.evidence.gpu.nvml import NvmlSource

PROG = Path(__file__).resolve().parent / "gpu_programs.py"


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def wait_file(p: Path, timeout: float, proc: subprocess.Popen[bytes]) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if p.exists():
            return True
        if proc.poll() is not None:
            return False
        time.sleep(0.05)
    return False


def sample(src: NvmlSource, seconds: float, every: float = 0.5) -> list[dict[str, Any]]:
    out = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        out.extend(s.to_json() for s in src.sample())
        time.sleep(every)
    return out


def dumps(cap: Capturer, pyspy: str, pid: int, d: Path) -> dict[str, Any]:
    res: dict[str, Any] = {}
    for native in (False, True):
        cap.native = native
        dmp = cap.dump_one(pid)
        key = "native" if native else "plain"
        res[key] = {"ok": dmp.ok, "error": dmp.error, "seconds": round(dmp.seconds, 3),
                    "state": dmp.facts.state if dmp.facts else None, "wchan": dmp.facts.wchan if dmp.facts else None}
        (d / f"pyspy-{key}.json").write_text(dmp.output or "")
    r = subprocess.run([pyspy, "dump", "--native", "--pid", str(pid)], capture_output=True, text=True, timeout=30,
                       check=False)
    (d / "pyspy-native.txt").write_text(r.stdout + r.stderr)
    return res


def scenario(name: str, work: Path, src: NvmlSource, cap: Capturer, pyspy: str, observe: float,
             env: dict[str, str] | None = None) -> dict[str, Any]:
    d = work / name
    d.mkdir(parents=True)
    log(f"{name}: start")
    with open(d / "program.log", "wb") as out:
        proc = subprocess.Popen([sys.executable, str(PROG), name, "--dir", str(d), "--seconds", "45"],
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, **(env or {})})
    res: dict[str, Any] = {"pid": proc.pid, "t_start": time.time()}
    try:
        if not wait_file(d / "ready", 180, proc):
            res["error"] = "never ready"
            return res
        res["ready"] = (d / "ready").read_text()
        if name.startswith("nccl"):
            res.update(nccl_phase(d, proc, src, cap, pyspy, observe))
        else:
            time.sleep(1.0)
            res["samples"] = sample(src, observe)
            res["dumps"] = dumps(cap, pyspy, proc.pid, d)
    finally:
        (d / "release").write_text("1")
        try:
            res["exit"] = proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            res["exit"] = f"killed: {proc.wait()}"
        res["t_end"] = time.time()
        log(f"{name}: exit {res['exit']}")
    return res


def fr_record(d: Path, pid: int, tag: str) -> dict[str, Any]:
    t = trigger([pid], {pid: 0}, settle=15.0)
    out: dict[str, Any] = {"seconds": t.seconds, "problems": list(t.problems), "ranks": []}
    for r in t.ranks:
        if r.data:
            (d / f"fr-{tag}-rank{r.rank}.pickle").write_bytes(r.data)
        out["ranks"].append({"rank": r.rank, "pipe": r.pipe, "dump": r.dump, "bytes": len(r.data),
                             "error": r.error, "seconds": r.seconds})
    return out


def nccl_phase(d: Path, proc: subprocess.Popen[bytes], src: NvmlSource, cap: Capturer, pyspy: str,
               observe: float) -> dict[str, Any]:
    res: dict[str, Any] = {}
    cfg = config_of(proc.pid)
    res["fr_config"] = None if cfg is None else {"buffer_size": cfg.buffer_size, "pipe_prefix": cfg.pipe_prefix,
                                                 "dump_prefix": cfg.dump_prefix, "problems": list(cfg.problems)}
    res["pipes_seen"] = sorted(p.name for p in d.iterdir() if p.name.endswith(".pipe"))
    ras = query_ras(timeout=10)
    (d / "ras-healthy.txt").write_text(ras.text)
    res["ras_healthy"] = {"ok": ras.ok, "error": ras.error, "seconds": ras.seconds}
    res["fr_healthy"] = fr_record(d, proc.pid, "healthy")
    (d / "go").write_text("1")
    if not wait_file(d / "stalled", 60, proc):
        res["error"] = "never stalled"
        return res
    time.sleep(1.0)
    res["samples"] = sample(src, observe)
    res["dumps"] = dumps(cap, pyspy, proc.pid, d)
    ras = query_ras(timeout=10)
    (d / "ras-stalled.txt").write_text(ras.text)
    res["ras_stalled"] = {"ok": ras.ok, "error": ras.error, "seconds": ras.seconds}
    res["fr_stalled"] = fr_record(d, proc.pid, "stalled")
    if proc.poll() is not None:
        return res
    os.kill(proc.pid, signal.SIGSTOP)
    try:
        ras = query_ras(timeout=3)
    finally:
        os.kill(proc.pid, signal.SIGCONT)
    (d / "ras-stopped.txt").write_text(ras.text)
    res["ras_stopped"] = {"ok": ras.ok, "error": ras.error, "seconds": ras.seconds}
    res["samples_after"] = sample(src, 2.0)
    return res


def two_ranks(work: Path, src: NvmlSource, cap: Capturer, pyspy: str) -> dict[str, Any]:
    """nccl2: rank 1 holds back, rank 0 hangs in a real all-reduce. RAS, Flight Recorder, NVML and stacks of both;
    then rank 1 is stopped (SIGSTOP) and RAS asked again, 10 s and 30 s later."""
    d = work / "nccl2"
    d.mkdir(parents=True)
    env = {**os.environ, "TORCH_FR_BUFFER_SIZE": "2000", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29533",
           "TORCH_FR_DUMP_TEMP_FILE": f"{d}/fr_", "TORCH_NCCL_DEBUG_INFO_PIPE_FILE": f"{d}/pipe_"}
    procs = []
    for rank in (0, 1):
        with open(d / f"program-rank{rank}.log", "wb") as out:
            procs.append(subprocess.Popen([sys.executable, str(PROG), "nccl2", "--dir", str(d), "--seconds", "90",
                                           "--rank", str(rank)], stdout=out, stderr=subprocess.STDOUT,
                                          start_new_session=True, env=env))
    res: dict[str, Any] = {"pids": [p.pid for p in procs], "t_start": time.time()}
    try:
        if not (wait_file(d / "r0" / "ready", 180, procs[0]) and wait_file(d / "r1" / "ready", 60, procs[1])):
            res["error"] = "never stalled"
            return res
        time.sleep(2.0)
        res["samples"] = sample(src, 8.0)
        for rank, p in enumerate(procs):
            (d / f"rank{rank}").mkdir()
            res[f"dumps_rank{rank}"] = dumps(cap, pyspy, p.pid, d / f"rank{rank}")
        for tag, wait in (("stalled", 0.0),):
            time.sleep(wait)
            ras = query_ras(timeout=10)
            (d / f"ras-{tag}.txt").write_text(ras.text)
            res[f"ras_{tag}"] = {"ok": ras.ok, "error": ras.error, "seconds": ras.seconds}
        t = trigger([p.pid for p in procs], {procs[0].pid: 0, procs[1].pid: 1}, settle=15.0)
        res["fr"] = {"seconds": t.seconds, "problems": list(t.problems),
                     "ranks": [{"rank": r.rank, "bytes": len(r.data), "error": r.error, "seconds": r.seconds}
                               for r in t.ranks]}
        for r in t.ranks:
            if r.data:
                (d / f"fr-stalled-rank{r.rank}.pickle").write_bytes(r.data)
        os.kill(procs[1].pid, signal.SIGSTOP)
        t0 = time.monotonic()
        try:
            for tag, at in (("rank1-stopped-10s", 10.0), ("rank1-stopped-30s", 30.0)):
                time.sleep(max(0.0, at - (time.monotonic() - t0)))
                ras = query_ras(timeout=10)
                (d / f"ras-{tag}.txt").write_text(ras.text)
                res[f"ras_{tag}"] = {"ok": ras.ok, "error": ras.error, "seconds": ras.seconds}
        finally:
            os.kill(procs[1].pid, signal.SIGCONT)
    finally:
        (d / "release").write_text("1")
        res["exit"] = []
        for p in procs:
            try:
                res["exit"].append(p.wait(60))
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                res["exit"].append(f"killed: {p.wait()}")
        log(f"nccl2: exit {res['exit']}")
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--pyspy", required=True)
    ap.add_argument("--only", default="")
    a = ap.parse_args()
    work = a.out
    work.mkdir(parents=True, exist_ok=True)
    src = NvmlSource()
    why = src.open()
    results: dict[str, Any] = {"nvml_unavailable": why, "scenarios": {}}
    if why:
        log(f"NVML unavailable: {why}")
    cap = Capturer(a.pyspy, timeout=30)
    names = ["idle", "matmul", "gemv", "spin", "spin_wide", "nccl", "nccl_bypass"]
    env = {"TORCH_FR_BUFFER_SIZE": "2000", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29531",
           "NCCL_RAS_ENABLE": "1"}
    if "nccl2" in a.only.split(","):
        results["scenarios"]["nccl2"] = two_ranks(work, src, cap, a.pyspy)
        (work / "results.json").write_text(json.dumps(results, indent=1))
    for name in [n for n in names if a.only != "nccl2" and (not a.only or n in a.only.split(","))]:
        e = None
        if name.startswith("nccl"):
            d = work / name
            e = {**env, "TORCH_FR_DUMP_TEMP_FILE": f"{d}/fr_", "TORCH_NCCL_DEBUG_INFO_PIPE_FILE": f"{d}/pipe_"}
        try:
            results["scenarios"][name] = scenario(name, work, src, cap, a.pyspy, 8.0, e)
        except Exception as ex:  # keep the other scenarios
            results["scenarios"][name] = {"error": f"{type(ex).__name__}: {ex}"}
            log(f"{name}: {type(ex).__name__}: {ex}")
        (work / "results.json").write_text(json.dumps(results, indent=1))
    log("done")


if __name__ == "__main__":
    main()
