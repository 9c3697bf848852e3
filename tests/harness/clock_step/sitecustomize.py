"""A step of the wall clock, for one Python process (the storm's watchdog): loaded when this directory is on
PYTHONPATH and WATCHDOG_TEST_CLOCK names a file; the file holds the seconds the wall clock is off (``3600``: an hour
ahead, as after NTP steps a host whose clock was behind), read again at most every 0.2 s. ``time.time`` and
``time.time_ns`` follow it (every wall time the watchdog reads or writes comes from them); ``time.monotonic`` does
not, as a real step leaves it alone. Inert without WATCHDOG_TEST_CLOCK.

libfaketime (Debian's 0.9.10) would step the whole process, but under it Python 3.11's ``time.sleep`` fails with
EINVAL (its clock_nanosleep wrapper), so the watchdog could not run under it.
"""

import os

if os.environ.get("WATCHDOG_TEST_CLOCK"):
    import time

    _path = os.environ["WATCHDOG_TEST_CLOCK"]
    _real_time, _real_time_ns, _mono = time.time, time.time_ns, time.monotonic
    _cache = [-1.0, 0.0]  # [monotonic time read, offset]

    def _offset() -> float:
        now = _mono()
        if now - _cache[0] >= 0.2:
            try:
                with open(_path, encoding="utf-8") as f:
                    _cache[1] = float(f.read().strip() or 0)
            except (OSError, ValueError):
                _cache[1] = 0.0
            _cache[0] = now
        return _cache[1]

    def _time() -> float:
        return _real_time() + _offset()

    def _time_ns() -> int:
        return _real_time_ns() + int(_offset() * 1e9)

    time.time = _time
    time.time_ns = _time_ns
