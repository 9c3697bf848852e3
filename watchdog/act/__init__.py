"""Act: incidents, alerts, restarts and the proof that the engine is back.

Pure: ``policy`` (budget, backoff, the choice). I/O: ``respond`` (the incident lifecycle, persisted in ``state``),
``restart`` (runs the plan, each command on its node), ``recovery`` (restart then proof, in the background),
``shm_sweep`` (the /dev/shm check), ``alert_sinks`` and ``alerts`` (what an alert is; delivery), ``heartbeat``,
``assemble`` (wires them for a config). Stands on every floor below it, ``nodes`` included.
"""
