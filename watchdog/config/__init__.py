"""Configuration: typed, validated, immutable, loaded from TOML; secrets from the environment or files.

``load`` (the file, every section, unknown keys refused with their name), ``act``, ``gpu``, ``nodes`` (their
sections, pure), ``restart_plan`` (the restart steps as commands in order, on their nodes; pure), ``starter`` (a
starting config's TOML from what ``watchdog init`` found; pure). Stands on
``core``, ``scrape`` and ``judge`` (their limits and thresholds are plain values config fills in).
"""
