"""The ``watchdog`` command, the top floor: ``main`` (the parser, exit codes, logging) and each stage's verbs,
``service`` (check, run, record, replay), ``evidence`` (dump, explain, incidents, show, report), ``act`` (pause,
resume, reset, status), ``nodes`` (nodes). May import every floor; nothing imports it.
"""
