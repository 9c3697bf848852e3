"""Host: this machine's processes, at the bottom of everything that does I/O.

``run`` (one child: argv only, a timeout, its process group ended, the outcome as data), ``ptrace`` (may we attach,
and why not), ``childenv`` (the environment children get), ``files`` (a file someone else controls, opened as root
without following a link, hanging on a FIFO or reading past a cap). Imports only ``core``.
"""
