# ruff: noqa: SIM105 - a driver: best-effort ends of its own process groups
"""Drive issue 10's device run: the two-GPU TP "engine" (tests/device/tp2_engine.py) watched by the real `watchdog run`.

    python3 tests/device/tp2_run.py --out DIR [--only healthy,wedge1,wedge0] [--ranks N] [--fake]

Per scenario: start the engine (own process group), wait for its page to count steps, start `watchdog run` (own
process group) with fast thresholds and GPU evidence on, watch it healthy for a while; for ``wedgeN`` make rank N
spin and wait for the watchdog's bundle; ask RAS ourselves during the wedge; release, stop. Everything started here
is ended here by its process group id. Everything lands under DIR/<scenario>/. ``--ranks 1 --only wedge0``
(issue 19): one rank alone in its NCCL group, spinning on its own GPU after some seconds of real work.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

CONFIG = """
[engine]
url = "http://127.0.0.1:{port}"
name = "tp2"
[scrape]
interval = 1.0
[judge]
suspect_after = 5.0
stall_window = 20.0
[probe]
interval = 10.0
timeout = 10.0
[capture]
gap = 2.0
timeout = 15.0
[gpu]
interval = 1.0
dense_interval = 0.5
fr_settle = 20.0
ras_timeout = 5.0
[exporter]
port = 0
[state]
dir = "{state}"
"""


def stamp(out: Path, msg: str) -> None:
    line = f"{time.time():.3f} driver {msg}"
    print(line, flush=True)
    with open(out / "driver.log", "a") as f:
        f.write(line + "\n")


def metrics_steps(port: int) -> float | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as r:
            text = r.read().decode()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("vllm:generation_tokens_total{"):
            return float(line.rsplit(" ", 1)[1])
    return None


def end_group(p: subprocess.Popen[bytes], grace: float) -> None:
    """End a process group this driver started (its leader is p), TERM then KILL."""
    if p.poll() is None:
        try:
            os.killpg(p.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            p.wait(grace)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    p.wait()


def bundles(state: Path) -> list[Path]:
    inc = state / "incidents"
    return sorted(p for p in inc.iterdir() if not p.name.startswith(".")) if inc.is_dir() else []


def scenario(name: str, root: Path, port: int, fake: bool, pyspy: str, ranks: int = 2) -> dict[str, object]:
    d = root / name
    d.mkdir(parents=True, exist_ok=True)
    state = d / "state"
    state.mkdir(exist_ok=True)
    (d / "watchdog.toml").write_text(CONFIG.format(port=port, state=state))
    meta: dict[str, object] = {"scenario": name, "port": port, "ranks": ranks}
    engine = subprocess.Popen([sys.executable, str(REPO / "tests/device/tp2_engine.py"), "serve",
                               "--dir", str(d / "engine"),
                               "--port", str(port), "--seconds", "240", "--ranks", str(ranks),
                               *(["--fake"] if fake else [])],
                              stdout=open(d / "engine.log", "wb"), stderr=subprocess.STDOUT,  # noqa: SIM115
                              start_new_session=True)
    wd: subprocess.Popen[bytes] | None = None
    try:
        end = time.monotonic() + 120
        while time.monotonic() < end and not (metrics_steps(port) or 0) > 0 and engine.poll() is None:
            time.sleep(0.5)
        meta["steps_at_start"] = metrics_steps(port)
        stamp(root, f"{name}: engine stepping ({meta['steps_at_start']})")
        env = dict(os.environ, PATH=f"{Path(pyspy).parent}:{os.environ.get('PATH', '')}")
        wd = subprocess.Popen([sys.executable, "-m", "watchdog", "run", "--config", str(d / "watchdog.toml")],
                              cwd=REPO, env=env, stdout=open(d / "watchdog.log", "wb"),  # noqa: SIM115
                              stderr=subprocess.STDOUT, start_new_session=True)
        time.sleep(15)
        if name == "healthy":
            time.sleep(30)
        else:
            rank = name.removeprefix("wedge")
            (d / "engine" / "wedge").write_text(rank)
            stamp(root, f"{name}: wedge asked of rank {rank}")
            end = time.monotonic() + 15
            while time.monotonic() < end and not (d / "engine" / "wedged.json").exists():
                time.sleep(0.1)
            time.sleep(8)
            if not fake:
                from watchdog.evidence.gpu.nccl_ras import query_ras
                ras = query_ras(timeout=5.0)
                (d / "ras-driver.txt").write_text(ras.text)
                meta["ras_driver"] = {"ok": ras.ok, "error": ras.error, "seconds": ras.seconds}
                subprocess.run(["nvidia-smi", "--query-gpu=index,utilization.gpu,power.draw,clocks.sm",
                                "--format=csv"], stdout=open(d / "smi-wedged.csv", "wb"), timeout=20,  # noqa: SIM115
                               check=False)
            end = time.monotonic() + 90
            while time.monotonic() < end and not bundles(state):
                time.sleep(0.5)
            meta["bundle_seen"] = time.time()
            stamp(root, f"{name}: bundles {[b.name for b in bundles(state)]}")
            time.sleep(3)
            (d / "engine" / "release").touch()
            stamp(root, f"{name}: released")
            time.sleep(12)
        meta["steps_at_end"] = metrics_steps(port)
        end_group(wd, 10)  # the watchdog stops before the engine does: an engine shutting down is no stall
        (d / "engine" / "stop").touch()
        try:
            engine.wait(40)
        except subprocess.TimeoutExpired:
            stamp(root, f"{name}: engine did not end by itself")
    finally:
        if wd is not None:
            end_group(wd, 10)
        end_group(engine, 5)
    meta["engine_rc"] = engine.returncode
    return meta


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--only", default="wedge0,healthy,wedge1")
    ap.add_argument("--fake", action="store_true")
    ap.add_argument("--pyspy", default="py-spy")
    ap.add_argument("--ranks", type=int, default=2)
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    metas = []
    for i, name in enumerate(a.only.split(",")):
        metas.append(scenario(name, a.out, 8201 + i, a.fake, a.pyspy, a.ranks))
        (a.out / "run-meta.json").write_text(json.dumps(metas, indent=2))


if __name__ == "__main__":
    main()
