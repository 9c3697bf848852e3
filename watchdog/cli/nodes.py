"""``watchdog nodes [--json]``: is every other node of the stack usable, and if not, what is still wrong, one line
each with its fix (`watchdog.nodes.findings`)? First this host's side (the key file and its mode, the node's entry
in known_hosts), then the node's own answer (`version`: reachable, host key verified, the agent and its config, its
audit log, ptrace, py-spy, the watchdog version there, the engine ranks found).

Exit status: 0 every node usable and its engine ranks seen; 1 a node is not usable (a problem); 3 every node is
usable but no engine ranks were found on one (the engine is not started there, or not taken for the engine's).
``watchdog nodes init NAME HOST`` sets a node up (`watchdog.cli.nodes_init`). The JSON: docs/two-nodes.md."""

from __future__ import annotations

import argparse
import json
import math
import os
import stat
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from watchdog import __version__
from watchdog.cli import nodes_init
from watchdog.cli.config import load_config
from watchdog.cli.progress import Progress
from watchdog.config.load import Config
from watchdog.config.nodes import NodeSection
from watchdog.host.run import run
from watchdog.nodes.enrol import host_pattern
from watchdog.nodes.findings import PROBLEM, Finding, LocalFacts, Where, answer_findings, call_findings, local_findings
from watchdog.nodes.protocol import clean
from watchdog.nodes.transport import NodeError, NodeLink

EXIT_FINE, EXIT_PROBLEM, EXIT_NO_RANKS = 0, 1, 3


def local_facts(node: NodeSection, keygen: str = "ssh-keygen") -> LocalFacts:
    """This host's side of the node's set-up: the private key (there, readable, not readable by others) and the
    node's entry in its known_hosts file (``ssh-keygen -F``: hashed entries and the ``[host]:port`` form too)."""
    key, mode, detail = "ok", 0o600, ""
    try:
        st = os.stat(node.identity_file)
        mode = stat.S_IMODE(st.st_mode)
        with open(node.identity_file, "rb"):
            pass
        if mode & 0o077:
            key = "mode"
    except FileNotFoundError:
        key = "missing"
    except OSError as e:
        key, detail = "unreadable", e.strerror or str(e)
    known = "ok"
    if not os.path.exists(node.known_hosts_file):
        known = "missing"
    else:
        r = run([keygen, "-F", host_pattern(node.host, node.port), "-f", node.known_hosts_file], 10.0)
        if r.rc != 0:
            known = "unknown"
            if node.port != 22 and run([keygen, "-F", node.host, "-f", node.known_hosts_file], 10.0).rc == 0:
                detail = f"it has one for {node.host}, but ssh looks up port {node.port} as [{node.host}]:{node.port}"
            elif r.rc is None or r.rc > 1:
                detail = clean(r.output.strip()[-200:])
    return LocalFacts(key, mode, known, detail)


def check_node(node: NodeSection, ssh: str = "ssh",
               local: Callable[[NodeSection], LocalFacts] = local_facts) -> dict[str, Any]:
    """One node: this host's side (``local``), then the node's answer; the findings and the summary flags."""
    out: dict[str, Any] = {"node": node.name, "host": node.host, "user": node.user, "port": node.port,
                           "reachable": False, "host_key_verified": False, "version": None, "ranks": [],
                           "ptrace_allowed": False, "problems": [], "warnings": [], "findings": []}
    where = Where(node.name, node.host, node.user, node.port, node.identity_file, node.known_hosts_file)
    facts = local(node)
    found: list[Finding] = local_findings(where, facts)
    if not facts.blocking:
        found += _ask(node, ssh, where, out)
    out["findings"] = [f.to_json() for f in found]
    out["problems"] = [f.problem for f in found if f.severity == PROBLEM]
    out["warnings"] = [f.problem for f in found if f.severity != PROBLEM]
    out["fine"] = out["reachable"] and out["host_key_verified"] and out["ptrace_allowed"] and not out["problems"]
    out["engine_ranks_found"] = bool(out["ranks"])
    return out


def _ask(node: NodeSection, ssh: str, where: Where, out: dict[str, Any]) -> list[Finding]:
    link = NodeLink(node, ssh=ssh)
    try:
        v = link.call("version")
    except NodeError as e:
        out["reachable"] = e.kind not in ("unreachable", "timeout")
        out["host_key_verified"] = e.kind not in ("host_key", "unreachable", "timeout")
        return call_findings(where, e.kind, e.message, e.detail)
    finally:
        link.close()
    ranks = v.get("ranks")  # the node's word: shapes checked, strings made printable
    when, version = v.get("time"), v.get("version")
    out.update(reachable=True, host_key_verified=True,
               version=clean(version, 40) if isinstance(version, str) else None,
               ranks=[clean(r, 100) for r in ranks[:64]] if isinstance(ranks, list) else [],
               ptrace_allowed=v.get("ptrace_allowed") is True, ptrace=clean(v.get("ptrace", "")),
               audit_problem=clean(v.get("audit_problem") or "", 300),
               clock_offset=round(when - time.time(), 3) if isinstance(when, int | float) and not isinstance(
                   when, bool) and math.isfinite(when) else None)
    said = {"version": out["version"], "ranks": out["ranks"], "ptrace_allowed": out["ptrace_allowed"],
            "ptrace": out["ptrace"], "pyspy": bool(v.get("pyspy")), "ignored": v.get("ignored"),
            "identity": clean(v.get("identity"), 300), "audit_problem": out["audit_problem"]}
    return answer_findings(said, __version__)


def exit_status(results: list[dict[str, Any]]) -> int:
    if not all(r["fine"] for r in results):
        return EXIT_PROBLEM
    return EXIT_FINE if all(r["engine_ranks_found"] for r in results) else EXIT_NO_RANKS


def cmd_nodes(cfg: Config, args: argparse.Namespace) -> int:
    if not cfg.nodes:
        if args.json:
            print(json.dumps({"config": cfg.source, "nodes": [], "fine": True, "exit": EXIT_FINE}, indent=2))
        else:
            print(f"no other nodes configured in {cfg.source} (no [[nodes]]; `watchdog nodes init NAME HOST` adds one)")
        return EXIT_FINE
    said = Progress("nodes")
    said.say(f"checking {len(cfg.nodes)} node(s) over ssh: {', '.join(n.name for n in cfg.nodes)}")
    done: list[str] = []
    counted = threading.Lock()

    def check(node: NodeSection) -> dict[str, Any]:
        r = check_node(node)
        state = "fine" if r["fine"] else f"{len(r['problems'])} problem(s)"
        with counted:  # the count and its line together: two nodes done at once are "1 of 2", then "2 of 2"
            done.append(node.name)
            said.say(f"{node.name}: {state} ({len(done)} of {len(cfg.nodes)} checked)")
        return r

    with ThreadPoolExecutor(max_workers=len(cfg.nodes)) as pool:
        results = list(pool.map(check, cfg.nodes))
    status = exit_status(results)
    if args.json:
        print(json.dumps({"config": cfg.source, "nodes": results, "fine": status == EXIT_FINE, "exit": status},
                         indent=2))
        return status
    yes = {True: "yes", False: "NO"}
    for r in results:
        state = "fine" if r["fine"] and r["engine_ranks_found"] else "usable, no engine ranks" if r["fine"] \
            else "NOT FINE"
        print(f"{r['node']} ({r['user']}@{r['host']}:{r['port']}): {state}; reachable {yes[r['reachable']]}, host "
              f"key verified {yes[r['host_key_verified']]}, watchdog {r['version'] or '?'}, ptrace allowed "
              f"{yes[r['ptrace_allowed']]}, ranks: {', '.join(r['ranks']) or 'none found'}")
        for f in r["findings"]:
            print(f"  {f['severity']} ({f['code']}): {f['problem']} -- fix: {f['fix']}")
    if status == EXIT_NO_RANKS:
        print(f"exit {EXIT_NO_RANKS}: every node usable, but no engine ranks found on "
              f"{', '.join(r['node'] for r in results if not r['engine_ranks_found'])}")
    return status


def add_commands(sub: Any, common: Any) -> None:
    """``nodes`` needs the config file: with none, it is an error (exit 64), never "no other nodes configured"."""
    n = sub.add_parser("nodes", help="check every other node: what is still wrong, with the fix; `nodes init` sets "
                                     "one up")
    common(n, url=False, as_json=True)
    more = n.add_subparsers(dest="nodes_command")
    nodes_init.add_parser(more)
    n.set_defaults(func=lambda a: nodes_init.cmd_init(a) if a.nodes_command == "init" else cmd_nodes(
        load_config(a.config, needs_file=True), a))
