"""Build hooks (everything else is in pyproject.toml): a build from git records its commit in the package.

`watchdog --version` prints it. Both the wheel and the sdist get ``watchdog/_build_commit.txt``: the commit of the
checkout the build ran in, with ``-dirty`` when tracked files differ from it. A wheel built from that sdist (no git
there) keeps the sdist's file. A build from neither records nothing, and the version is printed alone.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.command.sdist import sdist

HERE = Path(__file__).resolve().parent
COMMIT_FILE = Path("watchdog", "_build_commit.txt")


def _git(*args: str) -> str | None:
    try:
        r = subprocess.run(["git", "-C", str(HERE), *args],  # noqa: S607 (git from PATH, as the build found it)
                           capture_output=True, text=True, timeout=20, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return r.stdout.strip() if r.returncode == 0 else None


def build_commit() -> str | None:
    """This checkout's commit (``-dirty`` if tracked files changed), else what an sdist's file recorded, else None."""
    if (HERE / ".git").exists():
        head = _git("rev-parse", "HEAD")
        if head:
            dirty = _git("status", "--porcelain", "--untracked-files=no")
            return head + ("-dirty" if dirty else "")
    recorded = HERE / COMMIT_FILE
    if recorded.exists():
        return recorded.read_text().strip() or None
    return None


def _write(tree: Path) -> None:
    commit = build_commit()
    if commit:
        (tree / COMMIT_FILE).parent.mkdir(parents=True, exist_ok=True)
        (tree / COMMIT_FILE).write_text(commit + "\n")


class BuildPyWithCommit(build_py):
    def run(self) -> None:
        super().run()
        _write(Path(self.build_lib))


class SdistWithCommit(sdist):
    def make_release_tree(self, base_dir: str, files: list[str]) -> None:
        super().make_release_tree(base_dir, files)
        _write(Path(base_dir))


setup(cmdclass={"build_py": BuildPyWithCommit, "sdist": SdistWithCommit})
