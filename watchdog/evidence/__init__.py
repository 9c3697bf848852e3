"""Evidence: the stacks of every rank and what they show.

Pure (data in, findings out): ``model``, ``roles``, ``stacks``, ``explain``, ``findings``.
I/O at the edges: ``discover`` (/proc), ``capture`` (py-spy), ``context`` (page, logs, GPU, versions), ``bundle``
(incident directories), ``investigate`` (the coordinator, in a background thread), ``commands`` (the CLI verbs).
"""
