"""``watchdog nodes [--json]``: is every other node of the stack usable? Per node: reachable, host key verified,
the watchdog version there, the engine ranks found, ptrace allowed. Exit 0 when every node is fine, 1 otherwise."""

from __future__ import annotations

import argparse
import json
import math
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from watchdog import __version__
from watchdog.config.load import Config
from watchdog.config.nodes import NodeSection
from watchdog.nodes.protocol import clean
from watchdog.nodes.transport import NodeError, NodeLink


def check_node(node: NodeSection, ssh: str = "ssh") -> dict[str, Any]:
    out: dict[str, Any] = {"node": node.name, "host": node.host, "reachable": False, "host_key_verified": False,
                           "version": None, "ranks": [], "ptrace_allowed": False, "problems": []}
    link = NodeLink(node, ssh=ssh)
    try:
        v = link.call("version")
        ranks = v.get("ranks")  # the node's word: shapes checked, strings made printable
        when, version = v.get("time"), v.get("version")
        out.update(reachable=True, host_key_verified=True,
                   version=clean(version, 40) if isinstance(version, str) else None,
                   ranks=[clean(r, 100) for r in ranks[:64]] if isinstance(ranks, list) else [],
                   ptrace_allowed=v.get("ptrace_allowed") is True, ptrace=clean(v.get("ptrace", "")),
                   clock_offset=round(when - time.time(), 3) if isinstance(when, int | float) and not isinstance(
                       when, bool) and math.isfinite(when) else None)
        if not out["ptrace_allowed"]:
            out["problems"].append(f"ptrace not allowed there: {out['ptrace']}")
        if v.get("version") != __version__:
            out["problems"].append(f"watchdog {clean(v.get('version'), 40)} there, {__version__} here")
        if not v.get("pyspy"):
            out["problems"].append("no py-spy there")
        ignored = v.get("ignored")
        if not out["ranks"]:
            out["warnings"] = ["no engine ranks found there"]
        if isinstance(ignored, int) and not isinstance(ignored, bool) and ignored > 0:
            out.setdefault("warnings", []).append(
                f"{ignored} process(es) with the engine's title not taken for the engine's there (the node takes "
                f"{clean(v.get('identity'), 300)}: see engine_users/engine_units/engine_containers in its agent "
                "config)")
    except NodeError as e:
        out["reachable"] = e.kind not in ("unreachable", "timeout")
        out["host_key_verified"] = e.kind not in ("host_key", "unreachable", "timeout")
        out["problems"].append(e.message)
    finally:
        link.close()
    out["fine"] = out["reachable"] and out["host_key_verified"] and out["ptrace_allowed"] and not out["problems"]
    return out


def cmd_nodes(cfg: Config, args: argparse.Namespace) -> int:
    if not cfg.nodes:
        print("no other nodes configured ([[nodes]] in the config)")
        return 0
    with ThreadPoolExecutor(max_workers=len(cfg.nodes)) as pool:
        results = list(pool.map(check_node, cfg.nodes))
    if args.json:
        print(json.dumps({"nodes": results, "fine": all(r["fine"] for r in results)}, indent=2))
    else:
        for r in results:
            yes = {True: "yes", False: "NO"}
            print(f"{r['node']} ({r['host']}): {'fine' if r['fine'] else 'NOT FINE'}; reachable "
                  f"{yes[r['reachable']]}, host key verified {yes[r['host_key_verified']]}, watchdog "
                  f"{r['version'] or '?'}, ptrace allowed {yes[r['ptrace_allowed']]}, ranks: "
                  f"{', '.join(r['ranks']) or 'none found'}")
            for p in r["problems"]:
                print(f"  problem: {p}")
            for w in r.get("warnings", []):
                print(f"  warning: {w}")
    return 0 if all(r["fine"] for r in results) else 1


def add_commands(sub: Any, common: Any, config_of: Any) -> None:
    n = sub.add_parser("nodes", help="check every other node: reachable, host key, version, ranks, ptrace")
    common(n, url=False, as_json=True)
    n.set_defaults(func=lambda a: cmd_nodes(config_of(a), a))
