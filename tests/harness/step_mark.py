"""A restart step for the node scenarios (`cluster.py`): it marks where and when it ran, so a test can tell the
order and overlap of the steps on many nodes, and it fails where the test asked it to.

    python step_mark.py DIR VERB [URL]

Appends ``<begin> <end> <verb> <where>`` to DIR/steps.log, ``where`` being this node's address on its link
(10.231.x.2; ``head`` where there is none), after holding for HOLD seconds (so steps run at once overlap). Exit 1
when DIR/fail-<where> exists. With URL (the head's start), POSTs URL/_control/restart first (the fake engine's
new incarnation).
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

HOLD = 2.0


def where() -> str:
    out = subprocess.run(["ip", "-o", "-4", "addr", "show"], capture_output=True, text=True, timeout=10,
                         check=False).stdout
    found = re.findall(r"inet (10\.231\.\d+\.2)/", out)
    return found[0] if found else "head"


def main() -> int:
    folder, verb = Path(sys.argv[1]), sys.argv[2]
    me, begin = where(), time.time()
    if len(sys.argv) > 3:
        urllib.request.urlopen(urllib.request.Request(f"{sys.argv[3]}/_control/restart", data=b"", method="POST"),
                               timeout=10).read()
    time.sleep(HOLD)
    with open(folder / "steps.log", "a") as log:
        log.write(f"{begin:.3f} {time.time():.3f} {verb} {me}\n")
    return 1 if (folder / f"fail-{me}").exists() else 0


if __name__ == "__main__":
    sys.exit(main())
