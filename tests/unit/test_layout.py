"""The tree's promises, held: pure modules import nothing that does I/O; modules stay small; one vocabulary.

Pure means data in, verdicts out, time passed in as data: no network, no subprocess, no /proc, no files, no clock.
The check follows every import (top level and inside functions) through the package, so a pure module cannot reach
I/O through another of ours either. Every module is declared here, in PURE (checked) or in DOES_IO: a new module
fails until it is put in one, so none is left unchecked by omission.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "watchdog"

PURE = (
    "watchdog.core.types",
    "watchdog.core.processes",
    "watchdog.core.roles",
    "watchdog.core.ring",
    "watchdog.core.runbooks",
    "watchdog.scrape.page",
    "watchdog.judge.judge",
    "watchdog.judge.track",
    "watchdog.config.act",
    "watchdog.config.gpu",
    "watchdog.config.nodes",
    "watchdog.config.restart_plan",
    "watchdog.config.starter",
    "watchdog.evidence.stacks.frames",
    "watchdog.evidence.stacks.lines",
    "watchdog.evidence.stacks.parse",
    "watchdog.evidence.stacks.text",
    "watchdog.evidence.explain.classes",
    "watchdog.evidence.explain.frame_rules",
    "watchdog.evidence.explain.ranks",
    "watchdog.evidence.explain.findings",
    "watchdog.evidence.explain.engine_scope",
    "watchdog.evidence.explain.headline",
    "watchdog.evidence.explain.ring_layout",
    "watchdog.evidence.explain.ring_said",
    "watchdog.evidence.explain.known_hangs",
    "watchdog.evidence.explain.log_cause",
    "watchdog.evidence.gpu.readings",
    "watchdog.evidence.gpu.culprit",
    "watchdog.evidence.gpu.flight_recorder",
    "watchdog.evidence.gpu.ras_status",
    "watchdog.evidence.collect.deadlines",
    "watchdog.evidence.bundle.per_node",
    "watchdog.evidence.bundle.redact",
    "watchdog.evidence.bundle.timeline",
    "watchdog.evidence.bundle.upstream",
    "watchdog.nodes.protocol",
    "watchdog.nodes.arguments",
    "watchdog.nodes.liveness",
    "watchdog.nodes.enrol",
    "watchdog.nodes.findings",
    "watchdog.act.policy",
    "watchdog.act.blind",
    "watchdog.act.incident_types",
    "watchdog.act.incident_draft",
    "watchdog.act.incident_machine",
    "watchdog.act.incident_sight",
    "watchdog.service.probes",
)
# The modules that do I/O. A package stands for every module under it: host/ and cli/ do I/O throughout.
DOES_IO = (
    "watchdog.__main__",
    "watchdog.host",
    "watchdog.cli",
    "watchdog.act.alert_log",
    "watchdog.act.alert_sinks",
    "watchdog.act.alerts",
    "watchdog.act.heartbeat",
    "watchdog.act.respond",
    "watchdog.act.restart",
    "watchdog.act.shm_sweep",
    "watchdog.act.state",
    "watchdog.config.load",
    "watchdog.evidence.bundle.coordinator",
    "watchdog.evidence.bundle.investigate",
    "watchdog.evidence.bundle.write",
    "watchdog.evidence.collect.capture",
    "watchdog.evidence.collect.context",
    "watchdog.evidence.collect.deadline_read",
    "watchdog.evidence.collect.discover",
    "watchdog.evidence.collect.proxy",
    "watchdog.evidence.collect.ring",
    "watchdog.evidence.gpu.fr_dump",
    "watchdog.evidence.gpu.fr_trigger",
    "watchdog.evidence.gpu.gather",
    "watchdog.evidence.gpu.nccl_ras",
    "watchdog.evidence.gpu.nvml",
    "watchdog.nodes.agent",
    "watchdog.nodes.agent_config",
    "watchdog.nodes.audit",
    "watchdog.nodes.identity",
    "watchdog.nodes.ranks",
    "watchdog.nodes.remote",
    "watchdog.nodes.shm",
    "watchdog.nodes.transport",
    "watchdog.nodes.watch",
    "watchdog.scrape.engine_http",
    "watchdog.scrape.fetch",
    "watchdog.scrape.probe",
    "watchdog.service.compose",
    "watchdog.service.daemon",
    "watchdog.service.events",
    "watchdog.service.exporter",
    "watchdog.service.replay",
    "watchdog.service.sdnotify",
    "watchdog.service.signals",
    "watchdog.service.state_check",
    "watchdog.service.status_file",
    "watchdog.service.trace",
    "watchdog.service.watcher",
)
# Modules (or their parents) that do I/O, keep time or hand out randomness.
IO = ("requests", "urllib3", "urllib.request", "http", "socket", "ssl", "subprocess", "psutil", "pynvml", "systemd",
      "prometheus_client", "os", "io", "shutil", "pathlib", "tempfile", "select", "signal", "threading",
      "multiprocessing", "concurrent", "asyncio", "queue", "time", "random", "secrets", "uuid", "logging", "sqlite3",
      "tomllib", "glob", "fcntl", "mmap", "pickle")


def module_path(name: str) -> Path:
    rel = Path(*name.split(".")[1:])
    return PACKAGE / rel / "__init__.py" if (PACKAGE / rel).is_dir() else PACKAGE / rel.with_suffix(".py")


def imports(name: str) -> set[str]:
    tree = ast.parse(module_path(name).read_text())
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
            out.update(f"{node.module}.{a.name}" for a in node.names
                       if node.module.startswith("watchdog") and module_exists(f"{node.module}.{a.name}"))
    return out


def module_exists(name: str) -> bool:
    return name.startswith("watchdog") and module_path(name).is_file()


def reach(name: str) -> dict[str, str]:
    """Every module reachable from ``name`` through imports, with the package module that imports it."""
    seen: dict[str, str] = {}
    todo = [name]
    while todo:
        here = todo.pop()
        for dep in sorted(imports(here)):
            if dep in seen:
                continue
            seen[dep] = here
            if module_exists(dep):
                todo.append(dep)
    return seen


@pytest.mark.parametrize("name", PURE)
def test_pure_modules_reach_no_io(name: str) -> None:
    bad = {dep: via for dep, via in reach(name).items() if dep.split(".")[0] in IO or dep in IO}
    why = ", ".join(f"{dep} (imported by {via})" for dep, via in sorted(bad.items()))
    assert not bad, f"{name} reaches I/O: {why}"


def test_the_check_sees_io_when_it_is_there() -> None:
    """The checker itself must be able to fail: modules known to do I/O are flagged by the same rule."""
    for name in ("watchdog.scrape.fetch", "watchdog.evidence.collect.capture", "watchdog.service.daemon"):
        assert any(dep.split(".")[0] in IO for dep in reach(name)), name


def all_modules() -> dict[str, Path]:
    out = {}
    for p in PACKAGE.rglob("*.py"):
        rel = p.relative_to(PACKAGE.parent).with_suffix("")
        out[".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)] = p
    return out


def declared(entries: tuple[str, ...], modules: set[str]) -> dict[str, str]:
    """Each module an entry of ``entries`` stands for (itself, or every module under a package), with the entry."""
    return {m: e for e in entries for m in modules if m == e or m.startswith(f"{e}.")}


def test_every_module_is_declared_pure_or_io() -> None:
    """Each module (every file but a package's __init__) is in PURE or DOES_IO, in one only; every entry names one."""
    mods = {name for name, path in all_modules().items() if path.name != "__init__.py"}
    pure, io = declared(PURE, mods), declared(DOES_IO, mods)
    stale = [e for e in (*PURE, *DOES_IO) if e not in all_modules()]
    both = {m: (pure[m], io[m]) for m in pure.keys() & io.keys()}
    undeclared = sorted(mods - pure.keys() - io.keys())
    assert not stale, f"declared but no such module: {stale}"
    assert not both, f"declared pure and I/O: {both}"
    assert not undeclared, f"declared neither pure nor I/O (add each to PURE, or to DOES_IO): {undeclared}"


def test_a_package_entry_stands_for_its_modules() -> None:
    mods = {"p.a", "p.ab", "p.b.c", "p.b.d", "q"}
    assert declared(("p.a", "p.b"), mods) == {"p.a": "p.a", "p.b.c": "p.b", "p.b.d": "p.b"}


def test_every_stage_is_a_subpackage_and_modules_stay_small() -> None:
    stages = {p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").is_file()}
    assert {"scrape", "judge", "evidence", "act", "service", "config"} <= stages
    big = {str(p.relative_to(PACKAGE)): n for p in PACKAGE.rglob("*.py")
           if (n := len(p.read_text().splitlines())) > 350}
    assert not big, f"modules over 350 lines (split them by responsibility): {big}"


def test_one_role_vocabulary() -> None:
    """Process roles are spelled in watchdog/core/roles.py only: no module keeps its own table of role names."""
    spelled = []
    for p in PACKAGE.rglob("*.py"):
        if p.name == "roles.py":
            continue
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.Constant) and node.value in ("engine_core", "sglang_scheduler", "ray_worker"):
                spelled.append(f"{p.relative_to(PACKAGE)}:{node.lineno} {node.value!r}")
    assert not spelled, spelled


def test_the_scripts_run_files_that_exist() -> None:
    """A script that runs `python3 some/file.py` names a file of this tree (the device scripts kept running
    `device/...` after the GPU fixtures moved under tests/)."""
    root = PACKAGE.parent
    missing = []
    for script in sorted((root / "scripts").iterdir()):
        if not script.is_file():
            continue
        for path in re.findall(r"\b(?:python3?|bash) ((?:[\w.-]+/)+[\w.-]+\.(?:py|sh))\b", script.read_text()):
            if not (root / path).is_file():
                missing.append(f"{script.name}: {path}")
    assert not missing, missing
