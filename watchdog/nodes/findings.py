"""What is still wrong with a node, each with its fix (`watchdog nodes`), pure: from what was checked on this host
(the key file, the known_hosts entry) and what the node answered (or how the call failed), one `Finding` each.

Codes (the ``code`` of each finding in ``watchdog nodes --json``; docs/two-nodes.md lists them with their fixes):
key_missing, key_unreadable, key_mode, known_hosts_missing, host_key_unknown, host_key_changed, unreachable,
timeout, auth_refused, forced_command, agent_config, refused, agent_failed, audit_log, ptrace, pyspy_missing,
version_mismatch (problems: the node is not usable as it is) and no_engine_ranks, ignored (warnings: the node is
usable, but its engine is not seen there).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

DOC = "docs/two-nodes.md"
PROBLEM, WARNING = "problem", "warning"


@dataclass(frozen=True, slots=True)
class Finding:
    code: str
    severity: str  # problem | warning
    problem: str  # what is wrong, one line
    fix: str  # what to do, one line

    def to_json(self) -> dict[str, str]:
        return asdict(self)

    def line(self) -> str:
        return f"{self.severity}: {self.problem} -- fix: {self.fix}"


@dataclass(frozen=True, slots=True)
class Where:
    """The node's entry, for the fixes' wording."""

    name: str
    host: str
    user: str
    port: int
    identity_file: str
    known_hosts_file: str


@dataclass(frozen=True, slots=True)
class LocalFacts:
    """What this host's files say before any ssh (`watchdog.cli.nodes.local_facts`)."""

    key: str = "ok"  # ok | missing | unreadable | mode
    key_mode: int = 0o600
    known_hosts: str = "ok"  # ok | missing | unknown (no entry for the host, in its [host]:port form if not 22)
    detail: str = ""

    @property
    def blocking(self) -> bool:
        """ssh would fail on these anyway: the call is not tried."""
        return self.key != "ok" or self.known_hosts != "ok"


def _init(w: Where) -> str:
    port = f" --port {w.port}" if w.port != 22 else ""
    user = f" --user {w.user}" if w.user != "root" else ""
    return f"watchdog nodes init {w.name} {w.host}{port}{user} ({DOC})"


def local_findings(w: Where, f: LocalFacts) -> list[Finding]:
    out = []
    if f.key == "missing":
        out.append(Finding("key_missing", PROBLEM, f"the key {w.identity_file} does not exist",
                           f"make it with {_init(w)}, or point identity_file at the key"))
    elif f.key == "unreadable":
        out.append(Finding("key_unreadable", PROBLEM, f"the key {w.identity_file} cannot be read: {f.detail}",
                           "run the watchdog as the user owning the key (root under systemd), or fix its owner"))
    elif f.key == "mode":
        out.append(Finding("key_mode", PROBLEM, f"the key {w.identity_file} is mode {f.key_mode:04o}: ssh ignores "
                           "a private key others can read", f"chmod 600 {w.identity_file}"))
    if f.known_hosts == "missing":
        out.append(Finding("known_hosts_missing", PROBLEM, f"the known_hosts file {w.known_hosts_file} does not "
                           "exist (the node's host key is never learned on first use)",
                           f"{_init(w)} --host-key-file or --host-key-fingerprint"))
    elif f.known_hosts == "unknown":
        pattern = w.host if w.port == 22 else f"[{w.host}]:{w.port}"
        out.append(Finding("host_key_unknown", PROBLEM, f"{w.known_hosts_file} holds no key for {pattern}"
                           + (f" ({f.detail})" if f.detail else ""),
                           f"add the node's host key for {pattern}: {_init(w)} --host-key-file or "
                           "--host-key-fingerprint"))
    return out


def call_findings(w: Where, kind: str, message: str, detail: str = "") -> list[Finding]:
    """The call to the node failed (`watchdog.nodes.transport.NodeError`'s kind and message)."""
    host = f"{w.user}@{w.host}" + (f" port {w.port}" if w.port != 22 else "")
    if kind == "host_key":
        return [Finding("host_key_changed", PROBLEM, f"the node's host key is not the one in {w.known_hosts_file}",
                        "if the node was reinstalled, check its new key on its console (ssh-keygen -lf "
                        "/etc/ssh/ssh_host_ed25519_key.pub) and rerun nodes init with --host-key-fingerprint "
                        "--force; otherwise someone may be in the middle: do not trust it")]
    if kind == "auth":
        return [Finding("auth_refused", PROBLEM, f"sshd on {host} refused our key",
                        f"on the node, add the line of `watchdog nodes init` (beside the key: authorized_keys) to "
                        f"{w.user}'s ~/.ssh/authorized_keys; its sshd_config needs PubkeyAuthentication yes"
                        + (" and PermitRootLogin forced-commands-only" if w.user == "root" else ""))]
    if kind == "unreachable":
        return [Finding("unreachable", PROBLEM, f"cannot reach sshd on {host}: {message}",
                        "check the address and port, that sshd runs there and that a firewall lets the head in")]
    if kind == "timeout":
        return [Finding("timeout", PROBLEM, f"{host} did not answer in time: {message}",
                        "check the node's load and the link; call_timeout in [[nodes]] if the node is just slow")]
    if kind == "refused" and "agent config" in message:
        return [Finding("agent_config", PROBLEM, f"the agent's config on the node: {message}",
                        f"copy the agent.toml `watchdog nodes init` wrote to /etc/engine-watchdog/agent.toml on "
                        f"the node (or the path the forced command names) and fix what the message says ({DOC})")]
    if kind == "refused":
        return [Finding("refused", PROBLEM, f"the agent refused: {message}",
                        "the agent's audit log on the node says why; same watchdog version on both nodes?")]
    if kind == "agent" and "the agent failed" not in message:
        said = f" (the node said: {detail.strip()})" if detail.strip() else ""
        return [Finding("forced_command", PROBLEM, f"the key got in, but what answered is not the agent{said}",
                        "the authorized_keys line must carry the agent's forced command exactly as `watchdog nodes "
                        "init` printed it, with the watchdog installed at that python path on the node")]
    return [Finding("agent_failed", PROBLEM, f"the agent failed: {message}",
                    "the agent's audit log on the node has the reason; report it with that record if it is a bug")]


def answer_findings(v: dict[str, Any], here_version: str) -> list[Finding]:
    """The node answered `version` (values already cleaned by the caller)."""
    out = []
    if v.get("audit_problem"):
        out.append(Finding("audit_log", PROBLEM, f"the agent cannot write its audit log: {v['audit_problem']}",
                           "create the directory of audit_log in agent.toml, writable by the agent's user (root), "
                           "or point audit_log somewhere it can write"))
    if not v.get("ptrace_allowed"):
        out.append(Finding("ptrace", PROBLEM, f"ptrace not allowed there: {v.get('ptrace') or 'no reason given'}",
                           "py-spy needs ptrace: run the agent as root (the key's user), and allow it if Yama "
                           "says no (kernel.yama.ptrace_scope <= 1) or a container drops CAP_SYS_PTRACE"))
    if v.get("version") != here_version:
        out.append(Finding("version_mismatch", PROBLEM, f"watchdog {v.get('version')} there, {here_version} here",
                           "install the same engine-watchdog version on both nodes"))
    if not v.get("pyspy"):
        out.append(Finding("pyspy_missing", PROBLEM, "no py-spy there", "install py-spy into the watchdog's venv "
                           "on the node (pip install py-spy), or set pyspy = \"/path/to/py-spy\" in its agent.toml"))
    ignored = v.get("ignored")
    if isinstance(ignored, int) and not isinstance(ignored, bool) and ignored > 0:
        out.append(Finding("ignored", WARNING, f"{ignored} process(es) with the engine's title not taken for the "
                           f"engine's there (the node takes {v.get('identity')})",
                           "if they are the engine's, name their user, unit or container in the node's agent.toml "
                           "(engine_users, engine_units, engine_containers)"))
    if not v.get("ranks"):
        out.append(Finding("no_engine_ranks", WARNING, "no engine ranks found there",
                           f"start the engine's worker on that node ({DOC}, the worker's vllm command); if it "
                           "runs, check its title prefix (process_prefix) and who owns it (engine_users)"))
    return out
