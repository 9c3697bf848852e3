"""Act: incidents, alerts, restarts and the proof that the engine is back.

Pure: ``incident_machine`` (every incident's life: events in, commands out), ``incident_types`` (its incident,
phases, events and commands), ``incident_draft`` (one step being written), ``incident_sight`` (blind incidents),
``policy`` (budget, backoff, the choice), ``blind`` (what cannot be seen, and the words). I/O: ``respond`` (the
machine's edge: runs its commands, persisted in ``state``), ``restart`` (runs the plan, each command on its node,
then proves the engine back, in the background), ``shm_sweep`` (the /dev/shm check), ``alert_sinks`` and ``alerts``
(what an alert is; delivery), ``alert_log`` (each delivery's outcome on disk), ``heartbeat``. They are built for a
config by `watchdog.service.compose`. Stands on every floor below it, ``nodes`` included."""
