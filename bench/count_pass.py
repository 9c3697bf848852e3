"""How much Python one pass of `watchdog run` executes: bytecodes per pass, by module and by function.

    .venv/bin/python bench/count_pass.py [--part full|tick|scrape|get|read] [--passes 50] [--top 30]

CPU time at 1 Hz is noisy here (a shared 2-core VM, no hardware counters), and a pass costs well under a
millisecond; the number of bytecodes a pass runs is exact and repeatable, so a change to the hot path can be
judged in seconds before the side-by-side CPU benchmarks (bench/profile_tick.py --cpu, bench/profile_variants.py)
say what it is worth. It counts Python only: time in C (regex scans, system calls, the kernel) is not in it.

The daemon runs in this process with its act stage and trace, against the recorded TP=2 page under load
(bench/page_server.py, chunked as vLLM's uvicorn answers), past its start; each counted pass is traced with
``sys.settrace`` and opcode events.
"""

from __future__ import annotations

import argparse
import collections
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import CodeType, FrameType
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.profile_tick import in_process_daemon, start_server  # noqa: E402

PARTS = ("full", "tick", "scrape", "get", "read")


def count(fn: Callable[[], object], passes: int) -> tuple[collections.Counter[CodeType], collections.Counter[CodeType]]:
    """Bytecodes and calls per code object over ``passes`` calls of ``fn`` (10 ms apart, as a loop that sleeps)."""
    ops: collections.Counter[CodeType] = collections.Counter()
    calls: collections.Counter[CodeType] = collections.Counter()

    def tracer(frame: FrameType, event: str, _arg: Any) -> Callable[..., Any]:
        if event == "call":
            frame.f_trace_opcodes = True
            calls[frame.f_code] += 1
        elif event == "opcode":
            ops[frame.f_code] += 1
        return tracer

    for _ in range(passes):
        sys.settrace(tracer)
        try:
            fn()
        finally:
            sys.settrace(None)
        time.sleep(0.01)
    return ops, calls


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--part", choices=PARTS, default="full")
    ap.add_argument("--passes", type=int, default=50)
    ap.add_argument("--top", type=int, default=30)
    args = ap.parse_args()
    from watchdog.scrape.fetch import FILTERED, MetricsFetcher
    from watchdog.scrape.page import read_page

    server, url = start_server(chunked=True)
    try:
        with in_process_daemon(url) as (daemon, watcher):
            fetcher = watcher.fetcher
            assert isinstance(fetcher, MetricsFetcher)
            http = fetcher.http
            text = http.get_page(FILTERED, accept="text/plain").body.decode()
            parts: dict[str, Callable[[], object]] = {
                "full": lambda: daemon.one_pass(watcher),
                "tick": watcher.tick,
                "scrape": fetcher.scrape,
                "get": lambda: http.get_page(FILTERED, accept="text/plain"),
                "read": lambda: read_page(text),
            }
            ops, calls = count(parts[args.part], args.passes)
    finally:
        server.kill()
        server.wait(10)
    n = args.passes
    print(f"{args.part}: {sum(ops.values()) / n:.0f} bytecodes and {sum(calls.values()) / n:.1f} Python calls a pass")
    by_module: collections.Counter[str] = collections.Counter()
    for code, k in ops.items():
        by_module[code.co_filename.replace(str(ROOT) + "/", "")] += k
    for module, k in by_module.most_common(args.top):
        print(f"{k / n:8.0f}  {module}")
    print("bytecodes  calls  function")
    for code, k in ops.most_common(args.top):
        where = f"{code.co_filename.replace(str(ROOT) + '/', '')}:{code.co_firstlineno} {code.co_name}"
        print(f"{k / n:8.0f}  {calls[code] / n:5.1f}  {where}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
