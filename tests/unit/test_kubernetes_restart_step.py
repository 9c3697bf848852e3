"""The leader's restart step from deploy/kubernetes/vllm-lws.yaml, run for real as the watchdog plans it: in a PID
namespace made here that holds what the leader pod's shared process namespace holds (the vLLM server started by the
manifest's own command line, a rank, and a younger process with the same command line), it must end the server with
SIGTERM and nothing else. The module vLLM's command runs is a stand-in that only sleeps."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

from watchdog.config.load import load
from watchdog.config.restart_plan import plan

ROOT = Path(__file__).resolve().parents[2]
MANIFEST = ROOT / "deploy" / "kubernetes" / "vllm-lws.yaml"
LEADER_ADDRESS = "vllm-0.vllm.vllm"  # what LeaderWorkerSet puts in LWS_LEADER_ADDRESS for group 0 of this set


def by_kind(kind: str) -> dict[str, Any]:
    [doc] = [d for d in yaml.safe_load_all(MANIFEST.read_text()) if d and d["kind"] == kind]
    return doc


SERVER = '''import os, pathlib, time
pathlib.Path(os.environ["MARKS"], str(os.getpid())).touch()
time.sleep(60)
'''
DRIVER = '''import json, os, subprocess, sys, time
spec = json.load(open(sys.argv[1]))
env = dict(os.environ, PYTHONPATH=spec["fake"], MARKS=spec["marks"])
server = subprocess.Popen(spec["server"], env=env)  # the pod's vLLM server, as its container starts it
time.sleep(0.2)
rank = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "VLLM::EngineCore"])
younger = subprocess.Popen(spec["server"], env=env)  # a later process with the same command line
deadline = time.monotonic() + 20
while len(os.listdir(spec["marks"])) < 2 and time.monotonic() < deadline:
    time.sleep(0.05)
step = subprocess.run(spec["argv"], capture_output=True, text=True, timeout=spec["timeout"])
try:
    ended = server.wait(timeout=10)
except subprocess.TimeoutExpired:
    ended = None
print(json.dumps({"rc": step.returncode, "said": step.stderr, "server": ended, "rank": rank.poll() is None,
                  "younger": younger.poll() is None}))
'''


def test_the_restart_step_ends_the_pods_vllm_server_and_nothing_else(tmp_path: Path) -> None:
    config = tmp_path / "leader.toml"
    config.write_text(by_kind("ConfigMap")["data"]["leader.toml"])
    [step] = plan(load(config).restart)
    leader = by_kind("LeaderWorkerSet")["spec"]["leaderWorkerTemplate"]["leaderTemplate"]["spec"]
    [engine] = [c for c in leader["containers"] if c["name"] == "vllm-leader"]
    argv = [*engine["command"], *engine["args"]]
    assert argv[0] == "python3"
    server = [sys.executable, *[a.replace("$(LWS_LEADER_ADDRESS)", LEADER_ADDRESS) for a in argv[1:]]]
    module = Path(tmp_path, "fake", *argv[argv.index("-m") + 1].split("."))  # a stand-in for vLLM's CLI module
    module.parent.mkdir(parents=True)
    module.with_suffix(".py").write_text(SERVER)
    (tmp_path / "marks").mkdir()
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"fake": str(tmp_path / "fake"), "marks": str(tmp_path / "marks"), "server": server,
                                "argv": list(step.argv), "timeout": step.timeout}))
    (tmp_path / "driver.py").write_text(DRIVER)
    r = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", sys.executable, str(tmp_path / "driver.py"),
                        str(spec)], capture_output=True, text=True, timeout=60, start_new_session=True, check=False)
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout)
    assert out["rc"] == 0, out["said"]
    assert out["server"] == -15  # SIGTERM: the oldest match, the pod's server
    assert out["rank"] and out["younger"]  # nothing else was signalled
