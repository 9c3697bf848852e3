"""Act: incidents, alerts, restarts and the proof that the engine is back.

Pure: ``policy`` (budget, backoff, the choice). I/O: ``respond`` (the incident lifecycle, persisted), ``restart``
(commands), ``recovery`` (restart then proof, in the background), ``alerts``, ``heartbeat``, ``state`` (files),
``assemble`` (wires them for a config), ``commands`` (pause, resume, reset, status).
"""
