"""Collect (I/O on this host): ``discover`` (engine processes from /proc), ``capture`` (py-spy, twice, with /proc
facts), ``ring`` (the broadcast ring's flag bytes, read-only, from /dev/shm), ``context`` (page, log tail,
versions), ``deadlines`` (the engine's own timeouts, pure) and ``deadline_read`` (read from its processes),
``proxy`` (an engine in a container, found through Docker's userland proxy or the container's init pid)."""
