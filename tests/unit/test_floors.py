"""The floor order of the package, held: a module imports only from its own floor or the floors below it.

    core < host < scrape < judge < config < evidence < nodes < act < service < cli

and inside evidence: stacks < explain < gpu < collect < bundle. Every import counts (top level and inside
functions, `typing.TYPE_CHECKING` blocks too): an import that runs back up a floor is how the tree stops showing the
pipeline. The "Layout" section of docs/design.md draws the same order.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "watchdog"

FLOORS = ("core", "host", "scrape", "judge", "config", "evidence", "nodes", "act", "service", "cli")
EVIDENCE = ("stacks", "explain", "gpu", "collect", "bundle")
ROOT = {"__init__": "core", "__main__": "cli"}  # the package's own files: its version, and `python -m watchdog`


def floor_of(module: str) -> tuple[int, int]:
    """(floor, floor inside evidence) of a dotted module name under watchdog."""
    parts = module.split(".")[1:]
    if not parts:
        return FLOORS.index("core"), 0
    top = ROOT.get(parts[0], parts[0])
    inner = EVIDENCE.index(parts[1]) if top == "evidence" and len(parts) > 1 and parts[1] in EVIDENCE else 0
    return FLOORS.index(top), inner


def modules() -> dict[str, Path]:
    out = {}
    for p in PACKAGE.rglob("*.py"):
        rel = p.relative_to(PACKAGE.parent).with_suffix("")
        parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
        out[".".join(parts)] = p
    return out


def imported(path: Path, name: str) -> set[str]:
    """The watchdog modules that ``path`` (module ``name``) imports, relative imports resolved."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.startswith("watchdog"))
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*up, *([base] if base else [])])
            if base.startswith("watchdog"):
                # `from watchdog.evidence import bundle`: the submodule or subpackage named, where there is one
                subs = {f"{base}.{a.name}" for a in node.names if _exists(f"{base}.{a.name}")}
                out.update(subs or {base})
    return {m for m in out if m != "watchdog" or name != "watchdog"}


def _exists(module: str) -> bool:
    rel = Path(*module.split(".")[1:])
    return (PACKAGE / rel).is_dir() or (PACKAGE / rel.with_suffix(".py")).is_file()


def violations() -> list[str]:
    bad = []
    for name, path in sorted(modules().items()):
        mine = floor_of(name)
        for dep in sorted(imported(path, name)):
            if dep == "watchdog":  # `from watchdog import __version__`: the package root is on the bottom floor
                continue
            if floor_of(dep) > mine:
                bad.append(f"{name} imports {dep}")
    return bad


def test_every_folder_has_a_floor() -> None:
    folders = {p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").is_file()}
    assert folders == set(FLOORS), f"folders without a floor, or floors without a folder: {folders ^ set(FLOORS)}"
    inner = {p.name for p in (PACKAGE / "evidence").iterdir() if p.is_dir() and (p / "__init__.py").is_file()}
    assert inner == set(EVIDENCE), inner ^ set(EVIDENCE)
    loose = {p.name for p in PACKAGE.glob("*.py")} - {f"{k}.py" for k in ROOT}
    assert not loose, f"modules outside every floor: {sorted(loose)}"

    assert {p.name for p in (PACKAGE / "evidence").glob("*.py")} == {"__init__.py"}


def test_no_import_runs_back_up_a_floor() -> None:
    bad = violations()
    assert not bad, "imports that run back up a floor:\n" + "\n".join(bad)


def test_the_check_sees_an_import_that_runs_up(tmp_path: Path) -> None:
    """The checker itself can fail: a higher floor is higher, and a planted upward import is found."""
    assert floor_of("watchdog.nodes.agent") > floor_of("watchdog.evidence.bundle.write")
    assert floor_of("watchdog.evidence.bundle.write") > floor_of("watchdog.evidence.stacks.parse")
    assert floor_of("watchdog.core.types") < floor_of("watchdog.host.run")
    assert imported(_planted(tmp_path, "from watchdog import act"), "watchdog.core.types") >= {"watchdog.act"}
    assert "watchdog.evidence.bundle" in imported(_planted(tmp_path, "from watchdog.evidence import bundle"),
                                                  "watchdog.evidence.stacks.parse")
    probe = tmp_path / "types.py"
    probe.write_text((PACKAGE / "core" / "types.py").read_text() + "\nfrom watchdog.act.state import save_status\n")
    assert "watchdog.act.state" in imported(probe, "watchdog.core.types")
    assert floor_of("watchdog.act.state") > floor_of("watchdog.core.types")


def _planted(tmp_path: Path, line: str) -> Path:
    probe = tmp_path / "planted.py"
    probe.write_text(line + "\n")
    return probe
