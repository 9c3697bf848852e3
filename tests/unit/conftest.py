"""The unit tests' `watchdog` verbs read no config file of the host's: a real /etc/engine-watchdog/config.toml (its
restart steps, its nodes) must never reach a test. /dev/null is the built-in defaults; a test that gives --config
or its own ENGINE_WATCHDOG_CONFIG still reads that one. Subprocesses inherit it."""

import os

from watchdog.cli.config import CONFIG_ENV

os.environ[CONFIG_ENV] = os.devnull
