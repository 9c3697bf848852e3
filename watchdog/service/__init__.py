"""Service: the long-running daemon around the pipeline (I/O): ``compose`` (every edge built once for a config:
the composition root), ``daemon`` (the loop and its one pass, each stage in an error boundary), ``watcher`` (one
tick: scrape, judge, probe), ``events``, ``status_file``, ``exporter`` (its own metrics, and /readyz and /livez),
``probes`` (pure: what those answer), ``state_check`` (is the state directory usable), ``sdnotify`` (systemd),
``signals`` (stop), ``trace`` (recordings) and ``replay`` (a recording judged again)."""
