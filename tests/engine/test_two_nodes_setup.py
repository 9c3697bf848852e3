"""docs/two-nodes.md, followed as written: from nothing to a passing `watchdog nodes`, against a real sshd.

The `sh` blocks of the page are parsed and their `head#` / `worker#` lines run in order: the head's in this
namespace (`watchdog` is this venv's ``python -m watchdog``), the worker's inside the node's namespaces (a real
sshd, tests/harness/sshnode.py, started with a host key and nothing else of ours: its authorized_keys emptied, no
agent.toml). The page's paths are mapped into the test's directories (the head's /etc/engine-watchdog, the worker's
/etc/engine-watchdog, /root/.ssh, its host key, /var/log/engine-watchdog), its addresses to the namespace's. A
``# paste`` line gets the previous head line's output on stdin (mapped like the worker's paths); each `watchdog
nodes` line's ``# exit N: what`` is checked: its exit status and the finding it names. The fingerprint step takes
the one the worker printed. The page's vLLM blocks (`bash`) are not run: a process titled `VLLM::Worker_TP1`,
owned by root in the node's namespaces, stands in for the worker's rank there, so the last check passes (exit 0);
before it, "no engine ranks found" is the expected finding (exit 3). The sshd_config lines of the page are the
harness sshd's own. No vLLM: about ten seconds."""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.harness.sshnode import SSHD_CONFIG, SshNode

pytestmark = pytest.mark.engine

DOC = Path(__file__).resolve().parents[2] / "docs" / "two-nodes.md"
FINGERPRINT = re.compile(r"SHA256:[A-Za-z0-9+/]{43}")
EXPECT = re.compile(r"#\s*exit (\d+): (.+)$")


def blocks(text: str, lang: str) -> list[list[str]]:
    return [b.strip("\n").splitlines() for b in re.findall(rf"^```{lang}\n(.*?)^```", text, re.M | re.S)]


def steps(text: str) -> list[tuple[str, str]]:
    """(where, the line after its prompt) of every ``head#`` / ``worker#`` line of the page's sh blocks."""
    out = []
    for block in blocks(text, "sh"):
        for line in block:
            where, _, command = line.partition("# ")
            assert where in ("head", "worker"), f"a sh line without a head#/worker# prompt: {line!r}"
            out.append((where, command))
    return out


@pytest.fixture
def node(tmp_path: Path) -> Iterator[SshNode]:
    with SshNode(tmp_path / "n") as n:
        (n.dir / "authorized_keys").write_text("")  # a fresh worker: only its sshd and host key
        n.agent_config.unlink()
        yield n


def test_the_doc_runs_as_written_from_nothing_to_a_passing_check(node: SshNode, tmp_path: Path) -> None:
    text = DOC.read_text()
    sshd_lines = blocks(text, "text")[0]
    assert sshd_lines and all(line in SSHD_CONFIG.splitlines() for line in sshd_lines), sshd_lines
    head_etc, worker_etc = tmp_path / "head-etc", tmp_path / "worker-etc"
    head_map = {"/etc/engine-watchdog": str(head_etc), "10.0.0.2": node.addr, "10.0.0.1": node.head_addr}
    worker_map = {"/etc/engine-watchdog": str(worker_etc), "/etc/ssh/ssh_host_ed25519_key.pub":
                  str(node.dir / "host_key.pub"), "/root/.ssh": str(node.dir), "/var/log/engine-watchdog":
                  str(worker_etc / "log")}

    def mapped(s: str, table: dict[str, str]) -> str:
        for a, b in table.items():
            s = s.replace(a, b)
        return s

    said: list[str] = []
    stand_ins: list[subprocess.Popen[bytes]] = []
    fingerprint, last_head, checks = "", "", 0
    try:
        for where, command in steps(text):
            expect = EXPECT.search(command)
            if where == "head":
                line = mapped(FINGERPRINT.sub(fingerprint, command) if fingerprint else command, head_map)
                line = re.sub(r"^watchdog ", f"{shlex.quote(sys.executable)} -m watchdog ", line)
                r = subprocess.run(["sh", "-c", line], capture_output=True, text=True, timeout=120, check=False,
                                   start_new_session=True)
                last_head = r.stdout
            else:
                line = mapped(command, worker_map)
                stdin = mapped(last_head, worker_map) if "# paste" in command else ""
                r = subprocess.run([*node.nsenter(), "sh", "-c", line], input=stdin, capture_output=True, text=True,
                                   timeout=60, check=False, start_new_session=True)
                found = FINGERPRINT.search(r.stdout)
                fingerprint = found.group(0) if found else fingerprint
            said.append(f"{where}# {command}\n-> exit {r.returncode}\n{r.stdout}{r.stderr}")
            if not expect:
                assert r.returncode == 0, "\n".join(said)
                continue
            checks += 1
            code, what = int(expect.group(1)), expect.group(2).strip()
            assert r.returncode == code and (f"({what})" in r.stdout or what in r.stdout), "\n".join(said)
            if what == "no_engine_ranks":  # the worker's vLLM comes next in the page: a stand-in plays its rank
                assert "no engine ranks found there" in r.stdout
                stand_ins.append(subprocess.Popen([*node.nsenter(), "bash", "-c",
                                                   "exec -a VLLM::Worker_TP1 sleep 600"], start_new_session=True))
        assert fingerprint, "the worker's fingerprint step printed none"
        assert checks == 5 and stand_ins, "\n".join(said)  # no nodes; key refused; no agent config; no ranks; fine
        final = said[-1]
        assert final.startswith("head# watchdog nodes") and "-> exit 0" in final and "VLLM::Worker_TP1" in final
        assert (worker_etc / "log" / "agent.log").exists()  # the agent.toml as written: its audit log there
    finally:
        for p in stand_ins:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait(10)
