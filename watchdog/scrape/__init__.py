"""Scrape: read what the engine shows. ``page`` is pure text reading; ``http`` (the one engine session), ``fetch``,
``probe`` and ``trace`` do I/O."""
