"""Service: the long-running daemon around the pipeline (I/O): ``daemon`` (the loop, each stage in an error
boundary), ``watcher`` (one tick: scrape, judge, probe), ``events``, ``status_file``, ``exporter`` (its own
metrics, and /readyz and /livez), ``probes`` (pure: what those answer), ``state_check`` (is the state directory
usable), ``sdnotify`` (systemd), ``signals`` (stop), ``trace`` (recordings) and ``replay`` (a recording judged
again)."""
