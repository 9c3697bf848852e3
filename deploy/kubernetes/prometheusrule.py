#!/usr/bin/env python3
"""Prints a PrometheusRule (prometheus-operator, monitoring.coreos.com/v1) whose groups are exactly those of
deploy/prometheus/watchdog-rules.yml, read when it runs: one set of rules, never a second copy to keep in step.

    python3 deploy/kubernetes/prometheusrule.py --runbook-base https://wiki.example.org/runbooks \\
        --label release=kube-prometheus-stack | kubectl apply -f -

``--runbook-base`` takes the place of RUNBOOK_BASE in the rules, as the rules file's own install line does with sed;
``--label`` (repeatable) adds the labels your Prometheus selects rules by. Needs PyYAML only.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import yaml

RULES = Path(__file__).resolve().parents[1] / "prometheus" / "watchdog-rules.yml"
PLACEHOLDER = "RUNBOOK_BASE"


def replaced(value: Any, base: str) -> Any:
    """``value`` with the placeholder replaced by ``base`` in every string it holds."""
    if isinstance(value, str):
        return value.replace(PLACEHOLDER, base)
    if isinstance(value, list):
        return [replaced(v, base) for v in value]
    if isinstance(value, dict):
        return {k: replaced(v, base) for k, v in value.items()}
    return value


def prometheus_rule(rules: Path, name: str, namespace: str, labels: dict[str, str],
                    runbook_base: str) -> dict[str, Any]:
    loaded = yaml.safe_load(rules.read_text())
    if not isinstance(loaded, dict) or not isinstance(loaded.get("groups"), list):
        raise ValueError(f"{rules}: no list of groups")
    groups = replaced(loaded["groups"], runbook_base) if runbook_base else loaded["groups"]
    metadata: dict[str, Any] = {"name": name, "namespace": namespace}
    if labels:
        metadata["labels"] = labels
    return {"apiVersion": "monitoring.coreos.com/v1", "kind": "PrometheusRule", "metadata": metadata,
            "spec": {"groups": groups}}


class _Dumper(yaml.SafeDumper):
    """Multi-line strings (the rules' expressions and descriptions) as literal blocks, as in the rules file."""


def _str(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style="|" if "\n" in value else None)


_Dumper.add_representer(str, _str)


def _label(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    return key, value


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Print deploy/prometheus/watchdog-rules.yml as a PrometheusRule.")
    p.add_argument("--rules", type=Path, default=RULES, help="the rules file (default: the project's)")
    p.add_argument("--name", default="engine-watchdog")
    p.add_argument("--namespace", default="vllm")
    p.add_argument("--label", type=_label, action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--runbook-base", default="", help=f"the runbooks' published address, in place of {PLACEHOLDER}")
    args = p.parse_args(argv)
    try:
        rule = prometheus_rule(args.rules, args.name, args.namespace, dict(args.label), args.runbook_base)
    except (OSError, ValueError, yaml.YAMLError) as e:
        print(f"prometheusrule: {e}", file=sys.stderr)
        return 1
    if not args.runbook_base:
        print(f"prometheusrule: no --runbook-base: the runbook links keep {PLACEHOLDER}", file=sys.stderr)
    sys.stdout.write(yaml.dump(rule, Dumper=_Dumper, sort_keys=False, width=120))
    return 0


if __name__ == "__main__":
    sys.exit(main())
