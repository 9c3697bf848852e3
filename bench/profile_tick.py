"""Where a pass of `watchdog run` spends its CPU, against a real page served from another process.

    .venv/bin/python bench/profile_tick.py [--passes 2000] [--chunked] [--top 25]
    .venv/bin/python bench/profile_tick.py --cpu 60     # `watchdog run` at 1 Hz: its CPU, beside the naive watcher
    .venv/bin/python bench/profile_tick.py --cpu 120 --against /tmp/base   # ... and another checkout's service
    .venv/bin/python bench/profile_tick.py --cold 40    # each stage of a pass at 1 Hz, cold, in us
    .venv/bin/python bench/profile_tick.py --cold 300 --flush-mb 64   # ... with the caches flushed before each pass

The page server (bench/page_server.py) serves the TP=2 page under load with a counter advancing per request.
``--passes`` runs the daemon's pass (scrape, judge, report, act, evidence) back to back under cProfile and prints
the CPU per pass by stage; ``--cpu`` measures the real service's CPU share at 1 Hz next to the naive reference.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import json
import pstats
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.bench_engine import NAIVE  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_server(chunked: bool) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    cmd = [sys.executable, str(ROOT / "bench" / "page_server.py"), str(port)] + (["--chunked"] if chunked else [])
    proc = subprocess.Popen(cmd)
    url = f"http://127.0.0.1:{port}"
    for _ in range(100):
        try:
            socket.create_connection(("127.0.0.1", port), 0.2).close()
            break
        except OSError:
            time.sleep(0.05)
    return proc, url


@contextlib.contextmanager
def in_process_daemon(url: str) -> Iterator[tuple[Any, Any]]:
    """The daemon with its act stage and trace, in this process, on a watcher already past starting."""
    from watchdog.config.load import load
    from watchdog.service.compose import Hooks, compose
    from watchdog.service.daemon import Daemon

    with tempfile.TemporaryDirectory(prefix="profile-tick-") as tmp:
        cfg_path = Path(tmp) / "w.toml"
        cfg_path.write_text(f'[engine]\nurl = "{url}"\n[state]\ndir = "{tmp}"\n[exporter]\nport = 0\n'
                            "[gpu]\nenabled = false\n")
        cfg = load(cfg_path)
        d = Daemon(cfg, Path(tmp))
        d.parts = compose(cfg, Path(tmp), d.http, Hooks(d._count, d._write_trace, d._act_event, d._bundle),
                          d.clock, once=False)  # the parts `watchdog run` builds, capture included
        watcher = d.parts.watcher
        assert watcher is not None
        for _ in range(50):  # warm up: past starting
            d.one_pass(watcher)
        try:
            yield d, watcher
        finally:
            d.parts.close()
            d.http.close()


def profile_passes(url: str, passes: int, top: int) -> dict[str, float]:
    with in_process_daemon(url) as (d, watcher):
        stages: dict[str, Callable[[], object]] = {
            "tick (scrape+judge)": watcher.tick, "fetch only": watcher.fetcher.scrape,
            "one_pass": lambda: d.one_pass(watcher)}
        out: dict[str, float] = {}
        for name, fn in stages.items():
            t0 = time.process_time()
            for _ in range(passes):
                fn()
            out[name] = (time.process_time() - t0) / passes * 1e3
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(passes):
            d.one_pass(watcher)
        prof.disable()
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("cumulative").print_stats(top)
        print(s.getvalue())
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(top)
        print(s.getvalue())
        return out


def on_cpu_ns(pid: int) -> int:
    """Nanoseconds on the CPU of every thread of ``pid`` (/proc/PID/task/*/schedstat): utime+stime count 10 ms ticks,
    too coarse for a process that uses a tenth of a percent."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            total += int((task / "schedstat").read_text().split()[0])
        except (OSError, IndexError, ValueError):
            continue
    return total


SLEEPER = "import time\nwhile True:\n    time.sleep(1)\n"


def service_of(tree: str, url: str, state_dir: Path, config_text: str = "") -> subprocess.Popen[bytes]:
    """`watchdog run` of another checkout (`python -m watchdog` from that tree's root imports that tree's package),
    in its own session, at its defaults but for ``config_text``: an older commit beside this one in one run."""
    state_dir.mkdir()
    (state_dir / "w.toml").write_text(config_text)
    return subprocess.Popen(
        [sys.executable, "-m", "watchdog", "run", "--url", url, "--state-dir", str(state_dir),
         "--config", str(state_dir / "w.toml"), "--metrics-port", str(free_port())],
        cwd=tree, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def service_cpu(url: str, seconds: float, against: str = "") -> dict[str, float]:
    """The service at defaults (exporter on), the naive watcher and a Python that only sleeps 1 s in a loop (the
    floor), side by side against the same page server; with ``against``, also the service of another checkout (an
    older commit's worktree), so that a change is measured in one run."""
    from tests.harness.watcher import WatchdogProcess

    with tempfile.TemporaryDirectory(prefix="profile-cpu-") as tmp:
        w = WatchdogProcess(url, Path(tmp) / "w", "[gpu]\nenabled = false\n", metrics_port=free_port()).start()
        naive = subprocess.Popen([sys.executable, "-c", NAIVE, url], start_new_session=True)
        sleeper = subprocess.Popen([sys.executable, "-c", SLEEPER], start_new_session=True)
        others = [naive, sleeper]
        if against:
            others.append(service_of(against, url, Path(tmp) / "o", "[gpu]\nenabled = false\n"))
        try:
            time.sleep(10)
            assert w._popen is not None
            pids = {"watchdog": w._popen.pid, "naive": naive.pid, "sleeping_python": sleeper.pid}
            if against:
                pids["against"] = others[-1].pid
            a, t0 = {k: on_cpu_ns(p) for k, p in pids.items()}, time.monotonic()
            time.sleep(seconds)
            b, wall = {k: on_cpu_ns(p) for k, p in pids.items()}, time.monotonic() - t0
            res: dict[str, float] = {"seconds": round(wall, 1)}
            res.update({f"{k}_cpu_percent": round((b[k] - a[k]) / 1e9 / wall * 100, 4) for k in pids})
            for name in ("watchdog", "against") if against else ("watchdog",):
                ours = max(res[f"{name}_cpu_percent"], 1e-9)
                res[f"ratio_naive_to_{name}"] = round(res["naive_cpu_percent"] / ours, 1)
            return res
        finally:
            for p in others:
                p.kill()
                p.wait(10)
            w.stop()


def cold_stages(url: str, passes: int, flush_mb: int = 0) -> dict[str, float]:
    """The daemon's pass once a second, as the service runs it (cold: caches and the CPU idle in between), each
    stage's thread CPU time in us per pass, in-process. With ``flush_mb``, the caches are flushed before each pass
    (that many MB copied; more than the last-level cache), as an engine busy on every core leaves them: repeatable
    where the real engine's effect on them varies, and passes can follow each other quickly."""
    import functools
    import statistics

    from watchdog.judge.judge import Judge
    from watchdog.scrape import fetch
    from watchdog.scrape.engine_http import EngineHTTP
    from watchdog.service.daemon import Daemon
    from watchdog.service.trace import TraceWriter

    spent: dict[str, int] = {}

    def timed(owner: object, name: str, label: str) -> None:
        fn = getattr(owner, name)

        @functools.wraps(fn)
        def wrapper(*args: object, **kwargs: object) -> object:
            t0 = time.thread_time_ns()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[label] = spent.get(label, 0) + time.thread_time_ns() - t0

        setattr(owner, name, wrapper)

    for owner, name, label in ((EngineHTTP, "get_page", "GET of the page"), (fetch, "read_page", "reading it"),
                               (Judge, "observe", "judge"), (TraceWriter, "write", "trace"),
                               (Daemon, "_report", "report (exporter, events)"), (Daemon, "_respond", "act + status"),
                               (Daemon, "_evidence", "evidence")):
        timed(owner, name, label)
    with in_process_daemon(url) as (d, watcher):
        spent.clear()
        per_pass = []
        src, dst = bytearray(flush_mb << 20), bytearray(flush_mb << 20)
        for _ in range(passes):
            if flush_mb:
                time.sleep(0.02)
                dst[:] = src
            else:
                time.sleep(1.0)
            t0 = time.thread_time_ns()
            d.one_pass(watcher)
            per_pass.append(time.thread_time_ns() - t0)
    out: dict[str, float] = {"one_pass_median_us": round(statistics.median(per_pass) / 1e3)}
    out.update({k: round(v / passes / 1e3) for k, v in sorted(spent.items(), key=lambda kv: -kv[1])})
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--passes", type=int, default=0)
    ap.add_argument("--cpu", type=float, default=0.0)
    ap.add_argument("--chunked", action="store_true")
    ap.add_argument("--against", default="", help="with --cpu: another checkout's service beside this one")
    ap.add_argument("--cold", type=int, default=0, help="passes at 1 Hz: each stage's CPU in us, cold")
    ap.add_argument("--flush-mb", type=int, default=0, help="with --cold: flush the caches before each pass instead "
                    "of waiting a second (64: more than this machine's 32 MB L3)")
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args()
    server, url = start_server(args.chunked)
    try:
        if args.passes:
            print(json.dumps({k: round(v, 3) for k, v in profile_passes(url, args.passes, args.top).items()},
                             indent=2) + "  (CPU ms per call, this process only)")
        if args.cpu:
            print(json.dumps(service_cpu(url, args.cpu, args.against), indent=2))
        if args.cold:
            stages = cold_stages(url, args.cold, args.flush_mb)
            print(json.dumps(stages, indent=2) + "  (us of thread CPU per pass, cold)")
    finally:
        server.kill()
        server.wait(10)
    return 0


if __name__ == "__main__":
    sys.exit(main())
