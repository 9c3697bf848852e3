"""A two-GPU tensor-parallel "engine" that looks like vLLM to the watchdog, and can be wedged (issue 10).

    python3 tests/device/tp2_engine.py serve --dir DIR --port PORT [--ranks N] [--seconds N] [--fake]

``serve`` is the API-server-like parent (titled ``VLLM::APIServer``): it listens on PORT and serves a vLLM-style
``/metrics`` page (engine="0", running 1, waiting 0, ``vllm:generation_tokens_total`` = the ranks' common step
count), ``/v1/models`` and ``/v1/completions`` (answered once the ranks make a step, so a probe of a wedged engine
gets no answer), and starts two ranks, its children, titled ``VLLM::Worker_TP0`` / ``VLLM::Worker_TP1``.

Each rank (one GPU each, one ``torch.distributed`` NCCL group, Flight Recorder and its dump pipe on, NCCL RAS on,
``TORCH_NCCL_BLOCKING_WAIT=1`` so the host waits inside ``all_reduce`` as a collective's caller does) loops a
decode step: four small bf16 matmuls and an ``all_reduce``. When ``DIR/wedge`` appears and holds its rank, that
rank writes ``DIR/wedged.json`` (wall time, step) and launches a kernel that spins on a flag in pinned host memory
on its stream, then waits for the device (``torch.cuda.synchronize``, as a data-dependent sync inside a model
step does): it never reaches the next ``all_reduce``, which its peer has entered and waits in. ``DIR/release``
sets the flag (the spin also ends by its own deadline, ``%globaltimer``); ``DIR/stop`` or ``--seconds`` ends all.
``--fake``: no GPU, no torch (the ranks sleep instead): to try the watchdog path on a machine without a GPU.
``--ranks 1`` (issue 19): one rank, ``VLLM::Worker_TP0``, alone in its one-rank NCCL group; wedged, it waits on its
own GPU's spinning kernel with no peer to wait for it.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

MODEL = "tp2-spin"
NVLS_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}

SPIN_SRC = r"""
extern "C" __global__ void spin(volatile int *flag, unsigned long long max_ns) {
    unsigned long long start, now;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
    while (flag[0] == 0) {
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
        if (now - start > max_ns) break;
    }
}
"""


def title(name: str) -> None:
    try:
        import setproctitle
        setproctitle.setproctitle(name)
    except ImportError:
        print(f"setproctitle missing: the title {name} is not set", file=sys.stderr)


def log(d: Path, who: str, msg: str) -> None:
    line = f"{time.time():.3f} {who} {msg}"
    print(line, flush=True)
    with open(d / "program.log", "a") as f:
        f.write(line + "\n")


class Steps:
    """Each rank's step count, int64 at offset 8*rank of DIR/steps (a shared mapping the server reads)."""

    def __init__(self, d: Path, create: bool = False, ranks: int = 2) -> None:
        path = d / "steps"
        self.ranks = ranks
        if create:
            path.write_bytes(b"\0" * 8 * ranks)
        self.f = open(path, "r+b")  # noqa: SIM115 - held for the process's life
        self.m = mmap.mmap(self.f.fileno(), 8 * ranks)

    def set(self, rank: int, n: int) -> None:
        self.m[8 * rank: 8 * rank + 8] = n.to_bytes(8, "little")

    def get(self, rank: int) -> int:
        return int.from_bytes(self.m[8 * rank: 8 * rank + 8], "little")

    def common(self) -> int:
        return min(self.get(r) for r in range(self.ranks))


def page(steps: int, started: float) -> str:
    lab = f'engine="0",model_name="{MODEL}"'
    return "".join([
        "# HELP vllm:num_requests_running Number of requests in model execution batches.\n",
        "# TYPE vllm:num_requests_running gauge\n", f"vllm:num_requests_running{{{lab}}} 1.0\n",
        "# HELP vllm:num_requests_waiting Number of requests waiting to be processed.\n",
        "# TYPE vllm:num_requests_waiting gauge\n", f"vllm:num_requests_waiting{{{lab}}} 0.0\n",
        "# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.\n",
        "# TYPE vllm:kv_cache_usage_perc gauge\n", f"vllm:kv_cache_usage_perc{{{lab}}} 0.01\n",
        "# HELP vllm:prompt_tokens_total Number of prefill tokens processed.\n",
        "# TYPE vllm:prompt_tokens_total counter\n", f"vllm:prompt_tokens_total{{{lab}}} 16.0\n",
        f"vllm:prompt_tokens_created{{{lab}}} {started}\n",
        "# HELP vllm:generation_tokens_total Number of generation tokens processed.\n",
        "# TYPE vllm:generation_tokens_total counter\n", f"vllm:generation_tokens_total{{{lab}}} {float(steps)}\n",
        f"vllm:generation_tokens_created{{{lab}}} {started}\n",
    ])


def serve(a: argparse.Namespace) -> None:
    title("VLLM::APIServer")
    d: Path = a.dir
    d.mkdir(parents=True, exist_ok=True)
    (d / "fr").mkdir(exist_ok=True)
    steps = Steps(d, create=True, ranks=a.ranks)
    started = time.time()
    env = dict(os.environ, **NVLS_OFF, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(a.port + 1000),
               TORCH_FR_BUFFER_SIZE="2000", TORCH_NCCL_DEBUG_INFO_PIPE_FILE=f"{d}/fr/pipe_",
               TORCH_FR_DUMP_TEMP_FILE=f"{d}/fr/fr_", TORCH_NCCL_BLOCKING_WAIT="1", TORCH_NCCL_ENABLE_TIMING="1",
               NCCL_RAS_ENABLE="1", PYTHONUNBUFFERED="1",
               SPT_NOENV="1")  # setproctitle must not clobber /proc/PID/environ: the watchdog reads FR settings there
    ranks = [subprocess.Popen([sys.executable, __file__, "rank", "--dir", str(d), "--rank", str(r),
                               "--seconds", str(a.seconds), "--ranks", str(a.ranks), *(["--fake"] if a.fake else [])],
                              env=env, stdout=open(d / f"rank{r}.log", "w"), stderr=subprocess.STDOUT)  # noqa: SIM115
             for r in range(a.ranks)]
    log(d, "server", f"ranks {[p.pid for p in ranks]} started; server pid {os.getpid()}")

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

        def send(self, code: int, body: str, ctype: str = "application/json") -> None:
            data = body.encode()
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            if self.path.startswith("/metrics"):
                self.send(200, page(steps.common(), started), "text/plain; version=0.0.4; charset=utf-8")
            elif self.path.startswith("/v1/models"):
                self.send(200, json.dumps({"object": "list", "data": [{"id": MODEL, "object": "model"}]}))
            elif self.path.startswith("/health"):
                self.send(200, "")
            else:
                self.send(404, "{}")

        def do_POST(self) -> None:
            n = int(self.headers.get("Content-Length", "0") or 0)
            self.rfile.read(n)
            if not self.path.startswith("/v1/completions"):
                self.send(404, "{}")
                return
            first, end = steps.common(), time.monotonic() + 30
            while steps.common() == first and time.monotonic() < end:
                time.sleep(0.05)
            if steps.common() == first:
                self.send(500, json.dumps({"error": "no step in 30 s"}))
                return
            self.send(200, json.dumps({"id": "cmpl-1", "object": "text_completion", "model": MODEL,
                                       "choices": [{"index": 0, "text": "x", "finish_reason": "length"}],
                                       "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}))

    httpd = ThreadingHTTPServer(("127.0.0.1", a.port), Handler)
    httpd.daemon_threads = True
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    log(d, "server", f"listening on {a.port}")
    end = time.monotonic() + a.seconds
    while time.monotonic() < end and not (d / "stop").exists() and all(p.poll() is None for p in ranks):
        time.sleep(0.2)
    (d / "stop").touch()
    log(d, "server", f"stopping; ranks {[p.poll() for p in ranks]}; steps {[steps.get(r) for r in range(a.ranks)]}")
    for p in ranks:
        try:
            p.wait(20)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
    log(d, "server", f"ranks exited {[p.returncode for p in ranks]}")
    httpd.shutdown()


def rank_main(a: argparse.Namespace) -> None:
    r: int = a.rank
    title(f"VLLM::Worker_TP{r}")
    d: Path = a.dir
    steps = Steps(d, ranks=a.ranks)
    end = time.monotonic() + a.seconds
    if a.fake:
        n = 0
        while time.monotonic() < end and not (d / "stop").exists():
            if ((d / "wedge").exists() and (d / "wedge").read_text().strip() == str(r)
                    and not (d / "wedged.json").exists()):
                log(d, f"rank{r}", f"wedged at step {n} (fake)")
                (d / "wedged.json").write_text(json.dumps({"t": time.time(), "rank": r, "step": n}))
                while not (d / "release").exists() and not (d / "stop").exists() and time.monotonic() < end:
                    time.sleep(0.1)
            n += 1
            steps.set(r, n)
            time.sleep(0.01)
        return
    decode_loop(d, r, steps, end, a.spin_seconds, a.ranks)


def decode_loop(d: Path, r: int, steps: Steps, end: float, spin_seconds: float, world: int = 2) -> None:
    import cupy as cp
    import numpy as np
    import torch
    import torch.distributed as dist

    torch.cuda.set_device(r)
    dist.init_process_group("nccl", rank=r, world_size=world, device_id=torch.device("cuda", r))
    log(d, f"rank{r}", f"pid {os.getpid()} group up on cuda:{r}; env FR={os.environ.get('TORCH_FR_BUFFER_SIZE')}")
    w = [torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16) / 64 for _ in range(4)]
    h = torch.randn(8, 4096, device="cuda", dtype=torch.bfloat16)
    mem = cp.cuda.alloc_pinned_memory(4)
    flag = np.frombuffer(mem, np.int32, 1)
    flag[0] = 0
    kernel = cp.RawKernel(SPIN_SRC, "spin")

    def release_watch() -> None:
        while not (d / "release").exists() and not (d / "stop").exists() and time.monotonic() < end:
            time.sleep(0.05)
        flag[0] = 1

    threading.Thread(target=release_watch, daemon=True, name="release").start()
    wedge = d / "wedge"
    n = 0
    while time.monotonic() < end and not (d / "stop").exists():
        x = h
        for m in w:
            x = torch.tanh(x @ m)
        if wedge.exists() and wedge.read_text().strip() == str(r) and not (d / "wedged.json").exists():
            stuck_kernel(d, r, n, kernel, mem.ptr, spin_seconds, cp, np, torch)
        dist.all_reduce(x)  # blocking wait: the host stays in here until every rank's kernel finished
        h = x / 2
        n += 1
        steps.set(r, n)
        time.sleep(0.005)
    log(d, f"rank{r}", f"loop ended at step {n}")
    torch.cuda.synchronize()
    dist.destroy_process_group()


def stuck_kernel(d: Path, r: int, n: int, kernel: object, ptr: int, seconds: float, cp: object, np: object,
                 torch: object) -> None:
    """Launch a kernel that never finishes (until released) on this rank's stream and wait for the device."""
    stream = torch.cuda.current_stream()  # type: ignore[attr-defined]
    with cp.cuda.ExternalStream(stream.cuda_stream):  # type: ignore[attr-defined]
        kernel((132,), (32,), (np.uint64(ptr), np.uint64(int(seconds * 1e9))))  # type: ignore[attr-defined,operator]
    t = time.time()
    (d / "wedged.json").write_text(json.dumps({"t": t, "rank": r, "step": n}))
    log(d, f"rank{r}", f"wedged at step {n}: spin kernel launched, waiting for the device")
    torch.cuda.synchronize()  # type: ignore[attr-defined]
    log(d, f"rank{r}", f"released after {time.time() - t:.1f}s")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["serve", "rank"])
    ap.add_argument("--dir", required=True, type=Path)
    ap.add_argument("--port", type=int, default=8123)
    ap.add_argument("--rank", type=int, default=0)
    ap.add_argument("--ranks", type=int, default=2, help="ranks in the group (1: one GPU, one-rank NCCL group)")
    ap.add_argument("--seconds", type=float, default=180.0)
    ap.add_argument("--spin-seconds", type=float, default=150.0)
    ap.add_argument("--fake", action="store_true")
    a = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    if a.mode == "serve":
        serve(a)
    else:
        rank_main(a)


if __name__ == "__main__":
    main()
