"""The ``watchdog`` command, the top floor: ``main`` (the parser, exit codes, logging) and each stage's verbs,
``service`` (check, run, record, replay), ``evidence`` (dump, explain, incidents, show, report), ``act`` (pause,
resume, reset, status), ``nodes`` (nodes), ``nodes_init`` (nodes init: one other node's keys and files),
``config`` (which config file a verb reads; config check, config get), ``init`` (a starting config from what this
host shows); with ``progress`` (what a slow verb is doing, on a terminal's stderr) and ``version`` (``--version``
with the commit it was built from). May import every floor; nothing imports it.
"""
