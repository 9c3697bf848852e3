"""``watchdog replay``: a recorded trace judged again, under the thresholds given (the recording's own or others).

A trace holds observations only, never verdicts, so the transitions here are what those thresholds decide.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from watchdog.core.types import Observation, Transition
from watchdog.judge.judge import Judge
from watchdog.judge.track import Thresholds


def replay(observations: Iterable[Observation], thresholds: Thresholds) -> Iterator[Transition]:
    judge = Judge(thresholds)
    for obs in observations:
        yield from judge.observe(obs)
