"""Host: this machine's processes, at the bottom of everything that does I/O.

``run`` (one child: argv only, a timeout, its process group ended, the outcome as data), ``docker_cli`` (Docker's
command line asked about one container: its id, name, init pid, published port, one answer shape), ``proc_stat``
(a process's ``/proc/PID/stat``: state, parent, CPU, threads, start time), ``sockets`` (the TCP sockets listening
in a process's network namespace, and those it holds), ``ptrace`` (may we attach, and why not), ``childenv`` (the
environment children get), ``files`` (a file someone else controls, opened as root without following a link,
hanging on a FIFO or reading past a cap), ``ns_paths`` (where a path named by a process in another mount
namespace is on this host), ``jsonl_log`` (a JSON-lines log rolled over past its bound: the events, the alert
deliveries). Imports only ``core``.
"""
