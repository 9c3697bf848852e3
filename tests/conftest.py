"""Fixtures shared by every test directory."""

from tests.receiver import receiver  # noqa: F401  (a fixture: a real HTTP receiver on loopback)
