"""Service: the long-running daemon around the pipeline, its own metrics, and systemd at the edge (I/O)."""
