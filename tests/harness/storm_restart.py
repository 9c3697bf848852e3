"""The storm's restart command: the real restart script, unless the storm has armed a failure.

    python tests/harness/storm_restart.py FLAG -- RESTART_ARGV...

When FLAG holds ``fail`` the command empties it and exits 3 without touching the engine (one failed restart per
arming, as a restart whose image pull or mount failed); otherwise it runs RESTART_ARGV (bounded) and exits with its
status.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

FAILED = 3


def main(argv: list[str]) -> int:
    if len(argv) < 3 or argv[1] != "--":
        print("usage: storm_restart.py FLAG -- RESTART_ARGV...", file=sys.stderr)
        return 2
    flag = Path(argv[0])
    if flag.exists() and flag.read_text().strip() == "fail":
        flag.write_text("")
        print("restart refused: the storm armed a failed restart", file=sys.stderr, flush=True)
        return FAILED
    return subprocess.run(argv[2:], timeout=150, check=False).returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
