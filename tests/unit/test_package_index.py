"""Every package's docstring is its index: it names each module of the package in backquotes (single or double),
so a newcomer reading a package's ``__init__.py`` finds every file there and what it holds."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "watchdog"
PACKAGES = sorted(p.parent for p in PACKAGE.rglob("__init__.py"))


def unnamed(init: Path) -> list[str]:
    """The modules of ``init``'s package (its files but ``__init__``) that its docstring does not name."""
    doc = ast.get_docstring(ast.parse(init.read_text())) or ""
    named = set(re.findall(r"`+([\w.]+)`+", doc))
    return sorted(p.stem for p in init.parent.glob("*.py") if p.name != "__init__.py" and p.stem not in named)


@pytest.mark.parametrize("package", PACKAGES, ids=lambda p: ".".join(p.relative_to(PACKAGE.parent).parts))
def test_every_module_is_named_in_its_package_docstring(package: Path) -> None:
    missing = unnamed(package / "__init__.py")
    assert not missing, f"{package.relative_to(PACKAGE.parent)}/__init__.py names no {missing}: one line each"


def test_the_check_sees_a_module_left_out(tmp_path: Path) -> None:
    (tmp_path / "__init__.py").write_text('"""Pkg: ``kept`` (this one), `also` (that one); frames and lines."""\n')
    for name in ("kept", "also", "frames", "lines"):
        (tmp_path / f"{name}.py").write_text("")
    assert unnamed(tmp_path / "__init__.py") == ["frames", "lines"]  # a bare word is no name


def test_the_packages_are_all_seen() -> None:
    seen = {".".join(p.relative_to(PACKAGE.parent).parts) for p in PACKAGES}
    assert {"watchdog", "watchdog.host", "watchdog.act", "watchdog.evidence.explain"} <= seen
