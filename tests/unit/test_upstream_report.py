"""`watchdog show ID --upstream` on bundles written by the real bundle writer from real captures of the CPU vLLM
(tests/data/livelock: real py-spy dumps and /proc facts), on the real two-GPU bundle of tests/data/gpu-tp2 (written by
the real `watchdog run`, an older manifest), salted with secrets that must not come out, and on broken bundles."""

from __future__ import annotations

import dataclasses
import json
import shutil
from itertools import pairwise
from pathlib import Path
from typing import Any

import pytest

from tests.facts import line_of, says
from tests.unit.livelock_data import load
from watchdog.cli.evidence import read_bundle
from watchdog.cli.main import main
from watchdog.config.load import Config
from watchdog.core.processes import Capture, NodeContext, Problem
from watchdog.evidence.bundle.redact import scrub, short_path
from watchdog.evidence.bundle.upstream import Redaction, render
from watchdog.evidence.bundle.write import BundleHeader, write_bundle
from watchdog.evidence.collect.context import Context
from watchdog.evidence.explain.findings import assess

ROOT = Path(__file__).resolve().parents[2]
METRICS = ROOT / "tests" / "data" / "metrics" / "vllm-0.32.0-tp2-under-load.txt"
TP2 = ROOT / "tests" / "data" / "gpu-tp2" / "run1" / "wedge1" / "state"
ID = "20261201T120000Z-stack-engine0-frozen-ab12"
CREATED = 1796126400.0  # 2026-12-01T12:00:00Z

# Salt: each must never appear in a report.
TOKEN = "sk-LEAKEDtokenABCDEF0123456789"
HF = "hf_LEAKEDhuggingfacetoken0123"
PROMPT = "PROMPT-SECRET-the-launch-codes-are-0000"
BEARER = "LEAKEDbearerVALUE123"
HOSTNAME = "gpu-box-7.example.org"
ADDR = "10.9.8.7"
SALT = (TOKEN, HF, PROMPT, BEARER, HOSTNAME, ADDR, "alice", "/home/", "/root/", "/tmp/", "LEAKED")


def _stopped(cap: Capture, title: str) -> Capture:
    """The recorded capture with one rank in state T (as SIGSTOP leaves it), read with --nonblocking."""
    pid = next(p.id for p in cap.processes if p.title == title)
    rounds = tuple({k: dataclasses.replace(d, facts=dataclasses.replace(d.facts, state="T"), nonblocking=True)
                    if k == pid and d.facts else d for k, d in r.items()} for r in cap.rounds)
    return dataclasses.replace(cap, rounds=rounds)


def _with_locals(cap: Capture, title: str) -> Capture:
    """A dump taken with py-spy --locals: the deciding frame holds a token and a prompt."""
    pid = next(p.id for p in cap.processes if p.title == title)
    rounds = []
    for r in cap.rounds:
        d = r[pid]
        threads = json.loads(d.output)
        for t in threads:
            t["frames"][0]["locals"] = [{"name": "api_key", "addr": 1, "arg": True, "repr": repr(TOKEN)},
                                        {"name": "prompt", "addr": 2, "arg": False, "repr": repr(PROMPT)}]
        rounds.append({**r, pid: dataclasses.replace(d, output=json.dumps(threads))})
    return dataclasses.replace(cap, rounds=tuple(rounds), options={**cap.options, "locals": True})


def _on_node(cap: Capture, title: str, node: str) -> Capture:
    moved = {p.id: dataclasses.replace(p, node=node, title=f"{p.title} on node {node}")
             for p in cap.processes if p.title == title}
    procs = tuple(moved.get(p.id, p) for p in cap.processes)
    rounds = tuple({moved[k].id if k in moved else k: d for k, d in r.items()} for r in cap.rounds)
    return dataclasses.replace(cap, processes=procs, rounds=rounds)


def _events(state: Path, bundle: Path) -> None:
    def t(s: float) -> str:
        from datetime import UTC, datetime
        return datetime.fromtimestamp(CREATED + s, UTC).isoformat().replace("+00:00", "Z")

    eng = {"stack": "stack", "engine": "0"}
    inc = {**eng, "incident": ID, "kind": "frozen"}
    records: list[dict[str, Any]] = [
        {"time": t(-60), "event": "transition", **eng, "from": None, "to": "working", "reason": "running=2"},
        {"time": t(-40), "event": "transition", **eng, "from": "working", "to": "idle", "reason": "no work"},
        {"time": t(-30), "event": "transition", **eng, "from": "idle", "to": "working", "reason": "running=2"},
        {"time": t(-12), "event": "transition", **eng, "from": "working", "to": "suspect",
         "reason": f"no progress for 5s with work pending; probe Authorization: Bearer {BEARER} to {HOSTNAME}"},
        {"time": t(-1), "event": "transition", **eng, "from": "suspect", "to": "frozen",
         "reason": f"stacks confirm; http://{ADDR}:8000/metrics"},
        {"time": t(-5), "event": "transition", "stack": "stack", "engine": "1", "from": "working", "to": "frozen",
         "reason": "ANOTHER-ENGINE"},
        {"time": t(1), "event": "incident_opened", **inc, "reason": "stacks confirm"},
        {"time": t(1), "event": "evidence_captured", **eng, "incident": ID, "bundle": str(bundle),
         "decision": "stuck", "culprit": "Worker_TP1", "error": PROMPT},
        {"time": t(3), "event": "restart_started", **inc, "attempt": 1, "plan": [f"HF_TOKEN={HF} systemctl"]},
        {"time": t(40), "event": "restart_steps", **inc, "ok": True, "seconds": 37.0, "steps": ["x"]},
        {"time": t(70), "event": "recovered", **inc, "downtime": 81.0, "detail": f"{TOKEN} {PROMPT}"},
        {"time": t(70), "event": "resolved", **inc, "how": "recovered", "lasted": 69.0},
        {"time": t(500), "event": "transition", **eng, "from": "working", "to": "suspect", "reason": "LATER"},
    ]
    (state / "events.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records) + "{not json\n")


def salted_bundle(state: Path, fault: str = "livelock") -> Path:
    """A bundle of the recorded capture with Worker_TP1 stopped on node worker1, written by the real writer, with
    secrets in the dumps' locals, the log tail, the metrics page, the reasons, problems and events."""
    cap, page, _ = load(fault)
    cap = _on_node(_with_locals(_stopped(cap, "VLLM::Worker_TP1"), "VLLM::Worker_TP0"), "VLLM::Worker_TP1", "worker1")
    findings = assess(cap, work_pending=True, page=page)
    metrics = METRICS.read_text() + f'# HELP prompt {PROMPT}\nvllm:request_prompt{{text="{PROMPT}"}} 1\n'
    context = Context(metrics, f"HF_TOKEN={HF}\nINFO prompt: {PROMPT}\n", "docker logs --tail", 0, "",
                      {"vllm": "0.32.0", "torch": "2.9.0+cpu", "watchdog": "0.1.0", "py-spy": "0.4.1"},
                      (Problem(f"log file /home/alice/vllm.log: {HOSTNAME} refused"),),
                      {"worker1": NodeContext(True, f"OPENAI_API_KEY={TOKEN}\n", "journalctl -u vllm-worker",
                                              {"vllm": "0.32.0", "torch": "2.9.0+cpu"}, 0,
                                              (Problem(f"unreachable once: ssh: connect to host {ADDR}", "worker1"),))})
    header = BundleHeader(ID, "0", "frozen", f"no progress for 20s (http://{ADDR}:8000)", f"http://{ADDR}:8000",
                          CREATED)
    bundle = write_bundle(state / "incidents", header, cap, findings, context)
    _events(state, Path("/home/alice/state/incidents") / ID)
    return bundle


def show(state: Path, ident: str, capsys: pytest.CaptureFixture[str], *extra: str) -> tuple[int, str, str]:
    config = state / "watchdog.toml"
    config.write_text(f'[engine]\nurl = "http://{HOSTNAME}:8000"\n')
    rc = main(["show", ident, "--upstream", "--state-dir", str(state), "--config", str(config), *extra])
    out = capsys.readouterr()
    return rc, out.out, out.err


def leaked(text: str) -> list[str]:
    return [s for s in SALT if s.lower() in text.lower()]


def test_a_stopped_rank_on_another_node_is_reported_with_its_facts_and_no_secret(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bundle = salted_bundle(tmp_path)
    raw = "".join(p.read_text() for p in bundle.rglob("*") if p.is_file())
    assert TOKEN in raw and PROMPT in raw and HF in raw  # the salt is really in the bundle
    rc, text, err = show(tmp_path, ID[:20], capsys)
    assert rc == 0, err
    assert not leaked(text), leaked(text)
    assert text.startswith("# [Bug]: vLLM 0.32.0 engine frozen (livelock) with TP=2")
    assert says(line_of(text, "- culprit:"), "Worker_TP1", "stopped", "node worker1")
    assert says(line_of(text, "poll-parking"), "CONTRADICTED")
    for name in ("api_server", "EngineCore", "Worker_TP0 (TP 0)", "Worker_TP1 (TP 1) on node worker1"):
        assert f"#### {name}\n" in text, name
    assert says(line_of(text, "#### Worker_TP1"), "node worker1")
    assert says(line_of(text, "head"), "EngineCore", "Worker_TP0") and says(line_of(text, "node worker1:"),
                                                                          "Worker_TP1")
    assert says(line_of(text, "- vLLM:"), "0.32.0") and says(line_of(text, "Python"), "3.11")
    assert says(line_of(text, "page at the capture"), "running=4", "waiting=0", "fast-v1")
    assert says(line_of(text, "engine run as"), "Docker container", "systemd unit")
    assert says(line_of(text, "no progress on the page"), "17 s", "estimated")  # suspect -12 s, +5 s, capture 0
    assert "no local value" in text  # --locals was on; said, and none shown
    # the deciding frames, innermost first, paths cut: the stdlib path, never the interpreter's directory
    assert "asyncio/runners.py:118" in text and "vllm/v1/engine/core.py:1617" in text
    rows = [r for r in text.splitlines() if r.startswith("| ") and "time" not in r and "---" not in r]
    assert [says(r, w) for r, w in zip(rows, ("suspect", "frozen"), strict=False)] == [True, True], rows
    assert any(says(r, "recovered", "81.0") for r in rows) and any(says(r, "restart", "attempt 1") for r in rows)
    assert not any("ANOTHER-ENGINE" in r or "LATER" in r or "idle" in r for r in rows), rows
    assert "Generated by engine-watchdog" in text and says(line_of(text, "Left out"), "locals", "prompts", "<host>")


def test_addresses_are_kept_only_when_asked(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    salted_bundle(tmp_path)
    rc, text, _ = show(tmp_path, ID, capsys, "--keep-addresses")
    assert rc == 0
    assert ADDR in text and HOSTNAME in text
    assert not [s for s in (TOKEN, HF, PROMPT, BEARER, "alice", "/home/") if s in text]  # secrets still out


def test_the_real_two_gpu_bundle_of_an_older_watchdog(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Written by the real `watchdog run` on two H200s (tests/data/gpu-tp2): no nodes, culprit_node or headline in
    its manifest; its state directory has the event log and the page trace."""
    state = tmp_path / "state"
    shutil.copytree(TP2, state)
    manifest = json.loads(next((state / "incidents").glob("*/manifest.json")).read_text())
    assert "nodes" not in manifest and "headline" not in manifest
    rc, text, err = show(state, manifest["id"], capsys)
    assert rc == 0, err
    for fact in ("580.159.04", "3.12", "2 x NVIDIA H200", "TP=2", "CONTRADICTED", "device_wait"):
        assert says(text, fact), fact
    assert says(line_of(text, "GPU 1"), "spinning", "123.71 W") and says(line_of(text, "RAS"), "2758", "2822")
    # the stall from the trace: the last scrape whose counters moved before the bundle, computed here apart
    created = 1796119603.387741
    scrapes = [json.loads(line) for line in (state / "trace.jsonl").read_text().splitlines()
               if '"scrape"' in line]
    walls = [(s["wall"], s["engines"]["0"]["counters"]) for s in scrapes if "engines" in s and s["wall"] <= created]
    moved = max(b[0] for a, b in pairwise(walls) if b[1] != a[1])
    assert says(line_of(text, "no progress on the page"), f"{round(created - moved, 1):g} s", "trace")
    assert 30 < created - moved < 36  # the wedge began 34.7 s before the bundle (the data's README)
    for when, what in (("10:06:14.2", "suspect"), ("10:06:43.2", "frozen"), ("10:06:47.2", "resolved")):
        assert says(line_of(text, when, what), when), (when, what)
    for path in ("/opt/torch", "/work/main", "/tmp/tp2-run", "127.0.0.1", "/usr/local"):
        assert path not in text, path
    assert "torch/cuda/__init__.py:1162" in text  # from site-packages on


def test_an_unknown_incident_is_said_plainly(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, text, err = show(tmp_path, "20991231", capsys)
    assert rc == 2 and text == "" and says(err, "no incident") and "Traceback" not in err


def test_an_unreadable_manifest_falls_back_to_the_dumps(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bundle = salted_bundle(tmp_path)
    (bundle / "manifest.json").write_text("{ truncated")
    rc, text, err = show(tmp_path, str(bundle), capsys)  # given as a path: not listed without a manifest
    assert rc == 1 and says(err, "manifest.json", "not valid JSON") and "Traceback" not in err
    assert says(text, "Partial report", "classified again from the raw dumps")
    assert "#### EngineCore" in text and says(line_of(text, "#### EngineCore"), "EngineCore")
    assert not leaked(text), leaked(text)  # the raw dumps with --locals were read: their values were not kept


@pytest.mark.parametrize("broken", ["no_dumps", "old_keys", "partial", "not_an_object", "empty"])
def test_broken_bundles_say_what_they_can(tmp_path: Path, capsys: pytest.CaptureFixture[str], broken: str) -> None:
    bundle = salted_bundle(tmp_path)
    m = json.loads((bundle / "manifest.json").read_text())
    ident, expect_rc = ID, 1
    if broken == "no_dumps":
        shutil.rmtree(bundle / "dumps")
    elif broken == "old_keys":  # a bundle from before nodes, versions, the hypothesis and per-process details
        for key in ("nodes", "versions", "poll_parking", "capture_complete", "stuck_kind", "culprit_node",
                    "headline", "capture_options", "problems", "gpu"):
            m.pop(key, None)
        m["processes"] = [{"title": p["title"], "class": p["class"], "frames": p["frames"]} for p in m["processes"]]
        (bundle / "manifest.json").write_text(json.dumps(m))
        expect_rc = 0
    elif broken == "partial":
        bundle.rename(bundle.with_name(".partial-" + ID))
    elif broken == "not_an_object":
        (bundle / "manifest.json").write_text("[1, 2]")
    elif broken == "empty":
        shutil.rmtree(bundle / "dumps")
        (bundle / "manifest.json").unlink()
        (bundle / "dumps").mkdir()
        ident = str(bundle)
    rc, text, err = show(tmp_path, ident, capsys)
    assert rc == expect_rc, (rc, err)
    assert "Traceback" not in err and text.startswith("# [Bug]:") and "Generated by engine-watchdog" in text
    assert not leaked(text), leaked(text)
    if broken == "no_dumps":
        assert says(err, "no stack dumps") and says(line_of(text, "- culprit:"), "Worker_TP1", "worker1")
    if broken == "old_keys":
        assert says(line_of(text, "- culprit:"), "Worker_TP1") and "#### Worker_TP1" in text
        assert "records no versions" in text
    if broken == "partial":
        assert says(err, "never completed") and says(text, "Partial report")
    if broken == "not_an_object":
        assert says(err, "not a JSON object") and "#### EngineCore" in text  # from the dumps
    if broken == "empty":
        assert says(err, "no stack dumps") and says(text, "no process stacks")


@pytest.mark.parametrize(("text", "gone", "kept"), [
    ("http://127.0.0.1:8201/metrics: closed", ["127.0.0.1"], ["http://<host>:8201/metrics"]),
    ("ssh: connect to host 10.0.0.2 port 22; [::1]:8000; fe80::1ff:fe23:4567:890a", ["10.0.0.2", "::1", "fe80"],
     ["port 22"]),
    ("https://user:pw@gpu-box.example.org/v1", ["user", "pw", "gpu-box"], ["https://<host>/v1"]),
    ("Worker_TP1 (cuCtxSynchronize_v2 (libcuda.so.580.159.04) < c10::cuda::device_synchronize) at 10:06:14.251",
     [], ["libcuda.so.580.159.04", "c10::cuda::device_synchronize", "10:06:14.251", "VLLM::W"[:0]]),
    ("VLLM::Worker_TP1 in /home/alice/run/serve.py:12", ["alice", "/home"], ["VLLM::Worker_TP1", "serve.py:12"]),
    ("/root/.venv/lib/python3.12/site-packages/vllm/v1/engine/core.py", ["/root"], ["vllm/v1/engine/core.py"]),
    ("HF_TOKEN=hf_abcdefghijklmnopqrstuv and OPENAI_API_KEY='a b'", ["hf_abc", "'a b'"], ["HF_TOKEN=<secret>"]),
    ("--api-key sk-abcdefABCDEF123456 api_key: s3cr3t token=zzz1", ["sk-abc", "s3cr3t", "zzz1"], ["--api-key"]),
    ("Authorization: Bearer abcdefghijkl", ["abcdefghijkl"], ["Authorization"]),
    ("blob 0123456789abcdef0123456789abcdef0123 end", ["0123456789abcdef0123"], ["blob", "end"]),
    ("running=1 waiting=0; TP=2; RAS b3262f7dfd5a3eda; 20261201T100643Z-tp2-engine0-frozen-bb0c", [],
     ["running=1 waiting=0", "b3262f7dfd5a3eda", "20261201T100643Z-tp2-engine0-frozen-bb0c"]),
])
def test_scrub(text: str, gone: list[str], kept: list[str]) -> None:
    out = scrub(text, hosts=("gpu-box.example.org",))
    assert not [g for g in gone if g in out], out
    assert not [k for k in kept if k not in out], out


def test_named_hosts_go_unless_kept() -> None:
    assert scrub("node gpu-box-7 answered", ("gpu-box-7",)) == "node <host> answered"
    assert scrub("node gpu-box-7 answered", ("gpu-box-7",), keep_addresses=True) == "node gpu-box-7 answered"
    assert scrub("gpu-box-70 and my-gpu-box-7", ("gpu-box-7",)) == "gpu-box-70 and my-gpu-box-7"  # whole names only


def test_short_path() -> None:
    assert short_path("/usr/lib/python3.12/concurrent/futures/_base.py") == "concurrent/futures/_base.py"
    assert short_path("/home/bob/venv/lib/python3.11/dist-packages/torch/cuda/__init__.py") == "torch/cuda/__init__.py"
    assert short_path("/home/bob/code/serve.py") == "serve.py" and short_path("serve.py") == "serve.py"


def test_any_key_of_any_wrong_type_still_renders(tmp_path: Path) -> None:
    """A manifest from another version, or edited by hand: every key (top level, a process's, the GPU part's) set to
    each wrong type in turn still gives a report, never an exception."""
    shutil.copytree(TP2, tmp_path / "state")
    bundle = next((tmp_path / "state" / "incidents").iterdir())
    files = read_bundle(bundle, tmp_path / "state", Config())
    assert files.manifest is not None and files.events and files.scrapes
    good = files.manifest
    paths = [(k,) for k in good] + [("processes", 0, k) for k in good["processes"][0]] + [
        ("gpu", k) for k in good["gpu"]] + [("gpu", "readings", 0, k) for k in good["gpu"]["readings"][0]]
    for path in paths:
        for wrong in (None, 7, "x", " ", [1], {"a": 1}, -1.5, True):
            m = json.loads(json.dumps(good))
            where: Any = m
            for step in path[:-1]:
                where = where[step]
            where[path[-1]] = wrong
            text = render(dataclasses.replace(files, manifest=m), Redaction(), "test")
            assert text.startswith("# [Bug]:") and "Generated by engine-watchdog" in text, (path, wrong)
    weird_events = ({"time": "garbage"}, {"time": None, "event": 5}, {"kind": "scrape"},
                    {"event": "transition", "time": "2026-12-01T10:06:40Z", "engine": "0", "to": "frozen",
                     "reason": None})
    scrapes = ({"kind": "scrape", "wall": 1796119603.380, "engines": {"0": {"counters": {"x": "many"}}}},
               {"kind": "scrape", "wall": 1796119603.385, "engines": {"0": {"counters": {"x": 3, "y": None}}}},
               {"kind": "scrape", "wall": "soon", "engines": []})
    text = render(dataclasses.replace(files, events=(*files.events, *weird_events), scrapes=(*files.scrapes, *scrapes)),
                  Redaction(), "test")
    assert text.startswith("# [Bug]:")
