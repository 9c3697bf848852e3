"""The texts of a node's set-up (`watchdog nodes init`), pure: a public key's fingerprint, the known_hosts line (in
the ``[host]:port`` form when the port is not 22), the ``authorized_keys`` line binding the head's key to the agent
as a forced command, the node's ``agent.toml`` with every key, and the head's ``[[nodes]]`` entry.

Nothing here reads a file or runs a command: `watchdog.cli.nodes_init` does (ssh-keygen, ssh-keyscan, the writes).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import re
from dataclasses import dataclass

DEFAULT_AGENT_CONFIG = "/etc/engine-watchdog/agent.toml"
HOST_KEY_TYPES = ("ssh-ed25519", "ecdsa-sha2-nistp256", "ecdsa-sha2-nistp384", "ecdsa-sha2-nistp521", "ssh-rsa",
                  "sk-ssh-ed25519@openssh.com", "sk-ecdsa-sha2-nistp256@openssh.com")
# what may stand in the forced command unquoted (it goes through the user's shell on the node)
_PLAIN_PATH = re.compile(r"^/[A-Za-z0-9_@%+=:,./-]+$")
_FROM = re.compile(r"^[A-Za-z0-9_.:/*?!,-]+$")


@dataclass(frozen=True, slots=True)
class PublicKey:
    kind: str  # ssh-ed25519, ...
    blob: str  # the base64 key
    comment: str = ""

    @property
    def fingerprint(self) -> str:
        """``SHA256:...`` as ssh-keygen -l and ssh print it."""
        digest = hashlib.sha256(base64.b64decode(self.blob)).digest()
        return "SHA256:" + base64.b64encode(digest).decode().rstrip("=")

    def line(self) -> str:
        return f"{self.kind} {self.blob}"


def parse_public_key(text: str) -> PublicKey:
    """A public key line (``ssh-ed25519 AAAA... comment``, as in a ``.pub`` file or ssh-keyscan's output after its
    host field); ValueError saying what is wrong."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
    if len(lines) != 1:
        raise ValueError(f"expected one public key line, found {len(lines)}")
    parts = lines[0].split(None, 2)
    if len(parts) < 2 or parts[0] not in HOST_KEY_TYPES:
        raise ValueError(f"not a public key line (type one of {', '.join(HOST_KEY_TYPES[:2])}...): "
                         f"{lines[0][:80]!r}")
    try:
        raw = base64.b64decode(parts[1], validate=True)
    except (binascii.Error, ValueError):
        raise ValueError("the key's base64 does not decode") from None
    if not raw[4:4 + len(parts[0])] == parts[0].encode():  # the blob names its own type first
        raise ValueError(f"the key's blob is not a {parts[0]} key")
    return PublicKey(parts[0], parts[1], parts[2] if len(parts) > 2 else "")


def normal_fingerprint(fp: str) -> str:
    """``SHA256:abc`` (the prefix optional, base64 padding dropped); ValueError for an MD5 or other form."""
    fp = fp.strip()
    body = fp.removeprefix("SHA256:")
    if not re.fullmatch(r"[A-Za-z0-9+/]{43}=?", body):
        raise ValueError(f"not a SHA256 fingerprint (as `ssh-keygen -lf KEY.pub` prints it: SHA256:...): {fp[:60]!r}")
    return "SHA256:" + body.rstrip("=")


def keyscan_keys(output: str) -> list[PublicKey]:
    """The keys in ssh-keyscan's output (``host type base64`` lines; comments and junk skipped)."""
    keys = []
    for ln in output.splitlines():
        parts = ln.split()
        if len(parts) >= 3 and not ln.startswith("#"):
            try:
                keys.append(parse_public_key(f"{parts[1]} {parts[2]}"))
            except ValueError:
                continue
    return keys


def pick_by_fingerprint(keys: list[PublicKey], fingerprint: str) -> PublicKey:
    """The scanned key with the fingerprint the user confirmed; ValueError (listing what the node offered) when
    none has it: then nothing is written, nothing trusted."""
    want = normal_fingerprint(fingerprint)
    for k in keys:
        if k.fingerprint == want:
            return k
    offered = "; ".join(f"{k.kind} {k.fingerprint}" for k in keys) or "no key at all"
    raise ValueError(f"no host key of the node has the fingerprint {want} (it offered: {offered}): not trusted; "
                     "check the fingerprint on the node itself (ssh-keygen -lf /etc/ssh/ssh_host_ed25519_key.pub)")


def host_pattern(host: str, port: int) -> str:
    """How known_hosts names a host: ``host``, or ``[host]:port`` when the port is not 22 (ssh looks it up so)."""
    return host if port == 22 else f"[{host}]:{port}"


def known_hosts_line(host: str, port: int, key: PublicKey) -> str:
    return f"{host_pattern(host, port)} {key.line()}\n"


def forced_command(agent_python: str, agent_config: str = DEFAULT_AGENT_CONFIG) -> str:
    for what, path in (("the agent's python", agent_python), ("the agent config", agent_config)):
        if not _PLAIN_PATH.match(path):
            raise ValueError(f"{what} must be an absolute path without spaces or quotes, got {path!r}")
    return f"{agent_python} -m watchdog.nodes.agent --config {agent_config}"


def authorized_keys_line(key: PublicKey, agent_python: str, agent_config: str = DEFAULT_AGENT_CONFIG,
                         from_: str = "") -> str:
    """The line for the node's ``authorized_keys``: ``restrict`` (no forwarding, no pty, no agent, no X11, no
    ~/.ssh/rc), the forced command (whatever the head asks, sshd runs the agent), ``from=`` when given."""
    opts = ["restrict"]
    if from_:
        if not _FROM.match(from_):
            raise ValueError(f"--from must be addresses or patterns separated by commas, got {from_!r}")
        opts.append(f'from="{from_}"')
    opts.append(f'command="{forced_command(agent_python, agent_config)}"')
    comment = f" {key.comment}" if key.comment else ""
    return f"{','.join(opts)} {key.line()}{comment}\n"


def toml_str(value: str) -> str:
    """A TOML basic string (JSON's escapes are TOML's)."""
    return json.dumps(value, ensure_ascii=False)


def nodes_entry(name: str, host: str, user: str, port: int, identity_file: str, known_hosts_file: str) -> str:
    """The head's ``[[nodes]]`` entry for a new node, to append to its config."""
    return (f"\n# added by `watchdog nodes init` (docs/two-nodes.md)\n[[nodes]]\nname = {toml_str(name)}\n"
            f"host = {toml_str(host)}\nuser = {toml_str(user)}\nport = {port}\n"
            f"identity_file = {toml_str(identity_file)}\nknown_hosts_file = {toml_str(known_hosts_file)}\n")


# Every key of agent.toml (`watchdog.nodes.agent_config`): the TOML of its default, and what it means. The unit
# tests hold this list to the loader's keys, and docs/two-nodes.md to this list.
AGENT_KEYS: tuple[tuple[str, str, str], ...] = (
    ("process_prefix", '"VLLM::"', "the engine's process titles start with this (VLLM_PROCESS_NAME_PREFIX)"),
    ("title_filter", '""', "several engines on this node: only titles containing this"),
    ("pyspy", '""', "py-spy to use; empty: the one beside this python, else the one on PATH"),
    ("capture_timeout", "10.0", "seconds for one py-spy dump when the head gives none"),
    ("log_file", '""', "the one engine log the head may read here: a file, or"),
    ("journal_unit", '""', "a systemd unit (journalctl -u), or"),
    ("docker_container", '""', "a container (docker logs); at most one of the three"),
    ("pre_start", "[]", "argv the head may run here before the first start (the head's [[nodes]] pre_start: the same)"),
    ("pre_start_timeout", "120.0", "seconds the pre-start hook may run"),
    ("remove_shm", "false", "the head may remove stale psm_*/sem.mp-* segments in shm_dir"),
    ("shm_dir", '"/dev/shm"', "where POSIX shared memory lives"),
    ("audit_log", '"/var/log/engine-watchdog/agent.log"',
     "JSON lines, one record per session event; its directory is created (0750) if missing"),
    ("request_timeout", "10.0", "seconds for the head's request to arrive whole; then refused"),
    ("engine_users", '["root"]', "a titled process is the engine's if owned by one of these users, or"),
    ("engine_units", "[]", "it runs in one of these systemd units (besides those its steps and log name), or"),
    ("engine_containers", "[]", "it runs in one of these Docker containers (besides its steps' and log's), or"),
    ("engine_cgroups", "[]", "its cgroup lies under one of these paths (e.g. \"/kubepods.slice/\")"),
    ("allow_native", "true", "py-spy --native when the head asks (C/C++ frames)"),
    ("allow_locals", "false", "py-spy --locals when the head asks: locals hold prompts and secrets"),
)


def agent_toml(node: str, head: str) -> str:
    """The node's agent.toml: every key at its default, with what it means; the restart steps as a commented
    example (the head's [[restart.steps]] with ``node = "<node>"``, or ``nodes`` naming it, must match one of them
    exactly)."""
    width = max(len(f"{k} = {v}") for k, v, _ in AGENT_KEYS) + 2
    lines = [f"# engine-watchdog agent config for node {node!r} (head: {head}); docs/two-nodes.md explains each key.",
             "# It decides what the head may do on this node; unknown keys are refused with the key named.",
             "# Copy it to /etc/engine-watchdog/agent.toml on the node (owned by root, mode 0644 or stricter).", ""]
    for key, value, what in AGENT_KEYS:
        lines.append(f"{f'{key} = {value}':<{width}}# {what}")
    lines += ["", "# The restart steps the head may run here, as in the head's [[restart.steps]] (without `node`):",
              "# [[steps]]", '# kind = "systemd"            # systemd | docker | command', '# action = "stop"',
              '# units = ["vllm-worker.service"]', "# [[steps]]", '# kind = "systemd"', '# action = "start"',
              '# units = ["vllm-worker.service"]', ""]
    return "\n".join(lines)
