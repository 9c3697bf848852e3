"""The install tests' fixtures (the release's sdists, a recorded /metrics page on loopback) and their place in the run:
after the unit tests, before the engine tests (minutes each: a Debian root, apt and pip from the registries)."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import threading
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

CHECKOUT = Path(__file__).resolve().parents[2]
PAGE = CHECKOUT / "tests" / "data" / "metrics" / "vllm-0.32.0-tp2-under-load.txt"  # running=4: frozen when it stays


def _run(argv: list[str], cwd: Path | None = None, timeout: float = 600) -> str:
    r = subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=timeout, start_new_session=True,
                       check=False)
    assert r.returncode == 0, f"{argv} exited {r.returncode}:\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}"
    return r.stdout


@dataclass(frozen=True)
class Release:
    sdist: Path  # engine_watchdog-<version>.tar.gz
    version: str  # pyproject.toml's
    commit: str  # the commit it was built from, as `watchdog --version` names it


def _build(source: Path, out: Path) -> Release:
    _run([sys.executable, "-m", "build", "--sdist", "--no-isolation", "--outdir", str(out), str(source)])
    [sdist] = out.glob("*.tar.gz")
    version = tomllib.loads((source / "pyproject.toml").read_text())["project"]["version"]
    commit = _run(["git", "-C", str(source), "rev-parse", "HEAD"]).strip()
    return Release(sdist, version, commit)


@pytest.fixture(scope="session")
def clone(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A clone of this checkout's HEAD: the build sees committed files only, and the commit is not -dirty."""
    where = tmp_path_factory.mktemp("install-src") / "src"
    _run(["git", "clone", "--quiet", "--no-hardlinks", str(CHECKOUT), str(where)])
    return where


@pytest.fixture(scope="session")
def release(clone: Path, tmp_path_factory: pytest.TempPathFactory) -> Release:
    return _build(clone, tmp_path_factory.mktemp("install-dist"))


def higher(version: str) -> str:
    """The next patch version: 0.1.0 -> 0.1.1."""
    head, last = re.fullmatch(r"(.*?)(\d+)", version).groups()  # type: ignore[union-attr]
    return f"{head}{int(last) + 1}"


@pytest.fixture(scope="session")
def next_release(clone: Path, release: Release, tmp_path_factory: pytest.TempPathFactory) -> Release:
    """The same tree with a higher version in pyproject.toml, committed (so --version names a new, clean commit)."""
    where = tmp_path_factory.mktemp("install-next") / "src"
    shutil.copytree(clone, where, symlinks=True)
    pyproject = where / "pyproject.toml"
    text = pyproject.read_text()
    bumped = text.replace(f'\nversion = "{release.version}"\n', f'\nversion = "{higher(release.version)}"\n', 1)
    assert bumped != text, "pyproject.toml has no version line to bump"
    pyproject.write_text(bumped)
    _run(["git", "-C", str(where), "-c", "user.name=install test", "-c", "user.email=test@localhost",
          "commit", "--quiet", "-m", "a higher version", "--", "pyproject.toml"])
    return _build(where, tmp_path_factory.mktemp("install-next-dist"))


class _PageHandler(BaseHTTPRequestHandler):
    """The recorded page, the same bytes every time, at /metrics; nothing else (the watchdog reads it whole)."""

    def do_GET(self) -> None:
        body = PAGE.read_bytes() if self.path == "/metrics" else b""
        self.send_response(200 if body else 404)
        self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_POST = do_GET  # a probe: 404 (this page shows work pending: the watchdog does not probe)

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture
def recorded_page() -> Iterator[str]:
    """The base URL of a server on 127.0.0.1 answering a real vLLM's page under load, never changing; a root shares
    the host's network, so the watchdog inside reaches it."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _PageHandler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()
    thread.join(10)
