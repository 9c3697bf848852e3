# ruff: noqa: SIM105 - a device driver: best-effort ends
"""Record the real vLLM CUDA engine (TP=1, CUDA graphs on) watched by the real `watchdog run`, for CI's fixtures.

    python3 tests/device/vllm_record.py --out DIR --model MODEL [--only boot,idle,load,stop,spin,crash] [--budget S]

One engine serves every scenario, in this order (the crash ends it):

- ``boot``: the watchdog is started first; the engine boots without ``--enforce-eager`` (compilation and CUDA
  graph capture are minutes of silence); the first successful generation is timed.
- ``idle``: 15 s untouched, then `watchdog dump --native` of the healthy idle engine.
- ``load``: six clients generate without end; `watchdog dump` under load.
- ``stop``: EngineCore SIGSTOPped under load until the watchdog's bundle is on disk, `watchdog dump --native` of
  the stopped engine, SIGCONT, back to serving.
- ``spin``: the injected ``gpu_spin`` (a kernel of ``WATCHDOG_TEST_SPIN_S`` seconds in the model's step) under
  load, until the watchdog's bundle is on disk; the kernel ends by itself.
- ``crash``: the injected ``illegal_access``, set off by one request with ``repetition_penalty``: EngineCore dies on
  a CUDA illegal memory access; the watchdog's ``down`` incident is waited for.

Beside the watchdog's own state directory (events, trace, bundles) the driver keeps what it saw itself: NVML every
0.5 s (``nvml.jsonl``), the engine's process titles every 0.5 s (``titles.jsonl``), pages at each phase
(``pages/``), each phase's start and end (``phases.jsonl``), the environment (``env.json``). Every process started
here runs in its own session and is ended by its process group id; a stopped EngineCore is continued first.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
INJECT = REPO / "tests" / "harness" / "inject"
PORT = 8000
URL = f"http://127.0.0.1:{PORT}"
ORDER = ("boot", "idle", "load", "stop", "spin", "crash")

CONFIG = """# as an operator would write it: the engine, its log, where the state goes; every threshold at its default
[engine]
url = "{url}"
name = "h200"
[capture]
log_file = "{log}"
[state]
dir = "{state}"
"""


class Recorder:
    def __init__(self, out: Path, model: Path, budget: float, engine_python: str = sys.executable) -> None:
        self.out, self.model, self.engine_python = out, model, engine_python
        self.deadline = time.monotonic() + budget
        self.state = out / "state"
        self.log = out / "engine.log"
        self.config = out / "watchdog.toml"
        self.flag = out / "fault"
        self.stop_event = threading.Event()
        self.load_stop = threading.Event()
        self.procs: list[subprocess.Popen[bytes]] = []
        self.stopped: list[int] = []
        self.server: subprocess.Popen[bytes] | None = None
        self.ok_requests = 0
        self.failed_requests = 0

    # -- bookkeeping -----------------------------------------------------------------------------------------
    def mark(self, phase: str, what: str, **extra: Any) -> None:
        rec = {"t": round(time.time(), 3), "phase": phase, "what": what, **extra}
        print(json.dumps(rec), flush=True)
        with open(self.out / "phases.jsonl", "a") as f:
            f.write(json.dumps(rec) + "\n")

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def start(self, argv: list[str], log: Path, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        with open(log, "ab") as f:
            p = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, start_new_session=True,
                                 env={**os.environ, **(env or {})}, cwd=REPO)
        self.procs.append(p)
        return p

    def end_all(self) -> None:
        for pid in self.stopped:
            try:
                os.kill(pid, signal.SIGCONT)
            except OSError:
                pass
        for p in reversed(self.procs):
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGTERM)
                except OSError:
                    continue
                try:
                    p.wait(15)
                except subprocess.TimeoutExpired:
                    os.killpg(p.pid, signal.SIGKILL)
                    p.wait(5)

    # -- the engine ------------------------------------------------------------------------------------------
    def engine_pids(self) -> dict[int, str]:
        import psutil

        if self.server is None:
            return {}
        try:
            root = psutil.Process(self.server.pid)
            kids = [root, *root.children(recursive=True)]
        except psutil.Error:
            return {}
        out = {}
        for k in kids:
            try:
                cmd = k.cmdline()
                out[k.pid] = (cmd[0] if cmd else k.name()) + f" [{k.status()}]"
            except psutil.Error:
                continue
        return out

    def engine_core(self) -> int | None:
        return next((pid for pid, t in self.engine_pids().items() if t.startswith("VLLM::EngineCore")), None)

    def page(self) -> str | None:
        try:
            with urllib.request.urlopen(f"{URL}/metrics", timeout=3) as r:
                return str(r.read().decode())
        except OSError:
            return None

    def save_page(self, name: str) -> None:
        text = self.page()
        (self.out / "pages").mkdir(exist_ok=True)
        (self.out / "pages" / f"{name}.txt").write_text(text if text is not None else "# no page: unreachable\n")

    def generate(self, max_tokens: int = 16, timeout: float = 30, **extra: Any) -> bool:
        body = json.dumps({"model": "tiny", "prompt": "hello there", "max_tokens": max_tokens,
                           "ignore_eos": True, **extra}).encode()
        req = urllib.request.Request(f"{URL}/v1/completions", body, {"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                ok = r.status == 200 and bool(json.loads(r.read())["choices"][0]["text"] is not None)
        except (OSError, ValueError, KeyError):
            ok = False
        if ok:
            self.ok_requests += 1
        else:
            self.failed_requests += 1
        return ok

    def load(self, clients: int = 6) -> list[threading.Thread]:
        self.load_stop.clear()

        def client() -> None:
            while not self.load_stop.is_set() and not self.stop_event.is_set():
                if not self.generate(max_tokens=192, timeout=120):
                    time.sleep(0.5)

        threads = [threading.Thread(target=client, daemon=True) for _ in range(clients)]
        for t in threads:
            t.start()
        return threads

    # -- samplers --------------------------------------------------------------------------------------------
    def samplers(self) -> None:
        def nvml() -> None:
            try:
                import pynvml
            except ImportError:
                return
            try:
                pynvml.nvmlInit()
                h = pynvml.nvmlDeviceGetHandleByIndex(0)
            except pynvml.NVMLError as e:
                self.mark("nvml", f"no NVML: {e}")
                return
            with open(self.out / "nvml.jsonl", "a") as f:
                while not self.stop_event.is_set():
                    try:
                        u = pynvml.nvmlDeviceGetUtilizationRates(h)
                        procs = pynvml.nvmlDeviceGetComputeRunningProcesses(h)
                        rec = {"t": round(time.time(), 3), "util": u.gpu, "mem_util": u.memory,
                               "power_w": pynvml.nvmlDeviceGetPowerUsage(h) / 1000,
                               "limit_w": pynvml.nvmlDeviceGetEnforcedPowerLimit(h) / 1000,
                               "sm_mhz": pynvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_SM),
                               "mem_used_mib": pynvml.nvmlDeviceGetMemoryInfo(h).used // 2**20,
                               "procs": [p.pid for p in procs]}
                    except pynvml.NVMLError as e:
                        rec = {"t": round(time.time(), 3), "error": str(e)}
                    f.write(json.dumps(rec) + "\n")
                    f.flush()
                    self.stop_event.wait(0.5)

        def titles() -> None:
            last: dict[int, str] = {}
            with open(self.out / "titles.jsonl", "a") as f:
                while not self.stop_event.is_set():
                    now = self.engine_pids()
                    if now != last:
                        f.write(json.dumps({"t": round(time.time(), 3), "procs": now}) + "\n")
                        f.flush()
                        last = now
                    self.stop_event.wait(0.5)

        for fn in (nvml, titles):
            threading.Thread(target=fn, daemon=True).start()

    # -- the watchdog ----------------------------------------------------------------------------------------
    def watchdog(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "watchdog", args[0], "--config", str(self.config), *args[1:]],
                              capture_output=True, text=True, timeout=timeout, cwd=REPO, check=False)

    def dump(self, name: str, native: bool = True) -> None:
        t0 = time.monotonic()
        r = self.watchdog("dump", *(["--native"] if native else []), "--json", "--out", str(self.out / "dumps"))
        (self.out / "dumps").mkdir(exist_ok=True)
        (self.out / "dumps" / f"{name}.json").write_text(r.stdout)
        (self.out / "dumps" / f"{name}.stderr").write_text(r.stderr)
        self.mark(name, "dump", rc=r.returncode, seconds=round(time.monotonic() - t0, 2))

    def events(self) -> list[dict[str, Any]]:
        try:
            lines = (self.state / "events.jsonl").read_text().splitlines()
        except OSError:
            return []
        return [json.loads(x) for x in lines if x.strip()]

    def bundles(self) -> set[str]:
        d = self.state / "incidents"
        return {p.name for p in d.iterdir() if p.is_dir() and not p.name.startswith(".")} if d.is_dir() else set()

    def wait_for(self, what: str, cond: Any, timeout: float) -> bool:
        end = time.monotonic() + min(timeout, max(0.0, self.left()))
        while time.monotonic() < end:
            if cond():
                return True
            time.sleep(0.5)
        self.mark("wait", f"gave up waiting: {what}")
        return False

    # -- scenarios -------------------------------------------------------------------------------------------
    def boot(self) -> None:
        self.config.write_text(CONFIG.format(url=URL, log=self.log, state=self.state))
        self.flag.write_text("")
        self.start([sys.executable, "-m", "watchdog", "run", "--config", str(self.config)], self.out / "watchdog.log",
                   {"PYTHONUNBUFFERED": "1"})
        time.sleep(3)
        self.mark("boot", "engine launched")
        env = {"PYTHONPATH": os.pathsep.join([str(INJECT), os.environ.get("PYTHONPATH", "")]),
               "WATCHDOG_TEST_INJECT": str(self.flag), "VLLM_USE_FLASHINFER_SAMPLER": "0",
               "TORCH_FR_BUFFER_SIZE": "2000", "TORCH_NCCL_DEBUG_INFO_PIPE_FILE": str(self.out / "fr" / "pipe_"),
               "TORCH_FR_DUMP_TEMP_FILE": str(self.out / "fr" / "fr_"), "SPT_NOENV": "1"}
        (self.out / "fr").mkdir(exist_ok=True)
        self.server = self.start([self.engine_python, "-m", "vllm.entrypoints.openai.api_server", "--model",
                                  str(self.model), "--served-model-name", "tiny", "--port", str(PORT),
                                  "--max-model-len", "2048", "--max-num-seqs", "8", "--gpu-memory-utilization",
                                  "0.2", "--disable-uvicorn-access-log"], self.log, env)
        t0 = time.monotonic()
        if self.wait_for("first generation", lambda: self.server is not None and self.server.poll() is None
                         and self.generate(timeout=10), 420):
            self.mark("boot", "first generation", seconds=round(time.monotonic() - t0, 1))
        self.save_page("boot-ready")

    def idle(self) -> None:
        time.sleep(15)
        self.save_page("idle")
        self.mark("idle", "start")
        self.dump("idle")

    def under_load(self, phase: str, body: Any) -> None:
        threads = self.load()
        time.sleep(8)
        self.save_page(f"{phase}-before")
        try:
            body()
        finally:
            self.load_stop.set()
            for t in threads:
                t.join(130)

    def load_phase(self) -> None:
        def body() -> None:
            self.mark("load", "start")
            self.dump("load", native=True)
            time.sleep(5)
        self.under_load("load", body)

    def _until_bundle(self, phase: str, since: set[str], timeout: float) -> None:
        if self.wait_for(f"{phase} bundle", lambda: bool(self.bundles() - since), timeout):
            self.mark(phase, "bundle on disk", bundles=sorted(self.bundles() - since))

    def stop(self) -> None:
        def body() -> None:
            core = self.engine_core()
            if core is None:
                self.mark("stop", "no EngineCore found")
                return
            before = self.bundles()
            os.kill(core, signal.SIGSTOP)
            self.stopped.append(core)
            self.mark("stop", "SIGSTOP", pid=core)
            self._until_bundle("stop", before, 90)
            self.save_page("stop-frozen")
            self.dump("stopped")
            os.kill(core, signal.SIGCONT)
            self.stopped.remove(core)
            self.mark("stop", "SIGCONT", pid=core)
            time.sleep(10)
        self.under_load("stop", body)
        self.wait_for("generation after SIGCONT", lambda: self.generate(timeout=20), 60)
        self.mark("stop", "serving again")

    def spin(self) -> None:
        def body() -> None:
            before = self.bundles()
            self.flag.write_text("gpu_spin")
            self.mark("spin", "armed gpu_spin")
            self._until_bundle("spin", before, 90)
            self.save_page("spin-frozen")
            self.dump("spinning")
            self.flag.write_text("")
        self.under_load("spin", body)
        self.wait_for("generation after the spin", lambda: self.generate(timeout=30), 120)
        self.mark("spin", "serving again")

    def crash(self) -> None:
        before = self.bundles()
        n = len(self.events())
        self.flag.write_text("illegal_access")
        time.sleep(1)
        self.mark("crash", "armed illegal_access; one request with repetition_penalty")
        ok = self.generate(timeout=60, repetition_penalty=1.3)
        self.mark("crash", "request answered" if ok else "request failed")
        self.wait_for("server exit", lambda: self.server is not None and self.server.poll() is not None, 60)
        self.mark("crash", "server exited", rc=self.server.poll() if self.server else None)
        self.wait_for("down incident", lambda: any(e.get("event") == "incident_opened" for e in self.events()[n:]),
                      60)
        self._until_bundle("crash", before, 30)
        time.sleep(5)
        self.mark("crash", "end")

    def run(self, only: tuple[str, ...]) -> None:
        self.samplers()
        steps = {"boot": self.boot, "idle": self.idle, "load": self.load_phase, "stop": self.stop,
                 "spin": self.spin, "crash": self.crash}
        try:
            for name in ORDER:
                if name in only or name == "boot":
                    if self.left() < 20:
                        self.mark(name, "skipped: out of time")
                        continue
                    steps[name]()
        finally:
            self.stop_event.set()
            self.mark("end", "stopping", ok_requests=self.ok_requests, failed_requests=self.failed_requests)
            self.end_all()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--only", default=",".join(ORDER))
    ap.add_argument("--budget", type=float, default=480.0, help="seconds for the whole recording")
    ap.add_argument("--engine-python", default=sys.executable, help="the engine's interpreter (default: this one)")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    env = {"python": sys.version}
    for mod in ("torch", "vllm", "transformers", "triton") if args.engine_python == sys.executable else ():
        try:
            env[mod] = __import__(mod).__version__
        except ImportError as e:
            env[mod] = f"missing: {e}"
    (args.out / "env.json").write_text(json.dumps(env, indent=1))
    Recorder(args.out, args.model, args.budget, args.engine_python).run(tuple(args.only.split(",")))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
