"""Evidence: the stacks of every rank and what they show. Five jobs, one subpackage each, in floor order:

- ``stacks`` (pure): the dump formats read into frames (py-spy JSON and text, faulthandler, tracebacks, gdb);
- ``explain`` (pure): each process's class, the culprit across ranks, poll-parking, the decision on a suspicion;
- ``gpu``: NVML samples, NCCL RAS, the Flight Recorder, and what they say of a stall (readers pure, sources I/O);
- ``collect`` (I/O): engine processes from /proc, py-spy, the page, log tail and versions, the engine's deadlines;
- ``bundle``: the incident directory, what each node holds, the investigator that runs the stage in a thread.

Stands on ``core``, ``host``, ``scrape`` and ``config``; the other nodes' share is handed in from above
(`bundle.investigate.OtherNodes`).
"""
