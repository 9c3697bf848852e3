"""Core, the bottom floor: the vocabulary every stage speaks. Pure: data only, no I/O.

``types`` (observations, states, verdicts, decisions, the incident id), ``roles`` (the one vocabulary of process
roles, read from titles), ``processes`` (an engine process, a dump, a capture, a node's context), ``ring`` (what
the broadcast ring's flags showed when read), ``runbooks`` (the runbook pages' names). Imports nothing of ours but
itself.
"""
