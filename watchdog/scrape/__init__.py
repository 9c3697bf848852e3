"""Scrape: read what the engine shows. ``page`` is pure text reading; ``engine_http`` (the one engine session and
its caps), ``fetch`` (one /metrics scrape) and ``probe`` (one generation) do I/O. Stands on ``core`` only."""
