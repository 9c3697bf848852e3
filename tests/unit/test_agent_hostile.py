"""The node agent attacked as a hostile head-key holder or a hostile local user of the node would, against the real
agent behind a real sshd (`tests/harness/sshnode.py`: its own network, PID and mount namespaces, keys made here),
or run directly as sshd runs it where no SSH is involved. Each test is one finding of issue 20 (docs/threat-model.md):

1. the allowed log file: a link to a root-only file, a directory on its path swapped for a link, a second hard
   link, a FIFO, /dev/zero, a huge file: never read through, never hung on, never read past its cap;
2. a local user's process with the engine's title is not the engine's (not listed, not py-spied, its end is no
   rank lost); one in the node's unit or container is;
3. deeply nested JSON: one JSON refusal, audit-logged;
4. a request that never comes (or comes half): refused at the deadline, and the session is in the audit log;
5. the audit log: JSON lines, an argument with a newline writes no line of its own, argv logged as a list;
7. loose arguments: strings for booleans, unknown keys, floats for integers, ``lines: 0``, ``docker stop --time
   -1``/``0``, ``--locals`` the node forbids; /dev/shm removals audit-logged.

(6, the head's liveness stream, is in test_head_hostile.py.)
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.harness.hostile import (
    NOBODY,
    NOBODY_UID,
    Cgroup,
    hex_id,
    leaf_pid,
    nobodys_dir,
    records,
    run_agent,
    size,
    started,
    titled,
)
from tests.harness.sshnode import SshNode
from watchdog.cli.nodes import check_node
from watchdog.nodes.transport import NodeError, NodeLink

SECRET = "SECRET-d41d8cd98f00b204"


@pytest.fixture(scope="module")
def logs() -> Iterator[Path]:
    """The engine's log directory, owned by the engine's user (nobody), where nobody can reach it (not under
    pytest's root-only temp directory)."""
    with nobodys_dir("wdt-logs-") as d:
        yield d


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory, logs: Path) -> Iterator[SshNode]:
    root = tmp_path_factory.mktemp("sshnode-hostile")
    marks = root / "marks"
    marks.mkdir()
    secret = root / "secret"  # stands for /etc/shadow: root's, 0600
    secret.write_text(f"root:{SECRET}:19000:0:99999:7:::\n")
    secret.chmod(0o600)
    tag = os.urandom(3).hex()
    toml = (f'audit_log = "{root}/node/agent.log"\nlog_file = "{logs}/engine.log"\nremove_shm = true\n'
            f'request_timeout = 2.0\n'
            f'[[steps]]\nkind = "command"\nargv = ["touch", "{marks}/ran"]\n'
            f'[[steps]]\nkind = "docker"\naction = "stop"\ncontainers = ["wdt-{tag}-none"]\ntimeout = 60\n'
            f'[[steps]]\nkind = "systemd"\naction = "stop"\nunits = ["wdt-{tag}.service"]\n')
    n = SshNode(root, toml)
    n.marks, n.secret, n.tag = marks, secret, tag  # type: ignore[attr-defined]
    with n:
        yield n


@pytest.fixture
def link(node: SshNode) -> Iterator[NodeLink]:
    lk = NodeLink(node.section(call_timeout=10.0))
    yield lk
    lk.close()


@pytest.fixture
def engine_log(logs: Path) -> Iterator[Path]:
    """A fresh, ordinary engine log (the engine's user's) for each test; whatever the test made of it removed."""
    for p in logs.iterdir():
        shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink()
    log = logs / "engine.log"
    subprocess.run([*NOBODY, "sh", "-c", f"printf 'engine line 1\\nengine line 2\\n' > {log}"], check=True,
                   timeout=10)
    yield log


def as_nobody(*argv: str) -> None:
    subprocess.run([*NOBODY, *argv], check=True, timeout=10)


def context(link: NodeLink, log: Path, lines: int = 200) -> dict[str, object]:
    return link.call("context", {"lines": lines, "log": {"log_file": str(log)}})


# ---------------------------------------------------------------- 1. the log file


def test_the_engines_log_is_read(link: NodeLink, engine_log: Path) -> None:
    a = context(link, engine_log)
    assert a["log_tail"] == "engine line 1\nengine line 2\n" and a["problem"] == ""


def test_a_link_to_a_root_only_file_is_not_read(node: SshNode, link: NodeLink, engine_log: Path) -> None:
    """The engine's user replaces its log with a link to /etc/shadow (here: a root-only stand-in)."""
    engine_log.unlink()
    as_nobody("ln", "-s", str(node.secret), str(engine_log))  # type: ignore[attr-defined]
    before = size(node.audit_log)
    a = context(link, engine_log)
    assert SECRET not in json.dumps(a) and a["log_tail"] == ""
    assert "symbolic link" in str(a["problem"])
    [done] = [r for r in records(node.audit_log, before) if r["event"] == "done"]
    assert "symbolic link" in done["log_problem"]


def test_a_directory_swapped_for_a_link_is_not_followed(node: SshNode, link: NodeLink, logs: Path,
                                                        engine_log: Path) -> None:
    """The log's directory is the engine user's (in the sticky /tmp): it moves it away and puts a link of that name
    to a root-only directory holding a file of the log's name."""
    elsewhere = node.root / "elsewhere"
    elsewhere.mkdir(exist_ok=True)
    (elsewhere / "engine.log").write_text(f"{SECRET}\n")
    (elsewhere / "engine.log").chmod(0o600)
    moved = logs.with_name(logs.name + ".old")
    as_nobody("sh", "-c", f"mv {logs} {moved} && ln -s {elsewhere} {logs}")
    try:
        a = context(link, engine_log)
    finally:
        logs.unlink()
        moved.rename(logs)
    assert SECRET not in json.dumps(a) and a["log_tail"] == ""
    assert "symbolic link" in str(a["problem"])


def test_a_second_hard_link_is_not_read(node: SshNode, link: NodeLink, engine_log: Path) -> None:
    """With fs.protected_hardlinks off a user may link a file it cannot read into its own directory."""
    engine_log.unlink()
    os.link(node.secret, engine_log)  # type: ignore[attr-defined]
    try:
        a = context(link, engine_log)
    finally:
        engine_log.unlink()
    assert SECRET not in json.dumps(a) and "hard links" in str(a["problem"])


def test_a_fifo_does_not_hang_the_agent(link: NodeLink, engine_log: Path) -> None:
    engine_log.unlink()
    as_nobody("mkfifo", str(engine_log))
    t0 = time.monotonic()
    a = context(link, engine_log)  # today: open() waits for a writer until the call's 10 s run out
    assert time.monotonic() - t0 < 8
    assert "FIFO" in str(a["problem"]) and a["log_tail"] == ""


def test_dev_zero_and_a_huge_log_are_read_only_to_the_cap(tmp_path: Path, logs: Path) -> None:
    """Run directly (no SSH involved), under a 1 GiB memory limit: /dev/zero linked in place of the log, then a
    4 GiB (sparse) log."""
    cfg = tmp_path / "agent.toml"
    cfg.write_text(f'audit_log = "{tmp_path}/audit.log"\nlog_file = "{logs}/engine.log"\n')
    for p in logs.iterdir():
        p.unlink()
    as_nobody("ln", "-s", "/dev/zero", str(logs / "engine.log"))
    rc, out, err, _ = run_agent(cfg, "context", b'{"lines": 5000}', timeout=60)
    answer = json.loads(out)
    assert rc == 0 and answer["log_tail"] == "" and "symbolic link" in answer["problem"], err[-2000:]
    (logs / "engine.log").unlink()
    with open(logs / "engine.log", "wb") as f:
        f.seek(4 << 30)
        f.write(b"the last line\n")
    rc, out, err, _ = run_agent(cfg, "context", b'{"lines": 5000}', timeout=60)
    answer = json.loads(out)
    assert rc == 0 and answer["log_tail"].endswith("the last line\n"), err[-2000:]
    assert len(answer["log_tail"]) <= 256 * 1024 + 1


# ---------------------------------------------------------------- 2. which processes are the engine's


def test_a_local_users_titled_process_is_not_the_engines(node: SshNode, link: NodeLink) -> None:
    """``exec -a VLLM::Worker_TP1 sleep`` by an unprivileged user: not listed, never py-spied, and its end is no
    rank lost (which would make the head restart the engine)."""
    before = size(node.audit_log)
    with started([*node.nsenter(), *NOBODY, "bash", "-c", "exec -a VLLM::Worker_TP1 sleep 300"]) as fake:
        titled(fake)
        listed = link.call("list")
        assert listed["processes"] == []
        [ignored] = listed["ignored"]
        assert "not the engine's" in ignored["reason"] and f"uid {NOBODY_UID}" in ignored["reason"]
        checked = check_node(node.section())  # `watchdog nodes` says why no rank was found
        assert any("1 process(es) with the engine's title not taken" in w for w in checked["warnings"]), checked
        with pytest.raises(NodeError) as e:
            link.call("stacks", {"pids": [ignored["pid"]], "rounds": 1, "gap": 0})
        assert e.value.kind == "refused" and "not engine processes here" in e.value.message
        stream = link.start("liveness")
        try:
            assert stream.stdin is not None and stream.stdout is not None
            stream.stdin.write(b'{"interval": 0.3}')
            stream.stdin.close()
            assert json.loads(stream.stdout.readline())["ranks"] == []
            os.killpg(fake.pid, 9)
            fake.wait(timeout=10)
            seen = [json.loads(stream.stdout.readline())["ranks"] for _ in range(3)]
            assert seen == [[], [], []]  # no "gone" rank: nothing for the head to restart
        finally:
            os.killpg(stream.pid, 9)
            stream.wait()
    ignored_records = [r for r in records(node.audit_log, before) if r["event"] == "ignored"]
    assert ignored_records and ignored_records[0]["title"] == "VLLM::Worker_TP1"


@pytest.mark.parametrize("where", ["unit", "container"])
def test_a_process_in_the_nodes_unit_or_container_is_the_engines(node: SshNode, link: NodeLink, where: str) -> None:
    """The same unprivileged process, in the cgroup of the unit the node's steps name (as systemd puts a service
    with ``User=``), or of a Docker container the config names by id: taken."""
    cid = hex_id()
    relative = f"system.slice/wdt-{node.tag}.service" if where == "unit" else f"docker/{cid}"  # type: ignore[attr-defined]
    group = Cgroup(relative)
    assert group.usable, "needs a writable cgroup hierarchy below this process's own (as root on the CI machine)"
    original = node.agent_config.read_text()
    if where == "container":
        node.agent_config.write_text(f'engine_containers = ["{cid[:12]}"]\n' + original)
    try:
        with group, started([*node.nsenter(), *NOBODY, "bash", "-c", "exec -a VLLM::Worker_TP1 sleep 300"]) as fake:
            group.add(leaf_pid(fake))
            titled(fake)
            listed = link.call("list")
            assert [p["title"] for p in listed["processes"]] == ["VLLM::Worker_TP1"], listed
            os.killpg(fake.pid, 9)
            fake.wait(timeout=10)
    finally:
        node.agent_config.write_text(original)


def test_many_long_titled_processes_of_a_local_user_do_not_fail_the_calls(node: SshNode, link: NodeLink) -> None:
    """A local user's processes titled ``VLLM::Worker_AAAA...`` (100 000 characters each), forty of them: each is
    one `ignored` record, which also goes to stderr, which sshd hands to the head. The records are few (the first
    16, then one count) and their titles capped, and the head keeps only the tail of a long stderr: `list` and
    `stacks` still answer."""
    many = 40
    script = (f't=$(head -c 100000 /dev/zero | tr "\\0" A); for i in $(seq 1 {many}); do '
              '(exec -a "VLLM::Worker_$t$i" sleep 300) & done; wait')
    before = size(node.audit_log)
    with started([*node.nsenter(), *NOBODY, "bash", "-c", script]) as fake:
        deadline = time.monotonic() + 20
        while True:
            kids = Path(f"/proc/{leaf_pid(fake)}/task/{leaf_pid(fake)}/children").read_text().split()
            titles = 0
            for pid in kids:
                with contextlib.suppress(OSError):
                    titles += Path(f"/proc/{pid}/cmdline").read_bytes().startswith(b"VLLM::")
            if titles == many:
                break
            assert time.monotonic() < deadline, f"{titles} of {many} titled"
            time.sleep(0.05)
        listed = link.call("list")
        assert listed["processes"] == [] and len(listed["ignored"]) == many
        stacks = link.call("stacks", {"rounds": 1, "gap": 0}, timeout=60)
        assert stacks["capture"]["processes"] == []
    got = records(node.audit_log, before)
    ignored = [r for r in got if r["event"] == "ignored"]
    assert 0 < len(ignored) <= 2 * 16  # two sessions, the first 16 of each
    assert all(len(r["title"]) <= 256 for r in ignored)
    assert len([r for r in got if r["event"] == "ignored, more"]) == 2
    assert [r["ignored"] for r in got if r["event"] == "done"] == [many, many]


# ---------------------------------------------------------------- 3, 4. the request itself


def raw_session(link: NodeLink, verb: str, data: bytes, close: bool = True,
                wait: float = 15.0) -> tuple[list[dict[str, object]], float]:
    """A session through sshd with ``data`` as its request (stdin left open when not ``close``): its answer lines,
    read until it closes or ``wait`` seconds pass."""
    t0 = time.monotonic()
    p = link.start(verb)
    try:
        assert p.stdin is not None and p.stdout is not None
        p.stdin.write(data)
        p.stdin.flush()
        if close:
            p.stdin.close()
        out = b""
        deadline = time.monotonic() + wait
        while (left := deadline - time.monotonic()) > 0:
            ready, _, _ = select.select([p.stdout], [], [], left)
            chunk = os.read(p.stdout.fileno(), 65536) if ready else b""
            if not chunk:
                break
            out += chunk
        return [json.loads(x) for x in out.splitlines()], time.monotonic() - t0
    finally:
        os.killpg(p.pid, 9)
        p.wait()


def test_deeply_nested_json_gets_one_refusal(node: SshNode, link: NodeLink) -> None:
    before = size(node.audit_log)
    deep = b'{"pids": ' + b"[" * 1000 + b"]" * 1000 + b"}"  # about 2 KB, far under the size cap
    answers, _ = raw_session(link, "stacks", deep)
    assert len(answers) == 1 and answers[0]["ok"] is False and "deeper than" in str(answers[0]["error"])
    refused = [r for r in records(node.audit_log, before) if r["event"] == "refused"]
    assert len(refused) == 1 and refused[0]["verb"] == "stacks" and "deeper than" in refused[0]["reason"]


@pytest.mark.parametrize("sent", [b"", b'{"pids": [1, '], ids=["nothing", "half"])
def test_a_request_that_never_comes_is_refused_at_the_deadline(node: SshNode, link: NodeLink, sent: bytes) -> None:
    before = size(node.audit_log)
    answers, took = raw_session(link, "list", sent, close=False)
    assert len(answers) == 1 and "no complete request within 2s" in str(answers[0]["error"])
    assert took < 10
    got = records(node.audit_log, before)
    assert [r["event"] for r in got] == ["session", "refused"]
    assert got[0]["command"] == "list" and got[0]["client"] == node.head_addr


# ---------------------------------------------------------------- 5. the audit log


def test_the_audit_log_cannot_be_forged(node: SshNode, link: NodeLink) -> None:
    before = size(node.audit_log)
    forged = '{"time": "2026-01-01T00:00:00Z", "event": "done", "verb": "run", "argv": ["touch", "x"], "rc": 0}'
    for argv in (["touch", f"x\n{forged}"], ["touch " + str(node.marks / "ran")]):  # type: ignore[attr-defined]
        with pytest.raises(NodeError) as e:
            link.call("run", {"argv": argv, "timeout": 5})
        assert e.value.kind == "refused"
    lines = node.audit_log.read_text()[before:].splitlines()
    got = [json.loads(x) for x in lines]  # every line one JSON record
    assert all(r["time"] != "2026-01-01T00:00:00Z" for r in got)
    refused = [r["reason"] for r in got if r["event"] == "refused"]
    assert len(refused) == 2 and "\\n" in refused[0]  # the newline escaped inside the reason
    # one string with a space is not the allowed two-item argv: the record keeps the list
    assert json.dumps(["touch " + str(node.marks / "ran")]) in refused[1]  # type: ignore[attr-defined]
    link.call("run", {"argv": ["touch", str(node.marks / "ran")], "timeout": 5})  # type: ignore[attr-defined]
    ran = [r for r in records(node.audit_log, before) if r["event"] in ("running", "done") and r.get("argv")]
    assert [r["argv"] for r in ran] == [["touch", str(node.marks / "ran")]] * 2  # type: ignore[attr-defined]
    assert ran[1]["rc"] == 0


# ---------------------------------------------------------------- 7. the arguments


@pytest.mark.parametrize(("verb", "args", "says"), [
    ("shm", {"remove": "false"}, "shm: remove must be true or false"),
    ("stacks", {"native": "false"}, "stacks: native must be true or false"),
    ("stacks", {"locals": 1}, "stacks: locals must be true or false"),
    ("stacks", {"rounds": 1.5}, "stacks: rounds must be a whole number"),
    ("stacks", {"rounds": True}, "stacks: rounds must be a whole number"),
    ("context", {"lines": -1}, "context: lines must be a whole number in 0..5000"),
    ("list", {"pids": [1]}, "list: unknown argument 'pids'"),
    ("run", {"argv": ["touch", "x"], "env": {"LD_PRELOAD": "/tmp/x.so"}}, "run: unknown argument 'env'"),
], ids=lambda v: str(v)[:30])
def test_loose_arguments_are_refused_and_logged(node: SshNode, link: NodeLink, verb: str, args: dict[str, object],
                                               says: str) -> None:
    before = size(node.audit_log)
    segment = Path(f"/proc/{node.sshd_pid}/root/dev/shm/psm_wdt{os.urandom(3).hex()}")
    segment.write_bytes(b"x" * 4096)  # stale: nobody has it open
    try:
        with pytest.raises(NodeError) as e:
            link.call(verb, args)
        assert e.value.kind == "refused" and says in e.value.message
        assert segment.exists()  # "false" did not remove
    finally:
        segment.unlink(missing_ok=True)
    [refused] = [r for r in records(node.audit_log, before) if r["event"] == "refused"]
    assert says in refused["reason"] and refused["verb"] == verb


def test_lines_zero_is_no_tail(link: NodeLink, engine_log: Path) -> None:
    a = context(link, engine_log, lines=0)
    assert a["log_tail"] == ""


@pytest.mark.parametrize("time_arg", ["-1", "0", "1.5", "+5", "5 ", "99999999"])
def test_docker_stop_time_outside_the_step_is_refused(node: SshNode, link: NodeLink, time_arg: str) -> None:
    name = f"wdt-{node.tag}-none"  # type: ignore[attr-defined]
    with pytest.raises(NodeError) as e:
        link.call("run", {"argv": ["docker", "stop", "--time", time_arg, name], "timeout": 60})
    assert e.value.kind == "refused" and "not allowed" in e.value.message


def test_the_node_can_forbid_locals_and_native(node: SshNode, link: NodeLink) -> None:
    original = node.agent_config.read_text()
    node.agent_config.write_text("allow_native = false\n" + original)  # allow_locals is off by default
    before = size(node.audit_log)
    try:
        with started([*node.nsenter(), "bash", "-c", "exec -a VLLM::Worker_TP1 sleep 300"]) as engine:
            titled(engine)
            a = link.call("stacks", {"rounds": 1, "gap": 0, "locals": True, "native": True}, timeout=60)
    finally:
        node.agent_config.write_text(original)
    # py-spy really ran, on the engine's process, and without either option (not a pass for finding nothing)
    cap = a["capture"]
    assert [p["title"] for p in cap["processes"]] == ["VLLM::Worker_TP1"], cap
    assert len(cap["rounds"]) == 1 and len(cap["rounds"][0]) == 1, cap
    assert cap["options"]["native"] is False and cap["options"]["locals"] is False, cap["options"]
    assert cap["options"]["native_pids"] == [], cap["options"]
    problems = a["capture"]["problems"]
    assert any("--locals is not allowed by this node's config" in p for p in problems), problems
    assert any("--native is not allowed" in p for p in problems)
    got = records(node.audit_log, before)
    assert {r["option"] for r in got if r["event"] == "option refused"} == {"locals", "native"}
    [done] = [r for r in got if r["event"] == "done"]
    assert done["locals"] is False and done["native"] is False


def test_shm_removals_are_audit_logged(node: SshNode, link: NodeLink) -> None:
    name = f"psm_wdt{os.urandom(3).hex()}"
    Path(f"/proc/{node.sshd_pid}/root/dev/shm/{name}").write_bytes(b"x" * 8192)
    before = size(node.audit_log)
    a = link.call("shm", {"remove": True})
    assert name in a["removed"]
    got = records(node.audit_log, before)
    assert [(r["segment"], r["bytes"]) for r in got if r["event"] == "removed" and r["segment"] == name] == [
        (name, 8192)]
    [done] = [r for r in got if r["event"] == "done"]
    assert name in done["removed"] and done["bytes_removed"] >= 8192
