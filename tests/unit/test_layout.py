"""The tree's promises, held: pure modules import nothing that does I/O; modules stay small; one vocabulary.

Pure means data in, verdicts out, time passed in as data: no network, no subprocess, no /proc, no files, no clock.
The check follows every import (top level and inside functions) through the package, so a pure module cannot reach
I/O through another of ours either. PURE is every module a docstring calls pure (its own, or its floor's
__init__ naming it): a module that says so and is not checked fails, so the list and the prose cannot drift apart.
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


_WORD = re.compile(r"(?<!not )\bpure\b", re.IGNORECASE)
_NAME = re.compile(r"`+([A-Za-z_][\w.]*)`+")


def clauses(doc: str) -> list[str]:
    """A docstring cut where a claim ends: sentence ends, ``;``, list items, and ``), `` between named items;
    never inside parentheses, so ``(`x`, pure)`` and ``(...; pure)`` stay with the name before them."""
    out, depth, start = [], 0, 0
    for i, ch in enumerate(doc):
        depth += (ch == "(") - (ch == ")")
        nxt = doc[i + 1:i + 2]
        end = depth == 0 and ((ch in ".;" and nxt in (" ", "\n", "")) or (ch == "\n" and nxt == "-")
                              or (ch == ")" and nxt == ","))
        if end:
            out.append(doc[start:i + 1])
            start = i + 1
    return [*out, doc[start:]]


def claims_in(doc: str, name: str, package: str, modules: set[str]) -> set[str]:
    """The modules a docstring calls pure: in each clause with the word, the modules named before it, else those
    named after it ("Pure: ``policy``"), else the module ``name`` itself. Names resolve as written or inside
    ``package``; words in backquotes that are no module (a class, a key) do not count."""

    def resolve(word: str) -> str | None:
        return next((full for full in (word, f"{package}.{word}") if full in modules), None)

    out: set[str] = set()
    for clause in clauses(doc):
        for m in _WORD.finditer(clause):
            before = [r for w in _NAME.findall(clause[:m.start()]) if (r := resolve(w))]
            after = [r for w in _NAME.findall(clause[m.end():]) if (r := resolve(w))]
            out.update(before or after or [name])
    return out


def purity_claims() -> dict[str, str]:
    """Every module some docstring calls pure, with the module that says so. A claim that lands on a package (an
    __init__'s own words, or a named subpackage) is a summary and is not read: each module speaks for itself."""
    mods = all_modules()
    out: dict[str, str] = {}
    for name, path in sorted(mods.items()):
        doc = ast.get_docstring(ast.parse(path.read_text())) or ""
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for claimed in claims_in(doc, name, package, set(mods)):
            if mods[claimed].name != "__init__.py":
                out.setdefault(claimed, name)
    return out


def test_every_module_called_pure_is_checked() -> None:
    """A module whose docstring (or its floor's) says it is pure is in PURE, so the list cannot drift from the prose."""
    missing = {claimed: f"said in {by}" for claimed, by in purity_claims().items() if claimed not in PURE}
    assert not missing, f"called pure but not in PURE (add them, or correct the docstring): {missing}"


@pytest.mark.parametrize(("doc", "claimed"), [
    ("The [x] section. Pure.", {"p.m"}),
    ("Act, pure: the commands from ``[[restart.steps]]``; nothing here runs them (`p.b` does).", {"p.m"}),
    ("Pure: text in, a ``Status`` out.", {"p.m"}),  # a class named after the word: still the module's own claim
    ("Reads files; not pure.", set()),
    ("Pure: ``a`` (budget, backoff). I/O: ``b`` (files).", {"p.a"}),
    ("What goes over it (`a`, pure), rank liveness (`b` pure, `c`, `d`), the shm (`e`).", {"p.a", "p.b"}),
    ("``load`` (the file, every key), ``a``, ``b`` (their sections, pure), ``c`` (the plan; pure).",
     {"p.a", "p.b", "p.c"}),
    ("The plan comes from `p.a` (pure; its docstring has the rules).", {"p.a"}),
])
def test_purity_claims_are_read_as_written(doc: str, claimed: set[str]) -> None:
    assert claims_in(doc, "p.m", "p", {"p", "p.m", "p.a", "p.b", "p.c", "p.d", "p.e", "p.load"}) == claimed


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
