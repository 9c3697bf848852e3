"""A release: `python -m build` of a git checkout makes the sdist and the wheel, both carrying the commit, and an
installed wheel's `watchdog --version` names the version (pyproject.toml, the only place it is written) and that
commit. A wheel built from the sdist alone (no git there) keeps it; a tree with neither prints the version alone.

The checkout is cloned first, so the build sees only committed files and the commit is the clone's HEAD, not
`-dirty`. The wheel is installed without its dependencies into a fresh venv that reads the test venv's
site-packages through a .pth file (the dependencies are there): nothing is downloaded.
"""

from __future__ import annotations

import subprocess
import sys
import sysconfig
import tarfile
import tomllib
import zipfile
from pathlib import Path

import pytest

CHECKOUT = Path(__file__).resolve().parents[2]
VERSION = tomllib.loads((CHECKOUT / "pyproject.toml").read_text())["project"]["version"]
COMMIT_FILE = "watchdog/_build_commit.txt"


def _run(argv: list[str], cwd: Path | None = None, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    r = subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=timeout, start_new_session=True,
                       check=False)
    assert r.returncode == 0, f"{argv} exited {r.returncode}:\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}"
    return r


def _build(source: Path, out: Path, *what: str) -> None:
    _run([sys.executable, "-m", "build", "--no-isolation", *what, "--outdir", str(out), str(source)], timeout=600)


def _installed_version(wheel: Path, venv: Path) -> str:
    """`watchdog --version` of `wheel` installed alone into a new venv (dependencies from this interpreter's)."""
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)])
    site = next((venv / "lib").glob("python3*/site-packages"))
    (site / "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    _run([sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), "install", "--quiet", "--no-deps",
          "--no-index", "--disable-pip-version-check", str(wheel)])
    return _run([str(venv / "bin" / "watchdog"), "--version"], cwd=venv).stdout.strip()


@pytest.fixture(scope="module")
def clone(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """A clone of this checkout's HEAD, and that commit."""
    where = tmp_path_factory.mktemp("release") / "src"
    _run(["git", "clone", "--quiet", "--no-hardlinks", str(CHECKOUT), str(where)])
    head = _run(["git", "-C", str(where), "rev-parse", "HEAD"]).stdout.strip()
    return where, head


@pytest.fixture(scope="module")
def dist(clone: tuple[Path, str], tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("dist")
    _build(clone[0], out)
    return out


def test_the_build_makes_an_sdist_and_a_wheel_of_pyprojects_version_with_the_commit(
        dist: Path, clone: tuple[Path, str]) -> None:
    _, head = clone
    [sdist] = dist.glob("*.tar.gz")
    [wheel] = dist.glob("*.whl")
    assert sdist.name == f"engine_watchdog-{VERSION}.tar.gz"
    assert wheel.name == f"engine_watchdog-{VERSION}-py3-none-any.whl"
    top = f"engine_watchdog-{VERSION}"
    with tarfile.open(sdist) as tar:
        names = set(tar.getnames())
        recorded = tar.extractfile(f"{top}/{COMMIT_FILE}")
        assert recorded is not None and recorded.read().decode().strip() == head
    # what the host install runs and puts in place comes with the release (MANIFEST.in)
    for needed in ("scripts/install", "scripts/uninstall", "systemd/engine-watchdog.service",
                   "systemd/config.example.toml", "README.md", "runbooks/README.md", "watchdog/cli/main.py"):
        assert f"{top}/{needed}" in names, f"the sdist lacks {needed}"
    assert not [n for n in names if "__pycache__" in n or n.endswith(".pyc")]
    with zipfile.ZipFile(wheel) as whl:
        assert whl.read(COMMIT_FILE).decode().strip() == head
        metadata = whl.read(f"engine_watchdog-{VERSION}.dist-info/METADATA").decode()
    # systemd-python has no wheel: it is an extra, never a hard requirement (the host install links the distro's)
    requires = [line for line in metadata.splitlines() if line.startswith("Requires-Dist:")]
    assert [r for r in requires if "systemd-python" in r] and all("extra ==" in r for r in requires
                                                                   if "systemd-python" in r)
    assert any(r.startswith("Requires-Dist: py-spy") for r in requires)


def test_the_installed_wheel_says_its_version_and_commit(dist: Path, clone: tuple[Path, str],
                                                         tmp_path: Path) -> None:
    [wheel] = dist.glob("*.whl")
    assert _installed_version(wheel, tmp_path / "venv") == f"engine-watchdog {VERSION} (commit {clone[1]})"


def test_a_wheel_built_from_the_sdist_alone_keeps_the_commit(dist: Path, clone: tuple[Path, str],
                                                              tmp_path: Path) -> None:
    [sdist] = dist.glob("*.tar.gz")
    with tarfile.open(sdist) as tar:
        tar.extractall(tmp_path, filter="data")
    unpacked = tmp_path / f"engine_watchdog-{VERSION}"
    assert not (unpacked / ".git").exists()
    _build(unpacked, tmp_path / "out", "--wheel")
    [wheel] = (tmp_path / "out").glob("*.whl")
    assert _installed_version(wheel, tmp_path / "venv") == f"engine-watchdog {VERSION} (commit {clone[1]})"


def test_a_build_from_neither_git_nor_an_sdist_prints_the_version_alone(clone: tuple[Path, str],
                                                                        tmp_path: Path) -> None:
    plain = tmp_path / "plain"
    _run(["git", "-C", str(clone[0]), "archive", "--format=tar", "-o", str(tmp_path / "a.tar"), "HEAD"])
    plain.mkdir()
    with tarfile.open(tmp_path / "a.tar") as tar:
        tar.extractall(plain, filter="data")
    _build(plain, tmp_path / "out", "--wheel")
    [wheel] = (tmp_path / "out").glob("*.whl")
    with zipfile.ZipFile(wheel) as whl:
        assert COMMIT_FILE not in whl.namelist()
    assert _installed_version(wheel, tmp_path / "venv") == f"engine-watchdog {VERSION}"


def test_a_modified_checkout_is_marked_dirty(clone: tuple[Path, str], tmp_path: Path) -> None:
    source, head = clone
    changed = tmp_path / "changed"
    _run(["git", "clone", "--quiet", "--no-hardlinks", str(source), str(changed)])
    readme = changed / "README.md"
    readme.write_text(readme.read_text() + "\nlocal change\n")
    _build(changed, tmp_path / "out", "--wheel")
    [wheel] = (tmp_path / "out").glob("*.whl")
    with zipfile.ZipFile(wheel) as whl:
        assert whl.read(COMMIT_FILE).decode().strip() == f"{head}-dirty"
