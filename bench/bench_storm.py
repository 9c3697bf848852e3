"""Benchmark: the storm of faults for an hour (the test runs five minutes of it), with its figures.

    .venv/bin/python bench/bench_storm.py [--minutes 60] [--faults 100] [--seed N] [--out bench/results/storm.json]

The same storm as tests/engine/test_storm.py (tests/harness/storm.py): a real vLLM (CPU build, TP=2) under steady
load, the real `watchdog run` with a restart command and a webhook receiver, and faults drawn from the seed (printed;
``--seed`` replays it) until the minutes are up and at least ``--faults`` have run, each bounded and undone, every
check run after each. The figures: faults by kind, the faults' incidents and restarts, alerts received and received
twice (the receiver's view), the watchdog's RSS, open files and threads over its longest life between two kills
(growth: the second half's peak against the first half's), the longest wait between two passes that read the page,
and the state directory's high-water mark. Run as root for the disk-full fault (the state directory on a tmpfs of
its own).
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.harness import models  # noqa: E402
from tests.harness.engine_env import engine_python  # noqa: E402
from tests.harness.storm import FILLER, Storm  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=float, default=60.0)
    ap.add_argument("--faults", type=int, default=100, help="at least this many faults, however long they take")
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "storm.json")
    a = ap.parse_args()
    seed = a.seed if a.seed is not None else random.SystemRandom().randrange(1 << 31)
    py = engine_python()
    model = models.ensure_model(models.FAST, py)
    print(f"storm seed {seed}, {a.minutes:.0f} minutes and at least {a.faults} faults", flush=True)
    started = time.time()
    with tempfile.TemporaryDirectory(prefix="storm-") as tmp, Storm(py, model, Path(tmp), seed) as storm:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        storm.run(a.minutes * 60, min_faults=a.faults, progress=a.out.with_suffix(".partial.json"))
        final = storm.check()
        report = storm.report()
        if report["problems"] or final:  # what the watchdog wrote, kept for the post-mortem (the run's dir goes)
            shutil.copytree(storm.state_dir, a.out.parent / "storm-state", dirs_exist_ok=True,
                            ignore=shutil.ignore_patterns(FILLER))
    report.update({"minutes": a.minutes, "min_faults": a.faults, "wall_s": round(time.time() - started),
                   "final_problems": final})
    a.out.write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps({k: v for k, v in report.items() if k != "runs"}, indent=1))
    return 1 if report["problems"] or final else 0


if __name__ == "__main__":
    sys.exit(main())
