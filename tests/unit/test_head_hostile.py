"""The head reading what a node or an engine sends, attacked (issue 20's review of the head side):

- a node's answers, played by a fake ``ssh`` (`tests/harness/hostile.py`): nesting past the parser's recursion, pids
  that collide across nodes, titles with newlines and terminal escapes, strings for booleans, versions that are no
  mapping, infinite durations: each a refusal or a cleaned value, never an exception out of the capture or context;
- the liveness stream (finding 6) through the real sshd, with hostile forced commands: 200 KB on stderr does not
  freeze it, a stream that stays open but silent is ended and started again, a report that is no object does not
  end the watch;
- a hostile py-spy JSON (nesting, control characters in frame names);
- Flight Recorder files, whose paths come from the engine's environment: the trigger pipe linked to a file (never
  written), the dump linked to root's file (never read), a FIFO as the dump (no hang), a dump of another owner;
  and a malicious pickle runs nothing;
- NCCL RAS text (5000-digit numbers, unicode digits, quadratic shapes) and /metrics pages.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import pickle
import select
import selectors
import shutil
import subprocess
import sys
import threading
import time
import types
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.harness.hostile import NOBODY, fake_ssh, nobodys_dir, started
from tests.harness.sshnode import SshNode, keygen
from watchdog.cli.nodes import check_node
from watchdog.config.load import Config, load
from watchdog.core.processes import Capture, Dump, EngineProcess, Problem
from watchdog.core.roles import Role
from watchdog.evidence.collect.context import Context
from watchdog.evidence.explain.findings import assess
from watchdog.evidence.gpu.flight_recorder import fr_config
from watchdog.evidence.gpu.fr_dump import DumpError, load_dump
from watchdog.evidence.gpu.fr_trigger import trigger
from watchdog.evidence.gpu.ras_status import parse_ras
from watchdog.evidence.stacks.parse import parse_any
from watchdog.nodes import watch
from watchdog.nodes.findings import LocalFacts
from watchdog.nodes.remote import RemoteEvidence, SshRunner
from watchdog.nodes.transport import NodeError, NodeLink
from watchdog.nodes.watch import LivenessStream, Silent
from watchdog.scrape.page import PageError, read_page

NODE = ('[[nodes]]\nname = "worker1"\nhost = "10.0.0.2"\nidentity_file = "/k"\nknown_hosts_file = "/kh"\n'
        'connect_timeout = 3.0\ncall_timeout = 20.0\nliveness_interval = 0.3\nliveness_stale = 1.5\n')
PROC = {"pid": 7, "role": "worker", "title": "VLLM::Worker_TP1", "ranks": {"TP": 1}, "ppid": 1}
DUMP = {"pid": 7, "t": 1.0, "ok": True, "output": "[]", "error": "", "nonblocking": False, "facts": None,
        "seconds": 0.1, "failure": None, "quiet": None}


@pytest.fixture
def hostile_node(tmp_path: Path) -> Iterator[tuple[Config, Path, NodeLink]]:
    """A config with one node whose ssh is a fake: it answers each verb from answers/<verb>."""
    prog, answers = fake_ssh(tmp_path)
    p = tmp_path / "watchdog.toml"
    p.write_text("[capture]\ngap = 0.1\n" + NODE)
    cfg = load(p)
    link = NodeLink(cfg.nodes[0], control_dir=tmp_path / "ctl", ssh=str(prog))
    yield cfg, answers, link
    link.close()


def stacks_answer(processes: list[object], rounds: list[list[object]]) -> str:
    return json.dumps({"ok": True, "capture": {"processes": processes, "rounds": rounds, "problems": [],
                                               "options": {}}, "time": 1.0, "monotonic": 1.0, "wall": time.time()})


def capture_of(cfg: Config, link: NodeLink) -> Capture:
    remote = RemoteEvidence(cfg, {"worker1": link})
    return remote.capture_with(lambda: Capture((), ({},), ()))


# ---------------------------------------------------------------- a node's answers


def test_an_answer_nested_past_the_parsers_recursion_is_a_problem_not_a_crash(
        hostile_node: tuple[Config, Path, NodeLink]) -> None:
    cfg, answers, link = hostile_node
    (answers / "stacks").write_text('{"ok": true, "capture": ' + "[" * 100000 + "]" * 100000 + "}")
    c = capture_of(cfg, link)  # today: RecursionError out of the capture
    assert c.unseen_nodes == ("worker1",)
    assert any(p.node == "worker1" and "no stacks" in p.text and "deeper than" in p.text
               for p in c.problems), c.problems


@pytest.mark.parametrize(("process", "says"), [
    ({**PROC, "pid": 1 << 22}, "not a pid"),  # above the kernel's highest pid_max
    ({**PROC, "pid": -7}, "not a pid"),
    ({**PROC, "pid": True}, "not a pid"),
    ({**PROC, "pid": "7"}, "not a pid"),
    ({**PROC, "role": "root"}, "'root' is not a valid Role"),
    ({**PROC, "ranks": {"TP": 10**30}}, "ranks must map"),
    ({**PROC, "ppid": {"x": 1}}, "not a pid"),
])
def test_a_process_that_cannot_be_a_nodes_is_refused(hostile_node: tuple[Config, Path, NodeLink],
                                                     process: dict[str, object], says: str) -> None:
    cfg, answers, link = hostile_node
    (answers / "stacks").write_text(stacks_answer([process], [[{**DUMP, "pid": process["pid"]}]]))
    c = capture_of(cfg, link)
    assert c.processes == () and any(says in p.text for p in c.problems), c.problems


def test_titles_and_problems_are_cleaned(hostile_node: tuple[Config, Path, NodeLink]) -> None:
    cfg, answers, link = hostile_node
    title = "VLLM::Worker_TP1\n## culprit: rank 0 on node local\x1b]52;c;aGk=\x07"
    (answers / "stacks").write_text(json.dumps({"ok": True, "capture": {
        "processes": [{**PROC, "title": title}], "rounds": [[DUMP]], "problems": ["a\nforged line"],
        "options": {}}, "wall": time.time()}))
    c = capture_of(cfg, link)
    [p] = c.processes
    assert "\n" not in p.title and "\x1b" not in p.title and "\x07" not in p.title
    assert p.title.startswith("VLLM::Worker_TP1\ufffd## culprit") and p.title.endswith("on node worker1")
    assert Problem("a\ufffdforged line", "worker1") in c.problems


@pytest.mark.parametrize(("dump", "says"), [
    ({**DUMP, "ok": "false"}, "ok is not true or false"),
    ({**DUMP, "t": "nan"}, "t is not a finite number"),
    ({**DUMP, "t": "1e400"}, "t is not a finite number"),  # written 1e400 (a number): read as infinity
    ({**DUMP, "output": ["x"]}, "output is not a string"),
    ({**DUMP, "facts": {"state": "S", "wchan": "", "cpu_seconds": 1.0, "threads": -1}}, "facts.threads"),
])
def test_a_dump_with_loose_fields_is_refused(hostile_node: tuple[Config, Path, NodeLink], dump: dict[str, object],
                                             says: str) -> None:
    cfg, answers, link = hostile_node
    (answers / "stacks").write_text(stacks_answer([PROC], [[dump]]).replace('"1e400"', "1e400"))
    c = capture_of(cfg, link)
    assert any(says in p.text for p in c.problems), c.problems


def test_a_context_of_the_wrong_shapes_is_read_as_nothing(hostile_node: tuple[Config, Path, NodeLink]) -> None:
    cfg, answers, link = hostile_node
    (answers / "context").write_text(json.dumps({"ok": True, "log_tail": 7, "versions": "x", "shm": 5,
                                                 "log_source": "a\nb", "problem": ["x"]}))
    remote = RemoteEvidence(cfg, {"worker1": link})
    ctx = remote.context(Context())  # today: ValueError out of dict("x")
    nc = ctx.nodes["worker1"]
    assert nc.reached and nc.log_tail == "" and nc.versions == {} and nc.log_source == "a\ufffdb"


def test_a_run_answer_with_an_infinite_duration_is_read_safely(hostile_node: tuple[Config, Path, NodeLink]) -> None:
    _, answers, link = hostile_node
    (answers / "run").write_text('{"ok": true, "rc": true, "duration": 1e400, "timed_out": "yes", '
                                 '"output": "done\\n\\u001b[2J", "error": ""}')
    r = SshRunner(link)(["x"], 5)
    assert r.rc is None and r.duration == 0.0 and r.timed_out is False and r.output == "done\n\ufffd[2J"


def test_a_liveness_report_that_is_no_object_does_not_end_the_watch(
        hostile_node: tuple[Config, Path, NodeLink], tmp_path: Path) -> None:
    """The first session sends ``[1]`` (today: an AttributeError that ends the watch's thread for good), the next
    ones good reports."""
    _, answers, link = hostile_node
    count = tmp_path / "sessions"
    (answers / "liveness.py").write_text(
        "import json, sys, time\n"
        f"p = {str(count)!r}\n"
        "n = len(open(p).read()) if __import__('os').path.exists(p) else 0\n"
        "open(p, 'a').write('x')\n"
        "if n == 0:\n    print('[1]', flush=True)\n    time.sleep(30)\n"
        "while True:\n    print(json.dumps({'ok': True, 'ranks': []}), flush=True)\n    time.sleep(0.2)\n")
    stream = LivenessStream(link).start()
    try:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and stream.view().status != "no_ranks":
            time.sleep(0.1)
        assert stream.view().status == "no_ranks", stream.view()
        assert stream._thread.is_alive()
    finally:
        stream.stop()


@pytest.mark.parametrize("how", ["trickle", "stderr"])
def test_a_trickle_that_makes_no_report_is_silence(hostile_node: tuple[Config, Path, NodeLink], tmp_path: Path,
                                                   how: str) -> None:
    """One report, then a byte every 1 ms that never makes a line (or steady stderr): no report for liveness_stale
    (1.5 s), so the stream is ended and started again (before: the select never came back empty, the stream lived
    for ever on a report growing old)."""
    _, answers, link = hostile_node
    count = tmp_path / "sessions"
    # a byte every millisecond on stdout (a few KB: far under MAX_LINE), or three writers keeping stderr full
    then = ("while True:\n    os.write(1, b'x')\n    time.sleep(0.001)\n" if how == "trickle" else
            "os.execv('/bin/sh', ['sh', '-c', 'yes >&2 & yes >&2 & yes >&2 & wait'])\n")
    (answers / "liveness.py").write_text(
        "import json, os, time\n"
        f"open({str(count)!r}, 'a').write('x')\n"
        "print(json.dumps({'ok': True, 'ranks': []}), flush=True)\n" + then)
    stream = LivenessStream(link).start()
    try:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and len(count.read_text() if count.exists() else "") < 2:
            time.sleep(0.1)
        assert len(count.read_text()) >= 2, stream.error
    finally:
        stream.stop()


class _NeverEmpty(selectors.DefaultSelector):
    """A poll that waits until something is readable, however long: a stderr that never runs dry, as a chatty node's
    can (the real poll comes back empty now and then only because a pipe drains for a moment)."""

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        while not (events := super().select(timeout)):
            time.sleep(0.01)
        return events


def test_a_stream_whose_stderr_never_runs_dry_still_goes_silent(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """stderr always readable (`yes` feeding it, every poll with an event), one report on stdout and then nothing:
    the silence is seen all the same (before: it was looked at only when a poll came back empty)."""
    monkeypatch.setattr(watch, "selectors", types.SimpleNamespace(DefaultSelector=_NeverEmpty,
                                                                  EVENT_READ=selectors.EVENT_READ))
    section = load(_write(tmp_path, NODE)).nodes[0]
    stream = LivenessStream(types.SimpleNamespace(node=section))  # type: ignore[arg-type]
    r, w = os.pipe()
    os.write(w, b'{"ok": true, "ranks": []}\n')
    er, ew = os.pipe()
    fcntl.fcntl(ew, 1031, 1 << 20)  # F_SETPIPE_SZ
    yes = subprocess.Popen(["yes"], stdout=ew, start_new_session=True)
    os.close(ew)
    with open(r, "rb", buffering=0) as out, open(er, "rb", buffering=0) as flood:
        proc = types.SimpleNamespace(stdout=out, stderr=flood)
        got: list[object] = []

        def read() -> None:
            try:
                got.extend(stream._lines(proc, bytearray()))  # type: ignore[arg-type]
            except Exception as e:
                got.append(e)

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        reader.join(15)
        stream._stop.set()  # ends the old loop, should it still run
        reader.join(5)
        os.close(w)
        yes.kill()
        yes.wait()
    assert len(got) == 2 and isinstance(got[1], Silent), got


def _write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "silent.toml"
    p.write_text(text)
    return p


def test_watchdog_nodes_reads_a_hostile_version_answer(hostile_node: tuple[Config, Path, NodeLink]) -> None:
    cfg, answers, _ = hostile_node
    (answers / "version").write_text(json.dumps({"ok": True, "time": "abc", "ranks": "VLLM", "version": ["x"],
                                                 "ptrace_allowed": "yes", "ignored": True}))
    # today: ValueError out of float("abc")
    out = check_node(cfg.nodes[0], ssh=str(answers.parent / "ssh"), local=lambda n: LocalFacts())
    assert out["reachable"] and out["ranks"] == [] and out["clock_offset"] is None and out["version"] is None
    assert out["ptrace_allowed"] is False and not out["fine"]


def test_a_long_stderr_does_not_fail_a_call(hostile_node: tuple[Config, Path, NodeLink]) -> None:
    """A node's stderr far past the head's cap (its agent's audit lines: a local user's many titled processes) and
    then its answer: the call is answered, only the tail of stderr kept. An answer past max_bytes is named as such."""
    _, answers, link = hostile_node
    (answers / "list.py").write_text("import json, os\nfor _ in range(50):\n    os.write(2, b'e' * 10000)\n"
                                     "print(json.dumps({'ok': True, 'processes': [], 'ignored': []}))\n")
    assert link.call("list")["processes"] == []
    (answers / "version.py").write_text(f"import os\nos.write(1, b'x' * {link.node.max_bytes + 1})\n")
    with pytest.raises(NodeError) as e:
        link.call("version")
    assert e.value.kind == "too_big" and f"answer (stdout) over {link.node.max_bytes} bytes" in e.value.message


def test_watchdog_nodes_prints_the_nodes_strings_cleaned(hostile_node: tuple[Config, Path, NodeLink]) -> None:
    """``ptrace`` and ``version`` come from the node: no terminal escape or newline of theirs reaches a problem line,
    and their length is capped."""
    cfg, answers, _ = hostile_node
    (answers / "version").write_text(json.dumps({"ok": True, "time": 1.0, "ranks": [], "version": "9\x1b[2J\n" * 50,
                                                 "ptrace_allowed": False, "ptrace": "\x1b]0;owned\x07\nno"}))
    out = check_node(cfg.nodes[0], ssh=str(answers.parent / "ssh"), local=lambda n: LocalFacts())
    assert len(out["problems"]) >= 2, out
    for p in out["problems"]:
        assert not any(ord(c) < 32 or 127 <= ord(c) < 160 for c in p), p
        assert len(p) < 200, p


# ---------------------------------------------------------------- the liveness stream through the real sshd (6)

CHATTY = ("import json, sys, time\n"
          "sys.stderr.write('x' * int(sys.argv[1]) + '\\n')\nsys.stderr.flush()\n"
          "while True:\n    print(json.dumps({'ok': True, 'ranks': []}), flush=True)\n    time.sleep(0.3)\n")
SILENT = ("import json, sys, time\n"
          "open(sys.argv[1], 'a').write('x')\n"
          "print(json.dumps({'ok': True, 'ranks': []}), flush=True)\n"
          "time.sleep(600)\n")


@pytest.fixture(scope="module")
def sshd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SshNode]:
    root = tmp_path_factory.mktemp("sshnode-head")
    with SshNode(root, f'audit_log = "{root}/node/agent.log"\n') as n:
        yield n


def hostile_key(node: SshNode, tmp_path: Path, name: str, script: str, *args: str) -> NodeLink:
    """A key of the node bound to ``script`` as its forced command (the node is hostile); a link with it."""
    pub = keygen(tmp_path / name)
    prog = node.dir / f"{name}.py"
    prog.write_text(script)
    keys = node.dir / "authorized_keys"
    keys.write_text(keys.read_text() + f'command="{sys.executable} {prog} {" ".join(args)}",no-pty {pub}\n')
    return NodeLink(node.section(identity_file=str(tmp_path / name), liveness_interval=0.3, liveness_stale=1.5))


def _keeps_reporting(stream: LivenessStream) -> None:
    """Reports keep arriving (five new ones, 0.3 s apart, within 15 s), well after the flood: not a view's status
    sampled against a 1.5 s staleness, which a loaded machine can miss now and then."""
    time.sleep(4)  # today: the ssh client blocks writing stderr to a pipe nobody reads; no report comes
    seen: set[float] = set()
    deadline = time.monotonic() + 15
    while len(seen) < 5 and time.monotonic() < deadline:
        if stream.received is not None:
            seen.add(stream.received)
        time.sleep(0.1)
    assert len(seen) >= 5, (seen, stream.error)


def test_a_chatty_stderr_does_not_freeze_the_stream(sshd: SshNode, tmp_path: Path) -> None:
    """8 MB: more than sshd's channel window (2 MB) and the pipe hold, so the stall reaches the client."""
    link = hostile_key(sshd, tmp_path, "chatty", CHATTY, str(8 << 20))
    stream = LivenessStream(link).start()
    try:
        _keeps_reporting(stream)
    finally:
        stream.stop()
        link.close()


def test_a_chatty_ssh_does_not_freeze_the_stream(hostile_node: tuple[Config, Path, NodeLink]) -> None:
    """200 KB on the ssh child's own stderr (as the issue saw it)."""
    _, answers, link = hostile_node
    (answers / "liveness.py").write_text(CHATTY.replace("int(sys.argv[1])", "200000"))
    stream = LivenessStream(link).start()
    try:
        _keeps_reporting(stream)
    finally:
        stream.stop()


def test_a_silent_stream_is_ended_and_started_again(sshd: SshNode, tmp_path: Path) -> None:
    count = tmp_path / "sessions"
    link = hostile_key(sshd, tmp_path, "silent", SILENT, str(count))
    stream = LivenessStream(link).start()
    try:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and len(count.read_text() if count.exists() else "") < 3:
            time.sleep(0.2)
        assert len(count.read_text()) >= 3  # today: one session, read from for ever
        v = stream.view()
        assert v.status in ("blind", "no_ranks")
    finally:
        stream.stop()
        link.close()


# ---------------------------------------------------------------- a hostile py-spy JSON


def test_a_hostile_pyspy_json_is_unreadable_not_a_crash() -> None:
    proc = EngineProcess(7, Role.WORKER, "VLLM::Worker_TP1 on node w", {"TP": 1}, node="w")
    deep = Dump(proc.pid, 0.0, True, "[" * 100000 + "]" * 100000)
    f = assess(Capture((proc,), ({proc.id: deep}, {proc.id: deep})), work_pending=True)  # today: RecursionError
    assert f.processes[0].explanation is None
    frames = json.dumps([{"thread_id": 1, "frames": [{"name": "f\n## forged\x1b[2J", "filename": "a.py", "line": 1}]}])
    [stack] = parse_any(frames)
    assert stack.threads[0].frames[0].function == "f\ufffd## forged\ufffd[2J"


# ---------------------------------------------------------------- Flight Recorder files


@pytest.fixture
def engine_dir() -> Iterator[Path]:
    """The engine's own directory (its user's: nobody's), where its recorder's pipe and dumps are."""
    with nobodys_dir("wdt-fr-") as d:
        yield d


@pytest.fixture
def engine() -> Iterator[int]:
    """An engine process of user nobody: the owner its pipe and dumps must have."""
    with started([*NOBODY, "sleep", "300"]) as p:
        time.sleep(0.2)
        yield p.pid


def recorder(pipe: str, then: Callable[[], object]) -> threading.Thread:
    """What torch's monitor thread does: hold the pipe open, read a line, then (here) ``then``."""
    fd = os.open(pipe, os.O_RDONLY | os.O_NONBLOCK)

    def run() -> None:
        try:
            readable, _, _ = select.select([fd], [], [], 20)
            if readable:
                os.read(fd, 16)
                then()
        finally:
            os.close(fd)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def as_nobody(*argv: str) -> Callable[[], object]:
    return lambda: subprocess.run([*NOBODY, *argv], check=False, timeout=10)


def test_the_trigger_pipe_linked_to_a_file_is_never_written(engine_dir: Path, engine: int, tmp_path: Path) -> None:
    victim = tmp_path / "passwd"  # stands for /etc/passwd
    victim.write_text("root:x:0:0:root:/root:/bin/bash\n")
    cfg = fr_config({"TORCH_FR_BUFFER_SIZE": "10", "TORCH_NCCL_DEBUG_INFO_PIPE_FILE": f"{engine_dir}/pipe_",
                     "TORCH_FR_DUMP_TEMP_FILE": f"{engine_dir}/fr_"})
    subprocess.run([*NOBODY, "ln", "-s", str(victim), cfg.pipe_path(0)], check=True, timeout=10)
    res = trigger([engine], {engine: 0}, settle=0.5, configs={engine: cfg})
    assert victim.read_text() == "root:x:0:0:root:/root:/bin/bash\n"  # today: "1\not:x:..."
    assert "symbolic link" in res.ranks[0].error


@pytest.mark.parametrize("what", ["link to root's file", "fifo", "another owner"])
def test_a_dump_that_is_not_the_engines_is_never_read(engine_dir: Path, engine: int, tmp_path: Path,
                                                      what: str) -> None:
    secret = tmp_path / "config.json"  # stands for /root/.docker/config.json: a JSON object, as a dump may be
    secret.write_text('{"auths": {"registry": {"auth": "c2VjcmV0"}}}')
    secret.chmod(0o600)
    cfg = fr_config({"TORCH_FR_BUFFER_SIZE": "10", "TORCH_NCCL_DEBUG_INFO_PIPE_FILE": f"{engine_dir}/pipe_",
                     "TORCH_FR_DUMP_TEMP_FILE": f"{engine_dir}/fr_"})
    subprocess.run([*NOBODY, "mkfifo", cfg.pipe_path(0)], check=True, timeout=10)
    dump = cfg.dump_path(0)
    then = {"link to root's file": as_nobody("ln", "-s", str(secret), dump), "fifo": as_nobody("mkfifo", dump),
            # a root-owned JSON file where the engine (nobody) writes its dumps: not one it could have written
            "another owner": lambda: shutil.copy(secret, dump)}[what]
    t = recorder(cfg.pipe_path(0), then)
    done: list[object] = []
    runner = threading.Thread(target=lambda: done.append(trigger([engine], {engine: 0}, settle=2.0,
                                                                 configs={engine: cfg})), daemon=True)
    runner.start()
    runner.join(15)  # today a FIFO dump hangs the trigger (and the capture) for good
    t.join(15)
    assert done, "the trigger hung"
    [rank] = done[0].ranks  # type: ignore[attr-defined]
    assert rank.data == b"" and "auths" not in rank.error
    assert "refused" in rank.error or "not read" in rank.error, rank.error


class Marker:
    """A pickle that, if loaded, makes a directory: the proof that code ran."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (os.mkdir, (self.path,))


@pytest.mark.parametrize("protocol", range(pickle.HIGHEST_PROTOCOL + 1))
def test_a_malicious_flight_recorder_pickle_runs_nothing(tmp_path: Path, protocol: int) -> None:
    marker = tmp_path / f"ran-{protocol}"
    for payload in ({"entries": [Marker(str(marker))]}, Marker(str(marker))):
        with pytest.raises(DumpError, match="refused"):
            load_dump(pickle.dumps(payload, protocol=protocol))
    text_pickle = f"cos\nsystem\n(S'mkdir {marker}'\ntR.".encode()  # protocol 0 by hand: GLOBAL + REDUCE
    with pytest.raises(DumpError, match="refused"):
        load_dump(text_pickle)
    with pytest.raises(DumpError):
        load_dump(b"\x80\x04P" + b"x" * 8)  # persistent id: no persistent_load, refused
    assert not marker.exists()


# ---------------------------------------------------------------- NCCL RAS text, /metrics pages


@pytest.mark.parametrize("text", [
    "Job summary\n" + " ".join(["9" * 5000] * 5) + "\n",
    "Communicators\n\u00b2 x RUNNING OK\n",
    "Communicators\n7 " + "9" * 5000 + " RUNNING OK\n",
    "Errors\n#0-0 (8a57) MISMATCH\n  Rank 1 has launched up to operation " + "9" * 5000 + "\n",
    "Errors\n#0-0 (8a57) MISMATCH\n" + "  Rank 1 has launched up to operation 5\n" * 30000,
    "Errors\n" + "".join(f"rank {i} missing, counts mismatch\n" for i in range(30000)),
], ids=["5000-digit job", "unicode digit", "5000-digit comm", "5000-digit launched", "long block", "both"])
def test_hostile_ras_text_reads_in_linear_time_without_raising(text: str) -> None:
    t0 = time.monotonic()
    status = parse_ras(text)  # today: ValueError (int() of 5000 digits, of "²"), or minutes (quadratic)
    assert time.monotonic() - t0 < 5
    assert status.verdict()


@pytest.mark.parametrize("page", [
    'vllm:num_requests_running{engine="' + "a" * 2_000_000 + "\n",
    'vllm:num_requests_running{engine="' + "\\" * 2_000_001 + '"} 1\n',
    "vllm:num_requests_running " + "9" * 2_000_000 + "\n",
    "vllm:num_requests_running{" + ",".join(f'l{i}="x"' for i in range(50_000)) + "} 1\n",
    "vllm:num_requests_running{" + "{" * 1_000_000 + "} 1\n",
    'vllm:num_requests_running{engine="\x00\x1b[31m\\n"} 1\n',
], ids=["unclosed label", "backslashes", "huge value", "many labels", "braces", "control characters"])
def test_hostile_metrics_pages_are_read_or_refused_quickly(page: str) -> None:
    t0 = time.monotonic()
    with contextlib.suppress(PageError):
        read_page(page)
    assert time.monotonic() - t0 < 5
