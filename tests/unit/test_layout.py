"""The tree's promises, held: pure modules import nothing that does I/O; modules stay small; one vocabulary.

Pure means data in, verdicts out, time passed in as data: no network, no subprocess, no /proc, no files, no clock.
The check follows every import (top level and inside functions) through the package, so a pure module cannot reach
I/O through another of ours either.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "watchdog"

PURE = (
    "watchdog.core.types",
    "watchdog.judge.judge",
    "watchdog.judge.track",
    "watchdog.scrape.page",
    "watchdog.core.processes",
    "watchdog.core.roles",
    "watchdog.evidence.stacks.parse",
    "watchdog.evidence.explain.ranks",
    "watchdog.evidence.explain.findings",
    "watchdog.evidence.collect.deadlines",
    "watchdog.evidence.gpu.culprit",
    "watchdog.act.policy",
    "watchdog.config.restart_plan",
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
