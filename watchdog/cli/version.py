"""``watchdog --version``: the version (pyproject.toml, via the installed metadata) and the commit it was built from.

A wheel or sdist built from git carries the commit in ``watchdog/_build_commit.txt`` (setup.py writes it). An
editable install of a git checkout has no such file: the checkout's own ``git rev-parse HEAD`` says it (``-dirty``
when tracked files differ). Anything else prints the version alone. Computed only when asked, not at every start.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from collections.abc import Sequence
from importlib import resources
from pathlib import Path
from typing import Any

from watchdog import __version__

COMMIT_FILE = "_build_commit.txt"


def _git(checkout: Path, *args: str) -> str | None:
    try:
        r = subprocess.run(["git", "-C", str(checkout), *args], capture_output=True, text=True, timeout=5.0,  # noqa: S607
                           check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return r.stdout.strip() if r.returncode == 0 else None


def build_commit() -> str | None:
    """The commit this install was built from, or None when nothing records it."""
    try:
        recorded = resources.files("watchdog").joinpath(COMMIT_FILE).read_text().strip()
    except OSError:
        recorded = ""
    if recorded:
        return recorded
    checkout = Path(__file__).resolve().parents[2]
    if not (checkout / ".git").exists():
        return None
    head = _git(checkout, "rev-parse", "HEAD")
    if not head:
        return None
    return head + ("-dirty" if _git(checkout, "status", "--porcelain", "--untracked-files=no") else "")


def version_text() -> str:
    commit = build_commit()
    return f"engine-watchdog {__version__}" + (f" (commit {commit})" if commit else "")


class VersionAction(argparse.Action):
    """argparse's ``version`` action, with the text made only when ``--version`` is given."""

    def __init__(self, option_strings: Sequence[str], dest: str = argparse.SUPPRESS, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS,
                         help="print the version and the commit it was built from, then exit")

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: str | Sequence[Any] | None, option_string: str | None = None) -> None:
        sys.stdout.write(version_text() + "\n")
        parser.exit(0)
