"""Service: the long-running daemon around the pipeline (I/O): ``daemon`` (the loop, each stage in an error
boundary), ``watcher`` (one tick: scrape, judge, probe), ``events``, ``status_file``, ``exporter`` (its own
metrics), ``sdnotify`` (systemd), ``signals`` (stop), ``trace`` (recordings) and ``replay`` (a recording judged
again)."""
