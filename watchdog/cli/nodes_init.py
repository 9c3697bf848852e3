"""``watchdog nodes init NAME HOST [--port P] [--user U] (--host-key-file F | --host-key-fingerprint SHA256:...)``:
set up one other node from the head.

Into ``<config dir>/nodes/<NAME>/`` (0700; with the default config, /etc/engine-watchdog/nodes/NAME/; the config
is ``--config``, else ``$ENGINE_WATCHDOG_CONFIG``, else the default):
``id_ed25519`` (+ ``.pub``), the head's key for that node, ed25519 without a passphrase (the service runs
unattended: `BatchMode`, no ssh-agent), mode 0600, made once and reused; ``known_hosts``, the node's host key in the
``[host]:port`` form when the port is not 22, taken only from a file the operator copied from the node or from what
``ssh-keyscan`` returns when it has the fingerprint the operator read on the node: never trusted on first use;
``authorized_keys``, the line for the node (``restrict`` and the agent as forced command), also printed;
``agent.toml``, the node's agent config with every key, to copy to the node. Then the ``[[nodes]]`` entry is
appended to the config (the rest of its text kept as it was; the result checked by the real loader before it
replaces the file). Nothing is overwritten without ``--force``; bad input changes nothing.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import tempfile
from pathlib import Path
from typing import Any

from watchdog.cli.config import CONFIG_ENV, DEFAULT_CONFIG, config_path
from watchdog.config.load import ConfigError, load
from watchdog.config.nodes import NodeSection, check_nodes
from watchdog.host.run import communicate, run
from watchdog.nodes.enrol import (
    DEFAULT_AGENT_CONFIG,
    PublicKey,
    agent_toml,
    authorized_keys_line,
    keyscan_keys,
    known_hosts_line,
    nodes_entry,
    parse_public_key,
    pick_by_fingerprint,
)

EXIT_USAGE, EXIT_FAILED = 64, 1


class SetupError(Exception):
    """Said to the operator as it is; nothing (more) was written."""


def add_parser(more: Any) -> None:
    i = more.add_parser("init", help="make a node's key pair, known_hosts, authorized_keys line and agent.toml; add "
                                     "its [[nodes]] entry")
    i.add_argument("name", help="how steps, verdicts and bundles name the node (e.g. worker1)")
    i.add_argument("host", help="its address or DNS name, as ssh takes it")
    i.add_argument("--port", type=int, default=22)
    i.add_argument("--user", default="root", help="the user whose authorized_keys holds the key (default root)")
    i.add_argument("--config", default=argparse.SUPPRESS,
                   help=f"the head's config, created if missing, the entry appended (default ${CONFIG_ENV}, "
                        f"else {DEFAULT_CONFIG})")
    how = i.add_mutually_exclusive_group(required=True)
    how.add_argument("--host-key-file", help="the node's public host key, copied from the node by a channel you "
                                             "trust (its /etc/ssh/ssh_host_ed25519_key.pub)")
    how.add_argument("--host-key-fingerprint", help="SHA256:... as the node's console shows it (ssh-keygen -lf "
                                                    "/etc/ssh/ssh_host_ed25519_key.pub); checked against ssh-keyscan")
    i.add_argument("--agent-python", default=sys.executable,
                   help="the python of the watchdog's venv on the node (default: this one's path, the same install "
                        "on both nodes)")
    i.add_argument("--agent-config", default=DEFAULT_AGENT_CONFIG, help="where agent.toml lies on the node")
    i.add_argument("--from", dest="from_", default="", help="from= on the authorized_keys line: the head's address")
    i.add_argument("--force", action="store_true", help="replace a known_hosts or agent.toml written before")


def host_key(args: argparse.Namespace) -> PublicKey:
    if args.host_key_file:
        try:
            return parse_public_key(Path(args.host_key_file).read_text(errors="replace"))
        except OSError as e:
            raise SetupError(f"{args.host_key_file}: {e.strerror or e}") from None
        except ValueError as e:
            raise SetupError(f"{args.host_key_file}: {e}") from None
    r = communicate(["ssh-keyscan", "-p", str(args.port), "-T", "5", "-t", "ed25519,ecdsa,rsa", args.host], 30.0,
                    max_out=256 * 1024)
    keys = keyscan_keys(r.stdout.decode(errors="replace"))
    if not keys:
        raise SetupError(f"ssh-keyscan got no host key from {args.host} port {args.port}: {r.error or 'nothing'}"
                         f" {r.stderr.decode(errors='replace').strip()[-200:]}")
    try:
        return pick_by_fingerprint(keys, args.host_key_fingerprint)
    except ValueError as e:
        raise SetupError(str(e)) from None


def make_key(key: Path, comment: str) -> str:
    """The key pair at ``key`` (made unless it is there): what was done."""
    if key.exists():
        os.chmod(key, 0o600)
        return f"key pair {key} already there: kept"
    r = run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", comment, "-f", str(key)], 60.0)
    if not r.ok:
        raise SetupError(f"ssh-keygen failed: {r.error}: {r.output.strip()[-300:]}")
    os.chmod(key, 0o600)
    return f"key pair made: {key} (ed25519, no passphrase, mode 0600)"


def write_new(path: Path, text: str, force: bool, mode: int = 0o644) -> str:
    """Write ``text`` unless a different file is there and not ``force``: what was done."""
    if path.exists() and path.read_text(errors="replace") == text:
        return f"{path}: already so"
    if path.exists() and not force:
        raise SetupError(f"{path} exists with other content: not overwritten (--force replaces it)")
    _replace(path, text, mode)
    return f"wrote {path}"


def _replace(path: Path, text: str, mode: int) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def add_entry(config: Path, entry: str, name: str) -> str:
    """Append ``entry`` to the config; the whole checked by the real loader first; the file's other text kept."""
    old = config.read_text() if config.exists() else ""
    if old:
        try:
            if any(n.name == name for n in load(str(config)).nodes):
                return f"{config}: has a node {name!r} already: left as it is (edit it by hand to change it)"
        except ConfigError as e:
            raise SetupError(f"{config} does not load as it is, nothing added: {e}") from None
    new = old + ("" if not old or old.endswith("\n") else "\n") + entry
    check = config.parent / f".{config.name}.check.toml"
    try:
        check.write_text(new)
        load(str(check))
    except ConfigError as e:
        raise SetupError(f"the config with the new entry would not load, nothing added: {e}") from None
    finally:
        check.unlink(missing_ok=True)
    _replace(config, new, os.stat(config).st_mode & 0o777 if config.exists() else 0o644)
    return f"added [[nodes]] {name!r} to {config}"


def cmd_init(args: argparse.Namespace) -> int:
    config = Path(config_path(getattr(args, "config", None)).path).absolute()
    if config.exists() and not config.is_file():
        print(f"watchdog nodes init: {config} is not a regular file: nothing written (--config PATH names the "
              "head's config)", file=sys.stderr)
        return EXIT_USAGE
    home = config.parent / "nodes" / args.name
    key = home / "id_ed25519"
    node = NodeSection(name=args.name, host=args.host, user=args.user, port=args.port, identity_file=str(key),
                       known_hosts_file=str(home / "known_hosts"))
    try:
        check_nodes((node,))
    except ValueError as e:
        print(f"watchdog nodes init: {e}", file=sys.stderr)
        return EXIT_USAGE
    try:
        hk = host_key(args)  # before anything is written: an unconfirmed key writes nothing
        print(f"host key of {args.host}: {hk.kind} {hk.fingerprint}"
              + (f" (from {args.host_key_file})" if args.host_key_file else " (ssh-keyscan; the fingerprint you "
                 "gave matches)"))
        home.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(home, 0o700)
        done = [make_key(key, f"engine-watchdog@{socket.gethostname()} for {args.name}")]
        pub = parse_public_key(Path(f"{key}.pub").read_text())
        line = authorized_keys_line(pub, args.agent_python, args.agent_config, args.from_)
        done.append(write_new(home / "known_hosts", known_hosts_line(args.host, args.port, hk), args.force))
        done.append(write_new(home / "authorized_keys", line, True, 0o644))
        done.append(write_new(home / "agent.toml", agent_toml(args.name, socket.gethostname()), args.force))
        done.append(add_entry(config, nodes_entry(args.name, args.host, args.user, args.port, str(key),
                                                  str(home / "known_hosts")), args.name))
    except (SetupError, ValueError) as e:
        print(f"watchdog nodes init: {e}", file=sys.stderr)
        return EXIT_FAILED
    for d in done:
        print(d)
    print(f"\nOn {args.name}, add this line to {args.user}'s ~/.ssh/authorized_keys (also in {home}/authorized_keys):"
          f"\n\n{line}")
    print(f"Copy {home}/agent.toml to {args.agent_config} on {args.name} and adjust it (steps, log, engine_users).")
    print(f"Then check: watchdog nodes --config {config}")
    return 0
