"""engine-watchdog: notices when a vLLM engine stops producing tokens, and says why.

The package follows the pipeline, one subpackage per stage, in floors (a module imports only its own floor and
those below; tests/unit/test_floors.py holds the order):
core < host < scrape < judge < config < evidence < nodes < act < service < cli. ``__main__`` runs the CLI
(``python -m watchdog``).
"""

from importlib import metadata

DISTRIBUTION = "engine-watchdog"
UNKNOWN_VERSION = "0+unknown"  # imported from a source tree that was never installed: no metadata to read


def _version(distribution: str = DISTRIBUTION) -> str:
    """The version written once, in pyproject.toml, as the installed package metadata says it."""
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return UNKNOWN_VERSION


__version__ = _version()
# Marker that tells this package apart from the unrelated PyPI `watchdog` (filesystem events).
ENGINE_WATCHDOG = True
